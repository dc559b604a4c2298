"""`--check`: the translated command through lorarl's own validation and the start-up checks
that need no GPU, and a table of every key whose lorarl value means something else than verl's."""

from __future__ import annotations

import os

from recipes.from_verl.result import Translation


def difference_table(result: Translation) -> str:
    rows = [("verl key", "verl value", "lorarl key", "lorarl value", "why")]
    rows += [(d.verl, d.verl_value, d.lorarl, d.lorarl_value, d.why) for d in result.differences]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows[:1] + [("---",) * 5] + rows[1:])


def local_hf_config(path: str, trust_remote_code: bool):
    """The model's HF config when this machine has it (a folder or the HF cache), else None."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            os.path.expanduser(path), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError):
        return None


def split_costs(run, hf, splits: dict[str, int]) -> list[str]:
    """What holding whole sequences costs where verl split them: lorarl's estimate of the
    update's peak on one device (lorarl.memory), of which verl's split holds about 1/N of the
    activations."""
    from lorarl.driver.prepare import run_update_bytes
    from lorarl.rollout.memory import GIB, ModelDims

    mp = run.backend.model_parallel_size()
    need = run_update_bytes(run, ModelDims.of(hf), max(1, run.world_size // mp), mp)
    return [
        f"memory: {key}={n} is not used; the update's estimated peak on one device is {need / GIB:.1f} GiB "
        f"with whole sequences, where verl's split over {n} devices holds about 1/{n} of the activations"
        for key, n in splits.items()
    ]


def reward_check(reward_fn: str) -> str:
    """data.reward_fn loads as training will load it: a reward file runs (as verl runs it)."""
    from lorarl.rewards.custom import load_function

    spec, _ = load_function(reward_fn)
    return f"data.reward_fn: {spec.where} loads and defines {spec.name}"


def run_checks(overrides: list[str], splits: dict[str, int] | None = None) -> list[str]:
    """lorarl's validation of `overrides`, then its model-shape and vLLM-argument checks where
    they can run here, and the cost of verl's sequence `splits`. Returns what was checked, one
    line each; raises LorarlError on a problem."""
    from lorarl.config.compose import compose
    from lorarl.config.validate import check_model_shape_of
    from lorarl.driver.preflight import check_engine_kwargs

    run = compose(overrides)
    done = ["lorarl's config validation (every group's checks and the cross-group ones)"]
    check_engine_kwargs(run)
    done.append("rollout.engine_kwargs against the installed vLLM's engine arguments")
    if run.data.reward_fn:
        done.append(reward_check(run.data.reward_fn))
    hf = local_hf_config(run.model.path, run.model.trust_remote_code)
    if hf is None:
        done.append(f"model shape checks skipped: {run.model.path} is not on this machine")
        done += [
            f"memory: {key}={n} is not used; its cost needs the model's config" for key, n in (splits or {}).items()
        ]
        return done
    check_model_shape_of(run, hf)
    done.append("parallel sizes against the model's heads, layers, vocabulary and experts")
    return done + split_costs(run, hf, splits or {})
