"""Every launch script composes a valid config (`--cfg job` dry run), so a stale key fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("*.sh") if not p.name.startswith("_") and p.name != "install.sh")


def test_there_are_launch_scripts():
    names = {p.name for p in SCRIPTS}
    assert {
        "run_tiny_cpu.sh",
        "run_qwen2_5_0_5b_grpo_lora_fsdp.sh",
        "run_qwen2_7b_grpo_lora_megatron.sh",
        "sweep_rank_lr.sh",
    } <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_dry_run(script, tmp_path):
    text = script.read_text()
    assert "set -euo pipefail" in text and '"$@"' in text, f"{script.name}: strict mode and pass-through"
    # A sweep's comma lists only expand under multirun; single values let Hydra print the job config.
    env = {**os.environ, "PYTHON": sys.executable, "RANKS": "8", "LRS": "1e-3"}
    out = subprocess.run(
        ["bash", str(script), "trainer.seed=7", "--cfg", "job"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = OmegaConf.create(out.stdout)
    assert cfg.trainer.seed == 7  # "$@" reached Hydra
    assert cfg.model.lora.rank > 0 and cfg.backend.strategy in ("fsdp2", "megatron")


def test_install_script_is_idempotent_and_strict():
    text = (ROOT / "scripts" / "install.sh").read_text()
    assert "set -euo pipefail" in text and ".lorarl-installed" in text
