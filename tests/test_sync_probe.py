"""The log-prob probe end to end on the real worker (vLLM + FSDP2 over gloo, fp32 on CPU).

A correct sync reads far below the fp32 bound while the adapter has visibly moved the policy;
a skipped sync, a zeroed adapter and one layer's B left out each stop the probe.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lorarl.contract.messages import SyncRequest
from lorarl.contract.payload import WeightPayload
from lorarl.errors import SyncError
from lorarl.sync.probe import FP32_BOUNDS
from tests.test_sync_faults import make_worker
from tests.test_sync_faults import move_adapter as moved_adapter

# A sync that runs the probe whenever its sequences are set (the run's last step).
PROBING_SYNC = SyncRequest(step=1, last=True)


@pytest.fixture(scope="module")
def worker(run_cache: Path, lorarl_cache: Path):
    """The real Worker (vLLM + FSDP2 over gloo, one process), composed from the real config."""
    w = make_worker("qwen2_tiny", run_cache)
    yield w
    w.shutdown()
    os.environ["LORARL_CACHE"] = str(lorarl_cache)


@pytest.fixture(scope="module")
def probes(worker, tiny_tokenizer):
    from lorarl.data import arith
    from lorarl.models.tiny import prompt_ids

    seqs = [
        prompt_ids(tiny_tokenizer, r["prompt"]) + [5, 6, 7, 8, 9, 10] for r in arith.make_rows(6, seed=2, split="test")
    ]
    worker.sync_sessions[0].set_probes(seqs)
    assert all(len(s) >= 2 for s in worker.sync_sessions[0].probe_seqs)
    return worker.sync_sessions[0].probe_seqs


def test_worker_sync_reports_both_checks(worker, probes):
    moved_adapter(worker, seed=1)
    out = worker.sync(PROBING_SYNC)[0]
    assert out.adapter_match == 1.0
    assert out.logprob_diff_max < FP32_BOUNDS.max
    assert out.logprob_ref_diff_mean > 10 * FP32_BOUNDS.mean  # the adapter moved the policy


def test_probe_catches_a_skipped_sync_in_fp32(worker, probes):
    moved_adapter(worker, seed=2)
    worker.sync(PROBING_SYNC)
    moved_adapter(worker, seed=3)  # trained on, never synced
    with pytest.raises(SyncError, match="rank 0: after the sync vLLM and the trainer disagree"):
        worker.sync_sessions[0].probe()


def test_probe_catches_a_zeroed_adapter_in_fp32(worker, probes):
    lora = moved_adapter(worker, seed=4)
    worker.sync(PROBING_SYNC)
    config = worker.engine.adapter_config()
    worker.rollout.apply(WeightPayload.adapter({k: torch.zeros_like(v) for k, v in lora.items()}, config))
    with pytest.raises(SyncError, match="disagree|adapter-off reference"):
        worker.sync_sessions[0].probe()


def test_probe_catches_one_layers_b_left_out_in_fp32(worker, probes):
    lora = moved_adapter(worker, seed=5)
    worker.sync(PROBING_SYNC)
    sent = {k: v.clone() for k, v in lora.items()}
    sent["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].zero_()
    worker.rollout.apply(WeightPayload.adapter(sent, worker.engine.adapter_config()))
    with pytest.raises(SyncError, match="disagree"):
        worker.sync_sessions[0].probe()
    worker.sync(PROBING_SYNC)  # a real sync puts it right
    assert worker.sync_sessions[0].probe().sync_max < FP32_BOUNDS.max
