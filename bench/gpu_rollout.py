"""GPU rollout, adapter vs merged: vLLM sampling tokens/s and the sync cost of each.

For the Qwen2.5-0.5B and 7B shapes (bf16, LoRA rank 64 alpha 128 on all linear projections,
eager), one engine at a time on one GPU:
  adapter  vLLM with LoRA: `rollout.apply(WeightPayload.adapter(...))` (tmpfs and memory
           transports), then sampling with the adapter attached (and, for reference, with
           none attached on the same engine);
  merged   vLLM without LoRA: W + BA merged on the GPU and every weight pushed as a base
           payload, then sampling.
Sync starts from a PEFT model in GPU memory (no FSDP gather: bench.gpu_export measures that
part). Each repeat draws new LoRA weights. The last sync of both engines uses the same
weights and their log-probs on a probe sequence are compared.

Where merged wins: per step, adapter costs sync_a + T/rate_a and merged sync_m + T/rate_m for
T sampled tokens; with rate_m > rate_a and sync_m > sync_a merged is cheaper above
T* = (sync_m - sync_a) / (1/rate_a - 1/rate_m) tokens per step (reported per workload).

    python -m bench.gpu_rollout --out /tmp/gpu_rollout.json [--models qwen05,qwen7] [--quick] [--cuda-graphs]

Eager by default (the rollout's default, rollout.enforce_eager=true); --cuda-graphs measures
the same with captured graphs, where per-layer LoRA kernel launches cost less.

`--device cpu --models tiny --quick` runs the same code on the CPU build with the tiny model:
a smoke test of this script, not a result.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from bench.common import (  # noqa: E402
    GPU_MODELS,
    PROJECTIONS,
    Record,
    Stat,
    adapter_config_dict,
    cache_dir,
    perturb_lora,
    ratio_of_medians,
    shaped_model,
    timed,
    tiny_model,
    write_json,
)
from bench.sync_latency import merged_stream, probe_sequence  # noqa: E402

MODELS = {**GPU_MODELS, "tiny": "tiny-qwen2"}
RANK, ALPHA = 64, 128
WORKLOADS = ((64, 128), (256, 128))  # prompts x tokens per prompt (one sample each, ignore_eos)
FINAL_SEED = 999


def generation_rates(llm, prompts, tokens: int, request, repeats: int) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(n=1, max_tokens=tokens, ignore_eos=True, temperature=1.0, detokenize=False)
    rates = []
    for k in range(repeats + 1):
        seconds, outs = timed(lambda: llm.generate(prompts, params, lora_request=request, use_tqdm=False))
        if k:
            rates.append(sum(len(c.token_ids) for o in outs for c in o.outputs) / seconds)
    return rates


def rollout_records(
    cfg: str, first: str, sync: dict, info: dict, finals: dict, rates: dict, workloads: tuple
) -> list[Record]:
    """Sync records against the first adapter transport (an error where adapter and merged
    engines disagree on the probe), then generation rates against merged weights, with the
    tokens per step above which merged sync wins."""
    diff = max(abs(a - b) for a, b in zip(finals[first], finals["merged"]))
    records = []
    sync_stats = {name: Stat.of(samples) for name, samples in sync.items()}
    for name, stat in sync_stats.items():
        records.append(
            Record(
                "gpu_rollout",
                f"sync: {name}",
                cfg,
                stat,
                baseline=None if name == first else f"sync: {first}",
                ratio=None if name == first else ratio_of_medians(stat, sync_stats[first]),
                extra={**info[name], "probe_logprob_diff_adapter_vs_merged": diff},
                error=f"adapter and merged engines disagree on the probe by {diff:.3g} (> 0.25)"
                if diff > 0.25
                else None,
            )
        )
    sync_a, sync_m = sync_stats[first].median, sync_stats["merged"].median
    for prompts, tokens in workloads:
        merged_rate = Stat.of(rates[("merged", prompts)], unit="tok/s")
        rate_m = merged_rate.median
        for kind in ("merged", "adapter", "lora_no_adapter"):
            stat = Stat.of(rates[(kind, prompts)], unit="tok/s")
            extra = {}
            if kind == "adapter":
                rate_a = stat.median
                if rate_m > rate_a and sync_m > sync_a:
                    extra["merged_wins_above_tokens_per_step"] = (sync_m - sync_a) / (1 / rate_a - 1 / rate_m)
                elif rate_m > rate_a:
                    extra["merged_wins_above_tokens_per_step"] = 0.0
                else:
                    extra["merged_wins_above_tokens_per_step"] = None
            records.append(
                Record(
                    "gpu_rollout",
                    f"generate: {kind}",
                    f"{cfg}; {prompts} prompts x {tokens} tokens",
                    stat,
                    baseline=None if kind == "merged" else "generate: merged",
                    ratio=None if kind == "merged" else ratio_of_medians(stat, merged_rate),
                    extra=extra,
                )
            )
    return records


def measure(
    key: str,
    cache: Path,
    repeats: int,
    gen_repeats: int,
    transports: tuple[str, ...],
    device: str = "cuda",
    cuda_graphs: bool = False,
) -> list[Record]:
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorarl.data import arith
    from lorarl.models.tiny import prompt_ids
    from lorarl.rollout.vllm import VLLMRollout
    from lorarl.sync.payload import WeightPayload

    shape = MODELS[key]
    path = tiny_model(cache) if key == "tiny" else shaped_model(cache, shape, dtype="bfloat16", device=device)
    dtype = torch.float32 if key == "tiny" else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    on_gpu = device == "cuda"
    workloads = WORKLOADS if on_gpu else ((8, 16),)  # the CPU smoke run only checks the code path

    def synchronize() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def release() -> None:
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()

    lora = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(PROJECTIONS), lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, lora).eval()
    config = adapter_config_dict(model)
    probe, start = probe_sequence(tokenizer)
    rows = arith.make_rows(max(p for p, _ in workloads), seed=5, split="bench")
    all_prompts = [{"prompt_token_ids": prompt_ids(tokenizer, r["prompt"])} for r in rows]
    cfg = f"{shape} shape, {str(dtype).removeprefix('torch.')}, LoRA r={RANK} all linear, 1 {'GPU' if on_gpu else 'CPU (smoke)'}, {'CUDA graphs' if cuda_graphs else 'eager'}"
    kw = dict(max_model_len=1024 if on_gpu else 256, seed=0, gpu_memory_utilization=0.45, enforce_eager=not cuda_graphs)
    sync: dict[str, list[float]] = {}
    rates: dict[tuple[str, int], list[float]] = {}
    finals: dict[str, list[float]] = {}
    info: dict[str, dict] = {}

    def sync_loop(name: str, rollout, payload_fn) -> None:
        samples = []
        for k in range(2 + repeats):
            perturb_lora(model, seed=FINAL_SEED if k == 1 + repeats else k + 1)
            synchronize()
            seconds, stats = timed(lambda: rollout.apply(payload_fn()))
            synchronize()
            if k >= 2:
                samples.append(seconds)
            info[name] = {"bytes": stats.bytes, "num_tensors": stats.num_tensors}
        sync[name] = samples
        finals[name] = rollout.prompt_logprobs(probe, start)

    def adapter_payload():
        return WeightPayload.adapter(get_peft_model_state_dict(model), config)

    for transport in transports:
        rollout = VLLMRollout(path, lora_rank=RANK, adapter_transport=transport, **kw)
        sync_loop(f"adapter_{transport}", rollout, adapter_payload)
        if transport == transports[0]:
            # No local name for the engine: one left alive here kept the next engine
            # from finding its memory (7B: 62.7 of 62.9 GiB free).
            for prompts, tokens in workloads:
                rates[("adapter", prompts)] = generation_rates(
                    rollout.llm, all_prompts[:prompts], tokens, rollout.lora_request(), gen_repeats
                )
                rates[("lora_no_adapter", prompts)] = generation_rates(
                    rollout.llm, all_prompts[:prompts], tokens, None, gen_repeats
                )
        rollout.shutdown()
        del rollout
        release()

    rollout = VLLMRollout(path, lora_rank=None, **kw)
    sync_loop("merged", rollout, lambda: WeightPayload.base(merged_stream(model, ALPHA / RANK)))
    for prompts, tokens in workloads:
        rates[("merged", prompts)] = generation_rates(rollout.llm, all_prompts[:prompts], tokens, None, gen_repeats)
    rollout.shutdown()
    del rollout
    release()

    records = rollout_records(cfg, f"adapter_{transports[0]}", sync, info, finals, rates, workloads)
    del model, base
    release()
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--models", default="qwen05,qwen7")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: smoke test only")
    ap.add_argument("--cuda-graphs", action="store_true", help="capture CUDA graphs (rollout.enforce_eager=false)")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_rollout needs a CUDA GPU (or --device cpu for a smoke test)")
    cache = cache_dir(args.cache)
    records: list[Record] = []
    for key in args.models.split(","):
        try:
            records += measure(
                key,
                cache,
                repeats=2 if args.quick else 8,
                gen_repeats=1 if args.quick else 3,
                transports=("tmpfs",) if args.quick else ("tmpfs", "memory"),
                device=args.device,
                cuda_graphs=args.cuda_graphs,
            )
        except Exception as exc:  # noqa: BLE001 - one model failing must not lose the other's numbers
            records.append(
                Record("gpu_rollout", "all", MODELS.get(key, key), None, error=f"{type(exc).__name__}: {exc}"[:800])
            )
    write_json(Path(args.out), [r.as_dict() for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
