"""bench.update_profile on CPU: the code paths the GPU runs take (a real FSDPEngine over gloo on
the tiny Qwen3-MoE, attention and expert LoRA), and the allocator-trace replay behind --memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


def test_update_profile_times_variants_and_profiles_one(tmp_path):
    run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
         "-m", "bench.update_profile", "--shape", "moe-tiny", "--device", "cpu", "--rows", "8", "--response", "4",
         "--warmup", "0", "--repeats", "1", "--variants", "preset;backend.routed_expert_lora=false",
         "--out", str(tmp_path)],
        tmp_path,
    )  # fmt: skip
    result = json.loads((tmp_path / "update_profile_moe-tiny.json").read_text())
    assert [v["variant"] for v in result["variants"]] == ["preset", "backend.routed_expert_lora=false"]
    for v in result["variants"]:
        assert v["median_s"] > 0 and v["micro_batches"] >= 1 and v["reference_median_s"] > 0 and v["mfu_update"] > 0
    assert "Self CPU" in (tmp_path / "update_profile_moe-tiny.txt").read_text()


def test_memory_at_peak_counts_what_was_alive_at_the_highest_total():
    """The replay of an allocator trace (the events torch.cuda.memory._snapshot() records on the
    GPU): the blocks alive when the total peaked, grouped by the allocating line outside torch."""
    from bench.update_profile import blocks_at_peak, by_site

    def frames(line: int) -> list[dict]:
        return [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": "/x/lorarl/engines/megatron/engine.py", "line": line, "name": "forward_step"},
                {"filename": "/x/lorarl/ppo.py", "line": 7, "name": "ppo_update"}]  # fmt: skip

    def alloc(addr: int, size: int, line: int) -> dict:
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames(line)}

    def free(addr: int) -> dict:
        return {"action": "free_requested", "addr": addr, "size": 0, "frames": []}

    trace = [alloc(1, 10, 100), alloc(2, 30, 200), free(1), alloc(3, 30, 200), free(2), free(3), alloc(4, 50, 300)]
    peak, blocks = blocks_at_peak(trace)
    assert peak == 60 and sorted(b["addr"] for b in blocks) == [2, 3]
    (site,) = by_site(blocks)
    assert site["site"] == "engine.py:200 forward_step < ppo.py:7 ppo_update" and site["blocks"] == 2
    assert site["gib"] == 60 / 2**30
