"""Where the PPO update's time (and memory) goes on one GPU: the project's FSDP or Megatron engine
timed, then profiled with torch.profiler, on one `bench.gpu_step`-shaped batch (256 rows,
on-policy, rollout log-probs present), per variant (Hydra overrides on the shape's preset).
Options and outputs: bench/README.md, "Inside the update".

    torchrun --standalone --nproc_per_node=1 -m bench.update_profile --shape 0.5b --out DIR
    torchrun --standalone --nproc_per_node=1 -m bench.update_profile --shape 0.5b --backend megatron --memory --out DIR

Liger patches transformers' Qwen modules for the whole process, so engines built after a Liger
one get its kernels too: put a `backend.liger_kernel=false` variant first when comparing.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import cache_dir, ppo_step, shaped_model, tiny_model
from bench.step_report import mfu, param_count
from lorarl import metrics as keys
from lorarl.config.compose import compose
from lorarl.contract.engine import build_batch
from lorarl.driver.prepare import engine_spec
from lorarl.engines.fsdp import FSDPEngine

PRESETS = {
    "0.5b": ("qwen2.5-0.5b", "qwen2_5_0_5b_instruct"),
    "7b": ("qwen2.5-7b", "qwen2_5_7b_instruct"),
    "30b-a3b": ("qwen3-30b-a3b", "qwen3_30b_a3b"),  # attention + expert LoRA, as the preset targets
    "moe-tiny": ("qwen3-moe-tiny", "qwen3_30b_a3b"),  # the same code paths at CPU size
    "tiny": (None, "qwen2_tiny"),
}


def make_batch(engine, vocab: int, rows: int, response: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    top = min(500, vocab)  # ids < 512 are valid in every Qwen vocab and the tiny one
    prompts = [torch.randint(10, top, (int(torch.randint(18, 27, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(rows)]  # fmt: skip
    responses = [torch.randint(10, top, (response,), generator=gen).tolist() for _ in range(rows)]
    batch = build_batch(
        prompts,
        responses,
        engine.pad_token_id,
        advantages=torch.randn(rows, generator=gen).tolist(),
        left_pad_prompts=engine.left_pad_prompts,
        rollout_logprobs=[[-1.0] * response for _ in range(rows)],
    )
    return batch


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(call, warmup: int, repeats: int) -> tuple[list[float], object]:
    """(seconds of each timed call(k), the last call's result); k counts from 1, warm-up included."""
    out, result = [], None
    for k in range(warmup + repeats):
        synchronize()
        t0 = time.perf_counter()
        result = call(k + 1)
        synchronize()
        if k >= warmup:
            out.append(time.perf_counter() - t0)
    return out, result


def time_variant(run, engine, batch, device, warmup: int, repeats: int) -> tuple[list[float], dict, list[float]]:
    """(update seconds, the last update's metrics, reference-pass seconds)."""
    updates, metrics = timed(lambda k: ppo_step(run, engine, batch, k, device), warmup, repeats)
    reference, _ = timed(
        lambda _: engine.log_probs(batch, temperature=run.rollout.temperature, reference=True), 1, repeats
    )
    return updates, metrics, reference


def blocks_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """(the highest total, the blocks alive then) from a CUDA allocator trace
    (`torch.cuda.memory._snapshot()["device_traces"][device]`: alloc and free events with address,
    size and frames), counting only what was allocated while it was recorded."""
    total = best = best_at = 0
    live: dict[int, int] = {}
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > best:
                best, best_at = total, i
        elif event["action"] in ("free_requested", "free_completed"):
            total -= live.pop(event["addr"], 0)
    alive: dict[int, dict] = {}
    for event in trace[: best_at + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] in ("free_requested", "free_completed"):
            alive.pop(event["addr"], None)
    return best, list(alive.values())


def by_site(blocks: list[dict], top: int = 25) -> list[dict]:
    """Blocks grouped by the innermost Python frame outside torch that allocated them (with its
    caller), largest first."""
    sizes: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for block in blocks:
        ours = [f for f in block.get("frames", []) if "/torch/" not in f["filename"] and f["filename"][:1] != "<"]
        site = (
            " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in ours[:2]) or "(no Python frame)"
        )
        sizes[site] += block["size"]
        counts[site] += 1
    return [{"site": k, "gib": v / 2**30, "blocks": counts[k]} for k, v in sizes.most_common(top)]


def memory_at_peak(call) -> dict:
    """`call()` once under the CUDA allocator's history (Python frames): its peak above what was
    allocated before, and where the blocks alive at that moment were allocated."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)
    try:
        call()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks = blocks_at_peak(snapshot["device_traces"][torch.cuda.current_device()])
    return {"peak_gib": peak / 2**30, "sites": by_site(blocks)}


def trace_syncs(run, engine, batch, device) -> dict[str, int]:
    """Synchronizing calls of one update, counted by call site: the innermost frame and the two
    innermost outside torch. torch warns at each one in sync debug mode; a wait inside the
    backward (autograd's own thread) has no Python caller and is not counted here."""
    import traceback
    import warnings

    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        ours = [f for f in stack if "/torch/" not in f.filename][-2:]
        where = [f"{Path(f.filename).name}:{f.lineno}" for f in (stack[-1], *reversed(ours))]
        sites[" < ".join(where)] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            ppo_step(run, engine, batch, 101, device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites.most_common(40))


def variant_engine(run, device: torch.device):
    """The project's engine for one variant's run config."""
    if run.backend.strategy == "megatron":
        from lorarl.engines.megatron.engine import MegatronEngine

        return MegatronEngine(engine_spec(run, device.type), device)
    return FSDPEngine(engine_spec(run, device.type), device)


def profile_update(run, engine, batch, device, stem: Path, result: dict) -> None:
    """One update under torch.profiler: <stem>.txt (by self device time and by CPU time) and
    <stem>.json (`result` with the profiled wall and kernel seconds)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        synchronize()
        t0 = time.perf_counter()
        ppo_step(run, engine, batch, 100, device)
        synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in events) / 1e6
    result["profiled_wall_s"] = wall
    result["profiled_kernel_s"] = cuda_total
    text = [f"profiled update wall {wall:.3f} s, kernel time (sum of self device time) {cuda_total:.3f} s"]
    text.append(events.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=70))
    text.append(events.table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=70))
    stem.with_name(stem.name + ".txt").write_text("\n".join(text))
    stem.with_name(stem.name + ".json").write_text(json.dumps(result, indent=1))
    print(text[0], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(PRESETS), default="0.5b")
    ap.add_argument("--backend", choices=("fsdp", "megatron"), default="fsdp")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: all; the 30b-a3b pair ran 16)")
    ap.add_argument("--memory", action="store_true", help="where the last variant's update peaks (cuda)")
    ap.add_argument("--variants", default="preset", help="';'-separated, each a ','-list of overrides or 'preset'")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--reserve-gib", type=float, default=0.0, help="GPU memory held throughout, as an awake vLLM")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--kl", action="store_true", help="a reference log-prob tensor and the KL loss")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of this script")
    ap.add_argument("--trace-syncs", action="store_true", help="count one update's host waits by call site (cuda)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    cache = cache_dir()
    shape, preset = PRESETS[args.shape]
    model = shaped_model(cache, shape, args.layers, device=args.device) if shape else tiny_model(cache)
    hf_config = json.loads((Path(model) / "config.json").read_text())
    n_params, vocab = param_count(hf_config), hf_config["vocab_size"]
    reserve = torch.empty(int(args.reserve_gib * 2**30), dtype=torch.uint8, device=device) if args.reserve_gib else None
    base = [
        f"+backend={args.backend}",
        f"model={preset}",
        f"model.path={model}",
        "model.builder=null",
        "data.train_batch_size=32",
        "actor.ppo_mini_batch_size=32",
        "rollout.n=8",
        f"trainer.device={args.device}",
        f"actor.use_kl_loss={str(args.kl).lower()}",
    ]
    result = {"shape": args.shape, "backend": args.backend, "reserve_gib": args.reserve_gib, "variants": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = args.variants.split(";")
    for i, spec in enumerate(specs):
        extra = [] if spec == "preset" else spec.split(",")
        run = compose(base + extra)
        engine = variant_engine(run, device)
        batch = make_batch(engine, vocab, args.rows, args.response)
        if args.kl:
            batch.ref_logp = torch.zeros_like(batch.response_mask)
        stats = torch.cuda.memory_stats if on_gpu else dict
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        retries0 = stats().get("num_alloc_retries", 0)
        samples, metrics, reference = time_variant(run, engine, batch, device, args.warmup, args.repeats)
        tokens = int(batch.attention_mask.sum())
        row = {
            "variant": spec,
            "median_s": statistics.median(samples),
            "samples_s": samples,
            "mfu_update": mfu(n_params, tokens, statistics.median(samples), recomputes=False)["mfu_update"],
            "reference_median_s": statistics.median(reference),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
            "alloc_retries": stats().get("num_alloc_retries", 0) - retries0,
            "micro_batches": metrics.get(keys.ACTOR_MICRO_BATCHES.key),
        }
        if args.trace_syncs and on_gpu:
            row["syncs"] = trace_syncs(run, engine, batch, device)
            row["syncs_total"] = sum(row["syncs"].values())
        print(json.dumps({k: v for k, v in row.items() if k != "syncs"}), flush=True)
        result["variants"].append(row)
        if i < len(specs) - 1:
            del engine, batch
            gc.collect()  # PEFT and FSDP modules hold reference cycles: free the engine before the next
            if on_gpu:
                torch.cuda.empty_cache()
    if args.memory and on_gpu:
        result["memory_at_peak"] = {
            "update": memory_at_peak(lambda: ppo_step(run, engine, batch, 102, device)),
            "reference": memory_at_peak(
                lambda: engine.log_probs(batch, temperature=run.rollout.temperature, reference=True)
            ),
        }
        for name, m in result["memory_at_peak"].items():
            print(f"{name}: peak {m['peak_gib']:.1f} GiB above the start;", json.dumps(m["sites"][:8]), flush=True)
    profile_update(run, engine, batch, device, out / f"update_profile_{args.shape}", result)
    del reserve
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
