"""Run under torchrun (gloo): checks of the FSDP2 engine that need real shards.

    python -m torch.distributed.run --nproc_per_node=2 tests/distributed/fsdp_engine_check.py MODEL OUT

Sets every LoRA weight to a seeded random value (same full tensors at any world size), then
writes to OUT (rank 0): the adapter gathered three ways, the base stream, the merged
stream, reference/policy log-probs of a fixed batch, and the LoRA weights after one update.
The pytest side compares these against HF + PEFT on one process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from lorarl.config.compose import compose
from lorarl.config.run import RunConfig
from lorarl.contract.engine import build_batch
from lorarl.contract.payload import PayloadKind
from lorarl.driver.prepare import engine_spec
from lorarl.engines.fsdp import FSDPEngine, peft_name
from lorarl.sync import semantic

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
RESPONSES = [[12, 13, 14], [15, 16, 17, 18]]


def update(engine, run: RunConfig, batch, step: int) -> dict:
    """The worker's update call (lorarl.algorithms.ppo.ppo_update with the run's sampling facts)."""
    from lorarl.algorithms.ppo import AdapterPlan, Correction, ppo_update
    from lorarl.driver.jobs import sampling_of

    correction = Correction.of(run.algorithm.rollout_correction, engine.device.type)
    return ppo_update(engine, batch, step, [AdapterPlan(run.actor, sampling_of(run), correction)])[0].metrics()


def log_probs_at_temperature(engine, run: RunConfig, batch, **kw):
    return engine.log_probs(batch, temperature=run.rollout.temperature, **kw)


def make_run(model_path: str, world: int, merge: bool = False, micro: int = 1, reshard: bool = True) -> RunConfig:
    return compose(
        [
            "+backend=fsdp",
            f"model.path={model_path}",
            "model.builder=null",
            "model.dtype=float32",
            "model.lora.rank=8",
            "model.lora.alpha=16",
            f"model.lora.merge={str(merge).lower()}",
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.temperature=1.0",
            "actor.optim.lr=1e-5",
            "actor.ppo_mini_batch_size=2",
            f"actor.ppo_micro_batch_size_per_gpu={micro}",
            "actor.use_kl_loss=true",
            f"trainer.n_gpus_per_node={world}",
            "trainer.device=cpu",
            "backend.mixed_precision=bfloat16",
            f"backend.reshard_after_forward={str(reshard).lower()}",
        ]
    )


def randomize_lora(engine: FSDPEngine) -> None:
    """Seeded full LoRA tensors (same values at any world size), put into the shards by the
    engine's own checkpoint loader."""
    values = {}
    for i, (name, p) in enumerate(engine.model.named_parameters()):
        if p.requires_grad:
            values[peft_name(name)] = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 + i)) * 0.05
    engine.load_state(values, optimizer=None, scheduler=None)


def main(model_path: str, out: str) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    out_dir = Path(out)
    run = make_run(model_path, world)
    engine = FSDPEngine(engine_spec(run, "cpu"), torch.device("cpu"))
    randomize_lora(engine)

    adapters, timings = {}, {}
    for method in FSDPEngine.EXPORT_METHODS:
        payload, seconds = engine.export(PayloadKind.ADAPTER, method=method)
        assert payload.kind is PayloadKind.ADAPTER
        adapters[method] = dict(payload.tensors)
        timings[method] = seconds
    # The semantic check's expected side from the shards (one all-reduce), and the self-test's
    # random factors put back bit for bit.
    projections = {path: p.values.tolist() for path, p in engine.lora_projections().items()}
    with semantic.randomized(engine.lora_parameters()):
        randomized_differs = any(
            not torch.equal(t, adapters["bucketed"][n]) for n, t in engine.export(PayloadKind.ADAPTER)[0].tensors
        )
    restored = all(torch.equal(t, adapters["bucketed"][n]) for n, t in engine.export(PayloadKind.ADAPTER)[0].tensors)
    base_payload, _ = engine.export(PayloadKind.BASE)
    base = dict(base_payload.tensors)
    adapter_config = engine.adapter_config()

    batch = build_batch(PROMPTS, RESPONSES, pad_id=0, advantages=[1.0, -1.0])
    policy = log_probs_at_temperature(engine, run, batch)
    reference = log_probs_at_temperature(engine, run, batch, reference=True)
    # The layout the engine trains on: prompts right-aligned, responses from one column.
    left = build_batch(PROMPTS, RESPONSES, pad_id=0, left_pad_prompts=True)
    policy_left = log_probs_at_temperature(engine, run, left)
    batch.old_logp, batch.ref_logp = policy, reference
    metrics = update(engine, run, batch, 1)
    after, _ = engine.export(PayloadKind.ADAPTER)
    after = dict(after.tensors)

    # Both rows in one micro-batch: left padding in one row, right padding in the other, so
    # the engine's own attention mask is used (single rows are trimmed to no padding at all).
    # Parameters stay unsharded between forwards, and a reference pass comes between two
    # updates, as in every step with a KL loss.
    padded_run = make_run(model_path, world, micro=2, reshard=False)
    padded_engine = FSDPEngine(engine_spec(padded_run, "cpu"), torch.device("cpu"))
    randomize_lora(padded_engine)
    policy_padded = log_probs_at_temperature(padded_engine, padded_run, left)
    left.old_logp = policy_padded
    left.ref_logp = log_probs_at_temperature(padded_engine, padded_run, left, reference=True)
    left.advantages = batch.advantages
    metrics_padded = update(padded_engine, padded_run, left, 1)
    log_probs_at_temperature(padded_engine, padded_run, left, reference=True)
    metrics_padded_again = update(padded_engine, padded_run, left, 2)

    merged_engine = FSDPEngine(engine_spec(make_run(model_path, world, merge=True), "cpu"), torch.device("cpu"))
    randomize_lora(merged_engine)
    merged_payload, _ = merged_engine.export(PayloadKind.BASE)
    merged = dict(merged_payload.tensors)

    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        for method, tensors in adapters.items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / f"adapter_{method}.safetensors"))
        save_file({k: v.contiguous() for k, v in after.items()}, str(out_dir / "adapter_after_update.safetensors"))
        save_file({k: v.contiguous() for k, v in base.items()}, str(out_dir / "base.safetensors"))
        save_file({k: v.contiguous() for k, v in merged.items()}, str(out_dir / "merged.safetensors"))
        save_file(
            {
                "policy": policy.contiguous(),
                "reference": reference.contiguous(),
                "mask": batch.response_mask,
                "policy_left": policy_left.contiguous(),
                "mask_left": left.response_mask,
                "policy_padded": policy_padded.contiguous(),
            },
            str(out_dir / "logprobs.safetensors"),
        )
        (out_dir / "result.json").write_text(
            json.dumps(
                {
                    "world": world,
                    "metrics": metrics,
                    "metrics_padded": metrics_padded,
                    "metrics_padded_again": metrics_padded_again,
                    "timings": timings,
                    "adapter_config": adapter_config,
                    "projections": projections,
                    "randomized_differs": randomized_differs,
                    "restored": restored,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
