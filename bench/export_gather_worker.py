"""Run under torchrun: what one FSDP2 export costs, per method, on CPU (gloo) or GPU (NCCL).

    torchrun --standalone --nproc_per_node=N -m bench.export_gather_worker \
        --model PATH --dtype bfloat16 --rank 16 --device cpu --repeats 5 --out result.json

Methods, all through the project's FSDPEngine:
  bucketed / layered               the engine's adapter gathers (`engine.export(ADAPTER, method)`)
  per_param                        one `DTensor.full_tensor()` per LoRA param over the engine's
                                   model (many small collectives): the baseline they beat
  full_state_dict                  torch's get_model_state_dict(full_state_dict=True), LoRA
                                   keys kept: the "gather everything" way
  base_stream                      every base weight, one FSDP unit unsharded at a time
                                   (`engine.export(BASE)`, consumed)
  merged_stream                    the same with W + BA merged in (model.lora.merge=true)

Per repeat the slowest rank's seconds count (a collective ends when its last rank does). On
GPU, the peak extra memory of each rank (`torch.cuda.max_memory_allocated` above what was
allocated before the call, result kept alive) is recorded too. Every gathered adapter is
compared with the seeded values scattered into the shards, so a gather that returns wrong
tensors is reported, not timed as a success.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from lorarl.config import RunConfig, compose
from lorarl.engines.fsdp import FSDPEngine
from lorarl.sync.payload import PayloadKind

ADAPTER_METHODS = ("bucketed", "layered")
HEAVY_METHODS = ("full_state_dict", "base_stream", "merged_stream")  # move every base weight
METHODS = (*ADAPTER_METHODS, "per_param", *HEAVY_METHODS)


def make_run(model: str, dtype: str, rank: int, world: int, device: str) -> RunConfig:
    # Export only: the batch keys just have to validate (rollout.n=2 is the schema's minimum).
    return compose(
        [
            "+backend=fsdp",
            f"model.path={model}",
            "model.builder=null",
            f"model.dtype={dtype}",
            "model.enable_gradient_checkpointing=false",
            f"model.lora.rank={rank}",
            f"model.lora.alpha={2 * rank}",
            f"data.train_batch_size={world}",
            "rollout.n=2",
            f"actor.ppo_mini_batch_size={world}",
            "actor.ppo_micro_batch_size_per_gpu=1",
            f"trainer.n_gpus_per_node={world}",
            f"trainer.device={device}",
            f"backend.mixed_precision={dtype}",
        ]
    )


def seed_lora(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    """Seeded full LoRA values scattered into the shards; returns them on CPU by PEFT name."""
    from lorarl.engines.fsdp import peft_name

    full = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(engine.model.named_parameters()):
            if not p.requires_grad:
                continue
            value = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02
            full[peft_name(name)] = value
            value = value.to(device=p.device, dtype=p.dtype)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(value, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(value)
    return full


def per_param_lora(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    from lorarl.engines.fsdp import peft_name

    out = {}
    for name, p in engine.model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[peft_name(name)] = full.detach().clone()
    return out


def full_state_dict_lora(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lorarl.engines.fsdp import peft_name

    # cpu_offload=False: every rank holds the whole gathered model, what a naive exporter does.
    sd = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {peft_name(k): v.detach().to("cpu", copy=True) for k, v in sd.items() if "lora_" in k}


def run_method(engine: FSDPEngine, method: str) -> tuple[object, int, int]:
    """(result kept alive, tensors, bytes)."""
    if method in ADAPTER_METHODS:
        payload, _ = engine.export(PayloadKind.ADAPTER, method=method)
        tensors = dict(payload.tensors)
    elif method == "per_param":
        tensors = per_param_lora(engine)
    elif method == "full_state_dict":
        tensors = full_state_dict_lora(engine)
    else:
        merge = method == "merged_stream"
        # The trainer's base stream (FSDPEngine.base_stream), consumed the way vLLM does:
        # one tensor at a time, nothing kept.
        n, size = 0, 0
        for _, t in engine.base_stream(merge=merge):
            n += 1
            size += t.numel() * t.element_size()
        return None, n, size
    return tensors, len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def adapter_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Max |gathered - seeded| over every LoRA tensor; inf when names or shapes differ."""
    if set(got) != set(expected) or any(got[k].shape != v.shape for k, v in expected.items()):
        return float("inf")
    return max(float((got[k].float() - v).abs().max()) for k, v in expected.items())


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_ranks(x: float) -> list[float]:
    t = torch.tensor([x], dtype=torch.float64, device=_comm_device())
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(o.item()) for o in out]


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--heavy-repeats", type=int, default=None, help="repeats of the whole-model methods (default: --repeats)"
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    on_gpu = args.device == "cuda"
    if on_gpu:
        import os

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    t0 = time.perf_counter()
    engine = FSDPEngine(make_run(args.model, args.dtype, args.rank, world, args.device), device)
    build_s = time.perf_counter() - t0
    expected = seed_lora(engine)

    methods = args.methods.split(",")
    results = {
        m: {"samples_s": [], "peaks": [], "num_tensors": 0, "bytes": 0, "max_abs_diff_vs_seeded": None} for m in methods
    }
    heavy_repeats = args.repeats if args.heavy_repeats is None else args.heavy_repeats
    for k in range(args.warmup + max(args.repeats, heavy_repeats)):
        # Methods back to back within a repeat, order rotated, so ratios can be paired per repeat.
        for method in methods[k % len(methods) :] + methods[: k % len(methods)]:
            if k >= args.warmup + (heavy_repeats if method in HEAVY_METHODS else args.repeats):
                continue
            r = results[method]
            dist.barrier()
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            kept, r["num_tensors"], r["bytes"] = run_method(engine, method)
            if on_gpu:
                torch.cuda.synchronize()
            seconds = max_over_ranks(time.perf_counter() - start)
            if k >= args.warmup:
                r["samples_s"].append(seconds)
                if on_gpu:
                    r["peaks"].append(all_ranks((torch.cuda.max_memory_allocated() - before) / 2**30))
            if kept is not None and r["max_abs_diff_vs_seeded"] is None:
                r["max_abs_diff_vs_seeded"] = adapter_diff(kept, expected)
            del kept
    for r in results.values():
        peaks = r.pop("peaks")
        r["peak_extra_gib_per_rank"] = [max(p[i] for p in peaks) for i in range(world)] if peaks else None
    if rank == 0:
        params = sum(p.numel() for p in engine.model.parameters())
        lora = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
        info = {
            "world": world,
            "device": args.device,
            "dtype": args.dtype,
            "lora_rank": args.rank,
            "engine_build_s": build_s,
            "lora_params": lora,
            "local_params_rank0": params,
            "lora_tensors": len(expected),
            "threads_per_rank": args.threads if not on_gpu else None,
            "methods": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(info, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
