"""Every launch script composes a valid config (`--cfg job` dry run), so a stale key fails here,
and each run_*.sh is its experiment preset plus knobs: with no knob set it prints exactly the
preset's config, so a script and its preset cannot disagree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("*.sh") if not p.name.startswith("_") and p.name != "install.sh")
WRAPPERS = [p for p in SCRIPTS if p.name.startswith("run_")]
KNOB_VARS = ("MODEL_PATH", "DATA_DIR", "NGPUS", "NNODES", "TP", "PP", "LORA_RANK", "LR", "STEPS")
EXPERIMENT = re.compile(r"\+experiment=(\w+)")


def preset_of(script: Path) -> str:
    (name,) = EXPERIMENT.findall(script.read_text())
    return name


def skip_without_its_algorithm(preset: str) -> None:
    """A preset naming an algorithm option this tree lacks cannot compose yet; say which."""
    text = (ROOT / "conf" / "experiment" / f"{preset}.yaml").read_text()
    for algo in re.findall(r"override /algorithm: (\w+)", text):
        if not (ROOT / "conf" / "algorithm" / f"{algo}.yaml").exists():
            pytest.skip(f"conf/algorithm/{algo}.yaml is not in this tree")


# The model and data location a GPU launch script requires (it refuses to start without them).
LOCATIONS = {"MODEL_PATH": "/models/qwen", "DATA_DIR": "/data/gsm8k"}


def needs_locations(script: Path) -> bool:
    return "model_path_knob" in script.read_text()


def location_overrides(script: Path) -> list[str]:
    if not needs_locations(script):
        return []
    data = LOCATIONS["DATA_DIR"]
    return [
        f"model.path={LOCATIONS['MODEL_PATH']}",
        f"data.train_files=[{data}/train.parquet]",
        f"data.val_files=[{data}/test.parquet]",
    ]


def dry_run(script: Path, cwd: Path, *args: str, **knobs: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in KNOB_VARS}
    # A sweep's comma lists only expand under multirun; single values let Hydra print the job config.
    env.update(PYTHON=sys.executable, RANKS="8", LRS="1e-3", **LOCATIONS)
    env.update(knobs)
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run(
        ["bash", str(script), *args, "--cfg", "job"], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


def test_there_are_launch_scripts():
    names = {p.name for p in SCRIPTS}
    assert {
        "run_tiny_cpu.sh",
        "run_qwen2_5_0_5b_grpo_lora_fsdp.sh",
        "run_qwen2_7b_grpo_lora_megatron.sh",
        "run_qwen3_8b_grpo_lora_megatron.sh",
        "run_qwen3_1_7b_dapo_lora_fsdp.sh",
        "sweep_rank_lr.sh",
    } <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_dry_run(script, tmp_path):
    text = script.read_text()
    assert "set -euo pipefail" in text and '"$@"' in text, f"{script.name}: strict mode and pass-through"
    if script in WRAPPERS:
        skip_without_its_algorithm(preset_of(script))
    out = dry_run(script, tmp_path, "trainer.seed=7")
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = OmegaConf.create(out.stdout)
    assert cfg.trainer.seed == 7  # "$@" reached Hydra
    assert cfg.model.lora.rank > 0 and cfg.backend.strategy in ("fsdp2", "megatron")


@pytest.mark.parametrize("script", WRAPPERS, ids=lambda p: p.name)
def test_wrapper_is_its_preset_plus_knobs(script, tmp_path):
    """No optional knob set: the script's config is the preset's with the model and data location
    it requires, key for key. Its exec line names the preset and nothing else: every other value
    comes from a knob or from "$@"."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import lorarl.config.compose  # noqa: F401  (registers the schemas the YAML files name)

    preset = preset_of(script)
    skip_without_its_algorithm(preset)
    exec_line = next(line for line in script.read_text().splitlines() if line.startswith("exec "))
    assert exec_line == f'exec "$PYTHON" -m recipes.grpo +experiment={preset} "${{KNOBS[@]}}" "$@"'
    out = dry_run(script, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            expected = compose("grpo", overrides=[f"+experiment={preset}", *location_overrides(script)])
    finally:
        GlobalHydra.instance().clear()
    assert OmegaConf.to_container(OmegaConf.create(out.stdout)) == OmegaConf.to_container(expected)


@pytest.mark.parametrize("script", [s for s in WRAPPERS if needs_locations(s)], ids=lambda p: p.name)
@pytest.mark.parametrize("var", ["MODEL_PATH", "DATA_DIR"])
def test_gpu_script_without_its_model_or_data_location_says_which(script, var, tmp_path):
    out = dry_run(script, tmp_path, **{var: None})
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"error: {var} is not set: ") and out.stderr.count("\n") == 1, out.stderr
    assert "docs/gpu.md" in out.stderr


def test_knobs_become_overrides(tmp_path):
    script = ROOT / "scripts" / "run_qwen2_7b_grpo_lora_megatron.sh"
    out = dry_run(script, tmp_path, "actor.optim.lr=1e-6", TP="4", NGPUS="8", LORA_RANK="32", DATA_DIR="/data/g")
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = OmegaConf.create(out.stdout)
    assert cfg.backend.tensor_model_parallel_size == 4 and cfg.trainer.n_gpus_per_node == 8
    assert cfg.model.lora.rank == 32 and cfg.data.train_files == ["/data/g/train.parquet"]
    assert cfg.data.val_files == ["/data/g/test.parquet"]
    assert cfg.actor.optim.lr == 1e-6  # "$@" comes after the knobs and wins
    assert cfg.backend.pipeline_model_parallel_size == 1  # PP unset: the preset's value


def test_install_script_is_idempotent_and_strict():
    text = (ROOT / "scripts" / "install.sh").read_text()
    assert "set -euo pipefail" in text and ".lorarl-installed" in text
