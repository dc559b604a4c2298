"""Under torchrun (gloo): the FSDP engine over a replicated, shared base (backend.share_base) against
the FSDP engine that loads and shards its own base, same LoRA start, same per-rank batches.

    torchrun --standalone --nproc_per_node=2 tests/distributed/shared_base_check.py MODEL OUT [FAULT]

The shared engine's frozen parameters are views of tensors read from the checkpoint's own
safetensors file (in a worker they are vLLM's; lorarl.rollout.vllm.base_views), so every rank holds
the whole base. Writes OUT/result.json (rank 0): per step both engines' metrics, the largest
difference of the full LoRA gradients before each optimizer step and of the LoRA factors after
it, and what each engine's FSDP manages. FAULT `wrong_rows` binds layer 0's q_proj to layer 1's
rows, a wrong view the comparison must see.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Sibling scripts (torchrun puts this folder first on sys.path).
from fsdp_engine_check import make_run, randomize_lora, update
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lorarl.contract.engine import build_batch
from lorarl.driver.prepare import engine_spec
from lorarl.engines.fsdp import FSDPEngine

STEPS = 3


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def record_grads(engine: FSDPEngine, into: list[dict[str, torch.Tensor]]) -> None:
    """Keep the full LoRA gradients each optimizer step is about to apply."""
    step = engine.optimizer_step

    def recorded(n: int, skip=()) -> list[float]:
        into.append({name: full(p.grad) for name, p in engine.model.named_parameters() if p.grad is not None})
        return step(n, skip)

    engine.optimizer_step = recorded


def managed(engine: FSDPEngine) -> list[str]:
    """Names of the parameters FSDP shards, gathers and reduces in this engine."""
    ids = set()
    for module in engine.model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            ids |= {id(fp.sharded_param) for fp in (group.fsdp_params if group else [])}
    return [name for name, p in engine.model.named_parameters() if id(p) in ids]


def rank_batch(rank: int, pad: int):
    """This rank's own rows (data parallel: each rank sees other samples)."""
    gen = torch.Generator().manual_seed(100 + rank)
    prompts = [torch.randint(3, 60, (int(n),), generator=gen).tolist() for n in (3, 5, 4, 6)]
    responses = [torch.randint(3, 60, (int(n),), generator=gen).tolist() for n in (4, 2, 5, 3)]
    return build_batch(prompts, responses, pad, torch.randn(4, generator=gen).tolist(), left_pad_prompts=True)


def main(model_path: str, out: str, fault: str | None) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    run = make_run(model_path, world)
    spec = engine_spec(run, "cpu")
    sharded = FSDPEngine(spec, torch.device("cpu"))
    checkpoint = load_file(str(Path(model_path) / "model.safetensors"))
    views = dict(checkpoint)
    if fault == "wrong_rows":
        views["model.layers.0.self_attn.q_proj.weight"] = checkpoint["model.layers.1.self_attn.q_proj.weight"]
    shared = FSDPEngine(spec, torch.device("cpu"), base=views)
    for engine in (sharded, shared):
        randomize_lora(engine)  # the same full LoRA tensors in both
    frozen = {n: p for n, p in shared.model.named_parameters() if not p.requires_grad}
    bound = {n: p for n, p in frozen.items() if not isinstance(p, DTensor)}
    same_storage = all(
        p.untyped_storage().data_ptr() == views[hf].untyped_storage().data_ptr()
        for n, p in frozen.items()
        for hf in [n.removeprefix("base_model.model.").replace(".base_layer.", ".")]
    )

    grads = {"sharded": [], "shared": []}
    record_grads(sharded, grads["sharded"])
    record_grads(shared, grads["shared"])
    steps, start = [], sharded.lora_state()
    for step in range(1, STEPS + 1):
        metrics = {}
        for name, engine in (("sharded", sharded), ("shared", shared)):
            batch = rank_batch(rank, engine.pad_token_id)
            batch.old_logp = engine.log_probs(batch, temperature=1.0)
            batch.ref_logp = engine.log_probs(batch, temperature=1.0, reference=True)
            metrics[name] = update(engine, run, batch, step)
        a, b = sharded.lora_state(), shared.lora_state()
        ga, gb = grads["sharded"][-1], grads["shared"][-1]
        steps.append(
            {
                "metrics": metrics,
                "grad_max_diff": max(float((ga[k] - gb[k]).abs().max()) for k in ga),
                "grad_max": max(float(g.abs().max()) for g in ga.values()),
                "lora_max_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
                "lora_moved": max(float((a[k] - start[k]).abs().max()) for k in a),
                "grads_compared": sorted(ga) == sorted(gb) and len(ga),
            }
        )
    if rank == 0:
        result = {
            "steps": steps,
            "shared_frozen": len(frozen),
            "shared_frozen_whole": len(bound),
            "shared_same_storage": same_storage,
            "shared_managed": managed(shared),
            "sharded_managed": managed(sharded),
            "lora_params": [n for n, p in shared.model.named_parameters() if p.requires_grad],
        }
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "result.json").write_text(json.dumps(result, indent=1))
    # Both ranks leave together: rank 1 tearing gloo down while rank 0 still writes aborted rank 0
    # at exit once ("terminate called without an active exception", exit -6).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
