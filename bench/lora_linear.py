"""One LoRA linear's forward and backward, PEFT's against lorarl's fused one
(lorarl.engines.lora_linear, `backend.fused_lora=true`), side by side on one device.

    python -m bench.lora_linear --out bench/results/lora_linear_<where>_<date>.json [--device cuda]

A stack of `--layers` PEFT LoRA linears (frozen base with bias, rank-r adapter, no dropout) over
a [rows, seq, width] input, as the decoder layers' projections see a micro-batch; one repeat is a forward and
the backward of a sum through the whole stack. Both stacks hold the same weights; the check
compares their outputs and LoRA gradients first. Paired repeats, the order alternating; the
result is the median seconds per linear per forward+backward and the ratio.

The defaults (width 16, rank 8, 2 rows of 4 tokens, CPU, one thread) make the work small
enough that the host's time per op is what is measured: the cost that bounds the 7B update on one GPU, where ~46k
kernels are launched per update (bench/results/update_profile_2026-12-04). With
`--device cuda --width 3584 --rows 26 --seq 150` it times the 7B projection's GPU work instead.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import environment, perturb_lora, write_json
from lorarl.engines.lora_linear import fuse_lora_linears


def stacks(width: int, layers: int, rank: int, dtype: torch.dtype, device: str):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[str(i) for i in range(layers)]))
    perturb_lora(peft, seed=0)  # B starts at zero: give the check a real adapter
    peft = peft.to(device=device, dtype=dtype)
    fused = copy.deepcopy(peft)
    assert fuse_lora_linears(fused) == layers
    return peft, fused


def step(model, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.float().sum().backward()
    return out


def check(peft, fused, x: torch.Tensor) -> dict:
    a, b = step(peft, x), step(fused, x)
    grads = [
        float((p.grad.float() - q.grad.float()).abs().max() / p.grad.float().abs().max().clamp_min(1e-30))
        for p, q in zip(peft.parameters(), fused.parameters(), strict=True)
        if p.requires_grad
    ]
    return {"output_max_abs_diff": float((a.float() - b.float()).abs().max()), "grad_max_rel_diff": max(grads)}


def timed(model, x: torch.Tensor, sync) -> float:
    sync()
    t0 = time.perf_counter()
    step(model, x)
    sync()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    peft, fused = stacks(args.width, args.layers, args.rank, dtype, args.device)
    x = torch.randn(args.rows, args.seq, args.width, device=args.device, dtype=dtype, requires_grad=True)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    agree = check(peft, fused, x)
    samples: dict[str, list[float]] = {"peft": [], "fused": []}
    for _ in range(3):  # warm-up
        timed(peft, x, sync), timed(fused, x, sync)
    for i in range(args.repeats):
        for name in ("peft", "fused") if i % 2 == 0 else ("fused", "peft"):
            samples[name].append(timed(peft if name == "peft" else fused, x, sync) / args.layers)
    med = {k: statistics.median(v) for k, v in samples.items()}
    result = {
        "command": "python -m bench.lora_linear " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "args": vars(args),
        "environment": environment(),
        "check": agree,
        "seconds_per_linear": {k: {"median": med[k], "min": min(v), "max": max(v)} for k, v in samples.items()},
        "peft_over_fused": med["peft"] / med["fused"],
    }
    out = Path(args.out)
    write_json(out, result)
    out.with_suffix(".md").write_text(
        f"# One LoRA linear, forward + backward: PEFT against lorarl's fused linear ({args.device})\n\n"
        f"`{result['command']}`\n\n"
        f"{args.layers} linears of width {args.width}, rank {args.rank}, {args.rows} x {args.seq} tokens, {dtype}, "
        f"{args.threads} thread(s); {args.repeats} paired repeats, alternating.\n\n"
        "| | median us per linear | min | max |\n|---|---|---|---|\n"
        + "".join(
            f"| {k} | {s['median'] * 1e6:.1f} | {s['min'] * 1e6:.1f} | {s['max'] * 1e6:.1f} |\n"
            for k, s in result["seconds_per_linear"].items()
        )
        + f"\nPEFT / fused: {result['peft_over_fused']:.2f}x. Outputs differ by at most "
        f"{agree['output_max_abs_diff']:.2e}, LoRA gradients by {agree['grad_max_rel_diff']:.2e} of their largest value.\n"
    )
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
