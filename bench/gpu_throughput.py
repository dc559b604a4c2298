"""GPU training throughput: FSDP2 + LoRA tokens/s per GPU and MFU against the measured peak.

Run on 2 x H200: bench/results/gpu_2026-11-30/gpu_throughput.{json,md}.

Qwen2.5-0.5B and 7B shapes, bf16, LoRA rank 64 on all linear projections, gradient
checkpointing, 2 GPUs; (4 x 1024) and (1 x 4096) tokens per GPU per step. MFU is against
790 TFLOP/s per GPU (bf16 matmul measured on the H200, ../shared/ENVIRONMENT.md); see
bench/gpu_throughput_worker.py for the FLOP count. Megatron is not covered yet.

    python -m bench.gpu_throughput --out /tmp/gpu_tp.json [--models qwen05,qwen7] [--quick]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench.common import GPU_MODELS, Record, Stat, cache_dir, gpu_args, shaped_model, torchrun, write_json

SHAPES = ((4, 1024), (1, 4096))


def main(argv: list[str] | None = None) -> int:
    args = gpu_args("gpu_throughput", __doc__.splitlines()[0], argv)
    cache = cache_dir(args.cache)
    records: list[Record] = []
    for key in args.models.split(","):
        shape = GPU_MODELS[key]
        path = shaped_model(cache, shape, dtype="bfloat16", device="cuda")
        for batch, seq in SHAPES[:1] if args.quick else SHAPES:
            config = f"{shape} shape, bf16, LoRA r=64 all linear, grad ckpt, {args.world} GPUs, {batch}x{seq} tokens/GPU/step"
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "r.json"
                proc = torchrun(
                    "bench.gpu_throughput_worker",
                    [
                        "--model",
                        str(path),
                        "--batch",
                        str(batch),
                        "--seq",
                        str(seq),
                        "--repeats",
                        "2" if args.quick else "6",
                        "--out",
                        str(out),
                    ],
                    args.world,
                    timeout=1800,
                )
                if proc.returncode != 0 or not out.is_file():
                    records.append(
                        Record(
                            "gpu_throughput",
                            "FSDP2 update",
                            config,
                            None,
                            error=f"torchrun exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}",
                        )
                    )
                    continue
                r = json.loads(out.read_text())
            rates = [r["tokens_per_gpu_per_step"] / s for s in r["samples_s"]]
            rate = Stat.of(rates, unit="tok/s/GPU")
            peak = r["peak_tflops"] * 1e12
            records.append(
                Record(
                    "gpu_throughput",
                    "FSDP2 LoRA update (fwd+bwd+AdamW)",
                    config,
                    rate,
                    extra={
                        "mfu": rate.median * r["flops_per_token_6n"] / peak,
                        "mfu_lora": rate.median * r["flops_per_token_lora"] / peak,
                        "tokens_per_s_all_gpus": rate.median * r["world"],
                        "max_memory_allocated_gib_rank0": r["max_memory_allocated_gib_rank0"],
                        "step_s": r["samples_s"],
                    },
                )
            )
    write_json(Path(args.out), [r.as_dict() for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
