"""The MoE adapter sync at Qwen3-30B-A3B's expert layout: vLLM's loader against the in-place write.

    python -m bench.moe_sync                        # CPU: 48 layers x 128 experts at tiny widths
    python -m bench.moe_sync --dims real --layers 16 --device cuda    # GPU: the real widths

One sync's rollout side both ways, alternating on one engine: `loader`, the payload per expert
(6 x E tensors a layer) through vLLM's loader (`VLLMRollout.load_through_vllm`); `in_place`, PEFT's
stacks written into the slots (`VLLMRollout.write_in_place`). Each is followed by the transport
check (must read 1.0). The trainer's gather is the same for both, not timed. At `--dims tiny` the
cost is per tensor, which is what the stacks remove.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from bench.common import ROOT, cache_dir, versions, write_json

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
REAL = dict(hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
TINY = dict(hidden_size=64, moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def moe_model(cache: Path, dims: str, layers: int, experts: int, device: str) -> tuple[Path, object]:
    """(a saved random Qwen3-MoE checkpoint with these counts, its config), built once."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lorarl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    ids = dict(bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    width = dict(intermediate_size=128, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
    config = Qwen3MoeConfig(
        **(REAL if dims == "real" else TINY), **width, **ids, num_hidden_layers=layers, num_experts=experts
    )
    config.dtype = "bfloat16"  # what vLLM's dtype "auto" reads
    path = cache / "bench" / f"qwen3_moe_{dims}_l{layers}_e{experts}"
    if not (path / "config.json").is_file():
        torch.set_default_dtype(torch.bfloat16)  # at --dims real a float32 init would double the 20-60 GB
        with torch.device(device):
            Qwen3MoeForCausalLM(config).save_pretrained(path.with_name(path.name + ".tmp"))
        torch.set_default_dtype(torch.float32)
        tok.save_pretrained(path.with_name(path.name + ".tmp"))
        path.with_name(path.name + ".tmp").rename(path)
        torch.cuda.empty_cache()  # the model is gone: vLLM's memory profile must not count it
    return path, config


def adapter(config, rank: int, seed: int, device: str):
    """(PEFT-saved tensors with random values, the adapter config, the expert wrappers), as the trainer exports."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import Qwen3MoeForCausalLM

    from lorarl.sync.experts import expert_wrappers

    cfg = {"r": rank, "lora_alpha": 2 * rank, "target_modules": ATTENTION, "target_parameters": EXPERT_PARAMETERS}
    with torch.device("meta"):  # names and shapes only
        model = get_peft_model(Qwen3MoeForCausalLM(config), LoraConfig(**cfg))
    gen = torch.Generator().manual_seed(seed)
    state = get_peft_model_state_dict(model)
    state = {n: (torch.randn(t.shape, generator=gen) * 0.02).to(device, torch.bfloat16) for n, t in state.items()}
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

    from lorarl.contract.payload import WeightPayload
    from lorarl.rollout.vllm import engine_args
    from lorarl.rollout.vllm.engine import VLLMRollout
    from lorarl.sync import transport
    from lorarl.sync.experts import to_vllm_layout, vllm_adapter_config

    path, config = moe_model(cache_dir(), args.dims, args.layers, args.experts, args.device)
    llm = engine_args.build(path, lora_rank=args.rank, max_model_len=256, seed=0, on_cpu=args.device == "cpu")
    rows = {"loader": [], "in_place": []}
    with VLLMRollout(llm, adapter_transport="memory") as rollout:
        tensors, cfg, wrappers = adapter(config, args.rank, 0, args.device)
        rollout.apply(WeightPayload.adapter(tensors, cfg, wrappers))  # the first load places the slots
        for repeat in range(args.repeats + 1):  # the first pair warms up and is not kept
            tensors, cfg, wrappers = adapter(config, args.rank, repeat, args.device)
            for arm in ("loader", "in_place"):
                t0 = time.perf_counter()
                if arm == "loader":  # per expert, as the export sent it before
                    payload = WeightPayload.adapter(to_vllm_layout(tensors, wrappers), vllm_adapter_config(cfg))
                else:
                    payload = WeightPayload.adapter(tensors, cfg, wrappers)
                t1 = time.perf_counter()
                load = rollout.load_through_vllm if arm == "loader" else rollout.write_in_place
                load(dict(payload.tensors), payload.adapter_config, payload.experts)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                t2 = time.perf_counter()
                assert transport.verify_adapter(rollout, payload) == 1.0
                if repeat:
                    times = dict(payload_s=t1 - t0, load_s=t2 - t1, check_s=time.perf_counter() - t2)
                    rows[arm].append(dict(tensors=len(payload.tensors), **times))
    table = {arm: _summary(r) for arm, r in rows.items()}
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{os.cpu_count()} CPU cores"
    command = "python -m bench.moe_sync " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out")
    result = dict(command=command, machine=machine, versions=versions(), shape=config.to_dict(), arms=table, rows=rows)
    write_json(Path(args.out + ".json"), result)
    lines = ["| arm | tensors | payload s | load s | payload + load s | transport check s |", "|" + "---|" * 6]
    for arm, t in table.items():
        lines.append(f"| {arm} | {t['tensors']} | {t['payload_s']} | {t['load_s']} | {t['total_s']} | {t['check_s']} |")
    Path(args.out + ".md").write_text("\n".join([f"`{command}` on {machine}", "", *lines, ""]))
    print("\n".join(lines))


def _summary(rows: list[dict]) -> dict:
    """Median (min-max) over the kept repeats, per column."""
    cell = lambda v: f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"  # noqa: E731
    out = {k: cell([r[k] for r in rows]) for k in ("payload_s", "load_s", "check_s")}
    return dict(tensors=rows[0]["tensors"], **out, total_s=cell([r["payload_s"] + r["load_s"] for r in rows]))


if __name__ == "__main__":
    main()
