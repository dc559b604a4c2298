"""verl's published GRPO-LoRA launches translate into lorarl commands that compose with their values
(the translation itself: tests/test_from_verl_meaning.py checks defaults, forms and --check)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from lorarl.config.compose import compose
from lorarl.errors import ConfigError
from recipes.from_verl import VERL_KEYS, VerlTranslationError, script_launch, translate, verl_row
from tests.test_config import compose_job, hydra_compose  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]

# volcengine/verl examples/tuning/0.5b/qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh (commit 25d78fa9):
# its variables and its main_ppo call, without the GPU pinning and the `| tee` of the log.
FSDP_0_5B = r"""
NOW=$(date +%Y%m%d)
export WANDB_DIR=gsm8k-grpo-lora-qwen2.5-0.5b-${NOW}
export WANDB_PROJECT=${WANDB_DIR}
export WANDB_EXP=0.5b-${NOW}
MODEL_PATH=Qwen/Qwen2.5-0.5B-Instruct
nproc_per_gpu=1
nnodes=1
ngpu_per_node=1
total_procs=$(( nproc_per_gpu * nnodes * ngpu_per_node ))
mini_batch_size=$(( total_procs ))
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    trainer.val_before_train=False \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=${total_procs} \
    data.val_batch_size=${total_procs} \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.shuffle=False \
    actor_rollout_ref.model.path=$MODEL_PATH  \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.model.lora_rank=32 \
    actor_rollout_ref.model.lora_alpha=32 \
    actor_rollout_ref.model.target_modules=all-linear \
    actor_rollout_ref.actor.optim.lr=3e-5 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=${mini_batch_size} \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=${mini_batch_size} \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.fsdp_config.fsdp_size=-1 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=${mini_batch_size} \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.1 \
    actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.rollout.max_num_seqs=512 \
    actor_rollout_ref.rollout.max_model_len=1536 \
    actor_rollout_ref.rollout.max_num_batched_tokens=1536 \
    actor_rollout_ref.rollout.enable_chunked_prefill=False \
    actor_rollout_ref.rollout.load_format=safetensors \
    actor_rollout_ref.rollout.layered_summon=True \
    actor_rollout_ref.ref.log_prob_micro_batch_size=${mini_batch_size} \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 \
    actor_rollout_ref.actor.entropy_coeff=0.001 \
    algorithm.kl_ctrl.kl_coef=0.001 \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name=${WANDB_PROJECT} \
    trainer.experiment_name=${WANDB_EXP} \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=1 $@
"""

# volcengine/verl examples/grpo_trainer/run_qwen2-7b_math_megatron_lora.sh (commit b7036632):
# its variables, override arrays and main_ppo call, without the comments.
MEGATRON_7B = r"""
set -xeuo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
rollout_name="vllm"
project_name='verl_grpo_example_gsm8k_math'
exp_name='qwen2_7b_megatron_lora'
adv_estimator=grpo
max_prompt_length=1024
max_response_length=1024
train_prompt_bsz=128
gsm8k_train_path=$HOME/data/gsm8k/train.parquet
gsm8k_test_path=$HOME/data/gsm8k/test.parquet
math_train_path=$HOME/data/math/train.parquet
math_test_path=$HOME/data/math/test.parquet
train_files="['$gsm8k_train_path', '$math_train_path']"
test_files="['$gsm8k_test_path', '$math_test_path']"
DATA=(
    data.train_files="$train_files"
    data.val_files="$test_files"
    data.max_prompt_length=$max_prompt_length
    data.max_response_length=$max_response_length
    data.train_batch_size=$train_prompt_bsz
    data.filter_overlong_prompts=True
    data.truncation='error'
    data.shuffle=False
)
MODEL=(
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
    actor_rollout_ref.model.lora.rank=256
    actor_rollout_ref.model.lora.alpha=512
    actor_rollout_ref.model.lora.lora_A_init_method=kaiming
)
ACTOR=(
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=16
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.megatron.use_mbridge=True
    actor_rollout_ref.actor.megatron.vanilla_mbridge=False
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1
)
ROLLOUT=(
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=$rollout_name
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=4
)
REF=(
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4
)
ALGORITHM=(
    algorithm.adv_estimator=$adv_estimator
    algorithm.use_kl_in_reward=False
)
TRAINER=(
    trainer.logger='["console","wandb"]'
    trainer.project_name=$project_name
    trainer.experiment_name=$exp_name
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
    trainer.val_before_train=False
)
python3 -m verl.trainer.main_ppo \
    --config-path=config \
    --config-name='ppo_megatron_trainer.yaml' \
    "${DATA[@]}" \
    "${ALGORITHM[@]}" \
    "${MODEL[@]}" \
    "${ROLLOUT[@]}" \
    "${ACTOR[@]}" \
    "${REF[@]}" \
    "${TRAINER[@]}" \
    "$@"
"""

LAUNCHES = {
    "fsdp_0_5b": (FSDP_0_5B, "fsdp", "qwen2_5_0_5b_instruct", "gsm8k"),
    "megatron_7b": (MEGATRON_7B, "megatron", "qwen2_7b_instruct", "math"),
}


def parsed(key: str, value: str):
    """The value Hydra (verl's config system too) gives `key=value`."""
    return OverridesParser.create().parse_overrides([f"{key}={value}"])[0].value()


def launch_args(tmp_path: Path, name: str) -> list[str]:
    script = tmp_path / f"{name}.sh"
    script.write_text(LAUNCHES[name][0])
    return script_launch(script).args


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_verl_launch_translates_with_its_values(hydra_compose, tmp_path, name):  # noqa: F811
    args = launch_args(tmp_path, name)
    _, backend, model, data = LAUNCHES[name]
    result = translate(args)
    assert result.overrides[:3] == [f"+backend={backend}", f"model={model}", f"data={data}"]
    cfg = compose_job(result.overrides)
    checked = 0
    for arg in args:
        if arg.startswith("--"):
            continue
        key, _, value = arg.partition("=")
        row, to = verl_row(key.lstrip("+"))
        if to is None or to == "+backend":
            continue
        want = parsed(key.lstrip("+"), row.values.get(value, value))
        got = OmegaConf.select(cfg, to.lstrip("+"))
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        assert got == want, f"{key}={value} became {to}={got!r}"
        checked += 1
    assert checked >= 30
    ignored = {k for k, _, _ in result.ignored}
    assert "actor_rollout_ref.rollout.name" in ignored and all(reason for _, _, reason in result.ignored)


def test_fsdp_launch_keeps_layered_summon_and_the_string_path(hydra_compose, tmp_path):  # noqa: F811
    cfg = compose_job(translate(launch_args(tmp_path, "fsdp_0_5b")).overrides)
    assert cfg.rollout.layered_summon is True and cfg.rollout.load_format == "safetensors"
    assert cfg.data.train_files == str(Path.home() / "data/gsm8k/train.parquet")
    assert cfg.model.lora.target_modules == "all-linear"


def test_translated_launches_validate_or_name_the_key(tmp_path):
    """The 0.5B tuning launch samples one response per prompt, which GRPO cannot learn from, and
    the Megatron one saves mid-run checkpoints, which that backend lacks: both fail with the key;
    with those two keys changed both validate, the string path becoming a one-item list."""
    fsdp = translate(launch_args(tmp_path, "fsdp_0_5b")).overrides
    megatron = translate(launch_args(tmp_path, "megatron_7b")).overrides
    for overrides, key in ((fsdp, "rollout.n"), (megatron, "trainer.save_freq")):
        with pytest.raises(ConfigError, match=re.escape(key)):
            compose(overrides)
    run = compose([*fsdp, "rollout.n=5"])
    assert run.data.train_files == [str(Path.home() / "data/gsm8k/train.parquet")]
    assert (run.model.lora.rank, run.model.lora.target_modules, run.rollout.layered_summon) == (
        32,
        ["all-linear"],
        True,
    )
    run = compose([*megatron, "trainer.save_freq=-1"])
    assert (run.model.lora.rank, run.model.lora.alpha, run.model.lora.init_A) == (256, 512, "kaiming")
    assert (run.backend.tensor_model_parallel_size, run.backend.bridge) == (4, "megatron_bridge")
    assert len(run.data.train_files) == 2


RANKED = ["actor_rollout_ref.model.lora_rank=8", "algorithm.adv_estimator=grpo"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["actor_rollout_ref.rollout.multi_turn.enable=True"], "multi_turn.enable=True: lorarl supports only False"),
        (["foo.bar=1"], "foo.bar: not in verl's trainer config of any release lorarl knows (v0.3.0.post1 to "),
        (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name=sglang: lorarl supports only vllm"),
        (["actor_rollout_ref.model.path=org/Unknown-9B"], "not a Qwen2 / Qwen2.5 / Qwen3 checkpoint"),
        (
            ["actor_rollout_ref.actor.megatron.vanilla_mbridge=True"],
            "vanilla_mbridge=True: lorarl supports only False or false (LoRA is exported through Megatron-Bridge",
        ),
        (
            ["actor_rollout_ref.actor.grad_clip=1.0", "actor_rollout_ref.actor.optim.clip_grad=0.5"],
            "both set actor.grad_clip",
        ),
        (["data.train_files"], "not a verl override"),
    ],
)
def test_bad_launches_fail_with_one_line_naming_the_key(args, needle):
    with pytest.raises(VerlTranslationError) as err:
        translate(RANKED + args)
    assert [needle in p for p in err.value.problems] == [True], err.value.problems
    assert "\n" not in err.value.problems[0]


def test_renamed_values_translate(hydra_compose):  # noqa: F811
    result = translate(
        RANKED
        + [
            "algorithm.rollout_correction.rollout_is=sequence",
            "algorithm.rollout_correction.rollout_is_threshold=3.0",
            "actor_rollout_ref.actor.strategy=megatron",
            "trainer.total_training_steps=7",
        ]
    )
    assert result.overrides[0] == "+backend=megatron"
    cfg = compose_job(result.overrides)
    assert cfg.algorithm.rollout_correction.rollout_is == "sequence"
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 3.0
    assert (cfg.backend.bridge, cfg.trainer.total_steps) == ("megatron_bridge", 7)


def test_new_algorithm_and_moe_keys_translate(hydra_compose):  # noqa: F811
    result = translate(
        RANKED
        + [
            "actor_rollout_ref.actor.strategy=megatron",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5",
            "algorithm.rollout_correction.rollout_is_batch_normalize=True",
            "actor_rollout_ref.actor.loss_scale_factor=512",
            "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups.metric=acc",
            "algorithm.filter_groups.max_num_gen_batches=0",
            "data.train_batch_size=8",
            "data.gen_batch_size=16",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
        ]
    )
    cfg = compose_job(result.overrides)
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_is_batch_normalize) == ("token_k1", "0.5", True)
    assert cfg.actor.loss_scale_factor == 512 and cfg.data.gen_batch_size == 16
    assert (cfg.algorithm.filter_groups.metric, cfg.algorithm.filter_groups.max_num_gen_batches) == ("acc", 0)
    assert (cfg.backend.expert_model_parallel_size, cfg.backend.expert_tensor_parallel_size) == (2, 1)


def test_cli_prints_the_command_and_the_ignored_keys(tmp_path):
    script = tmp_path / "launch.sh"
    script.write_text(MEGATRON_7B)
    out = subprocess.run(
        [sys.executable, "-m", "recipes.from_verl", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("python -m recipes.grpo +backend=megatron model=qwen2_7b_instruct data=math ")
    assert "# ignored actor_rollout_ref.rollout.name=vllm: the rollout engine is vLLM" in out.stderr
    script.write_text(FSDP_0_5B)
    job = subprocess.run(
        [sys.executable, "-m", "recipes.from_verl", "--run", str(script), "--", "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "  layered_summon: true\n" in job.stdout and "  train_files: " + str(Path.home()) in job.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "recipes.from_verl", "data.foo=1"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1].startswith(
        "error: data.foo: not in verl's trainer config of any release lorarl knows ("
    )


def test_every_lorarl_key_of_the_table_exists(hydra_compose):  # noqa: F811
    cfg = compose_job(["+backend=megatron"])
    fsdp = compose_job(["+backend=fsdp"])
    for row in VERL_KEYS:
        if row.to and row.to != "+backend":
            # `+a.b.c` adds key c to lorarl's open mapping a.b, which must exist.
            key = row.to.lstrip("+").rsplit(".", 1)[0] if row.to.startswith("+") else row.to
            assert (
                OmegaConf.select(cfg, key, default="absent") != "absent"
                or OmegaConf.select(fsdp, key, default="absent") != "absent"
            ), f"{row.verl} maps to {row.to}, which lorarl lacks"


def test_vllm_engine_arguments_pass_through_by_their_names(hydra_compose):  # noqa: F811
    verl = [
        "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.async_scheduling=True",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_capture_sizes=[8,16]",
    ]
    overrides = translate(RANKED + verl).overrides
    assert overrides[1:6] == [
        "model.lora.rank=8",
        "algorithm.adv_estimator=grpo",
        "+rollout.engine_kwargs.max_num_batched_tokens=4096",
        "+rollout.engine_kwargs.async_scheduling=True",
        "+rollout.engine_kwargs.compilation_config.cudagraph_capture_sizes=[8,16]",
    ]
    engine_kwargs = OmegaConf.to_container(compose_job(overrides).rollout.engine_kwargs)
    assert engine_kwargs == {
        "max_num_batched_tokens": 4096,
        "async_scheduling": True,
        "compilation_config": {"cudagraph_capture_sizes": [8, 16]},
    }
    ignored = translate(RANKED + ["+actor_rollout_ref.rollout.engine_kwargs.sglang.x=1"]).ignored
    assert ignored == [
        (
            "actor_rollout_ref.rollout.engine_kwargs.sglang.x",
            "1",
            "arguments of another rollout engine; the rollout engine is vLLM",
        )
    ]
