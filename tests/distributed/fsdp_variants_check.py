"""Under torchrun (gloo, one rank): the FSDP engine with `backend.compile=true`, and with
`backend.fused_lora=true`, computes what the plain engine computes: reference pass, two updates
and the log-probs after them, on micro-batches of different shapes. The compiled engine with no
graph break and within torch.compile's recompile limit (a layer past it would silently run
eagerly); the fused one with every LoRA linear of a training forward computed by LoRALinear.

    torchrun --standalone --nproc_per_node=1 tests/distributed/fsdp_variants_check.py MODEL_DIR
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

# A sibling script (torchrun puts this folder first on sys.path).
from fsdp_engine_check import log_probs_at_temperature, update
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch._dynamo.utils import counters

from lorarl.config.compose import compose
from lorarl.contract.engine import build_batch
from lorarl.driver.prepare import engine_spec
from lorarl.engines.fsdp import FSDPEngine


def graph_nodes(root: torch.Tensor, name: str) -> int:
    """How many autograd nodes called `name` the graph behind `root` holds."""
    seen, stack, found = set(), [root.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += type(node).__name__ == name
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return found


def passes(model: str, variant: str | None = None) -> list[torch.Tensor]:
    run = compose(
        [
            "+backend=fsdp",
            f"model.path={model}",
            *([f"backend.{variant}=true"] if variant else []),
            "trainer.device=cpu",
            "actor.use_kl_loss=true",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "rollout.n=4",
            "actor.ppo_micro_batch_size_per_gpu=8",
        ]
    )
    torch.manual_seed(0)  # the same LoRA initialisation in every engine
    engine = FSDPEngine(engine_spec(run, "cpu"), torch.device("cpu"))
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
    if variant == "fused_lora":
        linears = sum(type(m) is PeftLoraLinear for m in engine.model.modules())
        logits = engine.model(input_ids=batch.input_ids[:2], use_cache=False).logits
        assert linears > 0 and graph_nodes(logits, "LoRALinearBackward") == linears, linears
    batch.ref_logp = log_probs_at_temperature(engine, run, batch, reference=True)
    before = log_probs_at_temperature(engine, run, batch)
    first = update(engine, run, batch, 1)
    second = update(engine, run, batch, 2)
    after = log_probs_at_temperature(engine, run, batch)
    losses = torch.tensor([first["actor/pg_loss"], second["actor/kl_loss"], second["actor/grad_norm"]])
    return [batch.ref_logp, before, losses, after]


def main() -> None:
    dist.init_process_group("gloo")
    plain = passes(sys.argv[1])
    for variant in ("fused_lora", "compile"):
        for name, a, b in zip(
            ("reference", "policy", "update metrics", "policy after update"), plain, passes(sys.argv[1], variant),
            strict=True,
        ):  # fmt: skip
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m, n=name, v=variant: f"{v} {n}: {m}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= torch._dynamo.config.recompile_limit, graphs
    print(f"fused LoRA, compiled and plain engines agree; {graphs} compiled graphs")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
