"""Launches written for any verl release or a project built on verl: every key of verl's trainer
configs in the releases named is known, renamed keys say what they became, arguments are read
with Hydra's rules, a decisive refusal comes first, and custom_reward_function carries over.

verl's side is its own data: the release files recipes/verl_data/releases/*.json and
verl_defaults.json, read here directly, as scripts/extract_verl_keys.py composed them from
verl's config folders at the tags and commit they record.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lorarl.config.compose import compose
from recipes.from_verl import VERL_KEYS, VerlTranslationError, translate, verl_row
from recipes.from_verl.reading import foreign_line, known_names

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "recipes" / "verl_data"
A = "actor_rollout_ref."
LORA = [A + "model.lora_rank=8", "algorithm.adv_estimator=grpo", A + "rollout.name=vllm", A + "rollout.n=4"]
RELEASES = ("v0.3.0.post1", "v0.4.0", "v0.4.1", "v0.5.0", "v0.6.0", "v0.6.1", "v0.7.0")


def release_configs() -> dict[str, dict]:
    out = {p.stem: json.loads(p.read_text()) for p in sorted((DATA / "releases").glob("*.json"))}
    out["main"] = json.loads((DATA / "verl_defaults.json").read_text())
    return out


def test_the_releases_named_are_there_with_their_commits():
    configs = release_configs()
    assert set(configs) == {*RELEASES, "main"}
    for name, body in configs.items():
        assert len(body["commit"]) == 40 and body.get("tag", name) == name
        assert len(body["fsdp"]) > 150 and len(body["megatron"]) > 150, name


def test_every_key_of_every_release_has_a_row():
    missing = sorted(
        {
            f"{name}: {key}"
            for name, body in release_configs().items()
            for backend in ("fsdp", "megatron")
            for key in body[backend]
            if verl_row(key)[0] is None
        }
    )
    assert not missing, missing


def test_each_key_is_spelt_in_one_row():
    """keys.py and ignored_keys.yaml are one table: a key in both would have two meanings."""
    spellings = [row.verl for row in VERL_KEYS]
    assert len(spellings) == len(set(spellings)), sorted({k for k in spellings if spellings.count(k) > 1})


def test_the_extractor_composes_a_release_with_its_component_files(tmp_path):
    """scripts/extract_verl_keys.py reads a tag's config folder as verl's Hydra composes it: the
    keys of the files in the defaults list land where the list puts them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("extract_verl_keys", ROOT / "scripts" / "extract_verl_keys.py")
    extract = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extract)
    config = tmp_path / "verl" / "trainer" / "config"
    (config / "actor").mkdir(parents=True)
    (config / "actor" / "dp_actor.yaml").write_text("clip_ratio: 0.2\noptim:\n  lr: 1e-6\n")
    (config / "ppo_trainer.yaml").write_text(
        "defaults:\n  - actor@actor_rollout_ref.actor: dp_actor\n  - _self_\n"
        "actor_rollout_ref:\n  actor:\n    clip_ratio: 0.3\ntrainer:\n  total_epochs: 30\n"
    )
    (config / "ppo_megatron_trainer.yaml").write_text("trainer:\n  total_epochs: 30\n  nnodes: 1\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    subprocess.run([*git, "tag", "v9.9"], check=True)
    out = extract.release_defaults(tmp_path, "v9.9")
    assert out["fsdp"] == {
        "actor_rollout_ref.actor.clip_ratio": 0.3,
        "actor_rollout_ref.actor.optim.lr": 1e-6,
        "trainer.total_epochs": 30,
    }
    assert out["megatron"] == {"trainer.nnodes": 1, "trainer.total_epochs": 30}


@pytest.mark.parametrize(
    "arg, needle",
    [
        (A + "actor.optim.warmup_style=cosine", "verl 0.3-0.5's name of optim.lr_scheduler_type"),
        ("algorithm.rollout_is=True", "since 0.6.1 it is algorithm.rollout_correction.rollout_is=token|sequence"),
        ("algorithm.rollout_correction.use_policy_gradient=True", "verl 0.6.1's name of rollout_correction.loss_type"),
        (A + "rollout.use_fire_sampling=True", "FIRE sampling) is not implemented"),
    ],
)
def test_renamed_and_removed_keys_say_what_they_became(arg, needle):
    with pytest.raises(VerlTranslationError) as err:
        translate([*LORA, arg])
    (line,) = err.value.problems
    assert line.startswith(arg + ": lorarl supports only") and needle in line


def test_removed_keys_at_their_defaults_are_ignored_with_their_note():
    result = translate([*LORA, "trainer.val_generations_to_log_to_wandb=10", A + "actor.optim.warmup_style=constant"])
    notes = {key: why for key, _, why in result.ignored}
    assert notes["trainer.val_generations_to_log_to_wandb"].startswith("verl 0.3's name of trainer.log_val_generations")
    assert "lr_scheduler_type" in notes[A + "actor.optim.warmup_style"]


def test_a_repeated_key_keeps_its_last_value_as_hydra_does():
    result = translate([*LORA, "trainer.total_epochs=1", "data.train_batch_size=8", "trainer.total_epochs=3"])
    assert "trainer.total_epochs=3" in result.overrides and "trainer.total_epochs=1" not in result.overrides
    assert "trainer.total_epochs is given twice: the last value (3) wins, as in verl" in result.notes


def test_a_repeated_unknown_key_is_one_line():
    with pytest.raises(VerlTranslationError) as err:
        translate([*LORA, "search.max_turns=2", "search.max_turns=4"])
    (line,) = err.value.problems
    assert line.startswith("search.max_turns: not in verl's trainer config") and line.count("search.max_turns") == 1


@pytest.mark.parametrize(
    "arg, needle",
    [
        ("~trainer.logger", "~trainer.logger: deleting verl keys has no lorarl equivalent; leave it out"),
        ("trainer.project_name=", "trainer.project_name= has no value"),
        ("trainer.logger=[console,", "trainer.logger=[console,: not a value Hydra can read"),
        ("++", "'++' is not a verl override (key=value)"),
    ],
)
def test_hydra_forms_are_read_or_named(arg, needle):
    with pytest.raises(VerlTranslationError) as err:
        translate([*LORA, arg])
    (line,) = err.value.problems
    assert line.startswith(needle), line


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            [A + "ref.log_prob_max_token_len_per_gpu=big", A + "rollout.log_prob_max_token_len_per_gpu=4096"],
            A + "ref.log_prob_max_token_len_per_gpu=big and " + A + "rollout.log_prob_max_token_len_per_gpu=4096 set "
            "actor.log_prob_max_token_len_per_gpu: give whole numbers",
        ),
        (
            [A + "rollout.expert_parallel_size=four"],
            A + "rollout.expert_parallel_size=four: not a value this key takes",
        ),
    ],
)
def test_values_a_derived_key_cannot_use_are_one_line(args, needle):
    with pytest.raises(VerlTranslationError) as err:
        translate([*LORA, *args])
    (line,) = err.value.problems
    assert line.startswith(needle), line


def test_plus_forms_set_the_key():
    result = translate([*LORA, "++trainer.total_epochs=2", "+trainer.save_freq=7"])
    assert {"trainer.total_epochs=2", "trainer.save_freq=7"} <= set(result.overrides)


def test_the_hint_never_names_the_key_given():
    """Known names given as if unknown (as a key without a row was before) get hints of other keys only."""
    names = known_names()
    hinted = 0
    for key in names[:: max(1, len(names) // 200)]:
        hint = re.search(r"\(did you mean (.*?)\?\)", foreign_line([key]))
        hinted += hint is not None
        assert hint is None or key not in hint.group(1).split(" or "), (key, hint.group(1))
    assert hinted > 100


# A fork's launch (a search agent built on verl): its own keys, and one thing lorarl cannot train.
FORK = [
    A + "model.path=Qwen/Qwen2.5-3B-Instruct",
    "retriever.url=http://127.0.0.1:8000/retrieve",
    "retriever.topk=3",
    "max_turns=4",
    A + "actor.state_masking=true",
    A + "rollout.name=sglang",
]


@pytest.mark.parametrize(
    "decisive, first",
    [
        ("algorithm.adv_estimator=reinforce_plus_plus", "algorithm.adv_estimator=reinforce_plus_plus: lorarl supports"),
        ("reward_model.enable=True", "reward_model.enable=True: lorarl supports only False or false (rewards are rule"),
        ("reward_model.reward_manager=prime", "reward_model.reward_manager=prime: lorarl supports only naive or dapo"),
        ("critic.enable=True", "critic.enable=True: lorarl supports only null or False or false (GRPO trains no"),
    ],
)
def test_a_decisive_refusal_comes_first_and_the_forks_keys_last_in_one_line(decisive, first):
    with pytest.raises(VerlTranslationError) as err:
        translate([*FORK, A + "model.lora_rank=8", "algorithm.adv_estimator=grpo", decisive])
    lines = err.value.problems
    assert lines[0].startswith(first), lines
    assert lines[1].startswith(A + "rollout.name=sglang"), lines
    assert len(lines) == 3 and lines[2].startswith(
        "retriever.url, retriever.topk, max_turns, actor_rollout_ref.actor.state_masking (did you mean "
    ), lines
    assert (
        "): none of these 4 keys is in verl's trainer config of any release lorarl knows (v0.3.0.post1 to "
        in (lines[2])
    )


REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n"


@pytest.mark.parametrize(
    "args, target",
    [
        (["custom_reward_function.path=rewards/my_reward.py"], "{cwd}/rewards/my_reward.py:compute_score"),
        (["custom_reward_function.path=file://rewards/my_reward.py"], "{cwd}/rewards/my_reward.py:compute_score"),
        (
            ["custom_reward_function.name=score_it", "custom_reward_function.path={cwd}/rewards/my_reward.py"],
            "{cwd}/rewards/my_reward.py:score_it",
        ),
        (["custom_reward_function.path=pkg://my_pkg/rewards"], "my_pkg.rewards:compute_score"),
    ],
)
def test_custom_reward_function_becomes_data_reward_fn(tmp_path, monkeypatch, args, target):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "my_reward.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    result = translate([*LORA, *(a.format(cwd=tmp_path) for a in args)])
    (reward_fn,) = [o for o in result.overrides if o.startswith("data.reward_fn=")]
    assert reward_fn == f"data.reward_fn='{target.format(cwd=tmp_path)}'"
    assert compose(result.overrides).data.reward_fn == target.format(cwd=tmp_path)


def test_reward_kwargs_and_a_missing_reward_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.py").write_text(REWARD)
    result = translate([*LORA, "custom_reward_function.path=r.py", "+custom_reward_function.reward_kwargs.bonus=2"])
    assert compose(result.overrides).data.reward_kwargs == {"bonus": 2}
    with pytest.raises(VerlTranslationError) as err:
        translate([*LORA, "custom_reward_function.path=missing.py"])
    (line,) = err.value.problems
    assert line.startswith(f"custom_reward_function.path=missing.py: no file {tmp_path}/missing.py (a relative path")
    ignored = translate([*LORA, "custom_reward_function.name=other"]).ignored
    assert ("custom_reward_function.name", "other", "used only with custom_reward_function.path, which the launch "
            "leaves unset") in ignored  # fmt: skip


def test_check_runs_the_reward_file_and_names_it_when_it_fails(tmp_path):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(REWARD)
    bad.write_text("import no_such_module_for_lorarl\n")
    sizes = ["trainer.n_gpus_per_node=1", A + "rollout.tensor_model_parallel_size=1"]
    base = [sys.executable, "-m", "recipes.from_verl", "--check", *LORA, *sizes]
    out = subprocess.run([*base, f"custom_reward_function.path={good}"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"# checked: data.reward_fn: {good} loads and defines compute_score" in out.stdout
    out = subprocess.run([*base, f"custom_reward_function.path={bad}"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        f"error: data.reward_fn='{bad}:compute_score': running {bad} failed: ModuleNotFoundError: No module named "
        "'no_such_module_for_lorarl'"
    )
