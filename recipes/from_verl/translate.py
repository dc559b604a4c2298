"""verl's trainer arguments -> the lorarl overrides that train the same way.

The translation starts from verl's defaults (recipes.from_verl.defaults) and collects every
problem it finds (refused values, full fine-tuning, the model preset, keys of no verl release)
before raising them together, the decisive ones first (recipes.from_verl.errors.Problems).
"""

from __future__ import annotations

from recipes.from_verl.carry import carry_defaults, derived_values
from recipes.from_verl.defaults import DELIBERATE, default_of, defaults_for
from recipes.from_verl.errors import Problems
from recipes.from_verl.keys import VERL_KEYS, A, Key, verl_row
from recipes.from_verl.models import model_preset, preset_names
from recipes.from_verl.reading import read_args
from recipes.from_verl.result import Difference, Translation, parsed, render, same
from recipes.from_verl.reward_file import reward_file

RANK_KEYS = (A + "model.lora_rank", A + "model.lora.rank")
FULL_FT_LR = 5e-6  # below this a learning rate is a full fine-tune's; LoRA trains at ~1e-5 and up
# lorarl keys that several verl keys set, where the smaller value keeps within every budget.
SMALLER_WINS = ("actor.log_prob_max_token_len_per_gpu",)


def accepted(row: Key, key: str, value, unset: bool, problems: Problems) -> bool:
    """Whether `value` (a string as written, or verl's default when `unset`) is one lorarl takes."""
    allowed = row.only or tuple(row.values)
    if not allowed:
        return True
    if any(same(parsed(a), value if unset else parsed(value)) or a == value for a in allowed):
        return True
    said = f"{key} unset means verl's default {render(value)}" if unset else f"{key}={value}"
    verb = "lorarl supports only" if row.only else "use one of"
    line = f"{said}: {verb} {' or '.join(allowed)}" + (f" ({row.note})" if row.note else "")
    (problems.decisive if row.decisive else problems.keys).append(line)
    return False


def translate(
    args: list[str],
    model: str | None = None,
    data: str | None = None,
    lora_rank: int | None = None,
    module: str = "verl.trainer.main_ppo",
) -> Translation:
    """lorarl overrides for the arguments of verl's `module` (its --config-name picks the backend;
    a DAPO module starts from verl-recipe's DAPO defaults)."""

    problems = Problems()
    backend, values, notes = read_args(args, problems)
    result = Translation([], [], notes=notes, backend=backend)
    defaults = defaults_for(backend, dapo="dapo" in module)
    mapped = map_values(values, backend, result, problems)
    check_lora(values, defaults, backend, lora_rank, mapped, result, problems)
    warmup_from_ratio(values, mapped, result, problems)
    reward_file(values, mapped, result, problems)
    head = [f"+backend={backend}"]
    head += model_choice(values, model, problems)
    if data or "data.train_files" in values:
        head.append(f"data={data or data_preset(values['data.train_files'])}")
    for row in VERL_KEYS:
        known, default = default_of(row, backend, defaults)
        if known and row.verl not in values and row.only and default != "???" and row.verl not in DELIBERATE:
            accepted(row, row.verl, default, True, problems)
    problems.raise_any()
    overrides = head + [f"{k}={v}" for k, (v, _) in mapped.items()]
    result.overrides = carry_defaults(overrides, values, backend, defaults, result)
    return result


def map_values(values: dict[str, str], backend: str, result: Translation, problems: Problems) -> dict:
    """{lorarl key: (value, the verl key it came from)} of the launch's accepted keys; ignored keys
    go to `result`, refused ones to `problems`."""
    mapped: dict[str, tuple[str, str]] = {}
    for key, value in values.items():
        row, to = verl_row(key)
        if not accepted(row, key, value, False, problems):
            continue
        if to is None:
            result.ignored.append((key, value, row.note))
            continue
        if value.strip() == "":
            continue  # read_args named it
        try:
            value = row.convert(value) if row.convert else row.values.get(value, value)
        except (TypeError, ValueError):
            problems.append(f"{key}={value}: not a value this key takes ({row.note})")
            continue
        if to == "+backend" or key in derived_values():
            continue
        if not backend_has(backend, to):
            result.ignored.append((key, value, f"not a setting of +backend={backend}"))
            continue
        if to in mapped and not same(parsed(mapped[to][0]), parsed(value)):
            value = one_value(to, mapped[to], key, value, problems)
            if value is None:
                continue
        mapped[to] = (value, key)
    return mapped


def one_value(to: str, first: tuple[str, str], key: str, value: str, problems: Problems) -> str | None:
    """The value of lorarl key `to` that two verl keys set differently: the smaller of two budgets
    (SMALLER_WINS), else None with the problem named."""
    if to in SMALLER_WINS:
        try:
            return str(min(int(parsed(first[0])), int(parsed(value))))
        except (TypeError, ValueError):
            problems.append(f"{first[1]}={first[0]} and {key}={value} set {to}: give whole numbers")
            return None
    problems.append(f"{first[1]} and {key} both set {to} but differ; give them one value")
    return None


def warmup_from_ratio(values, mapped, result: Translation, problems: Problems) -> None:
    """verl warms up for int(ratio x total steps) when lr_warmup_steps is unset (-1); lorarl counts
    warmup in steps, so the ratio needs trainer.total_training_steps to become one."""
    key, steps_key = A + "actor.optim.lr_warmup_steps_ratio", A + "actor.optim.lr_warmup_steps"
    ratio = float(parsed(values[key])) if key in values else 0.0
    if not ratio or parsed(values.get(steps_key, "-1")) not in (-1, None):
        return
    total = values.get("trainer.total_training_steps")
    if total is None or parsed(total) is None:
        problems.append(
            f"{key}={values[key]}: warmup is counted in steps here and the run's total is not in the launch; "
            "set actor_rollout_ref.actor.optim.lr_warmup_steps (ratio x total steps) or trainer.total_training_steps"
        )
        return
    steps = int(ratio * int(parsed(total)))
    mapped["actor.optim.warmup_steps"] = (str(steps), key)
    result.notes.append(f"{key}={values[key]} of trainer.total_training_steps={total}: {steps} warmup steps")


def backend_has(backend: str, to: str) -> bool:
    """Whether a lorarl key outside `backend.` or a field of the chosen backend's schema."""
    from dataclasses import fields

    from lorarl.config.backends import FSDPBackendConfig, MegatronBackendConfig

    if not to.lstrip("+").startswith("backend."):
        return True
    schema = MegatronBackendConfig if backend == "megatron" else FSDPBackendConfig
    return to.lstrip("+").split(".")[1] in {f.name for f in fields(schema)}


def check_lora(values, defaults, backend, lora_rank, mapped, result: Translation, problems: Problems) -> None:
    """Full fine-tuning (no LoRA rank, or 0) is refused unless --lora-rank opts in; a learning rate
    that looks like a full fine-tune's gets a warning."""
    rank_key = RANK_KEYS[1] if backend == "megatron" and RANK_KEYS[1] in values else RANK_KEYS[0]
    given = next((values[k] for k in RANK_KEYS if k in values), None)
    rank = parsed(given) if given is not None else 0
    lr_written = values.get(A + "actor.optim.lr")
    lr = parsed(lr_written) if lr_written is not None else defaults[A + "actor.optim.lr"]
    if lora_rank is not None:
        mapped["model.lora.rank"] = (str(lora_rank), "--lora-rank")
        rank = lora_rank
    elif not rank:
        unset = "unset, verl's default 0" if given is None else given
        problems.decisive.append(
            f"{rank_key}={unset}: this launch fine-tunes every weight, and lorarl trains LoRA adapters only; "
            "pass --lora-rank R (e.g. --lora-rank 64) to translate it as a LoRA run"
        )
    if isinstance(lr, (int, float)) and lr < FULL_FT_LR:
        written = "" if lr_written is not None else " (verl's default)"
        result.warnings.append(
            f"{A}actor.optim.lr={lr}{written} is a full-fine-tuning learning rate; LoRA usually trains at "
            "about 10x that (e.g. -- actor.optim.lr=1e-5)"
        )


def model_choice(values: dict[str, str], model: str | None, problems: Problems) -> list[str]:
    if model:
        return [f"model={model}"]
    path = values.get(A + "model.path")
    if path is None:
        return []
    preset, _ = model_preset(path)
    if preset is None:
        problems.decisive.append(
            f"{A}model.path={path}: not a Qwen2 / Qwen2.5 / Qwen3 checkpoint a conf/model preset trains; "
            f"pass --model with one of {', '.join(preset_names())}"
        )
        return []
    return [f"model={preset}"]


def data_preset(train_files: str) -> str:
    return "math" if "math" in train_files.lower() else "gsm8k"


__all__ = ["Translation", "Difference", "translate", "parsed", "render", "DELIBERATE"]
