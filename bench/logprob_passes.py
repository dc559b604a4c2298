"""The update's vocabulary-wide work, side by side: token_logprobs against the autograd
composition it replaced, on one device, Qwen's 151,936-token vocabulary.

    python -m bench.logprob_passes --out bench/results/logprob_passes_<date>.json [--device cuda]

One micro-batch's LM-head output as the FSDP engine sees it (B rows x (T+1) positions x V,
bf16): log-probs of T labels per row with the entropy as a metric, then the backward of a
weighted sum of the log-probs. `composed` is the former code path: logits[:, :-1] flattened
(a copy), float32 chunks of 1024 rows through logsumexp under activation checkpointing, the
entropy from a second chunked pass, each chunk's slice gradient summed by autograd.
`token_logprobs` reads each block once for log_softmax and writes the gradient into one buffer.
Paired repeats (the order alternates), median seconds and the ratio. This is memory-bound
work on both CPU and GPU; the GPU's share of it is in bench/results/update_profile_*.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from lorarl.algorithms import token_logprobs


def _chunk_logp(rows, labels, temperature):
    rows = rows.float() / temperature
    return rows.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(rows, dim=-1)


def _chunk_entropy(rows, temperature):
    rows = rows.float() / temperature
    return torch.logsumexp(rows, dim=-1) - (torch.softmax(rows, dim=-1) * rows).sum(-1)


def composed(logits, labels, temperature, chunk=1024):
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1)
    logp = torch.cat(
        [
            checkpoint(_chunk_logp, flat[s : s + chunk], lab[s : s + chunk], temperature, use_reentrant=False)
            for s in range(0, flat.shape[0], chunk)
        ]
    ).reshape(labels.shape)
    with torch.no_grad():
        detached = flat.detach()
        ent = torch.cat([_chunk_entropy(detached[s : s + chunk], temperature) for s in range(0, flat.shape[0], chunk)])
    return logp, ent.reshape(labels.shape)


def fused(logits, labels, temperature):
    return token_logprobs(logits, labels, temperature, with_entropy=True)


def run_once(fn, logits, labels, weights, temperature, sync) -> float:
    logits.grad = None
    sync()
    t0 = time.perf_counter()
    logp, _ = fn(logits, labels, temperature)
    (logp * weights).sum().backward()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128, help="response positions per row (T)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    shape = (args.rows, args.tokens + 1, args.vocab)
    logits = (torch.randn(shape, generator=gen) * 2).to(device, torch.bfloat16).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows, args.tokens), generator=gen).to(device)
    weights = torch.randn(args.rows, args.tokens, generator=gen).to(device)

    # Same numbers first: log-probs and the entropy agree, gradients up to bf16 rounding.
    a_lp, a_ent = composed(logits, labels, args.temperature)
    (a_lp * weights).sum().backward()
    a_grad, logits.grad = logits.grad.float(), None
    b_lp, b_ent = fused(logits, labels, args.temperature)
    (b_lp * weights).sum().backward()
    b_grad = logits.grad.float()
    check = {
        "logp_max_abs_diff": float((a_lp - b_lp).detach().abs().max()),
        "entropy_max_abs_diff": float((a_ent - b_ent).abs().max()),
        "grad_max_abs_diff": float((a_grad - b_grad).abs().max()),
        "grad_max_abs": float(a_grad.abs().max()),
    }
    samples = {"composed": [], "token_logprobs": []}
    for k in range(args.repeats):
        order = ["composed", "token_logprobs"] if k % 2 == 0 else ["token_logprobs", "composed"]
        for name in order:
            fn = composed if name == "composed" else fused
            samples[name].append(run_once(fn, logits, labels, weights, args.temperature, sync))
    med = {k: statistics.median(v) for k, v in samples.items()}
    result = {
        "measurement": "logprob_passes",
        "command": "python -m bench.logprob_passes " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "device": str(device),
        "torch": torch.__version__,
        "shape_logits": list(shape),
        "dtype": "bfloat16",
        "check": check,
        "samples_s": samples,
        "median_s": med,
        "ratio_composed_over_token_logprobs": med["composed"] / med["token_logprobs"],
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    md = out.with_suffix(".md")
    md.write_text(
        f"# Vocabulary-wide log-prob work, forward + backward ({device}, {torch.__version__})\n\n"
        f"`{result['command']}`\n\nlogits {list(shape)} bf16, temperature {args.temperature}, "
        f"{args.repeats} paired repeats.\n\n| path | median s | samples s |\n|---|---|---|\n"
        + "".join(f"| {k} | {med[k]:.3f} | {' '.join(f'{x:.3f}' for x in v)} |\n" for k, v in samples.items())
        + f"\ncomposed / token_logprobs: {result['ratio_composed_over_token_logprobs']:.2f}x. "
        f"Agreement: {json.dumps(check)}\n"
    )
    print(md.read_text())


if __name__ == "__main__":
    main()
