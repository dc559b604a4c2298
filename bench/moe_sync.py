"""The MoE adapter sync at Qwen3-30B-A3B's expert layout: vLLM's loader against the in-place write.

    python -m bench.moe_sync                        # CPU: 48 layers x 128 experts at tiny widths
    python -m bench.moe_sync --dims real --layers 16 --device cuda    # GPU: the real widths

What one sync costs on the rollout's side, both ways, alternating in one process on one engine:
`loader` is the payload as it was sent per expert (6 x E tensors a layer, each name checked)
loaded through vLLM's own loader (`VLLMRollout.load_through_vllm`); `in_place` is the payload in
PEFT's stacks (2 pairs a layer) written into the slots that load filled
(`VLLMRollout.write_in_place`, lorarl.rollout.vllm_lora_write). Both are followed by the transport
check, which must read 1.0. The trainer's gather is the same for both and not timed here. The
widths matter little at `--dims tiny`: the cost there is per tensor, which is what the stacks remove.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from bench.common import ROOT, cache_dir, write_json

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
REAL = dict(hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
TINY = dict(hidden_size=64, moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def moe_model(cache: Path, dims: str, layers: int, experts: int, device: str) -> tuple[Path, object]:
    """(a saved random Qwen3-MoE checkpoint with these counts, its config), built once."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lorarl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    config = Qwen3MoeConfig(
        **(REAL if dims == "real" else TINY),
        num_hidden_layers=layers,
        num_experts=experts,
        num_experts_per_tok=8,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    path = cache / "bench" / f"qwen3_moe_{dims}_l{layers}_e{experts}"
    if not (path / "config.json").is_file():
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        tmp = path.with_name(path.name + ".tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(path)
    return path, config


def adapter(config, rank: int, seed: int, device: str):
    """(PEFT-saved tensors with random values, the adapter config, the expert wrappers), as the trainer exports."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import Qwen3MoeForCausalLM

    from lorarl.sync.experts import expert_wrappers

    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION, target_parameters=EXPERT_PARAMETERS)
    with torch.device("meta"):  # names and shapes only
        model = get_peft_model(Qwen3MoeForCausalLM(config), lora)
    gen = torch.Generator().manual_seed(seed)
    state = {
        n: (torch.randn(t.shape, generator=gen) * 0.02).to(device, torch.bfloat16)
        for n, t in get_peft_model_state_dict(model).items()
    }
    cfg = {"r": rank, "lora_alpha": 2 * rank, "target_modules": ATTENTION, "target_parameters": EXPERT_PARAMETERS}
    return state, cfg, expert_wrappers(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / f"moe_sync_{date.today()}"))
    args = ap.parse_args()

    from lorarl.rollout import vllm_engine_args
    from lorarl.rollout.vllm import VLLMRollout
    from lorarl.sync import transport
    from lorarl.sync.experts import to_vllm_layout, vllm_adapter_config
    from lorarl.sync.payload import WeightPayload

    path, config = moe_model(cache_dir(), args.dims, args.layers, args.experts, args.device)
    llm = vllm_engine_args.build(path, lora_rank=args.rank, max_model_len=256, seed=0, on_cpu=args.device == "cpu")
    rows = {"loader": [], "in_place": []}
    with VLLMRollout(llm, adapter_transport="memory") as rollout:
        tensors, cfg, wrappers = adapter(config, args.rank, 0, args.device)
        rollout.apply(WeightPayload.adapter(tensors, cfg, wrappers))  # the first load places the slots
        for repeat in range(args.repeats + 1):  # the first pair warms up and is not kept
            tensors, cfg, wrappers = adapter(config, args.rank, repeat, args.device)
            for arm in ("loader", "in_place"):
                t0 = time.perf_counter()
                if arm == "loader":
                    payload = WeightPayload.adapter(to_vllm_layout(tensors, wrappers), vllm_adapter_config(cfg))
                else:
                    payload = WeightPayload.adapter(tensors, cfg, wrappers)
                t1 = time.perf_counter()
                if arm == "loader":
                    rollout.load_through_vllm(dict(payload.tensors), payload.adapter_config, {})
                else:
                    rollout.write_in_place(dict(payload.tensors), payload.adapter_config, wrappers)
                _sync(args.device)
                t2 = time.perf_counter()
                assert transport.verify_adapter(rollout, payload) == 1.0
                t3 = time.perf_counter()
                if repeat:
                    rows[arm].append(
                        dict(tensors=len(payload.tensors), payload_s=t1 - t0, load_s=t2 - t1, check_s=t3 - t2)
                    )
    table = {arm: _summary(r) for arm, r in rows.items()}
    result = dict(
        command="python -m bench." + Path(__file__).stem, args=vars(args), shape=config.to_dict(), arms=table, rows=rows
    )
    write_json(Path(args.out + ".json"), result)
    lines = [
        "| arm | tensors | payload s | load s | payload + load s | transport check s |",
        "|---|---|---|---|---|---|",
    ]
    for arm, t in table.items():
        lines.append(f"| {arm} | {t['tensors']} | {t['payload_s']} | {t['load_s']} | {t['total_s']} | {t['check_s']} |")
    Path(args.out + ".md").write_text(
        "\n".join(
            [
                f"`{result['command']} {' '.join(f'--{k} {v}' for k, v in vars(args).items() if k != 'out')}`",
                "",
                *lines,
                "",
            ]
        )
    )
    print("\n".join(lines))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _summary(rows: list[dict]) -> dict:
    """Median (min-max) over the kept repeats, per column."""

    def cell(values):
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    totals = [r["payload_s"] + r["load_s"] for r in rows]
    return dict(
        tensors=rows[0]["tensors"],
        **{k: cell([r[k] for r in rows]) for k in ("payload_s", "load_s", "check_s")},
        total_s=cell(totals),
    )


if __name__ == "__main__":
    main()
