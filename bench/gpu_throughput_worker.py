"""Run under torchrun on GPUs: FSDP2 + LoRA training throughput of the project's FSDPEngine.

    torchrun --standalone --nproc_per_node=2 -m bench.gpu_throughput_worker \
        --model PATH --batch 4 --seq 1024 --repeats 5 --out result.json

One `engine.update` (PPO-clip loss over every token, forward + backward + AdamW step, bf16
compute, LoRA rank 64 on all linear projections, gradient checkpointing on) per repeat on
random token ids; tokens/s per GPU and model FLOPs utilisation against a given peak.

FLOPs per token (matmul only, embeddings excluded, lm_head included; L layers, d hidden,
S sequence): forward 2N + 4LdS (attention scores and values, no causal halving), as in the
PaLM appendix. `mfu_6n` counts training as 3x forward (6N + 12LdS), the usual convention;
`mfu_lora` counts what a frozen base needs (no weight gradients: 4N + 12LdS). Recomputation
from gradient checkpointing is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import ppo_step
from bench.export_gather_worker import max_over_ranks
from lorarl.batch import build_batch
from lorarl.config import RunConfig, compose
from lorarl.engines.fsdp import FSDPEngine


def make_run(model: str, rank: int, world: int, batch: int, checkpointing: bool, device: str) -> RunConfig:
    # rollout.n=2 is the schema's minimum; update() is handed `batch` sequences per GPU directly,
    # which one mini-batch (ppo_mini_batch_size x n / world = 2 x batch) and one micro-batch cover.
    return compose(
        [
            "+backend=fsdp",
            f"model.path={model}",
            "model.builder=null",
            "model.dtype=bfloat16",
            f"model.enable_gradient_checkpointing={str(checkpointing).lower()}",
            f"model.lora.rank={rank}",
            f"model.lora.alpha={2 * rank}",
            f"data.train_batch_size={batch * world}",
            "rollout.n=2",
            "actor.optim.lr=1e-5",
            f"actor.ppo_mini_batch_size={batch * world}",
            f"actor.ppo_micro_batch_size_per_gpu={batch}",
            "actor.use_kl_loss=true",
            f"trainer.n_gpus_per_node={world}",
            f"trainer.device={device}",
            "backend.mixed_precision=bfloat16",
        ]
    )


def flops_per_token(config, seq: int) -> tuple[float, float]:
    """(forward matmul FLOPs per token, matmul params N) from the HF config."""
    d, L, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    per_layer = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d + 3 * d * ffn
    n = L * per_layer + d * config.vocab_size  # lm_head
    return 2 * n + 4 * L * heads * head_dim * seq, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul peak per GPU")
    ap.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu (gloo): smoke test of this script only"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    on_gpu = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    engine = FSDPEngine(
        make_run(args.model, args.rank, world, args.batch, not args.no_checkpointing, args.device), device
    )

    def synchronize() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    gen = torch.Generator().manual_seed(1000 + rank)
    vocab = engine.model.config.vocab_size
    ids = torch.randint(10, min(500, vocab), (args.batch, args.seq), generator=gen).tolist()
    # One prompt token, the rest response: the loss covers every position.
    batch = build_batch(
        [s[:1] for s in ids],
        [s[1:] for s in ids],
        engine.pad_token_id,
        advantages=(torch.randn(args.batch, generator=gen)).tolist(),
    )
    batch.old_logp = engine.log_probs(batch, temperature=engine.run.rollout.temperature)
    batch.ref_logp = batch.old_logp.clone()  # the KL term's cost is the same for any reference

    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    samples = []
    for k in range(args.warmup + args.repeats):
        dist.barrier()
        synchronize()
        t0 = time.perf_counter()
        ppo_step(engine.run, engine, batch, k + 1, engine.device)
        synchronize()
        seconds = max_over_ranks(time.perf_counter() - t0)
        if k >= args.warmup:
            samples.append(seconds)
    fwd, n = flops_per_token(engine.model.config, args.seq)
    L = engine.model.config.num_hidden_layers
    attn = fwd - 2 * n
    tokens = args.batch * args.seq
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None
    if rank == 0:
        out = {
            "world": world,
            "batch_per_gpu": args.batch,
            "seq": args.seq,
            "lora_rank": args.rank,
            "gradient_checkpointing": not args.no_checkpointing,
            "samples_s": samples,
            "tokens_per_gpu_per_step": tokens,
            "matmul_params": n,
            "layers": L,
            "flops_per_token_6n": 3 * fwd,
            "flops_per_token_lora": 4 * n + 3 * attn,
            "peak_tflops": args.peak_tflops,
            "max_memory_allocated_gib_rank0": peak_mem,
        }
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
