"""The colocated vLLM engine's own weight tensors, named as the HF checkpoint names them, for a
trainer that builds its frozen base as views of them (lorarl.engines.shared_base).

Contract of `base_views`: every tensor returned shares storage with a parameter vLLM computes
with (same device, same dtype, no copy), and has the shape the HF checkpoint gives that name:
- fused projections are split by rows: `qkv_proj` into q/k/v (weights and biases), `gate_up_proj`
  into gate/up, in the order and sizes of vLLM's own `packed_modules_mapping` and `output_sizes`;
- vocab-padded tables (`embed_tokens`, an untied `lm_head`) are their first `vocab` rows;
- fused-MoE stacks are whole: vLLM's `w13_weight` [E, 2I, H] (gate rows, then up) is HF's
  `experts.gate_up_proj` and `w2_weight` [E, H, I] is `experts.down_proj`;
- everything else (norms, o/down projections, the router) is the parameter itself.

vLLM's CPU build re-packs every linear layer's weight into its GEMM library's layout after
loading and leaves an empty placeholder (`dispatch_cpu_unquantized_gemm(remove_weight=True)`),
so no view of it can exist; its own per-layer opt-out (`_cpu_skip_gemm_dispatch`, which vLLM sets
on MLA's kv_b_proj) keeps the loaded weight and computes with `torch.nn.functional.linear`.
`dense_linear_weights()` sets it on vLLM's linear base class while an engine is built. The CPU
build's fused-MoE experts re-pack their stacks in place with no opt-out: they cannot be shared
there (lorarl.engines.shared_base refuses MoE on CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

from lorarl.rollout.vllm.in_worker import _served, vllm_worker

# vLLM's fused-MoE stacks and the HF (transformers >= 5) names of the same tensors.
EXPERT_STACKS = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}


@contextlib.contextmanager
def dense_linear_weights(keep: bool = True) -> Iterator[None]:
    """While an engine is built in this process: with `keep`, linear layers keep their loaded
    weights (CPU build; a no-op elsewhere, where vLLM computes with the loaded tensor itself)."""
    if not keep:
        yield
        return
    from vllm.model_executor.layers.linear import LinearBase

    had = "_cpu_skip_gemm_dispatch" in LinearBase.__dict__
    before = LinearBase.__dict__.get("_cpu_skip_gemm_dispatch")
    LinearBase._cpu_skip_gemm_dispatch = True
    try:
        yield
    finally:
        if had:
            LinearBase._cpu_skip_gemm_dispatch = before
        else:
            del LinearBase._cpu_skip_gemm_dispatch


def engine_base_views(rollout) -> dict[str, Tensor]:
    """HF name -> a view of the weight `rollout`'s engine computes with (base_views)."""
    vocab = rollout.llm.llm_engine.vllm_config.model_config.get_vocab_size()
    return rollout.run_in_worker(base_views, vocab)


def base_views(worker, vocab_size: int) -> dict[str, Tensor]:
    """HF name -> a view of vLLM's tensor (runs inside vLLM's worker; in-process engines only:
    the result holds the engine's own tensors). `vocab_size` is the checkpoint's (vLLM pads)."""
    model = vllm_worker(worker).model_runner.get_model()
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    out: dict[str, Tensor] = {}
    for module_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            name = _served(f"{module_name}.{leaf}")
            stem, _, leaf = name.rpartition(".")
            parent, _, short = stem.rpartition(".")
            data = param.data
            if short in packed and leaf in ("weight", "bias"):
                sizes = list(module.output_sizes)
                parts = packed[short]
                if len(sizes) != len(parts):
                    raise ValueError(f"{name}: vLLM packs {parts} into output sizes {sizes}")
                start = 0
                for part, rows in zip(parts, sizes, strict=True):
                    out[f"{parent}.{part}.{leaf}"] = data[start : start + rows]
                    start += rows
            elif leaf in EXPERT_STACKS:
                out[f"{stem}.{EXPERT_STACKS[leaf]}"] = data
            elif short in ("embed_tokens", "lm_head") and leaf == "weight":
                out[name] = data[:vocab_size]
            else:
                out[name] = data
    return out


def storage_spans(tensors: dict[str, Tensor]) -> dict[str, tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """name -> (storage address, element offset, shape, strides): two tensors with equal spans
    read the same memory the same way (the sharing tests compare these)."""
    return {
        name: (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        for name, t in tensors.items()
    }


def release_kv_cache(llm) -> set[str]:
    """Free the engine's KV cache and keep every weight where it is: the trainer computes with
    them during the update. vLLM with `release_kv_cache_memory` (a level-0 pause, then the
    kv_cache pool discarded) touches nothing else; an older vLLM gets a level-1 sleep followed
    by waking its weights, which come back at the same addresses (its allocator keeps each
    allocation's virtual range and re-maps it) at the cost of one host round trip of the base.
    `wake_up(["kv_cache"])` restores the cache either way. Returns what now sleeps."""
    engine = llm.llm_engine
    if hasattr(engine, "release_kv_cache_memory"):
        llm.sleep(level=0)
        engine.release_kv_cache_memory()
    else:
        llm.sleep(level=1)
        llm.wake_up(["weights"])
    return {"kv_cache"}
