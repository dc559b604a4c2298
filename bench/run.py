"""Run a benchmark suite and write bench/results/<suite>_<date>.{json,md}.

    python -m bench.run --suite cpu                 # ~10 min on a 2-core CPU host
    python -m bench.run --suite cpu --only sync_latency,export_gather
    python -m bench.run --suite gpu                 # 2 GPUs (H200); see bench/README.md

Each measurement runs in its own subprocess (`python -m bench.<module> --out ...`), so one
that crashes, or leaves vLLM or torch.distributed state behind, cannot spoil the next; a
failed measurement becomes a row with its error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import report
from bench.common import ROOT, Record, cache_dir, environment, tiny_model

SUITES: dict[str, list[tuple[str, list[str]]]] = {
    "cpu": [
        ("sync_latency", []),
        ("export_gather", []),
        ("peer_trl", []),
        ("step_breakdown", []),
    ],
    # Written for a 2 x H200 host; not run yet (see bench/README.md).
    "gpu": [
        ("gpu_export", []),
        ("gpu_throughput", []),
        ("gpu_rollout", []),
    ],
}
QUICK_ARGS = {
    "sync_latency": ["--quick"],
    "export_gather": ["--quick"],
    "peer_trl": ["--steps", "5"],
    "step_breakdown": ["--steps", "5"],
    "gpu_export": ["--quick"],
    "gpu_throughput": ["--quick"],
    "gpu_rollout": ["--quick"],
}


def run_measurement(module: str, args: list[str], cache: Path, timeout: int) -> tuple[list[dict], float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{module}.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "LORARL_CACHE": str(cache),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
            "PYTHONWARNINGS": "ignore",
            "TOKENIZERS_PARALLELISM": "false",
        }
        cmd = [sys.executable, "-m", f"bench.{module}", "--out", str(out), "--cache", str(cache), *args]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            failure = (
                None
                if proc.returncode == 0 and out.is_file()
                else f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}"
            )
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout} s"
        wall = time.perf_counter() - t0
        if failure:
            return [
                Record(
                    module, f"{module}: whole measurement", " ".join(args) or "defaults", None, error=failure
                ).as_dict()
            ], wall
        return json.loads(out.read_text()), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=sorted(SUITES), required=True)
    ap.add_argument("--only", default=None, help="comma list of measurements in the suite")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and steps: a smoke run, not a result")
    ap.add_argument("--cache", default=None, help="model cache (default $LORARL_CACHE or ~/.cache/lorarl)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stem", default=None, help="file name stem (default <suite>_<date>)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per measurement")
    args = ap.parse_args(argv)

    plan = SUITES[args.suite]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {m for m, _ in plan})
        if unknown:
            raise SystemExit(
                f"--only: {', '.join(unknown)} not in the {args.suite} suite ({', '.join(m for m, _ in plan)})"
            )
        plan = [(m, a) for m, a in plan if m in wanted]
    cache = cache_dir(args.cache)
    env = environment()
    t_start = time.perf_counter()
    tiny_model(cache)  # built once here, so no measurement pays for it
    records: list[dict] = []
    walls: dict[str, float] = {}
    for module, extra in plan:
        margs = extra + (QUICK_ARGS.get(module, []) if args.quick else [])
        print(f"[bench] {module} {' '.join(margs)}", flush=True)
        rows, walls[module] = run_measurement(module, margs, cache, args.timeout)
        records += rows
        errors = [r["error"] for r in rows if r.get("error")]
        print(
            f"[bench] {module}: {len(rows)} rows, {walls[module]:.0f} s"
            + (f", {len(errors)} with errors" if errors else ""),
            flush=True,
        )
    date = dt.date.today().isoformat()
    result = {
        "suite": args.suite,
        "date": date,
        "quick": args.quick,
        "command": "python -m bench.run "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "environment": env,
        "wall_s": time.perf_counter() - t_start,
        "wall_s_per_measurement": walls,
        "loadavg_end": os.getloadavg(),
        "records": records,
    }
    js, md = report.write(
        result, Path(args.out_dir), args.stem or f"{args.suite}_{date}{'_quick' if args.quick else ''}"
    )
    print(f"[bench] wrote {js} and {md} ({result['wall_s']:.0f} s)")
    return 1 if any(r.get("error") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
