"""Checkpoint folders: atomic commit, completeness by manifest, fallback past truncated ones, retention."""

from __future__ import annotations

import pytest
import torch

from lorarl.errors import LorarlError
from lorarl.files.checkpoint import (
    CheckpointManager,
    flatten_optimizer_state,
    is_complete,
    resolve_resume,
    unflatten_optimizer_state,
)
from lorarl.files.peft_io import load_peft_adapter, save_peft_adapter


def save_step(manager: CheckpointManager, step: int) -> None:
    tmp = manager.begin(step)
    save_peft_adapter(tmp / "adapter", {"base_model.model.x.lora_A.weight": torch.ones(2, 3) * step}, {"r": 2})
    (tmp / "trainer_state.json").write_text(f'{{"step": {step}}}')
    manager.commit(tmp, step)


def test_commit_is_atomic_and_complete(tmp_path):
    m = CheckpointManager(tmp_path)
    tmp = m.begin(3)
    assert m.latest() is None  # a folder still being written is never picked
    (tmp / "trainer_state.json").write_text("{}")
    final = m.commit(tmp, 3)
    assert final.name == "global_step_3" and is_complete(final) and not tmp.exists()
    assert m.latest() == final


def test_truncated_checkpoint_falls_back_to_previous(tmp_path):
    m = CheckpointManager(tmp_path)
    save_step(m, 1)
    save_step(m, 2)
    (tmp_path / "global_step_2" / "adapter" / "adapter_model.safetensors").write_bytes(b"trunc")
    assert m.latest().name == "global_step_1"
    assert resolve_resume("auto", m).name == "global_step_1"
    with pytest.raises(LorarlError, match="trainer.resume_mode"):
        resolve_resume(str(tmp_path / "global_step_2"), m)
    assert resolve_resume("disable", m) is None


def test_partial_saves_are_cleaned_and_retention_keeps_newest(tmp_path):
    m = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3):
        save_step(m, step)
    m.begin(4)  # a save that never finished
    m.clean_partial()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", "global_step_3"]


def test_adapter_and_optimizer_round_trip(tmp_path):
    tensors = {
        "base_model.model.m.lora_A.weight": torch.randn(4, 8),
        "base_model.model.m.lora_B.weight": torch.zeros(8, 4),
    }
    save_peft_adapter(tmp_path / "a", tensors, {"r": 4, "lora_alpha": 8})
    loaded, config = load_peft_adapter(tmp_path / "a")
    assert config["r"] == 4 and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    osd = {
        "state": {"p.lora_A": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
        "param_groups": [{"lr": 1e-3, "params": ["p.lora_A"]}],
    }
    flat, meta = flatten_optimizer_state(osd)
    back = unflatten_optimizer_state(flat, meta)
    assert back["param_groups"] == osd["param_groups"]
    assert torch.equal(back["state"]["p.lora_A"]["exp_avg"], torch.ones(2))


def test_empty_adapter_is_never_written(tmp_path):
    from lorarl.errors import SyncError

    with pytest.raises(SyncError, match="no LoRA tensors"):
        save_peft_adapter(tmp_path / "a", {}, {"r": 4, "lora_alpha": 8})
    assert not (tmp_path / "a").exists()
