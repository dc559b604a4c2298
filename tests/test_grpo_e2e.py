"""The whole loop through the real entry point: Ray workers, FSDP2 over gloo, vLLM CPU engines.

These are the slow tests (tens of seconds each); they share one cache folder with the
embedded model so it is built once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_metrics import assert_described, assert_list_logged

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def grpo(run_dir: Path, cache: Path, *overrides: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "LORARL_CACHE": str(cache)}
    cmd = [
        sys.executable,
        "-m",
        "recipes.grpo",
        "+backend=fsdp",
        "trainer.progress_bar=false",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def metrics(run_dir: Path) -> list[dict]:
    return [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"reward/mean"' in line
    ]


@pytest.fixture(scope="module")
def cache(run_cache) -> Path:
    return run_cache


def logged_keys(run_dir: Path) -> set[str]:
    return {k for line in (run_dir / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}


def test_reward_rises_with_the_synced_adapter(cache, tmp_path):
    """If rollouts did not use the trained adapter, reward could not climb: this is the proof.
    The data files are given as verl's launches give them, one path as a string."""
    data = cache / "data" / "arith_v3_n1024"
    out = grpo(
        tmp_path / "run",
        cache,
        f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/val.parquet",
        "trainer.total_steps=40",
        "trainer.device=cpu",
        "trainer.val_before_train=true",
        "trainer.test_freq=20",
    )
    assert out.returncode == 0, out.stderr[-5000:]
    rows = metrics(tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in lines if "val/acc" in r]
    assert [r["step"] for r in vals] == [0, 20, 40]
    assert {"val/arith/reward/mean", "val/arith/acc/mean@1", "val/arith/acc/pass@1"} <= vals[0].keys()
    assert 0.0 < vals[0]["val/acc"] < 1.0
    assert len(rows) == 40
    assert_described(logged_keys(tmp_path / "run"), "the default run")
    assert_list_logged(logged_keys(tmp_path / "run"), "the default run")
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    assert all(r["sync/kind"] == "adapter" and r["sync/num_adapters"] == 1 for r in rows)
    # The exact fingerprint after every sync; the probe on the first step, every 10th and the last.
    assert all(r["sync/adapter_match"] == 1.0 for r in rows)
    assert [r["step"] for r in rows if "sync/logprob_diff_max" in r] == [1, 10, 20, 30, 40]
    assert all("sync/probe_seconds" in r for r in rows if "sync/logprob_diff_max" in r)
    for key in (
        "reward/std",
        "response_length/mean",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "sync/num_tensors",
        "sync/bytes",
        "sync/seconds",
        "timing/gen",
        "timing/update",
        "timing/step",
    ):
        assert key in rows[0], key
    assert (tmp_path / "run" / "plot_reward.png").exists()
    check_adapter_loads_in_peft_and_vllm(tmp_path / "run" / "final_adapter", cache / "qwen2_tiny")


def check_adapter_loads_in_peft_and_vllm(adapter_dir: Path, base_path: Path) -> None:
    """The exported folder is a standard PEFT adapter: HF+PEFT and vLLM (by path) load it and agree."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]).resolve() == base_path.resolve()
    tok = AutoTokenizer.from_pretrained(base_path)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
            add_generation_prompt=True,
            tokenize=True,
        )["input_ids"]
        for a, b in ((1, 2), (3, 4), (5, 2))
    ]
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), adapter_dir
    ).eval()
    hf = []
    for p in prompts:
        out = model.generate(
            torch.tensor([p]),
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        hf.append(out[0, len(p) :].tolist())
    llm = LLM(
        model=str(base_path),
        enable_lora=True,
        max_lora_rank=config["r"],
        max_loras=1,
        max_model_len=128,
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        dtype="float32",
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=4, temperature=0.0),
        lora_request=LoRARequest("final", 1, str(adapter_dir)),
        use_tqdm=False,
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert [g[: len(h)] for g, h in zip(got, hf)] == hf
    del llm


def test_two_ranks_with_parity_probe_and_dummy_base(cache, tmp_path):
    """2 FSDP ranks, each with its own vLLM started from random (dummy) weights: the first sync
    must send the base, later ones only the adapter, and the probe must agree every step."""
    out = grpo(
        tmp_path / "run",
        cache,
        "trainer.total_steps=3",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        "trainer.check_sync=true",
        "trainer.check_sync_probe_freq=1",
        "rollout.load_format=dummy",
    )
    assert out.returncode == 0, out.stderr[-5000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["init/sync/kind"] == "base+adapter"
    rows = [r for r in lines if "reward/mean" in r]
    assert [r["sync/kind"] for r in rows] == ["adapter"] * 3
    assert max(r["sync/logprob_diff_max"] for r in rows) < 1e-3
    assert rows[0]["sync/bytes"] < lines[0]["init/sync/bytes"] / 10


def test_resumed_run_logs_the_steps_of_an_uninterrupted_one(cache, tmp_path):
    """A run stopped after step 3 whose newest checkpoint is step 2, relaunched in its folder: the
    rows of step 3 go (the step runs again), the validation before training is not repeated, and
    the resumed process's start-up is logged with its first step. metrics.jsonl then holds the
    steps an uninterrupted run logs, row for row, and the same rewards."""
    small = (
        "trainer.device=cpu", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
        "actor.ppo_micro_batch_size_per_gpu=8",
        "trainer.val_before_train=true", "trainer.test_freq=2", "trainer.save_freq=2",
    )  # fmt: skip
    whole = grpo(tmp_path / "whole", cache, *small, "trainer.total_steps=4")
    assert whole.returncode == 0, whole.stderr[-5000:]
    first = grpo(tmp_path / "stopped", cache, *small, "trainer.total_steps=3")
    assert first.returncode == 0, first.stderr[-5000:]
    shutil.rmtree(tmp_path / "stopped" / "checkpoints" / "global_step_3")  # stopped before its checkpoint
    again = grpo(tmp_path / "stopped", cache, *small, "trainer.total_steps=4")
    assert again.returncode == 0, again.stderr[-5000:]
    assert "at step 2" in again.stdout

    def rows(run: str) -> list[dict]:
        return [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    expected, got = rows("whole"), rows("stopped")
    assert [r["step"] for r in expected] == [0, 0, 1, 2, 3, 4]
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    assert [("val/acc" in r, "reward/mean" in r) for r in got] == [
        ("val/acc" in r, "reward/mean" in r) for r in expected
    ]
    for want, have in zip(expected, got):
        for key in ("reward/mean", "val/acc"):
            if key in want:
                assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (want["step"], key)
    assert "init/sync/kind" in got[4] and got[4]["step"] == 3  # the relaunch's start-up, with its first step


def sweep(cache: Path, sweep_dir: Path, *overrides: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m recipes.grpo -m` in `sweep_dir` on the embedded model, small batches."""
    env = {**os.environ, "LORARL_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "recipes.grpo", "-m", "+backend=fsdp", "trainer.progress_bar=false",
           "trainer.device=cpu", f"hydra.sweep.dir={sweep_dir}", *overrides]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_multirun_folders_and_summary_with_either_launcher(cache, tmp_path):
    """The same sweep through Hydra's basic launcher (one run after another) and through the
    shared-base launcher (both points as adapters of one base): the same job folders, each with
    the files and the config the basic launcher writes, the same logged keys, one summary row each."""
    points = ("trainer.total_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4",
              "model.lora.rank=8,16")  # fmt: skip
    basic = sweep(cache, tmp_path / "basic", *points)
    assert basic.returncode == 0, basic.stderr[-5000:]
    shared = sweep(cache, tmp_path / "shared", *points, "hydra/launcher=shared_base")
    assert shared.returncode == 0, shared.stderr[-5000:]
    assert "job 1 (model.lora.rank=16): group 0, adapter 1 of 2 on one base" in shared.stdout + shared.stderr
    for name in ("basic", "shared"):
        folder = tmp_path / name
        jobs = sorted(p.name for p in folder.iterdir() if p.is_dir())
        assert jobs == ["0_fsdp_qwen2_tiny_r8", "1_fsdp_qwen2_tiny_r16"]
        summary = (folder / "summary.md").read_text()
        assert "model.lora.rank=8" in summary and "model.lora.rank=16" in summary
        assert len((folder / "summary.csv").read_text().strip().splitlines()) == 3
        assert (folder / "plot_reward.png").exists()
    for job in ("0_fsdp_qwen2_tiny_r8", "1_fsdp_qwen2_tiny_r16"):
        a, b = tmp_path / "basic" / job, tmp_path / "shared" / job

        def files(root: Path) -> set[str]:
            return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

        assert files(a) == files(b), files(a) ^ files(b)
        for f in (".hydra/config.yaml", ".hydra/overrides.yaml", "final_adapter/adapter_config.json"):
            assert (a / f).read_text() == (b / f).read_text(), f
        keys_a = [set(json.loads(x)) for x in (a / "metrics.jsonl").read_text().splitlines()]
        keys_b = [set(json.loads(x)) for x in (b / "metrics.jsonl").read_text().splitlines()]
        assert keys_a == keys_b
        assert "first sync: adapter" in (b / "grpo.log").read_text()


def test_workers_get_the_launchers_communication_settings(monkeypatch):
    """NCCL_NVLS_ENABLE=0 and friends set by the launching shell must reach every Ray worker."""
    from lorarl.workers.worker import worker_env

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.setenv("LORARL_UNRELATED", "x")
    env = worker_env()
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert "LORARL_UNRELATED" not in env and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


RC = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    "algorithm,extra",
    [
        # token TIS combined with geometric-mean sequence rejection (verl's recommended preset);
        # oversampled rounds of 24 prompts for 16, as many rounds as it takes
        (
            "dapo",
            [
                f"{RC}.rollout_is=token",
                f"{RC}.rollout_rs=seq_mean_k1",
                f"{RC}.rollout_rs_threshold=1.001",
                "data.gen_batch_size=24",
                "algorithm.filter_groups.max_num_gen_batches=0",
            ],
        ),  # fmt: skip
        ("dr_grpo", []),
        # below 1, the sampler's log-probs must still be at the trainer's temperature (ratio ~1)
        ("gspo", [f"{RC}.rollout_is=token", "rollout.temperature=0.8"]),
    ],
)
def test_algorithm_presets_learn(algorithm, extra, cache, tmp_path):
    """Each GRPO variant trains the embedded default: reward rises, its own metrics are logged."""
    steps = 40 if algorithm == "dapo" else 30  # no KL and filtered groups: dapo moves slower on this task
    out = grpo(
        tmp_path / "run", cache, f"algorithm={algorithm}", f"trainer.total_steps={steps}", "trainer.device=cpu", *extra
    )
    assert out.returncode == 0, out.stderr[-5000:]
    rows = metrics(tmp_path / "run")
    assert_described(logged_keys(tmp_path / "run"), f"algorithm={algorithm}")
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.03, f"{algorithm}: reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    for key in ("kl", "k3_kl", "rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size", "chi2_token"):
        assert f"rollout_corr/{key}" in rows[0], key
    # fp32 on CPU: sampler and trainer agree
    assert all(r["rollout_corr/rollout_is_max"] < 1.01 and abs(r["rollout_corr/kl"]) < 1e-3 for r in rows)
    assert ("actor/kl_loss" in rows[0]) is False  # no KL term in these variants
    # On-policy: no separate old-log-prob pass, except that rejection needs the trainer's log-probs
    # before the loss is normalised.
    assert ("timing/old_logp" in rows[0]) is (algorithm == "dapo")
    if algorithm == "dapo":
        assert all(r["rollout_corr/rollout_rs_masked_fraction"] < 0.01 for r in rows)
        assert all(r["data/gen_rounds"] >= 1 for r in rows) and "reward/overlong" in rows[0]
        assert all(0.0 < r["data/groups_with_signal"] <= 1.0 for r in rows)
