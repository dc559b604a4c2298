"""FSDP2 export gather cost on CPU (gloo), 1 and 2 ranks: the trainer's side of a sync.

Runs bench/export_gather_worker.py under torchrun for the tiny model and the 0.5B-shaped model
and turns its samples into records; the ratio column divides by the bucketed adapter gather
(the default) measured in the same repeat of the same run.

    python -m bench.export_gather --out /tmp/export.json [--models tiny,qwen05] [--worlds 1,2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Record, Stat, cache_dir, qwen05_shaped_model, ratio_stat, tiny_model, torchrun, write_json

LABELS = {
    "bucketed": "adapter gather: bucketed (one all-gather, default)",
    "layered": "adapter gather: layered (unshard each FSDP unit)",
    "per_param": "adapter gather: per_param (DTensor.full_tensor each)",
    "full_state_dict": "adapter via get_model_state_dict(full_state_dict=True)",
    "base_stream": "base stream: every base weight, unit by unit",
    "merged_stream": "merged stream: base with W+BA (merge=true)",
}
BASELINE = "bucketed"
# A gathered adapter farther than this from the seeded values is wrong (bf16 rounding of
# 0.02-scale values is ~1e-4).
ADAPTER_TOL = 1e-2


def records_from(result: dict, model_label: str) -> list[Record]:
    world = result["world"]
    comm = "nccl" if result["device"] == "cuda" else f"gloo, {result['threads_per_rank']} thread/rank"
    config = (
        f"{model_label}, {result['dtype']}, LoRA r={result['lora_rank']}, {world} rank{'s' if world > 1 else ''} {comm}"
    )
    measurement = "gpu_export" if result["device"] == "cuda" else "export_gather"
    methods = result["methods"]
    base = methods.get(BASELINE)
    out = []
    for method, r in methods.items():
        diff = r["max_abs_diff_vs_seeded"]
        error = None
        if diff is not None and not diff <= ADAPTER_TOL:
            error = f"gathered adapter differs from the seeded values by {diff}"
        out.append(
            Record(
                measurement,
                LABELS.get(method, method),
                config,
                Stat.of(r["samples_s"]),
                baseline=None if method == BASELINE or base is None else LABELS[BASELINE],
                ratio=None if method == BASELINE or base is None else ratio_stat(r["samples_s"], base["samples_s"]),
                extra={
                    "bytes": r["bytes"],
                    "num_tensors": r["num_tensors"],
                    "max_abs_diff_vs_seeded": diff,
                    "peak_extra_gib_per_rank": r.get("peak_extra_gib_per_rank"),
                    "engine_build_s": result["engine_build_s"],
                    "lora_params": result["lora_params"],
                },
                error=error,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--models", default="tiny,qwen05")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--qwen05-layers", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    cache = cache_dir(args.cache)
    records: list[Record] = []
    for name in args.models.split(","):
        if name == "tiny":
            path, label, dtype = tiny_model(cache), "tiny", "float32"
            reps, heavy = (3, 2) if args.quick else (15, 10)
        elif name == "qwen05":
            path, dtype = qwen05_shaped_model(cache, layers=args.qwen05_layers), "bfloat16"
            label = f"qwen2.5-0.5B-shape ({args.qwen05_layers} layers)"
            reps, heavy = (2, 1) if args.quick else (5, 3)
        else:
            raise SystemExit(f"--models: unknown model {name!r}; use tiny or qwen05")
        for world in (int(w) for w in args.worlds.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                cmd = [
                    "--model",
                    str(path),
                    "--dtype",
                    dtype,
                    "--rank",
                    "16",
                    "--device",
                    "cpu",
                    "--repeats",
                    str(reps),
                    "--heavy-repeats",
                    str(heavy),
                    "--threads",
                    str(args.threads),
                    "--out",
                    str(out),
                ]
                try:
                    proc = torchrun("bench.export_gather_worker", cmd, world, timeout=900, threads=args.threads)
                except subprocess.TimeoutExpired:
                    records.append(
                        Record(
                            "export_gather",
                            "all methods",
                            f"{label}, {world} ranks",
                            None,
                            error="torchrun timed out (900 s)",
                        )
                    )
                    continue
                if proc.returncode != 0 or not out.is_file():
                    tail = (proc.stderr or proc.stdout)[-800:]
                    records.append(
                        Record(
                            "export_gather",
                            "all methods",
                            f"{label}, {world} ranks",
                            None,
                            error=f"torchrun exit {proc.returncode}: {tail}",
                        )
                    )
                    continue
                records += records_from(json.loads(out.read_text()), label)
    write_json(Path(args.out), [r.as_dict() for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
