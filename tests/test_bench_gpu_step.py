"""bench.gpu_step: the run plan, the parameter count behind its MFU, and one real lorarl run of
its --cpu-smoke (tiny model on CPU; the TRL half needs trl, which CI does not install)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import Sampler, host_state, nvidia_smi, slowdown_s
from bench.gpu_step import (
    CORRECTIONS,
    GPU_WORK,
    SHAPE_RUNS,
    TRL,
    Arm,
    Pair,
    Run,
    estimate_wall_s,
    lorarl_arms,
    lorarl_correction_overrides,
    parse_variant,
    plan,
    repeat_groups,
    select,
    walls_of,
)
from bench.step_report import lorarl_steps, markdown, pairs, param_count, step_row, trl_steps
from bench.trl_grpo_worker import TRL_IS_MODE, correction_options

ROOT = Path(__file__).resolve().parents[1]


def test_plan_alternates_lorarl_and_trl_within_each_equal_algorithm_pair():
    pairs = [Pair("0.5b", False, "none"), Pair("7b", True, "token_tis")]
    runs = plan(pairs, [*lorarl_arms(["fsdp"], ["adapter"]), TRL], repeats=2)
    assert [r.name for r in runs] == [
        "lorarl-fsdp-adapter-0.5b-kloff-none-r1",
        "trl-0.5b-kloff-none-r1",
        "lorarl-fsdp-adapter-0.5b-kloff-none-r2",
        "trl-0.5b-kloff-none-r2",
        "lorarl-fsdp-adapter-7b-klon-token_tis-r1",
        "trl-7b-klon-token_tis-r1",
        "lorarl-fsdp-adapter-7b-klon-token_tis-r2",
        "trl-7b-klon-token_tis-r2",
    ]
    # An earlier command's repeats: this one goes on from them, and the budget starts whole repeats.
    done = {"lorarl-fsdp-adapter-0.5b-kloff-none": 2, "trl-0.5b-kloff-none": 1}
    later = plan(pairs[:1], [*lorarl_arms(["fsdp"], ["adapter"]), TRL], repeats=1, done=done)
    assert [r.name for r in later] == ["lorarl-fsdp-adapter-0.5b-kloff-none-r3", "trl-0.5b-kloff-none-r2"]
    assert [len(g) for g in repeat_groups(runs)] == [2, 2, 2, 2]
    # A repeat's expected wall: the table until this command has run that arm at that shape.
    first = repeat_groups(runs)[0]
    assert [estimate_wall_s(r, {}) for r in first] == [125, 60]
    assert estimate_wall_s(first[1], {("trl", "0.5b"): 48.0}) == 48.0
    # ... or until an earlier command's rows (--append) say what its last finished run took.
    kept = [
        {"arm": "trl", "shape": "0.5b", "order": 2, "wall_s": 70.0, "model_build_s": 0.0},
        {"arm": "lorarl-fsdp-adapter", "shape": "0.5b", "order": 1, "wall_s": 150.0, "model_build_s": 12.0},
        {"arm": "lorarl-fsdp-adapter", "shape": "0.5b", "order": 3, "wall_s": 110.0, "model_build_s": 0.0},
        {"arm": "trl", "shape": "0.5b", "order": 4, "wall_s": 30.0, "error": "exit 1 after 0 steps"},
    ]
    assert [estimate_wall_s(r, walls_of(kept)) for r in first] == [110.0, 70.0]
    assert [r.name for r in select(runs, "trl-*-r1")] == ["trl-0.5b-kloff-none-r1", "trl-7b-klon-token_tis-r1"]
    with pytest.raises(SystemExit, match="matches no planned run"):
        select(runs, "lorarl-3b-*")
    # Megatron syncs adapters only; FSDP takes both modes.
    assert [a.name for a in lorarl_arms(["fsdp", "megatron"], ["adapter", "merged"])] == [
        "lorarl-fsdp-adapter",
        "lorarl-fsdp-merged",
        "lorarl-megatron-adapter",
    ]


def test_a_variant_runs_as_its_own_lorarl_arm_and_never_changes_the_algorithm(tmp_path):
    from bench.gpu_step import compose_run, last_setting_wins, lorarl_overrides, parse_args, planned

    args = parse_args(["--shapes", "7b", "--kl", "on", "--corrections", "token_tis", "--repeats", "1",
                       "--variant", "keep:backend.reshard_after_forward=false"])  # fmt: skip
    runs = planned(args, [])
    assert [r.name for r in runs] == [
        "lorarl-fsdp-adapter-7b-klon-token_tis-r1",
        "lorarl-fsdp-adapter-keep-7b-klon-token_tis-r1",
        "trl-7b-klon-token_tis-r1",
    ]
    # The variant's run composes the preset's algorithm with its own setting on top.
    base, keep = (lorarl_overrides(r, SHAPE_RUNS["7b"], GPU_WORK, tmp_path / "m", False) for r in runs[:2])
    configs = [compose_run("fsdp", o, tmp_path) for o in (base, [*keep, *runs[1].arm.overrides])]
    assert [c.backend.reshard_after_forward for c in configs] == [True, False]
    assert configs[0].actor == configs[1].actor and configs[0].algorithm == configs[1].algorithm
    # A setting given twice (the bench's own, then --override or the variant) is recorded once.
    assert last_setting_wins(["a=1", "b.c=2", "a=3", "+d=4", "b.c=5"]) == ["a=3", "+d=4", "b.c=5"]
    # Repeats of a variant go on from an earlier command's rows like any arm's.
    kept = [{"run": "lorarl-fsdp-adapter-keep-7b-klon-token_tis-r1", "repeat": 1}]
    assert planned(args, kept)[1].name == "lorarl-fsdp-adapter-keep-7b-klon-token_tis-r2"
    assert parse_variant("mb:actor.ppo_max_token_len_per_gpu=8192 backend.liger_kernel=false") == (
        "mb",
        ("actor.ppo_max_token_len_per_gpu=8192", "backend.liger_kernel=false"),
    )
    for bad, why in [
        ("kl:actor.kl_loss_coef=0.01", "not a setting of how lorarl runs"),
        ("n:rollout.n=4", "not a setting of how lorarl runs"),
        ("lr:actor.optim.lr=1e-4", "not a setting of how lorarl runs"),
        ("Keep-1:backend.compile=true", "NAME of a-z"),
        ("empty:", "NAME of a-z"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_variant(bad)
    with pytest.raises(SystemExit):
        parse_args(["--variant", "kl:actor.kl_loss_coef=0.01"])


def _rc(correction: str, rs_threshold: str = "2.0"):
    """lorarl's correction config as the bench's overrides compose it."""
    from lorarl.config.compose import compose

    overrides = lorarl_correction_overrides(correction)
    if any(o.startswith("algorithm.rollout_correction.rollout_rs=") and not o.endswith("=null") for o in overrides):
        overrides = [o for o in overrides if "rollout_rs_threshold=" not in o]
        overrides.append(f"algorithm.rollout_correction.rollout_rs_threshold={rs_threshold}")
    return compose(["+backend=fsdp", *overrides]).algorithm.rollout_correction


def test_trl_runs_lorarls_correction():
    assert correction_options("none", _rc("none")) == ["--vllm-is-correction", "off"]
    tis = correction_options("token_tis", _rc("token_tis"))
    assert tis == ["--vllm-is-correction", "on", "--vllm-is-mode", "token_truncate", "--vllm-is-clip-max", "2.0"]
    assert correction_options("seq_mask", _rc("seq_mask", "4.0"))[3:] == [
        "sequence_mask", "--vllm-is-clip-max", "4.0", "--vllm-is-clip-min", "0.25",
    ]  # fmt: skip
    # k1 bounds pi_rollout / pi_trainer; TRL's clip bounds the inverse ratio.
    assert correction_options("token_mask", _rc("token_mask", "0.5_10.0"))[-4:] == [
        "--vllm-is-clip-max", "2.0", "--vllm-is-clip-min", "0.1",
    ]  # fmt: skip
    assert set(TRL_IS_MODE) == set(CORRECTIONS) - {"none"}


@pytest.mark.gpu  # needs TRL, which only the GPU machine's stack has (the CPU suite never skips)
def test_trl_worker_builds_the_grpo_config_of_each_correction(tmp_path):
    from bench.trl_grpo_worker import grpo_config, parse_args

    base = ["--model", "m", "--train-parquet", "p", "--out", str(tmp_path / "o.json"), "--prompts", "4", "--n", "4"]
    off = grpo_config(parse_args([*base, *correction_options("none", _rc("none"))]))
    assert off.vllm_importance_sampling_correction is False
    for correction, mode in TRL_IS_MODE.items():
        cfg = grpo_config(parse_args([*base, "--micro-batch", "4", *correction_options(correction, _rc(correction))]))
        assert cfg.vllm_importance_sampling_correction is True
        assert (cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_max) == (mode, 2.0)
        assert cfg.vllm_importance_sampling_clip_min == (0.5 if mode.endswith("mask") else None)
        assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (4, 4)


def test_param_count_matches_the_saved_model(tiny_model_path):
    from bench.common import model_params

    config = json.loads((tiny_model_path / "config.json").read_text())
    assert param_count(config) == model_params(tiny_model_path)


def test_moe_param_count_is_what_one_token_runs_through(run_cache):
    """A MoE's MFU counts the active parameters: every tensor outside the experts, and top-k of E
    experts' share of the expert stacks, read from the saved model; at Qwen3-30B-A3B's dims, the
    3.3B active its model card states."""
    import torch
    import transformers
    from safetensors import safe_open

    from bench.common import SHAPES, shaped_model

    # Under the session's run cache: the shape takes the tokenizer of the tiny model already built there.
    model = shaped_model(run_cache, "qwen3-moe-tiny", dtype="float32")
    config = json.loads((model / "config.json").read_text())
    sizes = {}
    for shard in model.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            sizes.update({name: f.get_slice(name).get_shape() for name in f.keys()})  # noqa: SIM118 - no __iter__
    numel = {name: math.prod(shape) for name, shape in sizes.items()}
    experts = sum(n for name, n in numel.items() if ".mlp.experts." in name)
    share = config["num_experts_per_tok"] / config["num_local_experts"]
    assert experts and param_count(config) == pytest.approx(sum(numel.values()) - experts + share * experts, abs=3000)
    assert param_count(SHAPES["qwen3-30b-a3b"]) == pytest.approx(3.3e9, rel=0.03)
    # Written shard by shard (bench.common.save_by_shard): the class name vLLM resolves its
    # implementation by, and a checkpoint that loads back to the model as built (rebuilt here from
    # the same seed; a gate/up or expert mix-up in the per-expert split reads as a difference).
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    torch.manual_seed(0)
    built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model)).state_dict()
    assert loaded.keys() == built.keys()
    assert [k for k in built if not torch.equal(loaded[k], built[k])] == []


def test_cpu_smoke_lorarl_run_writes_the_step_compare_row(run_cache, tmp_path):
    name = "lorarl-fsdp-adapter-tiny-kloff-token_tis-r1"
    cmd = [sys.executable, "-m", "bench.gpu_step", "--cpu-smoke", "--kl", "off", "--corrections", "token_tis"]
    cmd += ["--repeats", "1", "--systems", "lorarl", "--cache", str(run_cache), "--out-dir", str(tmp_path)]
    cmd += ["--stem", "smoke"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[gpu_step] {name}: step" in proc.stdout
    result = json.loads((tmp_path / "smoke.json").read_text())
    (row,) = result["step_compare"]
    assert (row["system"], row["shape"], row["kl"], row["mode"]) == ("lorarl", "tiny", False, "adapter")
    assert (row["correction"], row["repeat"], row["order"], row["backend"]) == ("token_tis", 1, 1, "fsdp")
    assert len(row["steps_s"]) == 4 and row["step_s"] > 0
    assert row["step_s"] == pytest.approx(statistics.median(row["steps_s"][2:]))  # steps 3+
    # 4 prompts x 4 samples: prompt tokens from the trainer's loader, responses of at most 16 tokens.
    assert len(row["prompt_tokens_per_step"]) == 4 and all(t > 0 for t in row["prompt_tokens_per_step"])
    prompt = row["prompt_tokens_per_step"]
    assert min(prompt) < row["tokens_per_step"] <= max(prompt) + 16 * 16
    b = row["breakdown"]
    assert set(b) == {"gen_s", "logp_s", "update_s", "sync_s", "sleep_wake_s", "other_s"}
    assert b["logp_s"] == 0.0 and b["update_s"] > 0  # on-policy, no KL: the correction needs no extra pass
    assert row["mfu_update"] > 0 and row["mfu_update_hw"] is None  # no checkpointing: 4N only
    assert "recipes.grpo +backend=fsdp" in row["command"]
    # Where the run's start-up went, from the trainer's step-0 metrics.
    assert set(row["startup_s"]) >= {"ray_init", "rollout_start", "engine_build"}
    assert 0 < row["startup_s"]["rollout_start"] < row["startup_s"]["worker_setup"] < row["wall_s"]
    assert (
        "actor.use_kl_loss=false" in row["command"]
        and "algorithm.rollout_correction.rollout_is=token" in row["command"]
    )
    # What the machine did: host state before and after, the CPU sampled during the run (no GPU here).
    assert row["before"]["loadavg_1m"] >= 0 and row["after"]["mem_available_gib"] > 0
    assert row["during"]["samples"] > 0 and row["during"]["cpu_busy"]["n"] > 0
    assert "error" not in row
    # Where the sync went (steps 3-4): the fingerprint and the semantic check run after every sync,
    # the probe on the first and the last step only.
    parts = row["sync_parts_s"]
    assert all(parts[k] > 0 for k in ("gather", "load", "adapter_check", "meaning_check", "probe")), parts
    assert parts["weights_check"] is None  # an adapter sync: the merged check does not run
    assert f"sync gather {parts['gather']:.3f}," in (tmp_path / "smoke.md").read_text()
    (pair,) = result["pairs"]  # lorarl alone: the pair is there, with no TRL side
    assert (pair["correction"], pair["repeats"], pair["trl_step_s"]) == ("token_tis", [1], None)
    assert (tmp_path / "smoke.md").read_text().count(name) >= 3  # pairs, runs, start-up


def _metrics(step: int, step_s: float, update_s: float) -> dict:
    # One step of lorarl's metrics.jsonl, as the trainer writes it (KL off, on-policy: no log-prob passes).
    return {"step": step, "timing/step": step_s, "timing/gen": 0.5, "timing/update": update_s,
            "timing/sync": 0.1, "response_length/mean": 128.0}  # fmt: skip


def _trl_step(step_s: float, update_s: float) -> dict:
    # One step of bench.trl_grpo_worker's output.
    return {"step_s": step_s, "generation_s": 1.0, "sync_s": 0.2, "logp_s": 0.3, "update_s": update_s,
            "prompt_tokens": 5600, "completion_tokens": 32768, "completions": 256}  # fmt: skip


def test_rows_of_both_systems_share_one_vocabulary_and_pair_by_algorithm():
    n_params = 494_000_000
    rows = []
    for repeat, (ours, theirs) in enumerate([(2.0, 3.0), (2.5, 3.5), (1.9, 3.1)], start=1):
        steps = lorarl_steps([_metrics(s, ours, 0.6) for s in range(1, 7)], [5600] * 6, completions=256)
        row = step_row(steps, n_params, recomputes=False)
        assert steps[0]["other_s"] == pytest.approx(ours - 0.5 - 0.6 - 0.1)
        # A sleeping rollout: the driver's sync call includes the wake, a phase of its own here.
        (slept,) = lorarl_steps([{**_metrics(1, ours, 0.6), "timing/sync": 0.4, "timing/sleep": 0.2,
                                  "timing/wake": 0.3}], [5600], completions=256)  # fmt: skip
        assert (slept["sync_s"], slept["sleep_wake_s"]) == pytest.approx((0.1, 0.5))
        assert slept["other_s"] == pytest.approx(ours - 0.5 - 0.6 - 0.1 - 0.5)
        assert row["tokens_per_step"] == 5600 + 128 * 256
        rows.append({"run": f"lorarl-r{repeat}", "system": "lorarl", "arm": "lorarl-fsdp-adapter", "shape": "0.5b", "kl": False,
                     "correction": "none", "repeat": repeat, **row})  # fmt: skip
        trl = step_row(trl_steps({"steps": [_trl_step(theirs, 0.7)] * 6}), n_params, recomputes=False)
        assert trl["breakdown"]["other_s"] == pytest.approx(theirs - 1.0 - 0.2 - 0.3 - 0.7)
        rows.append({"run": f"trl-r{repeat}", "system": "trl", "arm": "trl", "shape": "0.5b", "kl": False, "correction": "none",
                     "repeat": repeat, **trl})  # fmt: skip
    # A TRL run with its correction on is another algorithm: it is not paired with these.
    rows.append({**rows[-1], "correction": "seq_mask", "repeat": 1})
    rows.append({**rows[0], "error": "exit 1", "repeat": 4})  # failed runs do not count
    (uncorrected,) = pairs(rows)  # the corrected TRL run has no lorarl run to pair with
    assert (uncorrected["correction"], uncorrected["repeats"], uncorrected["trl_repeats"]) == (
        "none",
        [1, 2, 3],
        [1, 2, 3],
    )
    assert uncorrected["lorarl_step_s"] == {"median": 2.0, "min": 1.9, "max": 2.5, "n": 3}
    assert uncorrected["speedup"] == pytest.approx(3.1 / 2.0)
    assert uncorrected["speedup_each"] == pytest.approx([1.5, 1.4, 3.1 / 1.9])
    assert uncorrected["lorarl_mfu_update"]["median"] == pytest.approx(
        4 * n_params * (5600 + 128 * 256) / (0.6 * 989e12)
    )
    assert uncorrected["targets"]["step_s"] == {"want": 1.4, "got": 2.0, "met": False}
    # 6N counts a recomputed forward: only a run that checkpoints has one.
    assert row["mfu_update_hw"] is None
    assert step_row(steps, n_params, recomputes=True)["mfu_update_hw"] == pytest.approx(1.5 * row["mfu_update"])
    assert uncorrected["targets"]["speedup"]["met"] is False
    report = markdown({"date": "d", "commands": ["c"], "work": "w", "mfu_formula": "f", "pairs": [uncorrected],
                       "step_compare": rows})  # fmt: skip
    assert "| 0.5b | off | none | lorarl-fsdp-adapter | 2.00 (1.90-2.50) | 3.10 (3.00-3.50) | 1.55x" in report
    # Several lorarl arms of a pair: a row each against the same TRL runs.
    report = markdown({"date": "d", "commands": ["c"], "work": "w", "mfu_formula": "f", "step_compare": rows,
                       "pairs": [uncorrected, {**uncorrected, "arm": "lorarl-fsdp-adapter-keep"}]})  # fmt: skip
    assert "| lorarl-fsdp-adapter | 2.00" in report and "| lorarl-fsdp-adapter-keep | 2.00" in report
    for table in report.split("\n## ")[1:3]:  # every row of the pair and runs tables has the header's columns
        lines = [line for line in table.splitlines() if line.startswith("|")]
        assert len(lines) > 2 and {line.count("|") for line in lines} == {lines[0].count("|")}


def test_an_off_policy_step_has_only_its_generation_wait_on_the_path_and_an_overlap_target():
    def off_policy(step: int, step_s: float) -> dict:
        # The next batch generated beside this update: 1.5 s long, 0.1 s of it left after the update call.
        return {**_metrics(step, step_s, 2.0), "timing/gen": 1.5, "timing/gen_wait": 0.1, "timing/old_logp": 0.4,
                "timing/sync": 0.5, "rollout/staleness": min(step - 1, 1)}  # fmt: skip

    rows = []
    for repeat, (on, off) in enumerate([(4.6, 3.2), (4.8, 3.6)], start=1):
        on_steps = lorarl_steps([_metrics(s, on, 2.0) for s in range(1, 7)], [5600] * 6, completions=256)
        off_steps = lorarl_steps([off_policy(s, off) for s in range(1, 7)], [5600] * 6, completions=256)
        assert off_steps[3]["other_s"] == pytest.approx(off - 0.1 - 0.4 - 2.0 - 0.5)
        for arm, steps in (("lorarl-fsdp-adapter", on_steps), ("lorarl-fsdp-adapter-offp", off_steps)):
            rows.append({"run": f"{arm}-r{repeat}", "system": "lorarl", "arm": arm, "shape": "7b", "kl": False,
                         "correction": "token_tis", "repeat": repeat, **step_row(steps, 7_620_000_000, False)})  # fmt: skip
    on_pair, off_pair = pairs(rows)
    assert rows[1]["breakdown"]["gen_wait_s"] == pytest.approx(0.1) and "gen_wait_s" not in rows[0]["breakdown"]
    # Each off-policy step over the longer of the on-policy arm's generation (0.5 s) and update (2.0 s),
    # measured there alone: the contended 1.5 s generation beside the update is not the yardstick.
    assert off_pair["lorarl_overlap"] == pytest.approx(
        {"median": 3.4 / 2.0, "min": 3.2 / 2.0, "max": 3.6 / 2.0, "n": 2}
    )
    assert off_pair["targets"]["overlap"] == {"want": 1.15, "got": pytest.approx(3.4 / 2.0), "met": False}
    assert "overlap" not in on_pair["targets"] and "lorarl_overlap" not in on_pair
    # Without an on-policy arm in the pair there is nothing measured alone to judge by.
    (alone,) = pairs([r for r in rows if r["arm"].endswith("offp")])
    assert "lorarl_overlap" not in alone and "overlap" not in alone["targets"]
    report = markdown({"date": "d", "commands": ["c"], "work": "w", "mfu_formula": "f", "pairs": [on_pair, off_pair],
                       "step_compare": rows})  # fmt: skip
    assert "overlap 1.70 vs 1.15: not met" in report and "waited 0.10 s for it" in report


def test_the_sampler_records_the_host_during_a_run():
    with Sampler(interval_s=30.0, gpu=False) as sampler:  # shorter than one interval: the closing sample
        sum(i * i for i in range(3_000_000))  # some CPU work to see
    summary = sampler.summary()
    assert summary["samples"] >= 1
    assert 0.0 <= summary["cpu_busy"]["min"] <= summary["cpu_busy"]["max"] <= 1.0
    counters = [f"clocks_event_reasons_counters.{c}" for c in ("sw_power_cap", "sw_thermal_slowdown")]
    before = {"slowdown_us": {counters[0]: 1_000_000.0, counters[1]: 0.0}}
    after = {"slowdown_us": {counters[0]: 3_500_000.0, counters[1]: 0.0}}
    assert slowdown_s(before, after) == {"sw_power_cap": 2.5, "sw_thermal_slowdown": 0.0}
    assert slowdown_s({"slowdown_us": None}, after) is None  # no nvidia-smi: nothing to difference
    state = host_state()
    assert state["loadavg_1m"] >= 0 and state["mem_available_gib"] > 0
    assert 0 < state["python_loop_us"] < 100
    assert state["gpu"] == nvidia_smi(("memory.used",)) is None or state["gpu"]["memory.used"] is not None
    assert state["page_cache_gib"] >= 0 and set(state["kernel_cache_files"]) == {"triton", "inductor", "vllm"}


def test_a_run_that_compiled_kernels_says_so(tmp_path, monkeypatch):
    """Files a kernel cache gained during a run are noted beside it (a lease's first 7B run was
    slower in every step; compiling is one suspect)."""
    from bench.step_report import new_cache_files

    for name, key in (
        ("triton", "TRITON_CACHE_DIR"),
        ("inductor", "TORCHINDUCTOR_CACHE_DIR"),
        ("vllm", "VLLM_CACHE_ROOT"),
    ):
        monkeypatch.setenv(key, str(tmp_path / name))
    (tmp_path / "triton" / "ab12").mkdir(parents=True)
    before = host_state()
    for i in range(3):
        (tmp_path / "triton" / "ab12" / f"k{i}.cubin").write_bytes(b"x")
    after = host_state()
    assert (before["kernel_cache_files"], after["kernel_cache_files"]) == (
        {"triton": 0, "inductor": 0, "vllm": 0},
        {"triton": 3, "inductor": 0, "vllm": 0},
    )
    assert new_cache_files({"before": before, "after": after}) == "triton +3"
    assert new_cache_files({"before": after, "after": after}) == ""


def test_the_runs_table_notes_the_updates_own_peak_and_a_sleeping_rollout():
    """The update's own peak decides the sleep; the runs table gives it beside the sleep it caused."""
    from bench.step_report import run_lines

    row = {"run": "lorarl-megatron-adapter-0.5b-klon-token_tis-r1", "correction": "token_tis", "order": 1,
           "memory_update_peak_gib": 120.04, "breakdown": {"sleep_wake_s": 0.54}}  # fmt: skip
    assert "update peak 120.0 GiB (rollout asleep)" in run_lines([row])[-1]
    row["breakdown"]["sleep_wake_s"] = 0.0
    assert run_lines([row])[-1].rstrip(" |").endswith("update peak 120.0 GiB")


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_each_arm_composes_the_pairs_algorithm_and_trl_copies_it(backend, tmp_path):
    from bench.gpu_step import compose_run, lorarl_overrides
    from bench.trl_grpo_worker import lorarl_options
    from bench.trl_grpo_worker import parse_args as parse_worker_args

    pair = Pair("7b", True, "seq_mask")
    run = Run(Arm("lorarl", backend, "adapter"), pair, 1)
    overrides = lorarl_overrides(run, SHAPE_RUNS["7b"], GPU_WORK, tmp_path / "model", False)
    cfg = compose_run(backend, [*overrides, "algorithm.rollout_correction.rollout_rs_threshold=4.0"], tmp_path)
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_rs, cfg.actor.use_kl_loss) == (None, "seq_sum_k1", True)
    args = lorarl_options(cfg, pair.correction, cpu=False)
    assert args[args.index("--vllm-is-mode") + 1] == "sequence_mask"
    assert args[args.index("--vllm-is-clip-min") + 1] == "0.25" and args[args.index("--beta") + 1] == "0.001"
    assert args[args.index("--micro-batch") + 1] == "16"  # the 7B preset's 4096-token budget / 192 tokens, as 2^k
    # TRL's work is read from the composed config: the bench's work, step for step.
    work = {o: args[args.index(o) + 1] for o in ("--prompts", "--samples", "--max-tokens", "--steps")}
    assert work == {"--prompts": "32", "--samples": "8", "--max-tokens": "128", "--steps": "6"}
    assert args[args.index("--vllm-gpu-memory-utilization") + 1] == "0.35"
    assert args[args.index("--target-modules") + 1] == "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    assert "--target-parameters" not in args  # a dense model: no fused expert parameters
    # The worker takes them as they are (its parser needs no trl).
    parsed = parse_worker_args(["--model", "m", "--train-parquet", "p", "--out", "o", *args])
    assert (parsed.prompts, parsed.n, parsed.micro_batch, parsed.vllm_is_clip_max) == (32, 8, 16, 4.0)
