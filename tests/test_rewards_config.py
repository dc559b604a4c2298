"""The `reward` config section: composes from conf/reward, takes command-line overrides, and
refuses unknown values in one line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException

from lorarl.config.compose import load_group, to_run_config
from lorarl.config.schema import RewardConfig
from lorarl.errors import ConfigError
from lorarl.rewards import get_reward_fn

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def compose_run():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        # experiment_name interpolates ${hydra:...}, which a bare compose cannot resolve.
        yield lambda *ov: to_run_config(compose("grpo", overrides=["+backend=fsdp", "trainer.experiment_name=t", *ov]))
    GlobalHydra.instance().clear()


def test_defaults_come_from_conf_reward(compose_run):
    run = compose_run()
    assert run.reward == load_group(RewardConfig, "reward/default")
    assert (run.reward.gsm8k.scoring, run.reward.gsm8k.method, run.reward.math.timeout_s) == ("lenient", "strict", 5.0)


def test_overrides_reach_the_reward_function(compose_run):
    run = compose_run(
        "data=gsm8k", "reward.gsm8k.scoring=verl", "reward.gsm8k.method=flexible", "reward.math.timeout_s=2"
    )
    assert (run.reward.gsm8k.scoring, run.reward.gsm8k.method, run.reward.math.timeout_s) == ("verl", "flexible", 2.0)
    fn = get_reward_fn("openai/gsm8k", run.data.reward_fn, run.reward)
    assert fn("so 1,080 in all", "1080", None) == 0.0  # verl flexible keeps the comma
    assert get_reward_fn("openai/gsm8k", None, compose_run().reward)("so 1,080 in all", "1080", None) == 0.0  # strict
    assert get_reward_fn("openai/gsm8k", None, compose_run().reward)("#### 1,080", "1080", None) == 1.0


@pytest.mark.parametrize(
    "override,needle",
    [
        ("reward.gsm8k.scoring=exact", "reward.gsm8k.scoring='exact' is not valid; use one of: lenient, verl"),
        ("reward.gsm8k.method=loose", "reward.gsm8k.method='loose' is not valid; use one of: strict, flexible"),
        ("reward.math.timeout_s=0", "reward.math.timeout_s=0.0 must be > 0"),
    ],
)
def test_bad_values_name_the_key(compose_run, override, needle):
    with pytest.raises(ConfigError) as err:
        compose_run(override)
    assert str(err.value) == needle


def test_misspelt_key_fails_at_compose(compose_run):
    with pytest.raises(ConfigCompositionException, match="reward.gsm8k.scorng"):
        compose_run("reward.gsm8k.scorng=verl")


def test_cli_shows_the_reward_section():
    out = subprocess.run(
        [sys.executable, "-m", "recipes.grpo", "+backend=fsdp", "reward.gsm8k.scoring=verl", "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "reward:\n  gsm8k:\n    scoring: verl\n    method: strict\n  math:\n    timeout_s: 5.0" in out.stdout
