"""Sync latency per step, three ways, same model and adapter, real in-process vLLM (CPU build).

  (a) ours: `rollout.apply(WeightPayload.adapter(...))`, tmpfs transport and memory transport;
  (b) merged: W + (alpha/r)·B@A for every wrapped linear, every weight pushed as a base payload
      into a vLLM started without LoRA (what lorarl's model.lora.merge=true, TRL and NeMo-RL do);
  (c) naive: `peft_model.save_pretrained(<disk folder>)`, then vLLM loads it by path under a
      fresh LoRARequest id each step.

Every method starts from the same PEFT model in memory (the trainer's gather is measured by
bench.export_gather) and ends when vLLM serves the new weights. Each repeat draws new LoRA
weights and runs the methods back to back, in an order rotated per repeat, so ratios are
paired within a repeat. After the last repeat every engine's log-probs on a probe sequence
are compared with HF+PEFT: a method that did not really sync shows up there.

Also, tiny model only: generation tokens/s with the adapter attached vs the merged engine
vs the LoRA engine with no adapter attached (fixed-length sampling, ignore_eos).

    python -m bench.sync_latency --out /tmp/sync.json [--models tiny,qwen05] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from bench.common import (  # noqa: E402 - the env var must be set before vLLM is imported
    LORA_ALPHA,
    LORA_RANK,
    Record,
    Stat,
    adapter_config_dict,
    cache_dir,
    peft_lora_config,
    perturb_lora,
    qwen05_shaped_model,
    ratio_stat,
    set_threads,
    timed,
    tiny_model,
    write_json,
)

MAX_MODEL_LEN = 128
METHODS = ("a_tmpfs", "a_memory", "b_merged", "c_disk")
LABELS = {
    "a_tmpfs": "(a) ours: adapter payload, tmpfs",
    "a_memory": "(a) ours: adapter payload, memory",
    "b_merged": "(b) merged: W+BA, all weights as base payload",
    "c_disk": "(c) naive: save_pretrained to disk + load by path, new id",
}
# Generation workload for the tiny model: prompts x samples x tokens, every sample full length.
GEN_PROMPTS, GEN_N, GEN_TOKENS = 8, 4, 16


def merged_stream(peft_model, scale: float):
    """Plain-HF-named base weights with LoRA merged in, one tensor at a time (the trainer's
    merge=true export, minus FSDP): the merge runs while vLLM consumes the stream."""
    import torch

    params = dict(peft_model.named_parameters())
    tied = bool(getattr(peft_model.config, "tie_word_embeddings", False))
    with torch.no_grad():
        for name, p in params.items():
            if "lora_" in name:
                continue
            tensor = p.detach()
            if name.endswith(".base_layer.weight"):
                stem = name[: -len(".base_layer.weight")]
                a = params[f"{stem}.lora_A.default.weight"].float()
                b = params[f"{stem}.lora_B.default.weight"].float()
                tensor = (tensor.float() + scale * (b @ a)).to(p.dtype)
            hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            yield hf, tensor
            if hf == "model.embed_tokens.weight" and tied:
                yield "lm_head.weight", tensor


def probe_sequence(tokenizer) -> tuple[list[int], int]:
    """A chat prompt plus a fixed answer; log-probs are read for every token after position 1."""
    from lorarl.data import arith
    from lorarl.models.tiny import prompt_ids

    row = arith.make_rows(1, seed=7, split="probe")[0]
    ids = prompt_ids(tokenizer, row["prompt"]) + tokenizer.encode("12<|im_end|>")
    return ids, 1


def raw_prompt_logprobs(llm, token_ids: list[int], start: int, lora_request) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, lora_request=lora_request, use_tqdm=False)[0]
    return [out.prompt_logprobs[i][token_ids[i]].logprob for i in range(start, len(token_ids))]


def hf_logprobs(model, token_ids: list[int], start: int) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    logp = logits.log_softmax(-1)
    return [logp[i - 1, token_ids[i]].item() for i in range(start, len(token_ids))]


def max_diff(x: list[float], y: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(x, y))


def start_engines(path: Path) -> tuple[dict, dict]:
    """The three engines (LoRA over tmpfs, LoRA from memory, no LoRA for merged weights) and
    their start-up seconds."""
    from lorarl.rollout.vllm import VLLMRollout

    kw = dict(max_model_len=MAX_MODEL_LEN, seed=0)
    engines: dict[str, VLLMRollout] = {}
    init_s = {}
    init_s["lora_tmpfs"], engines["a_tmpfs"] = timed(
        lambda: VLLMRollout(path, lora_rank=LORA_RANK, adapter_transport="tmpfs", **kw)
    )
    init_s["lora_memory"], engines["a_memory"] = timed(
        lambda: VLLMRollout(path, lora_rank=LORA_RANK, adapter_transport="memory", **kw)
    )
    init_s["no_lora"], engines["b_merged"] = timed(lambda: VLLMRollout(path, lora_rank=None, **kw))
    return engines, init_s


def sync_records(cfg: str, samples: dict[str, list[float]], tol: float, extra: dict) -> list[Record]:
    """One record per method, against (a) tmpfs, an error where its probe disagreed with HF+PEFT."""
    records = []
    for method in METHODS:
        bad = extra["checks"][method] > tol
        records.append(
            Record(
                "sync_latency",
                LABELS[method],
                cfg,
                Stat.of(samples[method]),
                baseline=None if method == "a_tmpfs" else LABELS["a_tmpfs"],
                ratio=None if method == "a_tmpfs" else ratio_stat(samples[method], samples["a_tmpfs"]),
                extra={
                    **extra["details"][method],
                    "warmup_s": extra["firsts"][method],
                    "logprob_diff_vs_hf_peft": extra["checks"][method],
                    "adapter_effect_on_logprob": extra["effect"],
                    "tolerance": tol,
                    "engine_init_s": extra["init_s"],
                },
                error=f"after the sync vLLM disagrees with HF+PEFT by {extra['checks'][method]:.4g} > {tol:.3g}: not synced"
                if bad
                else None,
            )
        )
    return records


def measure_model(name: str, path: Path, scratch: Path, repeats: int, warmup: int, gen_repeats: int) -> list[Record]:
    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.lora.request import LoRARequest

    from lorarl.sync.payload import WeightPayload

    dtype_name = _checkpoint_dtype(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name)).eval()
    model = get_peft_model(base, peft_lora_config()).eval()
    config = adapter_config_dict(model)
    config["base_model_name_or_path"] = str(path)
    scale = LORA_ALPHA / LORA_RANK
    probe, start = probe_sequence(tokenizer)
    cfg = f"{name}, {dtype_name}, LoRA r={LORA_RANK} all 7 proj, {torch.get_num_threads()} torch thread(s)"

    engines, init_s = start_engines(path)
    base_probe = engines["b_merged"].prompt_logprobs(probe, start)  # base from disk, before any sync

    # (c) shares the tmpfs engine: vLLM keeps one adapter (max_loras=1), so each method's load
    # evicts the other's, exactly as a fresh id evicts the previous step's adapter.
    naive_llm = engines["a_tmpfs"].llm
    disk_dir = scratch / f"naive_adapter_{name}"
    shutil.rmtree(disk_dir, ignore_errors=True)
    naive_request = None

    def sync_a(method: str) -> dict:
        stats = engines[method].apply(WeightPayload.adapter(get_peft_model_state_dict(model), config))
        return {
            "bytes": stats.bytes,
            "num_tensors": stats.num_tensors,
            "transfer_s": stats.transfer_s,
            "load_s": stats.load_s,
        }

    def sync_b() -> dict:
        stats = engines["b_merged"].apply(WeightPayload.base(merged_stream(model, scale)))
        return {"bytes": stats.bytes, "num_tensors": stats.num_tensors, "load_s": stats.load_s}

    naive_id = [1000]

    def sync_c() -> dict:
        nonlocal naive_request
        save_s, _ = timed(lambda: model.save_pretrained(disk_dir))
        naive_id[0] += 1
        naive_request = LoRARequest(f"naive-{naive_id[0]}", naive_id[0], str(disk_dir))
        load_s, _ = timed(lambda: naive_llm.llm_engine.add_lora(naive_request))
        naive_llm.reset_prefix_cache()
        size = sum(f.stat().st_size for f in disk_dir.iterdir() if f.is_file())
        return {"bytes": size, "save_s": save_s, "load_s": load_s}

    syncs = {
        "a_tmpfs": lambda: sync_a("a_tmpfs"),
        "a_memory": lambda: sync_a("a_memory"),
        "b_merged": sync_b,
        "c_disk": sync_c,
    }
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    firsts: dict[str, list[float]] = {m: [] for m in METHODS}
    details: dict[str, dict] = {}
    finals: dict[str, list[float]] = {}
    total = warmup + repeats
    for k in range(total):
        perturb_lora(model, seed=k + 1)
        shift = k % len(METHODS)
        last = k == total - 1
        for method in METHODS[shift:] + METHODS[:shift]:
            gc.collect()  # a collection inside one method's window would bill it for the others' garbage
            seconds, info = timed(syncs[method])
            (samples if k >= warmup else firsts)[method].append(seconds)
            details[method] = info
            if last:
                # The probe must be read right after the method's own sync: (a_tmpfs) and (c)
                # share an engine and evict each other's adapter.
                if method == "c_disk":
                    finals[method] = raw_prompt_logprobs(naive_llm, probe, start, naive_request)
                else:
                    finals[method] = engines[method].prompt_logprobs(probe, start)
    reference = hf_logprobs(model, probe, start)
    effect = max_diff(reference, base_probe)
    tol = 1e-3 if dtype_name == "float32" else max(0.05, 0.1 * effect)
    checks = {m: max_diff(finals[m], reference) for m in METHODS}

    extra = {"firsts": firsts, "details": details, "checks": checks, "effect": effect, "init_s": init_s}
    records = sync_records(cfg, samples, tol, extra)
    if gen_repeats:
        records += measure_generation(name, cfg, engines, tokenizer, gen_repeats)
    for engine in engines.values():
        engine.shutdown()
    del model, base
    gc.collect()
    shutil.rmtree(disk_dir, ignore_errors=True)
    return records


def measure_generation(name: str, cfg: str, engines: dict, tokenizer, repeats: int) -> list[Record]:
    """Tokens/s sampling the same batch: adapter attached, merged weights, LoRA engine bare."""
    from vllm import SamplingParams

    from lorarl.data import arith
    from lorarl.models.tiny import prompt_ids

    prompts = [
        {"prompt_token_ids": prompt_ids(tokenizer, r["prompt"])}
        for r in arith.make_rows(GEN_PROMPTS, seed=3, split="bench")
    ]
    params = SamplingParams(n=GEN_N, max_tokens=GEN_TOKENS, ignore_eos=True, temperature=1.0, detokenize=False)
    runs = {
        "adapter": (engines["a_tmpfs"].llm, engines["a_tmpfs"].lora_request()),
        "merged": (engines["b_merged"].llm, None),
        "lora_engine_no_adapter": (engines["a_tmpfs"].llm, None),
    }
    labels = {
        "adapter": "generate: LoRA engine, adapter attached",
        "merged": "generate: merged weights, engine without LoRA",
        "lora_engine_no_adapter": "generate: LoRA engine, no adapter attached",
    }
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for k in range(repeats + 1):
        keys = list(runs)
        keys = keys[k % len(keys) :] + keys[: k % len(keys)]
        for key in keys:
            llm, request = runs[key]
            seconds, outs = timed(lambda: llm.generate(prompts, params, lora_request=request, use_tqdm=False))
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            if k:  # the first round warms up
                rates[key].append(tokens / seconds)
    gcfg = f"{cfg}; {GEN_PROMPTS} prompts x {GEN_N} samples x {GEN_TOKENS} tokens"
    out = []
    for key in runs:
        out.append(
            Record(
                "generation",
                labels[key],
                gcfg,
                Stat.of(rates[key], unit="tok/s"),
                baseline=None if key == "merged" else labels["merged"],
                ratio=None if key == "merged" else ratio_stat(rates[key], rates["merged"]),
            )
        )
    return out


def _checkpoint_dtype(path: Path) -> str:
    import json

    saved = json.loads((path / "config.json").read_text())
    return str(saved.get("dtype") or saved.get("torch_dtype") or "float32")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--models", default="tiny,qwen05", help="comma list of tiny, qwen05")
    ap.add_argument("--qwen05-layers", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see bench.common.set_threads)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, not a result)")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    cache = cache_dir(args.cache)
    scratch = cache / "bench" / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    records: list[Record] = []
    for name in args.models.split(","):
        if name == "tiny":
            path, reps, gen = tiny_model(cache), (5 if args.quick else 20), (2 if args.quick else 7)
        elif name == "qwen05":
            path, reps, gen = qwen05_shaped_model(cache, layers=args.qwen05_layers), (2 if args.quick else 7), 0
            name = f"qwen2.5-0.5B-shape ({args.qwen05_layers} layers)"
        else:
            raise SystemExit(f"--models: unknown model {name!r}; use tiny or qwen05")
        try:
            records += measure_model(name, path, scratch, repeats=reps, warmup=2, gen_repeats=gen)
        except Exception as exc:  # noqa: BLE001 - one model failing must not lose the other's numbers
            records.append(
                Record("sync_latency", "all methods", name, None, error=f"{type(exc).__name__}: {exc}"[:500])
            )
    write_json(Path(args.out), [r.as_dict() for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
