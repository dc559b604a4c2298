"""A verl launch keeps its meaning: verl's defaults carried, every key of verl's published scripts
known, all problems in one pass, the launch forms verl's scripts use, and `--check`.

verl's side of each check is its own data (recipes/verl_data/, extracted from verl's repository
at the commits recorded there), not the translation's output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lorarl.config.compose import compose, compose_values
from recipes.from_verl import VerlTranslationError, script_launch, translate, verl_row
from recipes.from_verl.defaults import DELIBERATE, default_of, defaults_for, verl_defaults
from recipes.from_verl.keys import VERL_KEYS
from recipes.from_verl.launch import GRPO_MODULES, OTHER_MODULES, check_module
from recipes.from_verl.models import model_preset
from recipes.from_verl.result import parsed, same

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "recipes" / "verl_data"
A = "actor_rollout_ref."
LORA = [A + "model.lora_rank=32", "algorithm.adv_estimator=grpo", A + "rollout.name=vllm"]


def published_scripts():
    data = json.loads((DATA / "script_keys.json").read_text())
    return [(path, entry) for source in data.values() for path, entry in source["scripts"].items()]


def test_the_data_names_the_commits_it_came_from():
    scripts = json.loads((DATA / "script_keys.json").read_text())
    for source in scripts.values():
        assert len(source["commit"]) == 40 and source["repository"]
    assert len(verl_defaults()["commit"]) == 40
    assert len(published_scripts()) > 150


def test_every_key_of_verls_published_scripts_has_a_row():
    unknown, grpo = [], 0
    for path, entry in published_scripts():
        if entry["module"] in OTHER_MODULES:
            continue
        grpo += entry["module"] in GRPO_MODULES
        unknown += [f"{path}: {key}" for key in entry["keys"] if verl_row(key.lstrip("+~"))[0] is None]
    assert grpo > 150 and not unknown, unknown


def test_every_row_not_mapped_says_why():
    for row in VERL_KEYS:
        assert row.to or row.note, row.verl


@pytest.mark.parametrize("module", sorted(OTHER_MODULES))
def test_other_entry_points_are_refused_with_a_reason(module):
    with pytest.raises(VerlTranslationError, match=f"-m {module}: verl's .*; lorarl translates"):
        check_module(module)


def mismatched_defaults(backend: str, overrides: list[str], dapo: bool = False) -> list[str]:
    """Mapped keys whose composed lorarl value is neither verl's default nor a listed difference."""
    cfg = compose_values(overrides)
    bad = []
    for row in VERL_KEYS:
        known, default = default_of(row, backend, defaults_for(backend, dapo))
        if (
            not known
            or row.to in (None, "+backend")
            or row.verl in DELIBERATE
            or any(a.startswith(row.verl + "=") for a in LORA)
        ):
            continue
        if row.convert:
            default = parsed(row.convert(str(default)))
        ours = OmegaConf.select(cfg, row.to.lstrip("+"), default=None)
        ours = OmegaConf.to_container(ours) if OmegaConf.is_config(ours) else ours
        if not same(ours, default):
            bad.append(f"{row.verl}: verl {default!r}, lorarl {ours!r}")
    return bad


@pytest.mark.parametrize("module", ["verl.trainer.main_ppo", "recipe.dapo.main_dapo"])
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_every_mapped_default_is_carried_or_listed_with_its_reason(backend, module):
    args = LORA + ([A + "actor.strategy=megatron"] if backend == "megatron" else [])
    overrides = translate(args, module=module).overrides
    assert mismatched_defaults(backend, overrides, dapo="dapo" in module) == []
    for key, reason in DELIBERATE.items():
        assert reason and verl_row(key)[0] is not None, key


def test_the_walk_fails_when_defaults_are_not_carried():
    """Without the carried overrides lorarl's own defaults show through, and the walk names them."""
    result = translate(LORA + [A + "model.path=Qwen/Qwen2.5-7B-Instruct"])
    carried = {override for _, override in result.carried}
    bare = [o for o in result.overrides if o not in carried]
    bad = " ".join(mismatched_defaults("fsdp", bare))
    for key in ("lora_alpha", "optim.weight_decay", "use_dynamic_bsz", "rollout_is", "val_before_train"):
        assert key in bad


@pytest.mark.parametrize(
    "key, value",
    [
        ("model.lora.alpha", 16),
        ("actor.use_dynamic_bsz", False),
        ("actor.optim.weight_decay", 0.01),
        ("algorithm.rollout_correction.rollout_is", None),
        ("trainer.val_before_train", True),
        ("actor.clip_ratio_c", 3.0),
        ("actor.use_kl_loss", False),
    ],
)
def test_verls_named_defaults_are_stated(key, value):
    cfg = compose_values(translate(LORA + [A + "model.path=Qwen/Qwen2.5-7B-Instruct"]).overrides)
    assert OmegaConf.select(cfg, key) == value


@pytest.mark.parametrize("tp, sp", [("4", True), ("1", False)])
def test_megatron_sequence_parallel_is_on_with_tensor_parallel_as_in_verl(tp, sp):
    args = LORA + [A + "actor.strategy=megatron", f"{A}actor.megatron.tensor_model_parallel_size={tp}"]
    cfg = compose_values(translate(args).overrides)
    assert cfg.backend.sequence_parallel is sp
    assert (cfg.backend.transformer_impl == "transformer_engine") is sp


def test_full_fine_tuning_is_refused_in_one_line_and_lora_rank_opts_in():
    with pytest.raises(VerlTranslationError) as err:
        translate(["algorithm.adv_estimator=grpo", A + "actor.optim.lr=1e-6"])
    (line,) = err.value.problems
    assert "trains LoRA adapters only" in line and "--lora-rank R" in line and A + "model.lora_rank" in line
    result = translate(["algorithm.adv_estimator=grpo", A + "actor.optim.lr=1e-6"], lora_rank=64)
    assert "model.lora.rank=64" in result.overrides
    assert any("full-fine-tuning learning rate" in w for w in result.warnings)
    assert not translate(LORA + [A + "actor.optim.lr=3e-5"]).warnings


def test_one_pass_lists_every_problem_the_decisive_first():
    """What decides the launch (no LoRA rank, a non-Qwen model, verl's default estimator gae) comes
    first, then each key's own problem, then one line for the keys of no verl release."""
    with pytest.raises(VerlTranslationError) as err:
        translate(
            [
                A + "actor.optim.weight_decai=0.1",
                "my_fork.search.max_turns=4",
                A + "rollout.name=sglang",
                "trainer.log_val_generation=10",
                A + "model.path=org/Other-7B",
            ]
        )
    lines = err.value.problems
    assert len(lines) == 5, "\n".join(lines)
    assert lines[0].startswith(A + "model.lora_rank=unset") and "--lora-rank" in lines[0]
    assert lines[1].startswith(A + "model.path=org/Other-7B: not a Qwen2") and "pass --model" in lines[1]
    assert lines[2].startswith("algorithm.adv_estimator unset means verl's default gae")
    assert lines[3].startswith(A + "rollout.name=sglang: lorarl supports only vllm")
    assert lines[4].startswith(
        A + "actor.optim.weight_decai (did you mean actor_rollout_ref.actor.optim.weight_decay or "
    )
    assert (
        ", my_fork.search.max_turns, trainer.log_val_generation (did you mean trainer.log_val_generations?): "
        in lines[4]
    )
    assert "none of these 3 keys is in verl's trainer config of any release lorarl knows" in lines[4]
    assert all("\n" not in line for line in lines)


DAPO_SCRIPT = r"""
source /opt/conda/bin/activate
conda activate verl
set -xeuo pipefail
nvidia-smi
mkdir -p "$PWD/ckpts"
export VLLM_USE_V1=1
MODEL_PATH=${MODEL_PATH:-"${HOME}/models/Qwen3-30B-A3B-Base"}
CKPTS_DIR=${CKPTS_DIR:-"${PWD}/ckpts/dapo"}
ray job submit --address="http://127.0.0.1:8265" --runtime-env="${PWD}/runtime_env.yaml" --no-wait \
    -- python3 -m recipe.dapo.main_dapo \
    --config-name=dapo_megatron_trainer \
    data.train_files="${HOME}/data/dapo-math-17k.parquet" \
    data.val_files="${HOME}/data/aime-2024.parquet" \
    data.prompt_key=prompt \
    data.max_prompt_length=1024 data.max_response_length=4096 \
    data.train_batch_size=32 data.gen_batch_size=96 \
    actor_rollout_ref.rollout.n=8 \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False \
    algorithm.filter_groups.enable=True algorithm.filter_groups.metric=acc algorithm.filter_groups.max_num_gen_batches=10 \
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.lora.rank=32 actor_rollout_ref.model.lora.alpha=64 \
    actor_rollout_ref.actor.megatron.vanilla_mbridge=False \
    actor_rollout_ref.actor.optim.lr=1e-5 actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10240 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=4 \
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1 \
    actor_rollout_ref.actor.megatron.context_parallel_size=2 \
    actor_rollout_ref.actor.megatron.param_offload=True \
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.top_k=-1 actor_rollout_ref.rollout.val_kwargs.top_k=-1 \
    reward_model.reward_manager=dapo \
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True \
    +reward_model.reward_kwargs.overlong_buffer_cfg.len=1024 \
    +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
    +reward_model.reward_kwargs.overlong_buffer_cfg.log=False \
    +reward_model.reward_kwargs.max_resp_len=4096 \
    trainer.logger='["console","wandb"]' trainer.n_gpus_per_node=8 trainer.nnodes=1 \
    trainer.save_freq=-1 trainer.test_freq=10 trainer.log_val_generations=10 \
    trainer.default_local_dir="${CKPTS_DIR}"
"""


def test_ray_submitted_dapo_megatron_moe_launch_translates_and_validates(tmp_path, monkeypatch):
    """conda, nvidia-smi, set -e, `ray job submit -- python3 -m recipe.dapo.main_dapo`, --config-name,
    $PWD paths: all as verl's DAPO scripts write them."""
    script = tmp_path / "run_dapo.sh"
    script.write_text(DAPO_SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    launch = script_launch(script, cwd=work)
    assert launch.module == "recipe.dapo.main_dapo" and launch.args[0] == "--config-name=dapo_megatron_trainer"
    assert not (work / "ckpts").exists()  # the script's mkdir ran in a temporary folder
    result = translate(launch.args, module=launch.module)
    assert result.overrides[:2] == ["+backend=megatron", "model=qwen3_30b_a3b"]
    assert f"trainer.default_local_dir={work}/ckpts/dapo" in result.overrides
    assert any("context_parallel_size=2" in n and "2x" in n for n in result.notes)
    run = compose(result.overrides)
    assert run.model.path == str(Path.home() / "models/Qwen3-30B-A3B-Base")
    assert (run.backend.sequence_parallel, run.backend.tensor_model_parallel_size) == (True, 2)
    assert (run.algorithm.filter_groups.enable, run.algorithm.overlong_buffer.len) == (True, 1024)
    assert (run.actor.clip_ratio_c, run.actor.clip_ratio_high, run.actor.optim.warmup_steps) == (10.0, 0.28, 10)
    assert (run.model.lora.alpha, run.actor.optim.weight_decay, run.trainer.val_before_train) == (64, 0.1, True)


def test_gspo_translates_to_verls_loss_and_validates():
    args = LORA + [
        A + "actor.policy_loss.loss_mode=gspo",
        A + "actor.clip_ratio_low=3e-4",
        A + "actor.clip_ratio_high=4e-4",
        A + "actor.clip_ratio_c=10.0",
        A + "actor.loss_agg_mode=token-mean",
        A + "model.path=Qwen/Qwen3-8B-Base",
        A + "rollout.n=8",
        "data.train_batch_size=64",
        A + "actor.ppo_mini_batch_size=16",
        A + "actor.ppo_micro_batch_size_per_gpu=4",
        A + "rollout.tensor_model_parallel_size=2",
        "trainer.n_gpus_per_node=8",
    ]
    result = translate(args)
    run = compose(result.overrides)
    assert (run.actor.policy_loss, run.actor.loss_agg_mode, run.actor.clip_ratio_c) == (
        "gspo",
        "seq-mean-token-mean",
        None,
    )
    assert any(d.verl.endswith("loss_agg_mode") for d in result.differences)


@pytest.mark.parametrize(
    "name, preset, path_set",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", "qwen2_5_0_5b_instruct", False),
        ("Qwen/Qwen2.5-3B-Instruct", "qwen2_5_1_5b_instruct", True),
        ("Qwen/Qwen2.5-Math-7B", "qwen2_5_7b_instruct", True),
        ("Qwen/Qwen2.5-Math-1.5B-Instruct", "qwen2_5_1_5b_instruct", True),
        ("Qwen/Qwen2.5-Coder-32B-Instruct", "qwen2_5_7b_instruct", True),
        ("Qwen/Qwen2.5-32B", "qwen2_5_7b_instruct", True),
        ("Qwen/Qwen2-72B-Instruct", "qwen2_7b_instruct", True),
        ("Qwen/Qwen3-8B-Base", "qwen3_8b", True),
        ("Qwen/Qwen3-4B-Instruct-2507", "qwen3_4b", True),
        ("/data/models/Qwen3-32B", "qwen3_32b", False),
        ("Qwen/Qwen3-30B-A3B-Base", "qwen3_30b_a3b", True),
        ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3_30b_a3b", True),
        ("Qwen/Qwen3-235B-A22B-Thinking-2507", "qwen3_235b_a22b", True),
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_30b_a3b", True),
        ("Qwen/Qwen2.5-VL-7B-Instruct", None, False),
        ("deepseek-ai/deepseek-llm-7b-chat", None, False),
    ],
)
def test_qwen_checkpoints_resolve_to_their_family_preset(name, preset, path_set):
    assert model_preset(name) == (preset, path_set)


MEGATRON_LORA = r"""
python3 -m verl.trainer.main_ppo --config-path=config --config-name='ppo_megatron_trainer.yaml' \
    algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet \
    data.train_batch_size=64 data.max_prompt_length=512 data.max_response_length=1024 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct actor_rollout_ref.model.lora.rank=64 \
    actor_rollout_ref.actor.megatron.vanilla_mbridge=False \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size=16 \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=5 \
    trainer.n_gpus_per_node=8 trainer.save_freq=-1
"""


def test_check_validates_and_prints_the_differences(tmp_path):
    script = tmp_path / "megatron_lora.sh"
    script.write_text(MEGATRON_LORA)
    cmd = [sys.executable, "-m", "recipes.from_verl", "--check", str(script)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "# checked: lorarl's config validation" in out.stdout
    assert "| actor_rollout_ref.rollout.load_format | dummy | rollout.load_format |" in out.stdout
    assert "ppo_micro_batch_size=16 is global: 4 per GPU over 4 data-parallel replicas" in out.stderr
    bad = subprocess.run([*cmd, "--", "trainer.save_freq=5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: trainer.save_freq")


def test_slurm_launch_infers_megatron_and_keeps_what_the_backend_has(tmp_path):
    """`srun ... python -m` is recorded; Megatron keys under a custom --config-name pick the
    Megatron backend, where FSDP-only keys are ignored with the reason; two log-prob budgets
    become the smaller; a key whose variable is unset is named."""
    script = tmp_path / "slurm.sh"
    script.write_text(
        'srun --nodes=1 --ntasks=1 python -m verl.trainer.main_ppo --config-name=my_trainer "$@" \\\n'
        f"  {' '.join(LORA)} {A}actor.megatron.tensor_model_parallel_size=2 {A}actor.use_torch_compile=False \\\n"
        f"  {A}ref.log_prob_max_token_len_per_gpu=8192 {A}rollout.log_prob_max_token_len_per_gpu=4096 \\\n"
        f"  trainer.nnodes=$SLURM_NNODES {A}actor.megatron.dist_checkpointing_path=$UNSET_DIR\n"
    )
    launch = script_launch(script)
    with pytest.raises(VerlTranslationError) as err:
        translate(launch.args)
    assert err.value.problems == [
        "trainer.nnodes= has no value (a variable the script did not set?); set it or give the value"
    ]
    result = translate([*launch.args, "trainer.nnodes=1"])
    assert (
        result.overrides[0] == "+backend=megatron" and "actor.log_prob_max_token_len_per_gpu=4096" in result.overrides
    )
    assert (A + "actor.use_torch_compile", "False", "not a setting of +backend=megatron") in result.ignored


def test_check_estimates_what_a_sequence_split_costs(tmp_path):
    """Ulysses sequence parallelism translates to whole sequences per device; with the model's
    config on this machine --check runs the shape checks and prints lorarl's memory estimate."""
    from transformers import Qwen2Config

    from lorarl.driver.prepare import run_update_bytes
    from lorarl.rollout.memory import GIB, ModelDims

    model = tmp_path / "Qwen2.5-7B-Instruct"
    shape = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28)
    Qwen2Config(**shape, num_key_value_heads=4, vocab_size=152064).save_pretrained(model)
    args = LORA + [
        f"{A}model.path={model}",
        f"{A}actor.ulysses_sequence_parallel_size=2",
        f"{A}rollout.n=4",
        "data.train_batch_size=16",
        f"{A}actor.ppo_mini_batch_size=8",
        f"{A}actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.n_gpus_per_node=8",
    ]
    cmd = [sys.executable, "-m", "recipes.from_verl", "--check", *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    run = compose(translate(args).overrides)
    want = run_update_bytes(run, ModelDims.of(Qwen2Config.from_pretrained(model)), 8, 1) / GIB
    assert "# checked: parallel sizes against the model's heads" in out.stdout
    assert f"is not used; the update's estimated peak on one device is {want:.1f} GiB" in out.stdout
    assert "| actor_rollout_ref.actor.ulysses_sequence_parallel_size | 2 | - | 1 |" in out.stdout


def test_dapo_starts_from_verl_recipes_dapo_defaults():
    """verl-recipe's DAPO config leaves the overlong penalty factor at 0 and gen batches unlimited."""
    args = LORA + ["algorithm.filter_groups.enable=True", "reward_model.overlong_buffer.enable=True"]
    dapo = compose_values(
        translate(args + ["reward_model.overlong_buffer.len=128"], module="recipe.dapo.main_dapo").overrides
    )
    assert (dapo.algorithm.overlong_buffer.penalty_factor, dapo.algorithm.filter_groups.max_num_gen_batches) == (0.0, 0)


def test_a_warmup_ratio_becomes_steps_of_the_launchs_total():
    ratio = A + "actor.optim.lr_warmup_steps_ratio=0.05"
    result = translate(LORA + [ratio, "trainer.total_training_steps=500"])
    assert "actor.optim.warmup_steps=25" in result.overrides
    with pytest.raises(VerlTranslationError, match="lr_warmup_steps_ratio=0.05: warmup is counted in steps"):
        translate(LORA + [ratio])
    assert "actor.optim.warmup_steps=7" in translate(LORA + [ratio, A + "actor.optim.lr_warmup_steps=7"]).overrides


def test_a_stray_backslash_is_named():
    with pytest.raises(VerlTranslationError, match="a stray argument"):
        translate(LORA + ["\\"])


def test_the_extractor_reads_keys_from_arrays_continuations_and_plus_forms():
    """scripts/extract_verl_keys.py reads keys from the script text: quoted, in arrays, after `+`,
    never from comments or from variables' own assignments."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("extract_verl_keys", ROOT / "scripts" / "extract_verl_keys.py")
    extract = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extract)
    text = (
        'max_len=$((1024 * 2))\nARGS=(\n    data.max_prompt_length=${max_len}\n    "trainer.logger=[console]"\n)\n'
        "# actor_rollout_ref.rollout.n=4 is in a comment\n"
        "python3 -m verl.trainer.main_ppo \\\n    +actor_rollout_ref.actor.megatron.override_transformer_config.x=1 \\\n"
        '    "${ARGS[@]}" algorithm.adv_estimator=grpo  # trailing comment critic.model.path=x\n'
    )
    roots = {"data", "trainer", "actor_rollout_ref", "algorithm", "critic"}
    assert extract.script_keys(text, roots) == [
        "actor_rollout_ref.actor.megatron.override_transformer_config.x",
        "algorithm.adv_estimator",
        "data.max_prompt_length",
        "trainer.logger",
    ]
