"""verl's defaults and derived values carried into a translation.

After the script's own keys are mapped, what verl would have done with the rest is stated:
each mapped key left unset gets verl's default where lorarl's composed value differs (unless
recipes.from_verl.defaults.DELIBERATE says why not), and values verl derives from others are
derived the same way (GSPO's loss aggregation, Megatron's sequence parallelism, the global
micro-batch size).
"""

from __future__ import annotations

from omegaconf import OmegaConf

from recipes.from_verl.defaults import DELIBERATE, default_of
from recipes.from_verl.errors import VerlTranslationError
from recipes.from_verl.keys import VERL_KEYS, A, verl_row
from recipes.from_verl.result import Difference, Translation, parsed, render, same

SP, TP, PP = (A + "actor.megatron." + k for k in ("sequence_parallel", "tensor_model_parallel_size",
                                                  "pipeline_model_parallel_size"))  # fmt: skip
MICRO = A + "actor.ppo_micro_batch_size"
GSPO_AGG = "seq-mean-token-mean"


def derived_values() -> frozenset[str]:
    """verl keys whose lorarl value is derived here rather than mapped as written."""
    return frozenset(
        {
            SP,
            MICRO,
            A + "actor.optim.lr_warmup_steps_ratio",
            "custom_reward_function.path",
            "custom_reward_function.name",
        }
    )


def effective(values: dict[str, str], key: str, defaults: dict):
    """The value verl runs with: the script's, else verl's default."""
    return parsed(values[key]) if key in values else defaults.get(key)


def whole(values: dict[str, str], key: str, defaults: dict) -> int:
    """An integer setting as verl runs it (null: 1, verl's meaning for a parallel size)."""
    value = effective(values, key, defaults)
    try:
        return 1 if value is None else int(value)
    except (TypeError, ValueError):
        raise VerlTranslationError(f"{key}={values.get(key, value)}: not a whole number") from None


class Overrides(dict):
    """lorarl key -> value, in order; `+backend=...`-style heads keep their place."""

    @classmethod
    def of(cls, overrides: list[str]) -> Overrides:
        return cls(o.split("=", 1) for o in overrides)

    def as_list(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.items()]


def derive(out: Overrides, values: dict[str, str], backend: str, defaults: dict, result: Translation) -> set[str]:
    """The values verl computes from others; returns the verl keys whose default does not apply."""
    unused = set()
    if effective(values, A + "actor.policy_loss.loss_mode", defaults) == "gspo":
        unused.add(A + "actor.clip_ratio_c")
        if "actor.clip_ratio_c" in out:
            del out["actor.clip_ratio_c"]
            result.ignored.append(
                (A + "actor.clip_ratio_c", values[A + "actor.clip_ratio_c"], "verl's GSPO loss ignores it")
            )
        agg = effective(values, A + "actor.loss_agg_mode", defaults)
        out["actor.loss_agg_mode"] = GSPO_AGG
        if agg != GSPO_AGG:
            result.differences.append(Difference(A + "actor.loss_agg_mode", str(agg), "actor.loss_agg_mode", GSPO_AGG,
                                                 "verl's GSPO loss aggregates seq-mean-token-mean whatever this says"))  # fmt: skip
    if backend == "megatron":
        sp = bool(effective(values, SP, defaults)) and whole(values, TP, defaults) > 1
        out["backend.sequence_parallel"] = render(sp)
        if sp:
            out["backend.transformer_impl"] = "transformer_engine"
            result.notes.append("sequence parallelism (verl's default with tensor parallel > 1) needs Transformer "
                                "Engine layers: backend.transformer_impl=transformer_engine")  # fmt: skip
    if MICRO in values and parsed(values[MICRO]) is not None and "actor.ppo_micro_batch_size_per_gpu" not in out:
        world = whole(values, "trainer.nnodes", defaults) * whole(values, "trainer.n_gpus_per_node", defaults)
        split = whole(values, TP, defaults) * whole(values, PP, defaults) if backend == "megatron" else 1
        dp = max(1, world // split)
        per_gpu = max(1, whole(values, MICRO, defaults) // dp)
        out["actor.ppo_micro_batch_size_per_gpu"] = str(per_gpu)
        result.notes.append(f"{MICRO}={values[MICRO]} is global: {per_gpu} per GPU over {dp} data-parallel replicas")
    for key in (A + "actor.ulysses_sequence_parallel_size", A + "actor.megatron.context_parallel_size",
                A + "actor.megatron.override_transformer_config.context_parallel_size"):  # fmt: skip
        if key in values and whole(values, key, defaults) > 1:
            result.splits[key] = whole(values, key, defaults)
            result.differences.append(Difference(key, values[key], "-", "1", verl_row(key)[0].note))
            result.notes.append(f"{key}={values[key]}: lorarl has no sequence splitting, so each device holds "
                                f"whole sequences and its activation memory is about {values[key]}x verl's")  # fmt: skip
    return unused


def composed(overrides: list[str]):
    from lorarl.config.compose import compose_values

    try:
        return compose_values(overrides)
    except Exception as err:  # Hydra's own errors (a value of the wrong type, a missing preset)
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise VerlTranslationError(f"the translated command does not compose: {line}") from None


def carry_defaults(
    overrides: list[str], values: dict[str, str], backend: str, defaults: dict, result: Translation
) -> list[str]:
    """`overrides` with verl's defaults stated where lorarl's differ; records each difference kept."""
    out = Overrides.of(overrides)
    unused = derive(out, values, backend, defaults, result)
    set_by_script = {verl_row(k)[1] for k in values}
    cfg = composed(out.as_list())
    for row in VERL_KEYS:
        known, default = default_of(row, backend, defaults)
        if (
            not known
            or row.verl in unused
            or row.verl in derived_values()
            or row.to in (None, "+backend")
            or row.to in set_by_script
            or row.to in out
            or row.verl in values
        ):
            continue
        if row.convert or row.values:
            default = parsed(
                row.convert(render(default)) if row.convert else row.values.get(render(default), render(default))
            )
        ours = OmegaConf.select(cfg, row.to.lstrip("+"), default=None)
        ours = OmegaConf.to_container(ours) if OmegaConf.is_config(ours) else ours
        if same(ours, default):
            continue
        if row.verl in DELIBERATE:
            result.differences.append(Difference(row.verl, render(default), row.to, render(ours), DELIBERATE[row.verl]))
            continue
        out[row.to] = render(default)
        result.carried.append((row.verl, f"{row.to}={render(default)}"))
    return out.as_list()
