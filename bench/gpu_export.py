"""GPU export gather cost (2 GPUs, NCCL), bf16, LoRA rank 64 on all linear projections.

Run on 2 x H200: bench/results/gpu_2026-11-30/gpu_export.{json,md}.

For the Qwen2.5-0.5B and Qwen2.5-7B shapes (random weights, real configs) this runs
bench/export_gather_worker.py under torchrun with --device cuda: seconds (slowest rank) and
the peak extra GPU memory of each rank (`torch.cuda.max_memory_allocated` above what was
allocated before the call, result held) for the bucketed / layered adapter gathers (the
engine's) and per_param (one `DTensor.full_tensor` per param, the worker's own), the full gather (`get_model_state_dict(full_state_dict=True)`), and the base and
merged streams. The claim to check: layered peaks at about one layer, the full gather at
about the whole model, bucketed at about the adapter.

    python -m bench.gpu_export --out /tmp/gpu_export.json [--models qwen05,qwen7] [--world 2] [--quick]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench.common import GPU_MODELS, Record, cache_dir, gpu_args, shaped_model, torchrun, write_json
from bench.export_gather import records_from

LORA_RANK = 64


def main(argv: list[str] | None = None) -> int:
    args = gpu_args("gpu_export", __doc__.splitlines()[0], argv)
    import torch

    cache = cache_dir(args.cache)
    records: list[Record] = []
    for key in args.models.split(","):
        shape = GPU_MODELS[key]
        path = shaped_model(cache, shape, dtype="bfloat16", device="cuda")
        torch.cuda.empty_cache()
        reps, heavy = (2, 1) if args.quick else (10, 5)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [
                "--model",
                str(path),
                "--dtype",
                "bfloat16",
                "--rank",
                str(LORA_RANK),
                "--device",
                "cuda",
                "--repeats",
                str(reps),
                "--heavy-repeats",
                str(heavy),
                "--warmup",
                "2",
                "--out",
                str(out),
            ]
            proc = torchrun("bench.export_gather_worker", cmd, args.world, timeout=1800, threads=4)
            if proc.returncode != 0 or not out.is_file():
                records.append(
                    Record(
                        "gpu_export",
                        "all methods",
                        f"{shape}, {args.world} GPUs",
                        None,
                        error=f"torchrun exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}",
                    )
                )
                continue
            records += records_from(json.loads(out.read_text()), f"{shape} shape")
    write_json(Path(args.out), [r.as_dict() for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
