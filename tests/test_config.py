"""Every config group option composes and validates; mistakes fail with the key's name."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict

import lorarl.config.compose  # noqa: F401  (registers schemas)
from lorarl.config.backends import FSDPBackendConfig, MegatronBackendConfig
from lorarl.config.compose import to_run_config
from lorarl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def hydra_compose():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield compose_job
    HydraConfig.instance().cfg = None
    GlobalHydra.instance().clear()


def compose_job(overrides: list[str]):
    """The job config as @hydra.main sees it (`${hydra:...}` resolvable), without the hydra node."""
    cfg = compose("grpo", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    OmegaConf.set_readonly(cfg, False)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def resolved(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("backend", options("backend"))
@pytest.mark.parametrize("model", options("model"))
def test_every_backend_and_model_composes(hydra_compose, backend, model):
    cfg = hydra_compose([f"+backend={backend}", f"model={model}"])
    assert resolved(cfg)["model"]["path"]
    run = to_run_config(cfg)
    assert run.backend.strategy in ("fsdp2", "megatron")
    assert isinstance(run.backend, FSDPBackendConfig if backend == "fsdp" else MegatronBackendConfig)


@pytest.mark.parametrize(
    "group,option",
    [(g, o) for g in ("data", "rollout", "algorithm") for o in options(g)],
)
def test_every_group_option_composes(hydra_compose, group, option):
    run = to_run_config(hydra_compose(["+backend=fsdp", f"{group}={option}"]))
    assert run.rollout.n >= 2


def skip_without_its_algorithm(experiment: str) -> None:
    """A preset naming an algorithm option this tree lacks cannot compose yet; say which."""
    for algo in re.findall(r"override /algorithm: (\w+)", (CONF / "experiment" / f"{experiment}.yaml").read_text()):
        if not (CONF / "algorithm" / f"{algo}.yaml").exists():
            pytest.skip(f"conf/algorithm/{algo}.yaml is not in this tree")


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_preset_composes(hydra_compose, experiment):
    skip_without_its_algorithm(experiment)
    run = to_run_config(hydra_compose([f"+experiment={experiment}"]))
    assert run.model.lora.rank > 0


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiment_presets_hold_deltas_only(hydra_compose, experiment):
    """Every value an experiment preset sets differs from what its defaults list (backend,
    model, data, algorithm options) already gives: a repeated value could silently drift."""
    skip_without_its_algorithm(experiment)
    body = OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml")
    defaults = OmegaConf.to_container(body.pop("defaults"))
    groups = [
        f"{'+' if entry.startswith('/backend') else ''}{entry.lstrip('/').replace('override /', '').replace(': ', '=')}"
        for entry in (d if isinstance(d, str) else f"{next(iter(d))}: {next(iter(d.values()))}" for d in defaults)
        if entry != "_self_"
    ]
    base = _flat(resolved(hydra_compose(groups)))
    delta = _flat(OmegaConf.to_container(body))
    assert delta, f"{experiment} sets nothing beyond its defaults list"
    repeated = {k: v for k, v in delta.items() if base.get(k) == v}
    assert not repeated, f"{experiment} repeats values its defaults already give: {repeated}"


QWEN_PRESETS = [o for o in options("model") if o.startswith("qwen") and not o.endswith("_tiny")]


@pytest.mark.parametrize("model", QWEN_PRESETS)
def test_qwen_model_presets_are_the_shared_base_plus_size_dependent_keys(model):
    """A model preset holds what depends on the model: its path and (for the sizes that need it)
    activation checkpointing; how it trains sits in conf/tuning/model/<model>.yaml."""
    body = OmegaConf.load(CONF / "model" / f"{model}.yaml")
    assert list(body.pop("defaults")) == ["/model_base/qwen_lora", "_self_"]
    keys = set(_flat(OmegaConf.to_container(body)))
    assert {k for k in keys if not k.startswith("model.lora.")} <= {"model.path", "model.enable_gradient_checkpointing"}
    tuning = OmegaConf.load(CONF / "tuning" / "model" / f"{model}.yaml")
    assert list(tuning.pop("defaults")) == ["qwen_lora", "_self_"]
    assert set(_flat(OmegaConf.to_container(tuning))) == {"actor.optim.lr", "actor.ppo_max_token_len_per_gpu"}


def _schema_values(schema: type, prefix: str = "") -> dict:
    """Every field of a schema dataclass (nested ones walked) that has a value other than MISSING."""
    out = {}
    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            out.update(_schema_values(f.default_factory, f"{prefix}{f.name}."))
        elif f.default_factory is not dataclasses.MISSING or f.default != "???":
            out[f"{prefix}{f.name}"] = f.default
    return out


def test_schemas_hold_no_values_the_yaml_holds_them_all(hydra_compose):
    """One source of defaults: a value written in a schema (lorarl.config.schema) competes with its YAML
    group; every schema key is MISSING there, and the default composition sets every one."""
    from lorarl.config.backends import FSDPBackendConfig as F
    from lorarl.config.backends import MegatronBackendConfig as M
    from lorarl.config.schema import GRPOConfig

    for schema in (GRPOConfig, F, M):
        valued = _schema_values(schema)
        assert not valued, f"{schema.__name__} carries values that belong in conf/: {valued}"
    for backend in ("fsdp", "megatron"):
        cfg = hydra_compose([f"+backend={backend}"])
        unset = [k for k, v in _flat(OmegaConf.to_container(cfg, resolve=False)).items() if v == "???"]
        assert not unset, f"+backend={backend}: no YAML sets {unset}"


# Groups whose options write other groups' keys, and which ones: the algorithm is its loss, which
# lives under actor (verl's layout). Everything else writes only its own group.
CROSS_GROUP = {"algorithm": {"algorithm", "actor"}}


@pytest.mark.parametrize("group", ["model", "model_base", "data", "rollout", "algorithm", "reward", "backend"])
def test_each_group_writes_only_its_own_keys(group):
    for path in sorted((CONF / group).glob("*.yaml")):
        text = path.read_text()
        body = OmegaConf.load(path)
        body.pop("defaults", None)
        if "@package _global_" not in text:
            continue  # written into its own package by Hydra
        own = "model" if group == "model_base" else group
        written = set(body.keys())
        assert written <= CROSS_GROUP.get(group, {own}), f"{path} writes {sorted(written)}; keep to {own}"


def test_tiny_tuning_goes_with_the_tiny_model_on_the_sums_only(hydra_compose):
    """The default run's tuning (conf/tuning/task/qwen2_tiny_arith.yaml) applies to that pair only:
    the tiny model on other data is not capped at its 112 steps, nor sampled at its temperature."""
    default = hydra_compose(["+backend=fsdp"])
    assert default.trainer.total_steps == 112 and default.rollout.temperature == 0.8
    assert hydra_compose(["+backend=fsdp", "model=qwen3_tiny"]).trainer.total_steps == 112
    for overrides in (["data=gsm8k"], ["model=qwen3_tiny", "data=math_sample"]):
        other = hydra_compose(["+backend=fsdp", *overrides])
        assert other.trainer.total_steps is None and other.rollout.temperature == 1.0, overrides
    # The order of the defaults list no longer matters for it: a command-line value still wins.
    assert hydra_compose(["+backend=fsdp", "rollout.temperature=0.7"]).rollout.temperature == 0.7


def test_qwen_presets_micro_batch_by_a_budget_that_shrinks_with_size(hydra_compose):
    budget = {m: hydra_compose([f"model={m}"]).actor for m in QWEN_PRESETS}
    assert all(a.use_dynamic_bsz for a in budget.values())
    assert (
        budget["qwen2_5_0_5b_instruct"].ppo_max_token_len_per_gpu
        > budget["qwen2_5_7b_instruct"].ppo_max_token_len_per_gpu
    )


@pytest.mark.parametrize("model", ["qwen2_tiny", "qwen3_tiny"])
def test_embedded_models_name_their_builder(hydra_compose, model):
    run = to_run_config(hydra_compose(["+backend=fsdp", f"model={model}"]))
    assert run.model.builder == f"tiny_{model.split('_')[0]}" and run.model.path.endswith(f"/{model}")
    assert run.model.dtype == "float32" and run.model.lora.rank == 16 and run.actor.optim.lr == 1e-3


@pytest.mark.parametrize(
    "dead", ["algorithm.kl_coef=0.1", "algorithm.kl_penalty=k1", "data.val_batch_size=8", "rollout.name=vllm"]
)
def test_removed_keys_are_rejected(hydra_compose, dead):
    with pytest.raises(ConfigCompositionException) as err:
        hydra_compose(["+backend=fsdp", dead])
    assert dead.split("=")[0].split(".")[-1] in str(err.value.__cause__ or err.value)


def test_compose_gives_the_validated_run_config(hydra_compose):
    """config.compose is the command line's config: same as composing by hand, validated, and it
    leaves an initialised Hydra (this fixture's) as it found it."""
    from lorarl.config.compose import compose as compose_run

    overrides = ["+backend=fsdp", "model=qwen3_tiny", "rollout.n=4", "trainer.seed=3"]
    run = compose_run(overrides)
    assert run == to_run_config(hydra_compose(overrides))
    assert run.trainer.experiment_name == "qwen3_tiny_grpo_lora"  # ${hydra:runtime.choices.model}
    with pytest.raises(ConfigError, match="rollout.n"):
        compose_run(["+backend=fsdp", "rollout.n=1"])
    with pytest.raises(ConfigError, match=r"\+backend=fsdp"):
        compose_run([])
    with pytest.raises(ConfigCompositionException):
        compose_run(["+backend=fsdp", "model.lora.rnak=8"])
    assert to_run_config(hydra_compose(["+backend=megatron"])).backend.strategy == "megatron"  # still usable


def test_every_yaml_opens_with_a_runbook_comment():
    for path in CONF.rglob("*.yaml"):
        head = path.read_text().splitlines()[:3]
        assert head and head[0].startswith("#"), f"{path} must open with a comment saying what it is for"
        text = path.read_text()
        assert "Launch" in text or path.parent.name == "hydra" or "Used by" in text, f"{path}: say how to launch it"


def test_yaml_keys_match_schemas(hydra_compose):
    """A key in a YAML file that is missing from the schema, or the reverse, fails here."""
    cfg = hydra_compose(["+backend=fsdp"])
    keys = set(resolved(cfg).keys())
    assert keys == {"model", "data", "rollout", "actor", "algorithm", "trainer", "backend", "reward"}


def test_user_facing_key_spellings(hydra_compose):
    cfg = resolved(hydra_compose(["+backend=fsdp"]))
    spelled = {
        "model": ["path", "lora"],
        "data": [
            "train_files",
            "val_files",
            "train_batch_size",
            "max_prompt_length",
            "max_response_length",
            "filter_overlong_prompts",
            "truncation",
            "shuffle",
        ],
        "rollout": [
            "n",
            "temperature",
            "top_p",
            "gpu_memory_utilization",
            "tensor_model_parallel_size",
            "load_format",
            "layered_summon",
            "enforce_eager",
            "n_workers",
        ],
        "actor": [
            "optim",
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "ppo_epochs",
            "clip_ratio",
            "entropy_coeff",
            "use_kl_loss",
            "kl_loss_coef",
            "kl_loss_type",
            "loss_agg_mode",
            "grad_clip",
        ],
        "algorithm": ["adv_estimator", "norm_adv_by_std_in_grpo", "use_kl_in_reward"],
        "trainer": [
            "total_epochs",
            "total_steps",
            "save_freq",
            "test_freq",
            "val_before_train",
            "logger",
            "project_name",
            "experiment_name",
            "nnodes",
            "n_gpus_per_node",
            "device",
            "seed",
            "placement",
        ],
    }
    for group, keys in spelled.items():
        for key in keys:
            assert key in cfg[group], f"{group}.{key}"
    assert set(cfg["model"]["lora"]) >= {"rank", "alpha", "target_modules", "dropout"}
    assert "lr" in cfg["actor"]["optim"]


def test_typo_in_key_names_the_key(hydra_compose):
    with pytest.raises(ConfigCompositionException) as err:
        hydra_compose(["+backend=fsdp", "model.lora.rnak=8"])
    assert "rnak" in str(err.value.__cause__ or err.value)


def test_unknown_keys_added_with_plus_fail_naming_each(hydra_compose):
    """Hydra refuses `key=value` for a key no schema has, but `+key=value` adds it; a misspelt key
    must fail, not be ignored. One line names each unknown key (top-level, in a group, nested two
    deep) with the keys it may have meant."""
    cfg = hydra_compose(
        [
            "+backend=fsdp",
            "+trainer.nonsense_key=1",
            "+actor.optim.lr_warmup=3",
            "+algorithm.rollout_correction.rollout_is_treshold=2.0",
            "+trainr.total_steps=3",
        ]
    )
    with pytest.raises(ConfigError) as err:
        to_run_config(cfg)
    message = str(err.value)
    assert "\n" not in message and message.startswith("unknown config keys ")
    assert re.search(r"trainer\.nonsense_key(,|:)", message)  # nothing close: named alone
    assert "actor.optim.lr_warmup (did you mean actor.optim.warmup_steps?)" in message
    assert (
        "algorithm.rollout_correction.rollout_is_treshold (did you mean "
        "algorithm.rollout_correction.rollout_is_threshold" in message
    )
    assert "trainr (did you mean trainer?)" in message
    with pytest.raises(ConfigError, match=r"^unknown config key trainer\.lr \(did you mean actor\.optim\.lr\?\)"):
        to_run_config(hydra_compose(["+backend=fsdp", "+trainer.lr=1e-5"]))


def test_pass_through_maps_take_any_key(hydra_compose):
    """vLLM's engine arguments and Megatron's TransformerConfig overrides are other programs' names:
    their maps stay open. trainer.sync_fault is a real key whose default is null (`+` sets it)."""
    run = to_run_config(
        hydra_compose(["+backend=fsdp", "+rollout.engine_kwargs.some_future_arg=1", "+trainer.sync_fault=scale_x2"])
    )
    assert run.rollout.engine_kwargs["some_future_arg"] == 1 and run.trainer.sync_fault == "scale_x2"
    run = to_run_config(hydra_compose(["+backend=megatron", "+backend.override_transformer_config.some_field=1"]))
    assert run.backend.override_transformer_config["some_field"] == 1


def test_wrong_type_names_the_key(hydra_compose):
    with pytest.raises(ConfigCompositionException) as err:
        hydra_compose(["+backend=fsdp", "model.lora.rank=eight"])
    text = str(err.value.__cause__ or err.value)
    assert "rank" in text


def test_backend_keys_are_typed(hydra_compose):
    with pytest.raises(ConfigCompositionException):
        hydra_compose(["+backend=fsdp", "backend.tensor_model_parallel_size=2"])
    run = to_run_config(
        hydra_compose(
            [
                "+backend=megatron",
                "backend.tensor_model_parallel_size=2",
                "trainer.n_gpus_per_node=2",
                "model.lora.rank=16",
            ]
        )
    )
    assert run.backend.tensor_model_parallel_size == 2


def test_missing_backend_is_one_line_naming_both(hydra_compose):
    with pytest.raises(ConfigError) as err:
        to_run_config(hydra_compose([]))
    assert "+backend=fsdp" in str(err.value) and "+backend=megatron" in str(err.value)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model.lora.rank=0"], "model.lora.rank"),
        (["model.lora.rank=1024"], "model.lora.rank"),
        (["rollout.n=1"], "rollout.n"),
        (["data.train_batch_size=6", "actor.ppo_mini_batch_size=4"], "data.train_batch_size"),
        (["actor.ppo_micro_batch_size_per_gpu=5"], "actor.ppo_micro_batch_size_per_gpu"),
        (["actor.log_prob_max_token_len_per_gpu=0"], "actor.log_prob_max_token_len_per_gpu"),
        (["rollout.layered_summon=true", "rollout.load_format=dummy"], "rollout.load_format"),
        (["model.lora.target_modules=[lm_head]"], "model.lora.target_modules"),
        (["model.lora.target_modules=[q_proj,embed_tokens]"], "model.lora.target_modules"),
        (["actor.kl_loss_type=k9"], "actor.kl_loss_type"),
        (["actor.loss_agg_mode=sum"], "actor.loss_agg_mode"),
        (["trainer.n_gpus_per_node=3"], "divide"),
        (
            ["rollout.tensor_model_parallel_size=2"],
            "rollout.tensor_model_parallel_size=2 must divide trainer.n_gpus_per_node=1",
        ),
        # Two workers, but on two nodes: one engine cannot span them.
        (
            ["rollout.tensor_model_parallel_size=2", "trainer.nnodes=2", "actor.ppo_micro_batch_size_per_gpu=8"],
            "one node",
        ),
        (["rollout.tensor_model_parallel_size=0"], "rollout.tensor_model_parallel_size=0 must be >= 1"),
        (["trainer.logger=[console,mlflow]"], "trainer.logger"),
        (["algorithm.use_kl_in_reward=true"], "algorithm.use_kl_in_reward"),
        (["trainer.check_sync_tolerance=0"], "trainer.check_sync_tolerance"),
        (["model.builder=tiny_llama"], "model.builder='tiny_llama' is not valid; use null or one of: tiny_qwen2"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["data.truncation=middle"], "data.truncation='middle' is not valid"),
        (["data.train_batch_size=0"], "data.train_batch_size=0 must be > 0"),
        (["data.max_prompt_length=0"], "data.max_prompt_length and data.max_response_length must be > 0"),
        (["rollout.adapter_transport=pipe"], "rollout.adapter_transport='pipe' is not valid"),
        (["data.train_files=[a.parquet,3]"], "data.train_files=['a.parquet', 3]: give one string or a list"),
    ],
)
def test_invalid_combinations_name_the_key(hydra_compose, overrides, needle):
    with pytest.raises(ConfigError) as err:
        to_run_config(hydra_compose(["+backend=fsdp", *overrides]))
    msg = str(err.value)
    assert needle in msg and "\n" not in msg


def test_list_keys_take_one_string_as_verl_does(hydra_compose):
    """verl's launches write data.train_files=$HOME/data/gsm8k/train.parquet, target_modules=all-linear."""
    run = to_run_config(
        hydra_compose(
            [
                "+backend=fsdp",
                "data=gsm8k",
                "data.train_files=/data/gsm8k/train.parquet",
                "data.val_files=[/data/gsm8k/test.parquet,/data/math/test.parquet]",
                "model.lora.target_modules=all-linear",
                "trainer.logger=console",
            ]
        )
    )
    assert run.data.train_files == ["/data/gsm8k/train.parquet"]
    assert run.data.val_files == ["/data/gsm8k/test.parquet", "/data/math/test.parquet"]
    assert run.model.lora.target_modules == ["all-linear"]
    assert run.trainer.logger == ["console"]


def test_rollout_tensor_parallel_groups_of_one_node(hydra_compose):
    run = to_run_config(
        hydra_compose(
            [
                "+backend=fsdp",
                "rollout.tensor_model_parallel_size=2",
                "trainer.nnodes=2",
                "trainer.n_gpus_per_node=4",
                "actor.ppo_micro_batch_size_per_gpu=4",
            ]
        )
    )
    assert run.rollout.tensor_model_parallel_size == 2 and run.world_size == 8


def test_megatron_checks(hydra_compose):
    with pytest.raises(ConfigError, match="backend.tensor_model_parallel_size"):
        to_run_config(
            hydra_compose(["+backend=megatron", "backend.tensor_model_parallel_size=2", "model.lora.rank=15"])
        )
    with pytest.raises(ConfigError, match="backend.bridge=mbridge is not supported"):
        to_run_config(hydra_compose(["+backend=megatron", "backend.bridge=mbridge", "model.lora.merge=true"]))
    # Tensor-parallel ranks share a replica: batch sizes divide over replicas, not devices.
    run = to_run_config(
        hydra_compose(
            [
                "+backend=megatron",
                "backend.tensor_model_parallel_size=2",
                "trainer.n_gpus_per_node=2",
                "data.train_batch_size=3",
                "actor.ppo_mini_batch_size=3",
                "actor.ppo_micro_batch_size_per_gpu=3",
            ]
        )
    )
    assert run.data.train_batch_size == 3
    with pytest.raises(ConfigError, match="data-parallel replicas"):
        to_run_config(
            hydra_compose(
                [
                    "+backend=megatron",
                    "backend.tensor_model_parallel_size=2",
                    "trainer.n_gpus_per_node=4",
                    "data.train_batch_size=3",
                    "actor.ppo_mini_batch_size=3",
                ]
            )
        )


def run_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "recipes.grpo", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_cli_prints_composed_config():
    out = run_cli("--cfg", "job", "+backend=fsdp")
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.backend.strategy == "fsdp2" and cfg.model.lora.rank == 16


def test_cli_without_backend_fails_with_one_line(tmp_path):
    out = run_cli(f"hydra.run.dir={tmp_path}/run")
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert "+backend=fsdp" in last and "+backend=megatron" in last
    assert "Traceback" not in out.stderr


def test_cli_unknown_key_fails_before_anything_starts(tmp_path):
    out = run_cli("+backend=fsdp", "+trainer.nonsense_key=1", f"hydra.run.dir={tmp_path}/run")
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: unknown config key trainer.nonsense_key: no schema defines it; fix the spelling or "
                      "drop the + override (the YAML files under conf/ show every key)"]  # fmt: skip
    assert "Traceback" not in out.stderr
    # Only Hydra's own record of the command line; no step, log or checkpoint was written.
    assert {p.name for p in (tmp_path / "run").iterdir()} <= {".hydra", "grpo.log"}


def test_layered_summon_is_an_fsdp_gather(hydra_compose):
    """The Megatron engine exports through its bridge; a layered gather it cannot do is refused."""
    with pytest.raises(ConfigError, match=r"rollout\.layered_summon=true gathers the adapter one FSDP unit"):
        to_run_config(hydra_compose(["+backend=megatron", "rollout.layered_summon=true"]))
    assert to_run_config(hydra_compose(["+backend=fsdp", "rollout.layered_summon=true"])).rollout.layered_summon
