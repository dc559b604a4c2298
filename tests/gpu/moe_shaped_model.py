"""A random-weight model with Qwen3-30B-A3B's layer dims, built offline for the GPU check.

    python -m tests.gpu.moe_shaped_model --layers 24 --out /tmp/lcache/qwen3_30b_a3b_l24 [--device cuda]

The config values are Qwen/Qwen3-30B-A3B's config.json (hard-coded: the GPU machine has no
network); only num_hidden_layers may be lowered. The tokenizer is the embedded tiny model's
(ids < 512 are valid in any Qwen vocabulary), so the embedded arithmetic task feeds it. The output
layer gives data=token_share's subset a direction (lorarl.data.token_share.give_subset_a_direction),
so that task's reward can climb. `--tiny` keeps the layout at CPU size (the same script exercised
on CPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Qwen/Qwen3-30B-A3B config.json.
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    hidden_act="silu",
)
# The same layout at CPU size, for exercising this script and the run script off the GPU.
TINY = dict(
    QWEN3_30B_A3B,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=512,
)
DONE = "shaped_model.json"


def build(out: Path, layers: int, device: str, tiny: bool) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lorarl.data.token_share import give_subset_a_direction
    from lorarl.models.tiny import build_tokenizer

    if (out / DONE).is_file():
        return out
    tok = build_tokenizer()
    dims = dict(TINY if tiny else QWEN3_30B_A3B, num_hidden_layers=layers)
    config = Qwen3MoeConfig(
        **dims, bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 15B parameters in fp32 would be 60 GB
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    give_subset_a_direction(model.get_output_embeddings().weight)
    model.config.dtype = "bfloat16"
    tmp = out.with_name(out.name + ".tmp")
    # Saved from where it was built: safetensors copies one tensor at a time to host memory, so a
    # 61 GB model never needs a second whole copy in RAM (it may be written to /dev/shm).
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    params = sum(p.numel() for p in model.parameters())
    (tmp / DONE).write_text(json.dumps({"dims": dims, "params": params, "dtype": "bfloat16", "token_share": True}))
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=QWEN3_30B_A3B["num_hidden_layers"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    print(build(Path(args.out), args.layers, args.device, args.tiny))


if __name__ == "__main__":
    main()
