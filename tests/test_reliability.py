"""Bad input, faults and limits end in one clear line and lose nothing (issue 7).

Every case goes through the real entry point, `python -m recipes.grpo`, and checks the
message (one line naming the key or file and the fix), the exit status (2 for a user error),
that stderr holds no traceback, and what is left on disk. Most cases fail before Ray starts;
five runs start workers (divergence, a killed worker + resume, one of two workers killed, SIGTERM).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorarl.data.arith import make_rows
from lorarl.data.dataset import write_parquet
from lorarl.files.checkpoint import is_complete
from tests.test_metrics import assert_described

ROOT = Path(__file__).resolve().parents[1]
# Small enough for two CPU cores: 4 prompts x 2 samples per step.
SMALL = (
    "trainer.device=cpu",
    "trainer.progress_bar=false",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "rollout.n=2",
)
SECRETS = {"WANDB_API_KEY": "secret-xyz-2d7f", "HF_TOKEN": "secret-abc-91c4"}


@pytest.fixture(scope="module")
def cache(run_cache) -> Path:
    return run_cache


def cli_cmd(run_dir: Path, *overrides: str, backend: str = "fsdp") -> list[str]:
    return [sys.executable, "-m", "recipes.grpo", f"+backend={backend}", f"hydra.run.dir={run_dir}", *SMALL, *overrides]


def cli_env(cache: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "LORARL_CACHE": str(cache), **extra}


def grpo(
    run_dir: Path, cache: Path, *overrides: str, backend: str = "fsdp", env: dict | None = None, timeout: int = 600
):
    return subprocess.run(
        cli_cmd(run_dir, *overrides, backend=backend),
        cwd=ROOT,
        env=env or cli_env(cache),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_line(out: subprocess.CompletedProcess, *needles: str, status: int = 2) -> str:
    """The user error: exit status 2, no traceback, and the message on the last line of stderr."""
    assert out.returncode == status, f"exit {out.returncode}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    assert last.startswith("error: "), out.stderr[-3000:]
    for needle in needles:
        assert needle in last, f"{needle!r} not in: {last}"
    return last


def assert_nothing_written(run_dir: Path) -> None:
    """A run that failed before training leaves only Hydra's own files."""
    assert {p.name for p in run_dir.iterdir()} <= {".hydra", "grpo.log"}, sorted(p.name for p in run_dir.iterdir())


def data_overrides(*files: Path) -> tuple[str, ...]:
    quoted = ",".join(f"'{f}'" for f in files)
    return (f"data.train_files=[{quoted}]", "data.val_files=[]", "data.generator=null")


def trainer_error(cache: Path, monkeypatch, out_dir: Path, *overrides: str):
    """The same path through the public API, in this process: compose, validate, build the
    trainer. Used where the CLI part (one line, exit 2, no traceback) is already shown by a
    sibling case and a fresh interpreter per case would cost seconds."""
    from hydra import compose

    from lorarl.config.compose import to_run_config
    from lorarl.driver.jobs import Job
    from lorarl.driver.trainer import GRPOTrainer
    from lorarl.errors import LorarlError

    monkeypatch.setenv("LORARL_CACHE", str(cache))
    with composing():
        cfg = compose("grpo", overrides=["+backend=fsdp", "trainer.experiment_name=x", *SMALL, *overrides])
    run = to_run_config(cfg)
    with pytest.raises(LorarlError) as err:
        GRPOTrainer([Job(run, out_dir)])
    assert "\n" not in str(err.value), str(err.value)
    assert not out_dir.exists(), "the trainer wrote output before failing"
    return err.value


def arith_rows(n: int = 8) -> list[dict]:
    return make_rows(n, seed=0, split="train")


# ---- 1. config ---------------------------------------------------------------------------


def test_megatron_without_cuda_points_to_fsdp(cache, tmp_path):
    out = grpo(tmp_path, cache, backend="megatron")
    error_line(out, "+backend=megatron", "CUDA", "+backend=fsdp")
    assert_nothing_written(tmp_path)


def test_unknown_key_on_the_command_line_names_it(cache, tmp_path):
    # Hydra rejects it while composing (its exit status is 1), before lorarl runs at all.
    out = grpo(tmp_path, cache, "model.lora.rnak=8")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "rnak" in out.stderr and "LoraConfig" in out.stderr


def test_tensor_parallel_must_split_the_heads(tiny_model_path):
    from hydra import compose
    from transformers import AutoConfig

    from lorarl.config.compose import to_run_config
    from lorarl.config.validate import check_model_shape
    from lorarl.errors import ConfigError

    with composing():
        cfg = compose(
            "grpo",
            overrides=[
                "+backend=megatron",
                "backend.tensor_model_parallel_size=8",
                "trainer.n_gpus_per_node=8",
                "actor.ppo_micro_batch_size_per_gpu=8",
                "trainer.experiment_name=x",
            ],
        )
    run = to_run_config(cfg)
    hf = AutoConfig.from_pretrained(tiny_model_path)
    with pytest.raises(ConfigError) as err:
        check_model_shape(run, hf.num_attention_heads, hf.num_key_value_heads)
    msg = str(err.value)
    assert "backend.tensor_model_parallel_size=8" in msg and f"{hf.num_attention_heads} attention heads" in msg
    assert "\n" not in msg
    # Qwen2.5-7B: 28 query heads split over 4 devices, its 4 KV heads over 4; 8 cannot split 28.
    check_model_shape(run_with_tp(run, 4), 28, 4)
    with pytest.raises(ConfigError, match="28 attention heads"):
        check_model_shape(run, 28, 4)


@contextlib.contextmanager
def composing():
    """Hydra's compose API on conf/ (experiment_name is overridden: it reads Hydra's runtime)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


def run_with_tp(run, tp: int):
    from dataclasses import replace

    return replace(run, backend=replace(run.backend, tensor_model_parallel_size=tp))


# ---- 2. model ------------------------------------------------------------------------------


def test_model_path_that_does_not_exist(cache, tmp_path):
    missing = tmp_path / "no_such_model"
    out = grpo(tmp_path / "run", cache, f"model.path={missing}", "model.builder=null")
    error_line(out, f"model.path='{missing}'", "does not exist")
    assert_nothing_written(tmp_path / "run")


def test_model_path_given_with_the_default_preset_means_that_model(cache, tmp_path, monkeypatch, tiny_model_path):
    """The tiny-model builder writes only into the lorarl cache: a mistyped path is the usual
    one-line error (no toy model trained in its place), and a user's own model is used as is."""
    from lorarl.config.compose import to_run_config
    from lorarl.driver.prepare import prepare_model
    from lorarl.models.tiny import MARKER

    missing = tmp_path / "typo_model"
    err = trainer_error(cache, monkeypatch, tmp_path / "run", f"model.path={missing}")
    assert f"model.path='{missing}' does not exist" in str(err)
    assert not missing.exists()

    own = tmp_path / "own_model"
    shutil.copytree(tiny_model_path, own, ignore=shutil.ignore_patterns(MARKER))
    with composing():
        from hydra import compose

        cfg = compose("grpo", overrides=["+backend=fsdp", "trainer.experiment_name=x", *SMALL, f"model.path={own}"])
    run = to_run_config(cfg)
    assert run.model.builder == "tiny_qwen2"  # the default preset
    assert prepare_model(run) == str(own)
    assert not (own / MARKER).exists()


def test_model_that_is_not_a_causal_lm(cache, tmp_path, monkeypatch):
    from transformers import BertConfig

    from lorarl.errors import ModelError

    BertConfig(
        num_hidden_layers=1,
        hidden_size=64,
        num_attention_heads=2,
        intermediate_size=64,
        architectures=["BertForMaskedLM"],
    ).save_pretrained(tmp_path / "bert")
    err = trainer_error(cache, monkeypatch, tmp_path / "run", f"model.path={tmp_path / 'bert'}", "model.builder=null")
    assert isinstance(err, ModelError)
    assert "model.path=" in str(err) and "BertForMaskedLM" in str(err) and "not a causal language model" in str(err)


def test_architecture_vllm_cannot_serve_with_lora(cache, tmp_path, monkeypatch):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=64, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "gpt2")
    err = trainer_error(cache, monkeypatch, tmp_path / "run", f"model.path={tmp_path / 'gpt2'}", "model.builder=null")
    assert "GPT2LMHeadModel" in str(err) and "LoRA" in str(err) and "model.lora.merge=true" in str(err)
    # vLLM's registry said so, and the answer is kept for the next run (importing vLLM takes seconds).
    known = json.loads((cache / "vllm_lora_support.json").read_text())
    assert {k.split("/", 1)[1]: v for k, v in known.items()}["GPT2LMHeadModel"] is False


def test_a_resume_path_that_is_no_checkpoint_fails_before_the_model_is_read(cache, tmp_path, monkeypatch):
    """trainer.resume_mode naming a folder that is not a complete checkpoint is one of the start-up
    checks: it fails before the model is looked at (the missing model path is not what it reports)."""
    half = tmp_path / "ckpt" / "global_step_4"
    half.mkdir(parents=True)  # a folder without manifest.json: a save that never finished
    err = trainer_error(
        cache, monkeypatch, tmp_path / "run", f"trainer.resume_mode={half}", f"model.path={tmp_path / 'no_model'}"
    )
    assert str(err).startswith(f"trainer.resume_mode='{half}': not a complete checkpoint folder")


def test_vllm_engine_argument_it_does_not_have_or_lorarl_sets(cache, tmp_path, monkeypatch):
    """rollout.engine_kwargs goes to vLLM as given: a name the installed vLLM lacks fails before
    Ray starts (its names read once per vLLM version), and so does one lorarl sets itself."""
    from lorarl.config.compose import compose
    from lorarl.errors import ConfigError

    err = trainer_error(cache, monkeypatch, tmp_path / "run", "+rollout.engine_kwargs.max_num_seq=4")
    assert isinstance(err, ConfigError)
    assert "rollout.engine_kwargs.max_num_seq: vLLM" in str(err) and "did you mean max_num_seqs" in str(err)
    assert "EngineArgs" in json.loads((cache / "vllm_engine_args.json").read_text()).popitem()[0]
    with pytest.raises(ConfigError, match="rollout.engine_kwargs.gpu_memory_utilization: .* set rollout.gpu_memory"):
        compose(["+backend=fsdp", "+rollout.engine_kwargs.gpu_memory_utilization=0.3"])


def test_target_module_that_matches_nothing(cache, tmp_path):
    # One typo among valid names: PEFT alone would silently train the other projections only.
    out = grpo(tmp_path, cache, "model.lora.target_modules=[q_proj,vproj]")
    error_line(out, "model.lora.target_modules", "'vproj'", "v_proj")
    assert_nothing_written(tmp_path)


def test_peft_error_inside_the_engine_is_one_line(cache, tmp_path, monkeypatch, tiny_model_path):
    """The workers' own guard, for a model the driver check cannot see the same way."""
    from hydra import compose

    from lorarl.config.compose import to_run_config
    from lorarl.driver.prepare import engine_spec
    from lorarl.engines.fsdp import load_lora_model
    from lorarl.errors import ModelError

    monkeypatch.setenv("LORARL_CACHE", str(cache))
    with composing():
        cfg = compose(
            "grpo", overrides=["+backend=fsdp", "trainer.experiment_name=x", "model.lora.target_modules=[vproj]"]
        )
    run = to_run_config(cfg)
    run.model.path = str(tiny_model_path)
    with pytest.raises(ModelError) as err:
        load_lora_model(engine_spec(run, "cpu"))
    msg = str(err.value)
    assert "model.lora.target_modules=['vproj']" in msg and "\n" not in msg


def test_unexpected_worker_error_is_one_line_naming_its_traceback_file(tmp_path):
    import traceback

    import ray

    from lorarl.errors import ConfigError, TrainingError
    from lorarl.workers.group import failure_line

    def update():
        return {}["actor/pg_loss"]

    try:
        update()
    except KeyError as e:
        err = ray.exceptions.RayTaskError("Worker.update", traceback.format_exc(), e).as_instanceof_cause()
    trace = tmp_path / "worker_traceback.txt"
    line = str(failure_line(err, "worker 1 of 2", trace))
    assert line == f"worker 1 of 2 failed: KeyError: 'actor/pg_loss' (traceback: {trace})"
    text = trace.read_text()
    assert "in update" in text and "KeyError" in text and "\x1b[" not in text
    # The user's own mistakes stay their one line, with no file.
    user = ConfigError("actor.ppo_mini_batch_size=3 must divide data.train_batch_size=4")
    wrapped = ray.exceptions.RayTaskError("Worker.update", "", user).as_instanceof_cause()
    assert failure_line(wrapped, "the worker", tmp_path / "other.txt") is user
    assert not (tmp_path / "other.txt").exists()
    assert isinstance(failure_line(err, "the worker", None), TrainingError)


def test_a_call_past_the_stall_limit_leaves_every_threads_stack_and_a_prompt_one_leaves_nothing(tmp_path):
    import threading

    from lorarl.workers.stall_report import stacks_after, stacks_file

    path = stacks_file(tmp_path, 3)
    assert path.name == "worker_stacks_rank3.txt"
    with stacks_after(path, 5.0):
        pass
    assert not path.exists()

    held = threading.Event()

    def waits_in_a_collective():
        held.wait(5)

    with stacks_after(path, 0.3):
        helper = threading.Thread(target=waits_in_a_collective, name="peer")
        helper.start()
        time.sleep(1.0)  # past the limit: the block goes on
        held.set()
        helper.join()
    text = path.read_text()
    assert "most recent call first" in text and "waits_in_a_collective" in text, text
    assert "test_a_call_past_the_stall_limit" in text  # the main thread too
    # A later call that returns in time appends nothing and keeps the report.
    with stacks_after(path, 5.0):
        pass
    assert path.read_text() == text
    with stacks_after(None, 0.1), stacks_after(path, None):
        time.sleep(0.3)
    assert path.read_text() == text
    # A call that fails in time leaves no (empty) file either.
    other = stacks_file(tmp_path, 4)
    with pytest.raises(RuntimeError), stacks_after(other, 5.0):
        raise RuntimeError("CUDA Error: out of memory")
    assert not other.exists()


def test_model_code_is_not_run_without_trust_remote_code(cache, tmp_path):
    model = tmp_path / "custom"
    model.mkdir()
    marker = tmp_path / "code_ran"
    (model / "configuration_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'lorarl_evil'\n"
    )
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "lorarl_evil",
                "architectures": ["EvilForCausalLM"],
                "auto_map": {
                    "AutoConfig": "configuration_evil.EvilConfig",
                    "AutoModelForCausalLM": "configuration_evil.EvilConfig",
                },
            }
        )
    )
    # transformers copies a model's code into its modules cache: keep that inside tmp_path.
    env = cli_env(cache, HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    out = grpo(tmp_path / "run", cache, f"model.path={model}", "model.builder=null", env=env)
    error_line(out, "model.trust_remote_code=true")
    assert not marker.exists(), "the model's own code ran although model.trust_remote_code is false"
    # The flag is what gates it: set, the same folder's code runs.
    load = f"from lorarl.driver.preflight import load_hf_config; load_hf_config({str(model)!r}, trust_remote_code=True)"
    ran = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert marker.exists()


def test_pickled_weights_are_refused(cache, tmp_path, tiny_model_path, monkeypatch):
    model = tmp_path / "bin_model"
    model.mkdir()
    for f in tiny_model_path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, model / f.name)
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    err = trainer_error(cache, monkeypatch, tmp_path / "run", f"model.path={model}", "model.builder=null")
    assert "no *.safetensors" in str(err) and "pytorch_model.bin" in str(err)


def test_trust_remote_code_is_off_in_every_model_preset():
    from hydra import compose

    with composing():
        for model in sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")):
            cfg = compose("grpo", overrides=["+backend=fsdp", f"model={model}", "trainer.experiment_name=x"])
            assert cfg.model.trust_remote_code is False, model


# ---- 3. data -------------------------------------------------------------------------------


def test_missing_data_file(cache, tmp_path):
    missing = tmp_path / "nope.parquet"
    out = grpo(tmp_path / "run", cache, *data_overrides(missing))
    error_line(out, str(missing), "not found", "data.train_files")
    assert_nothing_written(tmp_path / "run")


def test_mistyped_data_path_with_the_default_preset_fails_and_writes_nothing(cache, tmp_path):
    """The arith generator writes only into the lorarl cache: a path the user gives means that
    file, so a typo is the one-line error (no toy data written there and trained on)."""
    typo = tmp_path / "some" / "typo" / "train.parquet"
    out = grpo(tmp_path / "run", cache, f"data.train_files={typo}")
    error_line(out, "data.train_files", f"'{typo}'", "not found")
    assert not typo.exists() and not (tmp_path / "some").exists()
    assert_nothing_written(tmp_path / "run")


def test_unreadable_parquet(cache, tmp_path, monkeypatch):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet")
    err = trainer_error(cache, monkeypatch, tmp_path / "run", *data_overrides(bad))
    assert str(bad) in str(err) and "not readable parquet" in str(err)


def test_missing_columns_are_named(cache, tmp_path, monkeypatch):
    rows = [{"data_source": r["data_source"], "prompt": r["prompt"]} for r in arith_rows()]
    f = write_parquet(rows, tmp_path / "no_truth.parquet")
    err = trainer_error(cache, monkeypatch, tmp_path / "run", *data_overrides(f))
    assert str(f) in str(err) and "lacks column(s) reward_model.ground_truth" in str(err)


def test_empty_after_filtering(cache, tmp_path, monkeypatch):
    f = write_parquet(arith_rows(), tmp_path / "train.parquet")
    err = trainer_error(cache, monkeypatch, tmp_path / "run", *data_overrides(f), "data.max_prompt_length=4")
    assert "all 8 prompts" in str(err) and "data.max_prompt_length=4" in str(err)


def test_overlong_prompt_with_truncation_error_names_row_and_length(cache, tmp_path, monkeypatch):
    rows = arith_rows()
    rows[3]["prompt"] = [{"role": "user", "content": "What is 1 + 2? " * 20}]
    f = write_parquet(rows, tmp_path / "train.parquet")
    err = trainer_error(
        cache,
        monkeypatch,
        tmp_path / "run",
        *data_overrides(f),
        "data.max_prompt_length=40",
        "data.filter_overlong_prompts=false",
        "data.truncation=error",
    )
    msg = str(err)
    assert msg.startswith("row 3:") and "data.max_prompt_length=40" in msg and "data.truncation" in msg
    assert int(re.search(r"prompt has (\d+) tokens", msg).group(1)) > 40


def test_non_numeric_gsm8k_ground_truth_fails_before_any_rollout(cache, tmp_path):
    rows = arith_rows()
    for r in rows:
        r["data_source"] = "openai/gsm8k"
    rows[5]["reward_model"] = {"style": "rule", "ground_truth": "seventy-two"}
    f = write_parquet(rows, tmp_path / "train.parquet")
    t0 = time.perf_counter()
    out = grpo(tmp_path / "run", cache, *data_overrides(f))
    error_line(out, "data row 5", "'seventy-two'", "not a number")
    assert_nothing_written(tmp_path / "run")
    # Caught while loading the data: no Ray, no vLLM (those alone take longer than this on CPU).
    assert "Worker pid" not in out.stderr, f"workers started ({time.perf_counter() - t0:.0f} s)"


# ---- 4. faults -----------------------------------------------------------------------------


def steps_on_disk(ckpt_root: Path) -> list[int]:
    """Step numbers of the checkpoint folders; each must be complete, and no save may be half-done."""
    names = sorted(p.name for p in ckpt_root.iterdir())
    assert not [n for n in names if ".tmp-" in n], names
    steps = []
    for n in names:
        assert re.fullmatch(r"global_step_\d+", n), n
        assert is_complete(ckpt_root / n), n
        steps.append(int(n.rsplit("_", 1)[1]))
    return sorted(steps)


def assert_safe_formats(root: Path) -> None:
    """Only safetensors, JSON and YAML: no pickle (torch.save's zip or raw protocol) anywhere."""
    from safetensors import safe_open

    files = [p for p in root.rglob("*") if p.is_file()]
    assert files
    for f in files:
        assert f.suffix in (".safetensors", ".json", ".yaml"), f
        head = f.read_bytes()[:2]
        assert head != b"PK" and not head.startswith(b"\x80"), f"{f} looks pickled"
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as st:
                assert list(st.keys())
        elif f.suffix == ".json":
            json.loads(f.read_text())


@pytest.mark.slow
def test_divergence_stops_with_the_step_and_keeps_the_last_good_checkpoint(cache, tmp_path):
    """lr=1e30: the first update with a non-zero gradient blows the adapter up and the next
    forward pass is NaN. The run stops there, names the step, and every checkpoint written
    before it is complete. The run also carries secrets in its environment: none may land in
    the run folder or the console."""
    run = tmp_path / "run"
    out = grpo(
        run,
        cache,
        "actor.optim.lr=1e30",
        "trainer.save_freq=1",
        "trainer.total_steps=6",
        "trainer.logger=[console,jsonl]",
        env=cli_env(cache, **SECRETS),
    )
    line = error_line(out, "last complete checkpoint")
    assert re.search(r"\b(nan|inf)\b", line), line
    failed = int(re.match(r"error: step (\d+): ", line).group(1))
    assert failed >= 2, line  # the first update cannot produce a NaN loss in its own step
    ckpts = run / "checkpoints"
    assert steps_on_disk(ckpts) == list(range(1, failed)), line
    assert str(ckpts / f"global_step_{failed - 1}") in line
    assert not (run / "final_adapter").exists()
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(logged) == failed - 1  # the failed step logged nothing
    log = (run / "grpo.log").read_text().splitlines()  # the run's log keeps what the console showed
    assert any(f"- step {failed - 1}: reward/mean=" in x for x in log) and log[-1].endswith(line), log[-3:]

    assert_safe_formats(ckpts)
    for secret in SECRETS.values():
        assert secret not in out.stdout + out.stderr
        for f in run.rglob("*"):
            if f.is_file():
                assert secret.encode() not in f.read_bytes(), f"{secret} written to {f}"


def descendants(pid: int) -> dict[int, bytes]:
    """Every live process below `pid` (Ray's GCS, raylet, workers...) with its command line."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    out = {}
    for c in found:
        try:
            out[c] = Path(f"/proc/{c}/cmdline").read_bytes()
        except OSError:
            pass
    return out


def alive(pids) -> list[int]:
    left = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.append(pid)
    return left


class Background:
    """A run in the background whose console we can watch, for faults injected mid-run."""

    def __init__(self, run_dir: Path, cache: Path, *overrides: str):
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = run_dir.parent / "stdout.txt", run_dir.parent / "stderr.txt"
        self.proc = subprocess.Popen(
            cli_cmd(run_dir, *overrides),
            cwd=ROOT,
            env=cli_env(cache),
            stdout=self.stdout_path.open("w"),
            stderr=self.stderr_path.open("w"),
        )

    def wait_for(self, text: str, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stdout_path.read_text():
            assert self.proc.poll() is None, f"run ended early:\n{self.stderr_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s"
            time.sleep(0.2)

    def finish(self, timeout: float = 120) -> subprocess.CompletedProcess:
        t0 = time.monotonic()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the run hung: still alive {timeout} s after the fault")
        self.seconds = time.monotonic() - t0
        return subprocess.CompletedProcess(
            self.proc.args, rc, self.stdout_path.read_text(), self.stderr_path.read_text()
        )


def assert_all_gone(pids, grace: float = 30) -> None:
    deadline = time.monotonic() + grace
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = alive(pids)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in left if Path(f"/proc/{p}").exists()]


@pytest.mark.slow
def test_killed_worker_ends_the_run_and_a_truncated_checkpoint_is_skipped_on_resume(cache, tmp_path):
    """A worker killed mid-run (as the OOM killer would) ends the run with that worker's error
    within seconds. Then the newest checkpoint loses a file, and the relaunch resumes from the
    one before it and repeats the lost step exactly."""
    run = tmp_path / "run"
    bg = Background(run, cache, "trainer.save_freq=1", "trainer.total_steps=50")
    bg.wait_for("step 2:")
    procs = descendants(bg.proc.pid)
    workers = [p for p, cmd in procs.items() if cmd.startswith(b"ray::Worker")]
    assert len(workers) == 1, procs
    os.kill(workers[0], signal.SIGKILL)
    out = bg.finish()
    line = error_line(out, "a worker process died", "last complete checkpoint")
    assert bg.seconds < 60, f"took {bg.seconds:.0f} s to notice the dead worker"
    assert_all_gone(procs)
    steps = steps_on_disk(run / "checkpoints")
    newest = steps[-1]
    assert newest >= 2 and steps == list(range(1, newest + 1)), (steps, line)

    (run / "checkpoints" / f"global_step_{newest}" / "adapter" / "adapter_model.safetensors").unlink()
    killed_rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    again = grpo(run, cache, "trainer.save_freq=1", f"trainer.total_steps={newest + 1}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'global_step_{newest - 1}'} at step {newest - 1}" in again.stdout
    assert steps_on_disk(run / "checkpoints") == list(range(1, newest + 2))
    # Both sync checks run in the resumed process too: the probe is armed on its first step (and
    # runs on its last), whatever trainer.check_sync_probe_freq says about the steps between.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # The relaunch's start-up is logged with its first step; the killed run's row of the step it
    # repeats is gone, so each step has one row.
    resumed = max(i for i, r in enumerate(rows) if "init/sync/kind" in r)
    after = [r for r in rows[resumed:] if "reward/mean" in r]
    assert [r["step"] for r in after] == [newest, newest + 1], after
    assert [r["step"] for r in rows if "reward/mean" in r] == list(range(1, newest + 2))
    assert all(r["sync/adapter_match"] == 1.0 and "sync/logprob_diff_max" in r for r in after), after
    # The repeated step is the step the killed run took (its row is logged after its checkpoint):
    # model, optimizer, data order and sampling seeds all come back.
    before = next(r for r in killed_rows if r.get("step") == newest and "reward/mean" in r)
    for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert after[0][key] == pytest.approx(before[key], rel=1e-5, abs=1e-7), key
    assert_described({k for r in rows for k in r}, "a resumed run with checkpoints")


@pytest.mark.slow
def test_stalled_worker_is_reported_and_a_killed_one_stops_the_run_within_15_s(cache, tmp_path):
    """Two workers. One is stopped (SIGSTOP): the step stalls, and after trainer.stall_report_s
    the driver says so, naming the stacks files, without ending the run; resumed (SIGCONT), the
    run goes on. Then it is SIGKILLed while its peer will sit in a collective: the run ends with
    exit 2 and one line naming the dead worker and the last checkpoint, within 15 s, and leaves
    no process and no tmpfs adapter folder behind."""
    run = tmp_path / "run"
    stall = re.compile(
        r"the workers' ([a-z -]+) is still running after trainer.stall_report_s=6 s; "
        r"their Python stacks at that moment: (\S+)$",
        re.M,
    )
    bg = Background(
        run,
        cache,
        "trainer.n_gpus_per_node=2",
        "actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.save_freq=1",
        "trainer.total_steps=50",
        "trainer.stall_report_s=6",
    )
    bg.wait_for("step 2:")
    procs = descendants(bg.proc.pid)
    workers = sorted(p for p, cmd in procs.items() if cmd.startswith(b"ray::Worker"))
    assert len(workers) == 2, procs
    before = len(stall.findall(bg.stdout_path.read_text()))
    os.kill(workers[1], signal.SIGSTOP)
    t0 = time.monotonic()
    while len(reports := stall.findall(bg.stdout_path.read_text())) == before:
        assert time.monotonic() - t0 < 60, "no stall report 60 s into a stopped worker"
        time.sleep(0.2)
    assert reports[-1][1] == f"{run}/worker_stacks_rank*.txt", reports
    assert bg.proc.poll() is None  # reported, not ended
    os.kill(workers[1], signal.SIGCONT)
    last = max(int(n) for n in re.findall(r"^step (\d+):", bg.stdout_path.read_text(), re.M))
    bg.wait_for(f"step {last + 1}:", timeout=120)
    # Whatever stacks a worker wrote (at set-up on a slow machine, in the stalled step) read as
    # faulthandler's dump of every thread.
    for f in run.glob("worker_stacks_rank*.txt"):
        assert "most recent call first" in f.read_text(), f
    os.kill(workers[1], signal.SIGKILL)
    out = bg.finish(timeout=60)
    line = error_line(out, "a worker process died (worker ", " of 2)", "last complete checkpoint: ")
    assert re.search(r"\(worker [01] of 2\)", line), line
    assert bg.seconds < 15, f"took {bg.seconds:.1f} s to stop after the kill"
    assert_all_gone(procs, grace=5)
    assert not [p for w in workers for p in Path("/dev/shm").glob(f"lorarl-adapter-{w}-*")]


def test_adapter_folders_of_dead_processes_are_removed_at_start(tmp_path):
    from lorarl.rollout.vllm.engine_process import ADAPTER_DIR_PREFIX, remove_stale_adapter_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{ADAPTER_DIR_PREFIX}{dead.pid}-abc"
    mine = tmp_path / f"{ADAPTER_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{ADAPTER_DIR_PREFIX}notapid"
    for d in (stale, mine, other):
        d.mkdir()
        (d / "adapter_config.json").write_text("{}")
    assert remove_stale_adapter_dirs(tmp_path) == [stale]
    assert not stale.exists() and mine.is_dir() and other.is_dir()


@pytest.mark.slow
def test_sigterm_shuts_down_cleanly(cache, tmp_path):
    """SIGTERM mid-run: exit 143 with one line, no half-written checkpoint, and no Ray, worker
    or vLLM process left behind."""
    run = tmp_path / "run"
    bg = Background(run, cache, "trainer.save_freq=1", "trainer.total_steps=50")
    bg.wait_for("step 1:")
    procs = descendants(bg.proc.pid)
    assert any(cmd.startswith(b"ray::Worker") for cmd in procs.values()), procs
    bg.proc.send_signal(signal.SIGTERM)
    out = bg.finish()
    assert out.returncode == 128 + signal.SIGTERM, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith("interrupted by SIGTERM")
    assert_all_gone(procs)
    assert steps_on_disk(run / "checkpoints")[0] == 1
    assert not (run / "final_adapter").exists()


# ---- 5. security ---------------------------------------------------------------------------


def _calls(tree: ast.AST, attr: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name == attr:
                yield node


def test_no_unsafe_loading_in_the_source():
    """torch.load only with weights_only=True; no pickle/joblib loads; trust_remote_code never hard-wired on."""
    sources = sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "recipes").rglob("*.py"))
    assert sources
    for path in sources:
        tree = ast.parse(path.read_text(), filename=str(path))
        for call in _calls(tree, "load"):
            f = call.func
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            if owner == "torch":
                kw = {k.arg: k.value for k in call.keywords}
                ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                assert ok, f"{path}:{call.lineno}: torch.load without weights_only=True"
            assert owner not in ("pickle", "joblib", "dill", "cloudpickle"), f"{path}:{call.lineno}: {owner}.load"
        for call in _calls(tree, "loads"):
            f = call.func
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            assert owner not in ("pickle", "dill", "cloudpickle"), f"{path}:{call.lineno}: {owner}.loads"
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                assert not (isinstance(node.value, ast.Constant) and node.value.value is True), (
                    f"{path}:{node.value.lineno}: trust_remote_code=True"
                )


def test_liger_kernel_resolves_per_device_and_refuses_cpu(cache, monkeypatch, tiny_model_path):
    """backend.liger_kernel: null is on for CUDA training only; true on CPU is a one-line error
    naming the key, raised before any model is loaded; a missing package names the fix."""
    import torch
    from hydra import compose

    from lorarl.config.compose import to_run_config
    from lorarl.driver.prepare import engine_spec
    from lorarl.engines.liger import apply_liger_kernel
    from lorarl.errors import ConfigError

    monkeypatch.setenv("LORARL_CACHE", str(cache))
    with composing():
        cfg = compose("grpo", overrides=["+backend=fsdp", "trainer.experiment_name=x"])
    run = to_run_config(cfg)
    run.model.path = str(tiny_model_path)
    assert run.backend.liger_kernel is None
    assert engine_spec(run, "cuda").liger_kernel and not engine_spec(run, "cpu").liger_kernel
    run.backend.liger_kernel = False
    assert not engine_spec(run, "cuda").liger_kernel
    run.backend.liger_kernel = True
    with pytest.raises(ConfigError) as err:
        engine_spec(run, "cpu")
    assert str(err.value).startswith("backend.liger_kernel=true needs CUDA") and "\n" not in str(err.value)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as on a machine without the gpu extra
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(ConfigError) as err:
        apply_liger_kernel(torch.nn.Module())
    assert "liger-kernel is not importable" in str(err.value) and "backend.liger_kernel=false" in str(err.value)
