"""Composing the run config: conf/grpo.yaml through Hydra, into the validated RunConfig.

Importing this module registers the schemas in Hydra's ConfigStore (the YAML files name them in
their defaults lists), so it must be imported before Hydra composes: recipes/grpo.py does.
`compose` builds the config a command line would, for tests, benchmarks and tools.
"""

from __future__ import annotations

import os
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from lorarl.config.backends import FSDPBackendConfig, MegatronBackendConfig
from lorarl.config.run import GROUPS, RunConfig
from lorarl.config.schema import GRPOConfig, cache_dir
from lorarl.config.validate import check_known_keys, validate
from lorarl.errors import ConfigError

# src/lorarl/config/compose.py -> the repository's conf/.
CONF_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "conf"
)


def register_schemas() -> None:
    """Make the schemas visible to Hydra; the YAML files name them in their defaults lists."""
    if not OmegaConf.has_resolver("lorarl_cache"):
        OmegaConf.register_new_resolver("lorarl_cache", cache_dir)
    cs = ConfigStore.instance()
    cs.store(name="grpo_schema", node=GRPOConfig)
    cs.store(group="backend", name="fsdp_schema", node=FSDPBackendConfig)
    cs.store(group="backend", name="megatron_schema", node=MegatronBackendConfig)


register_schemas()


def load_group(schema: type, option: str, config_dir: str | None = None):
    """One group option (e.g. "reward/default") as its typed schema, for code that needs a group's
    values outside a run (a verl-style `compute_score` call, a test of one group)."""
    path = os.path.join(config_dir or CONF_DIR, f"{option}.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"{path} does not exist; name a file under conf/ (e.g. reward/default)")
    body = OmegaConf.load(path)
    body.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), body))


MISSING_BACKEND = (
    "no training backend chosen: add +backend=fsdp (FSDP2, CPU or GPU) or +backend=megatron (Megatron-core, GPU)"
)


# List-typed keys that verl also takes as one string (`data.train_files=train.parquet`,
# `target_modules=all-linear`, `trainer.logger=console`). Their schema type is Any so Hydra
# accepts both spellings; `as_string_lists` makes them lists of strings before anything reads them.
STRING_OR_LIST_KEYS = ("data.train_files", "data.val_files", "model.lora.target_modules", "trainer.logger")


def as_string_lists(obj: Any) -> None:
    """Turn each STRING_OR_LIST_KEYS value of a GRPOConfig object into a list of strings."""
    for key in STRING_OR_LIST_KEYS:
        section, *path, leaf = key.split(".")
        parent = getattr(obj, section)
        for name in path:
            parent = getattr(parent, name)
        value = getattr(parent, leaf)
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{key}={value!r}: give one string or a list of strings, e.g. {key}=[a,b]")
        setattr(parent, leaf, list(items))


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Typed config from a composed one, after the check for unknown keys, every group's own checks
    and the cross-group ones."""
    if "backend" not in cfg or OmegaConf.is_missing(cfg, "backend"):
        raise ConfigError(MISSING_BACKEND)
    obj = OmegaConf.to_object(cfg)
    check_known_keys(obj)
    as_string_lists(obj)
    run = RunConfig(**{k: getattr(obj, k) for k in GROUPS})
    validate(run)
    return run


def compose(overrides: list[str], config_dir: str | None = None) -> RunConfig:
    """The validated RunConfig that `python -m recipes.grpo <overrides>` would train with.

    Composes conf/grpo.yaml through Hydra's compose API (the same defaults lists, schemas and
    `${hydra:...}` interpolations as the command line), so tests, benchmarks and GPU scripts
    never build a RunConfig by hand. `config_dir` defaults to the repository's conf/. Any Hydra
    instance already initialised in this process is left as it was found.
    """
    return _compose(overrides, config_dir, to_run_config)


def compose_values(overrides: list[str], config_dir: str | None = None) -> DictConfig:
    """The composed config `compose` would validate, resolved, before any check: what each key
    would be, for tools that compare values (recipes.from_verl)."""

    def resolved(cfg: DictConfig) -> DictConfig:
        OmegaConf.resolve(cfg)
        return cfg

    return _compose(overrides, config_dir, resolved)


def _compose(overrides: list[str], config_dir: str | None, finish):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    config_dir = os.path.abspath(config_dir or CONF_DIR)
    if not os.path.isfile(os.path.join(config_dir, "grpo.yaml")):
        raise ConfigError(f"{config_dir} has no grpo.yaml; pass the repository's conf/ folder as config_dir")
    saved_hydra, saved_cfg = GlobalHydra.instance().hydra, HydraConfig.instance().cfg
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = hydra_compose("grpo", overrides=list(overrides), return_hydra_config=True)
            # `${hydra:runtime.choices.model}` (trainer.experiment_name) resolves against this.
            HydraConfig.instance().set_config(cfg)
            OmegaConf.set_readonly(cfg, False)
            with open_dict(cfg):
                del cfg["hydra"]
            return finish(cfg)
    finally:
        # initialize_config_dir swaps the GlobalHydra singleton on exit: ask for it again.
        GlobalHydra.instance().clear()
        if saved_hydra is not None:
            GlobalHydra.instance().initialize(saved_hydra)
        HydraConfig.instance().cfg = saved_cfg
