"""Against a peer, same work: lorarl vs TRL's GRPOTrainer (PEFT LoRA, vLLM colocate) on CPU.

Both train the tiny Qwen2 (fp32) on the arith parquet with the arith reward, 4 prompts x 4
completions x <= 32 tokens per step, LoRA r=16 alpha=32 on the seven projections, lr 1e-3,
KL coef 0.001, one optimizer step per batch. One run each, back to back; seconds per step and
per sync over the steps after the first two.

Threads: TRL runs with 1 torch thread (--trl-threads; at 2 its trainer and in-process vLLM
contend for one OpenMP pool: bench/README.md). lorarl runs twice: at TRL's thread count (through
bench.grpo_run --cpu-count; the baseline of the TRL rows) and as shipped.

TRL must be importable (`pip install trl==1.16.0`: it adds datasets/pandas/multiprocess and
leaves torch, vllm and transformers as they are); without it the rows say so.

    python -m bench.peer_trl --out /tmp/peer.json [--steps 12]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import ROOT, cache_dir, tiny_model, write_json
from bench.grpo_run import run_grpo
from lorarl import metrics as keys

PROMPTS, N, MAX_TOKENS = 4, 4, 32
WARMUP_STEPS = 2
OURS = "lorarl (adapter sync)"
TRL = "TRL GRPOTrainer (merged full-weight sync)"


@dataclass
class Stat:
    """Median and spread of repeated samples (seconds, or a ratio as `unit` says)."""

    median: float
    p25: float
    p75: float
    min: float
    max: float
    n: int
    unit: str = "s"
    samples: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, samples: list[float], unit: str = "s") -> Stat:
        xs = sorted(float(x) for x in samples)
        if not xs:
            raise ValueError("no samples")
        q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) >= 2 else [xs[0], xs[0], xs[0]]
        return cls(statistics.median(xs), q[0], q[2], xs[0], xs[-1], len(xs), unit, [float(x) for x in samples])


@dataclass
class Record:
    """One result row: what was measured, under which config, its samples, and where it has a
    baseline measured in the same run, the ratio to it."""

    measurement: str
    what: str
    config: str
    stat: Stat | None
    baseline: str | None = None
    ratio: Stat | None = None
    extra: dict = field(default_factory=dict)
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def ratio_of_medians(num: Stat, den: Stat) -> Stat:
    """Samples not taken in pairs (separate runs): one ratio of medians."""
    return Stat.of([num.median / den.median], unit="x")


def versus(what: str, config: str, stat: Stat, baseline: str, base: Stat | None, extra: dict) -> Record:
    """A row with its ratio to `baseline` (measured in the same run), when that one exists."""
    return Record(
        "peer_trl",
        what,
        config,
        stat,
        baseline=baseline if base else None,
        ratio=ratio_of_medians(stat, base) if base else None,
        extra=extra,
    )


def run_ours(cache: Path, steps: int, tmp: Path, threads: int | None) -> list[dict]:
    overrides = [
        f"trainer.total_steps={steps}",
        f"data.train_batch_size={PROMPTS}",
        f"rollout.n={N}",
        f"data.max_response_length={MAX_TOKENS}",
        f"actor.ppo_mini_batch_size={PROMPTS}",
        f"actor.ppo_micro_batch_size_per_gpu={PROMPTS * N}",
    ]
    return run_grpo(tmp / f"ours_t{threads}", cache, overrides, threads=threads)


def arith_train_file(cache: Path) -> str:
    """The arith train parquet the lorarl run reads (conf/data/arith.yaml names the folder), written if missing."""
    os.environ["LORARL_CACHE"] = str(cache)  # ${lorarl_cache:} in the data config reads it
    from lorarl.config.compose import compose
    from lorarl.driver.prepare import prepare_data

    run = compose(["+backend=fsdp", "data=arith"])
    prepare_data(run)
    return run.data.train_files[0]


def run_trl(cache: Path, steps: int, tmp: Path, threads: int) -> dict:
    out = tmp / "trl.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "LORARL_CACHE": str(cache),
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": str(threads),
    }
    cmd = [
        sys.executable,
        "-m",
        "bench.trl_grpo_worker",
        "--model",
        str(cache / "qwen2_tiny"),
        "--train-parquet",
        arith_train_file(cache),
        "--steps",
        str(steps),
        "--prompts",
        str(PROMPTS),
        "--n",
        str(N),
        "--max-tokens",
        str(MAX_TOKENS),
        "--out",
        str(out),
        "--workdir",
        str(tmp / "trl_out"),
        "--threads",
        str(threads),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"TRL run exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}")
    return json.loads(out.read_text())


def ours_records(cache: Path, steps: int, tmp: Path, trl_threads: int, config: str) -> tuple[list[Record], dict]:
    """lorarl at TRL's thread count (the baseline), then as shipped: step and sync records, and
    the baseline's stats by label."""
    records: list[Record] = []
    default_threads = max(1, os.cpu_count() or 1)  # lorarl's worker group: cpu_count // ranks, 1 rank
    ours: dict[str, Stat] = {}
    matched = f"{OURS}, {trl_threads} thread"
    # Matched threads first: it is the baseline for TRL. Then lorarl as shipped.
    for label, threads in ((matched, trl_threads), (f"{OURS}, {default_threads} threads (default)", None)):
        try:
            rows = run_ours(cache, steps, tmp, threads)[WARMUP_STEPS:]
        except Exception as exc:  # noqa: BLE001 - recorded as the result
            records.append(
                Record("peer_trl", f"{label}: run", config, None, error=f"{type(exc).__name__}: {exc}"[:900])
            )
            continue
        step, sync = Stat.of([r[keys.TIMING_STEP.key] for r in rows]), Stat.of([r[keys.SYNC_SECONDS.key] for r in rows])
        ours[label] = step
        ours[label + " sync"] = sync
        phases = (keys.TIMING_GEN, keys.TIMING_OLD_LOGP, keys.TIMING_REF_LOGP, keys.TIMING_UPDATE, keys.TIMING_TRAIN)
        phases += (keys.TIMING_SYNC,)
        extra = {
            "sync_bytes": rows[-1][keys.SYNC_BYTES.key],
            "reward_mean_per_step": [r[keys.REWARD_MEAN.key] for r in rows],
            "response_length_mean": sum(r[keys.RESPONSE_LENGTH_MEAN.key] for r in rows) / len(rows),
            # Where lorarl's step goes, for reading the ratio (medians over the same steps).
            "median_s": {
                m.key: Stat.of([r[m.key] for r in rows]).median for m in phases if all(m.key in r for r in rows)
            },
        }
        base_step = ours.get(matched) if label != matched else None
        base_sync = ours.get(matched + " sync") if label != matched else None
        records.append(
            versus(f"{label}: seconds per step", config, step, f"{matched}: seconds per step", base_step, extra)
        )
        records.append(
            versus(
                f"{label}: seconds per sync",
                config,
                sync,
                f"{matched}: seconds per sync",
                base_sync,
                {"sync_bytes": rows[-1][keys.SYNC_BYTES.key]},
            )
        )
    return records, ours


def trl_records(
    cache: Path, steps: int, tmp: Path, trl_threads: int, config: str, ours: dict, matched: str
) -> list[Record]:
    """TRL's step and sync records against the baseline (an error record without trl)."""
    records: list[Record] = []
    ours_step, ours_sync = ours.get(matched), ours.get(matched + " sync")
    if importlib.util.find_spec("trl") is None:
        records.append(
            Record(
                "peer_trl",
                TRL,
                config,
                None,
                error="trl is not installed: pip install trl==1.16.0 (keeps torch/vllm/transformers)",
            )
        )
    else:
        try:
            result = run_trl(cache, steps, tmp, trl_threads)
            steps = result["steps_s"][WARMUP_STEPS:]
            # Sync i happens at the start of step i+1; the first one (before step 1) is warm-up.
            syncs = [s["seconds"] for s in result["syncs"] if "error" not in s and not s.get("after_failure")]
            failure = next((s["error"] for s in result["syncs"] if "error" in s), None)
            trl_step, trl_sync = Stat.of(steps), Stat.of(syncs[WARMUP_STEPS - 1 :] or syncs)
            mode = "TRL's sync routed through vLLM reload_weights" if failure else "TRL unchanged"
            extra = {
                "sync_as_is_error": failure,
                "sync_mode": mode,
                "init_s": result["init_s"],
                "reward_mean_per_step": result["reward_mean_per_step"][WARMUP_STEPS:],
                "torch_threads": result["torch_threads"],
            }
            trl_label = f"{TRL}, {result['torch_threads']} thread"
            records.append(
                versus(
                    f"{trl_label}: seconds per step ({mode})",
                    config,
                    trl_step,
                    f"{matched}: seconds per step",
                    ours_step,
                    extra,
                )
            )
            records.append(
                versus(
                    f"{trl_label}: seconds per sync ({mode})",
                    config,
                    trl_sync,
                    f"{matched}: seconds per sync",
                    ours_sync,
                    {"sync_as_is_error": failure},
                )
            )
        except Exception as exc:  # noqa: BLE001 - recorded as the result
            records.append(Record("peer_trl", TRL, config, None, error=f"{type(exc).__name__}: {exc}"[:900]))
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--trl-threads", type=int, default=1)
    args = ap.parse_args(argv)
    cache = cache_dir(args.cache)
    tiny_model(cache)
    config = (
        f"tiny Qwen2 fp32, arith, {PROMPTS} prompts x {N} x <={MAX_TOKENS} tokens, LoRA r=16, {args.steps} steps "
        f"(first {WARMUP_STEPS} dropped), CPU"
    )
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        records, ours = ours_records(cache, args.steps, tmp, args.trl_threads, config)
        matched = f"{OURS}, {args.trl_threads} thread"
        records += trl_records(cache, args.steps, tmp, args.trl_threads, config, ours, matched)
    write_json(Path(args.out), [r.as_dict() for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
