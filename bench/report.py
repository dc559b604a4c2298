"""Results as JSON (everything, samples included) and as a markdown table (what a reader needs)."""

from __future__ import annotations

from pathlib import Path

TITLES = {
    "sync_latency": "Sync latency per step (trainer memory -> vLLM serving the new weights)",
    "generation": "Rollout generation with the adapter vs merged weights",
    "export_gather": "FSDP2 export gather (trainer side of a sync)",
    "peer_trl": "Against a peer: TRL GRPOTrainer, same work",
    "step_breakdown": "Step-time breakdown of a CPU end-to-end run",
    "gpu_export": "GPU export gather: seconds and peak extra memory per rank",
    "gpu_throughput": "GPU training throughput (FSDP2 + LoRA)",
    "gpu_rollout": "GPU rollout: adapter vs merged, sampling and sync",
}


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        if value < 1e-3:
            return f"{value * 1e6:.0f} us"
        if value < 1:
            return f"{value * 1e3:.1f} ms"
        return f"{value:.2f} s"
    if unit == "x":
        return f"{value:.3g}x"
    if unit == "GiB":
        return f"{value:.3g} GiB"
    if abs(value) >= 1e4:
        return f"{value:,.0f} {unit}"
    return f"{value:.4g} {unit}"


def fmt_bytes(n: int | None) -> str:
    if not n:
        return ""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def notes(record: dict) -> str:
    extra = record.get("extra") or {}
    parts = []
    if "bytes" in extra:
        parts.append(fmt_bytes(extra["bytes"]))
    if "sync_bytes" in extra and extra["sync_bytes"]:
        parts.append(f"sync {fmt_bytes(extra['sync_bytes'])}")
    if "num_tensors" in extra:
        parts.append(f"{extra['num_tensors']} tensors")
    if "logprob_diff_vs_hf_peft" in extra:
        parts.append(f"|logp - HF+PEFT| {extra['logprob_diff_vs_hf_peft']:.2g}")
    if extra.get("peak_extra_gib_per_rank"):
        parts.append("peak +" + "/".join(f"{g:.2f}" for g in extra["peak_extra_gib_per_rank"]) + " GiB per rank")
    if extra.get("mfu") is not None:
        parts.append(f"MFU {extra['mfu']:.1%}")
    if "probe_logprob_diff_adapter_vs_merged" in extra:
        parts.append(f"probe |adapter - merged| {extra['probe_logprob_diff_adapter_vs_merged']:.2g}")
    if "merged_wins_above_tokens_per_step" in extra:
        t = extra["merged_wins_above_tokens_per_step"]
        parts.append(
            "merged never cheaper"
            if t is None
            else "merged cheaper at any step size (faster sync and sampling)"
            if t == 0
            else f"merged cheaper above {t:.0f} tokens/step"
        )
    if extra.get("sync_as_is_error"):
        parts.append(f"TRL sync as shipped failed: `{extra['sync_as_is_error'][:80]}`")
    if record.get("error"):
        parts.append(f"**ERROR**: {record['error'][:200]}")
    return "; ".join(p for p in parts if p).replace("\n", " ")


def markdown(result: dict) -> str:
    env = result["environment"]
    load = lambda v: "/".join(f"{x:.1f}" for x in v) if v else "?"  # noqa: E731
    lines = [
        f"# lorarl benchmarks: {result['suite']} suite, {result['date']}",
        "",
        f"Machine: {env.get('cpus')} CPUs, {env.get('mem_total_gib')} GiB, load average (1/5/15 min) {load(env.get('loadavg'))} at start, "
        f"{load(result.get('loadavg_end'))} at end (the host is shared); torch threads {env.get('torch_threads')} in the runner "
        "(each measurement sets its own, see config); "
        f"torch {env.get('torch')}, vllm {env.get('vllm')}, transformers {env.get('transformers')}, peft {env.get('peft')}, trl {env.get('trl')}.",
        "Median and spread over repeats (p25-p75, then min-max and n). Ratios divide by the baseline "
        "row measured in the same run (paired per repeat where the rows were taken back to back).",
        f"Command: `{result['command']}` ({result['wall_s']:.0f} s).",
        "",
    ]
    by_measurement: dict[str, list[dict]] = {}
    for r in result["records"]:
        by_measurement.setdefault(r["measurement"], []).append(r)
    for measurement, records in by_measurement.items():
        lines += [
            f"## {TITLES.get(measurement, measurement)}",
            "",
            "| what | config | median | spread | ratio | notes |",
            "|---|---|---|---|---|---|",
        ]
        for r in records:
            s = r["stat"]
            if s:
                unit = s["unit"]
                median = fmt(s["median"], unit)
                spread = f"{fmt(s['p25'], unit)}-{fmt(s['p75'], unit)} (min {fmt(s['min'], unit)}, max {fmt(s['max'], unit)}, n={s['n']})"
            else:
                median = spread = "-"
            ratio = ""
            if r.get("ratio"):
                q = r["ratio"]
                ratio = fmt(q["median"], "x") + (f" ({fmt(q['p25'], 'x')}-{fmt(q['p75'], 'x')})" if q["n"] > 1 else "")
                ratio += f" vs {r['baseline']}" if r.get("baseline") else ""
            row = [r["what"], r["config"], median, spread, ratio, notes(r)]
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
        lines.append("")
    return "\n".join(lines)


def write(result: dict, out_dir: Path, stem: str) -> tuple[Path, Path]:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    js.write_text(json.dumps(result, indent=1, default=str))
    md.write_text(markdown(result))
    return js, md
