"""The GPU step bench's markdown: the equal-algorithm pairs first, then every run in the order
it ran with what the machine was doing meanwhile."""

from __future__ import annotations

from bench.step_rows import WARMUP_STEPS, fmt, fmt_spread


def _targets(entry: dict) -> str:
    marks = []
    for key, t in entry["targets"].items():
        got = "-" if t["got"] is None else (f"{t['got']:.1%}" if key == "mfu_update" else f"{t['got']:.2f}")
        marks.append(f"{key} {got} vs {t['want']}: {'-' if t['met'] is None else ('met' if t['met'] else 'not met')}")
    return "; ".join(marks) or "-"


def pair_lines(entries: list[dict]) -> list[str]:
    lines = [
        "| shape | KL | correction | lorarl arm | lorarl step s | TRL step s | TRL / lorarl (each repeat) | "
        "lorarl update s | TRL update s | lorarl gen s | MFU update | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        each = " ".join(f"{x:.2f}" for x in e["speedup_each"])
        mfu = "-" if not e["lorarl_mfu_update"] else f"{e['lorarl_mfu_update']['median']:.1%}"
        lines.append(
            f"| {e['shape']} | {'on' if e['kl'] else 'off'} | {e['correction']} | {e['arm']} | "
            f"{fmt_spread(e['lorarl_step_s'])} | {fmt_spread(e['trl_step_s'])} | "
            f"{fmt(e.get('speedup'))}x ({each or '-'}) | {fmt_spread(e['lorarl_update_s'])} | "
            f"{fmt_spread(e['trl_update_s'])} | {fmt_spread(e['lorarl_gen_s'])} | "
            f"{mfu} | {_targets(e)} |"
        )
    return lines


def _new_cache_files(row: dict) -> str:
    """'triton +12, vllm +3': files each kernel cache gained during the run (kernels compiled)."""
    before = (row.get("before") or {}).get("kernel_cache_files") or {}
    after = (row.get("after") or {}).get("kernel_cache_files") or {}
    grown = {k: after[k] - before[k] for k in after if k in before and after[k] > before[k]}
    return ", ".join(f"{k} +{n}" for k, n in grown.items())


def variance_lines(entries: list[dict]) -> list[str]:
    lines = [
        "| pair | side | spread | run | step s | update s | gen s | SM MHz median (min) | temp max C | power W | "
        "clocks slowed s | CPU busy | load before | host loop us before | GPU MiB before |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    trl_shown = set()  # TRL's runs are the same for every lorarl arm of a pair: shown once
    for e in entries:
        pair = f"{e['shape']} KL {'on' if e['kl'] else 'off'} {e['correction']}"
        for side, v in e["variance"].items():
            repeats = (e["lorarl_step_s"] if side == "lorarl" else e["trl_step_s"] or {"n": 0})["n"]
            if not v or repeats < 2 or (side == "trl" and pair in trl_shown):
                continue
            if side == "trl":
                trl_shown.add(pair)
            for label in ("fastest", "slowest"):
                f = v[label]
                lines.append(
                    f"| {pair} | {e['arm'] if side == 'lorarl' else 'trl'} | "
                    f"{v['spread_pct']:.0%} | {label} (r{f['repeat']}, #{fmt(f['order'], 0)}) | {fmt(f['step_s'])} | "
                    f"{fmt(f['update_s'])} | {fmt(f['gen_s'])} | {fmt(f['sm_clock_mhz'], 0)} "
                    f"({fmt(f['sm_clock_min_mhz'], 0)}) | {fmt(f['temperature_max_c'], 0)} | {fmt(f['power_w'], 0)} | "
                    f"{fmt(f['clocks_slowed_s'])} | "
                    f"{fmt(f['cpu_busy'])} | {fmt(f['loadavg_before'])} | {fmt(f.get('python_loop_us_before'), 3)} | "
                    f"{fmt(f['gpu_mib_before'], 0)} |"
                )
    return lines


def _machine(row: dict) -> str:
    before = row.get("before") or {}
    gpu = before.get("gpu") or {}
    during = row.get("during") or {}

    def stat(key: str, part: str, digits: int = 0) -> str:
        return fmt((during.get(key) or {}).get(part), digits)

    return (
        f"{stat('clocks.sm', 'median')} ({stat('clocks.sm', 'min')}) | {stat('temperature.gpu', 'max')} | "
        f"{stat('power.draw', 'median')} | {fmt(gpu.get('memory.used'), 0)} | {fmt(before.get('loadavg_1m'))} | "
        f"{fmt(before.get('python_loop_us'), 3)} | {stat('cpu_busy', 'median', 2)} |"
    )


def _in_order(rows: list[dict]) -> list[dict]:
    """The rows in the order they ran; rows without an order last."""
    return sorted(rows, key=lambda r: (r.get("order") is None, r.get("order") or 0))


def run_lines(rows: list[dict]) -> list[str]:
    lines = [
        "| # | run | correction | step s | steps s | gen | logp | update | sync | sleep+wake | other | tokens/step | "
        "MFU update (4N / 6N) | SM MHz median (min) | temp max C | power median W | GPU MiB before | "
        "load 1m before | host loop us before | CPU busy median | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in _in_order(rows):
        b = row.get("breakdown") or {}
        m4, m6 = row.get("mfu_update"), row.get("mfu_update_hw")
        mfu = "-" if m4 is None else f"{m4:.1%} / " + ("-" if m6 is None else f"{m6:.1%}")
        note = row["error"].splitlines()[0][:80] if row.get("error") else ""
        retries = sum(r or 0 for r in row.get("update_alloc_retries") or [])
        if retries:
            note = f"{note} allocator retries in the update: {retries:.0f}".strip()
        peak = row.get("memory_update_peak_gib")
        if peak:
            slept = " (rollout asleep)" if (b.get("sleep_wake_s") or 0) > 0 else ""
            note = f"{note} update peak {peak:.1f} GiB{slept}".strip()
        compiled = _new_cache_files(row)
        if compiled:
            note = f"{note} kernel cache files added: {compiled}".strip()
        steps = " ".join(f"{s:.1f}" for s in row.get("steps_s") or [])
        phases = " | ".join(fmt(b.get(k)) for k in ("gen_s", "logp_s", "update_s", "sync_s", "sleep_wake_s", "other_s"))
        lines.append(
            f"| {fmt(row.get('order'), 0)} | {row['run']} | {row['correction']} | {fmt(row.get('step_s'))} | {steps} | "
            f"{phases} | {row.get('tokens_per_step') or '-'} | {mfu} | {_machine(row)} {note} |"
        )
    return lines


def startup_lines(rows: list[dict]) -> list[str]:
    """Each run's wall time and, for lorarl, where its start-up went (the trainer's init/timing/*)."""
    lines = [
        "| run | wall s | model build s | checks s | Ray s | workers placed s | vLLM start s | training engine s | "
        "steps s | rest s | TRL init s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in _in_order(rows):
        up = row.get("startup_s") or {}
        steps = sum(row.get("steps_s") or []) or None
        cells = [row.get("wall_s"), row.get("model_build_s")]
        cells += [up.get(k) for k in ("prepare", "ray_init", "workers_start", "rollout_start", "engine_build")]
        # The rest: interpreter and imports, the first sync, the final adapter, plots, shutdown.
        stages = (up.get(k) for k in ("prepare", "ray_init", "workers_start", "worker_setup"))
        known = [row.get("model_build_s"), steps, *stages]
        rest = row["wall_s"] - sum(k for k in known if k) if up and "wall_s" in row else None
        cells += [steps, rest, row.get("init_s")]
        lines.append(f"| {row['run']} | " + " | ".join(fmt(c, 1) for c in cells) + " |")
    return lines


def markdown(result: dict) -> str:
    lines = [
        f"# GPU step: lorarl vs TRL GRPOTrainer at equal algorithm ({result['date']})",
        "",
        f"`{result['command']}`",
        "",
        f"{result['work']}. Step: median over steps {WARMUP_STEPS + 1}+ of each run; a pair's numbers are the "
        "median (min-max) over its alternating repeats. TRL / lorarl > 1: lorarl is faster. "
        f"{result['mfu_formula']}",
        "",
        "## Equal-algorithm pairs",
        "",
        *pair_lines(result["pairs"]),
        "",
        "## Variance: each side's fastest and slowest repeat",
        "",
        *variance_lines(result["pairs"]),
        "",
        "## Runs, in the order they ran",
        "",
        "SM clock, temperature, power and CPU busy share are sampled every second during the run; GPU memory "
        "and load average are read just before it.",
        "",
        *run_lines(result["step_compare"]),
        "",
        "## Start-up",
        "",
        *startup_lines(result["step_compare"]),
    ]
    if result.get("skipped"):
        lines += ["", f"Not started (the --budget-s would have run out): {', '.join(result['skipped'])}"]
    lines += ["", "Commands:", ""] + [
        f"- `{row['run']}`: `{row.get('command') or '-'}`" for row in result["step_compare"]
    ]
    return "\n".join(lines) + "\n"
