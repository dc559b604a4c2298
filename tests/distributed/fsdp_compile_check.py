"""Under torchrun (gloo, one rank): the FSDP engine with `backend.compile=true` computes what the
eager engine computes, reference pass, update and the log-probs after it, with no graph break
and within torch.compile's recompile limit (a layer past it would silently run eagerly).

    torchrun --standalone --nproc_per_node=1 tests/distributed/fsdp_compile_check.py MODEL_DIR
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

# A sibling script (torchrun puts this folder first on sys.path).
from fsdp_engine_check import log_probs_at_temperature, update
from torch._dynamo.utils import counters

from lorarl.batch import build_batch
from lorarl.config import compose
from lorarl.engines.fsdp import FSDPEngine


def passes(model: str, compiled: bool) -> list[torch.Tensor]:
    run = compose(
        [
            "+backend=fsdp",
            f"model.path={model}",
            f"backend.compile={str(compiled).lower()}",
            "trainer.device=cpu",
            "actor.use_kl_loss=true",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "rollout.n=4",
            "actor.ppo_micro_batch_size_per_gpu=8",
        ]
    )
    torch.manual_seed(0)  # the same LoRA initialisation in both engines
    engine = FSDPEngine(run, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    # Rows of different prompt and response lengths: micro-batches of different shapes.
    prompts = [
        torch.randint(3, 60, (int(n),), generator=gen).tolist() for n in torch.randint(2, 9, (16,), generator=gen)
    ]
    responses = [
        torch.randint(3, 60, (int(n),), generator=gen).tolist() for n in torch.randint(1, 12, (16,), generator=gen)
    ]
    batch = build_batch(
        prompts, responses, engine.pad_token_id, torch.randn(16, generator=gen).tolist(), engine.left_pad_prompts
    )
    batch.ref_logp = log_probs_at_temperature(engine, batch, reference=True)
    before = log_probs_at_temperature(engine, batch)
    first = update(engine, batch, 1)
    second = update(engine, batch, 2)
    after = log_probs_at_temperature(engine, batch)
    losses = torch.tensor([first["actor/pg_loss"], second["actor/kl_loss"], second["actor/grad_norm"]])
    return [batch.ref_logp, before, losses, after]


def main() -> None:
    dist.init_process_group("gloo")
    eager = passes(sys.argv[1], compiled=False)
    compiled = passes(sys.argv[1], compiled=True)
    for name, a, b in zip(
        ("reference", "policy", "update metrics", "policy after update"), eager, compiled, strict=True
    ):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= torch._dynamo.config.recompile_limit, graphs
    print(f"compiled and eager agree; {graphs} compiled graphs")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
