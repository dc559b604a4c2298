"""No launch makes the translator raise anything but its own one-line refusal.

Every published verl and verl-recipe script of the committed corpus (recipes/verl_data/
script_keys.json: each script's module and keys) becomes a launch with verl's defaults as values,
then is mutated as scripts go wrong in the wild: lines duplicated with other values, reordered,
emptied, truncated, prefixed with `+`, `++` or `~`, given values Hydra's grammar refuses. The
launch scripts the other tests embed are mutated line by line and read by script_launch too.
Seeded per script, so a failure names a launch that fails again.
"""

from __future__ import annotations

import json
import random
import traceback
import zlib
from pathlib import Path

from lorarl.errors import LorarlError
from recipes.from_verl import VerlTranslationError, script_launch, translate
from recipes.from_verl.defaults import verl_defaults
from recipes.from_verl.launch import GRPO_MODULES
from recipes.from_verl.result import render
from tests.test_from_verl import FSDP_0_5B, MEGATRON_7B
from tests.test_from_verl_meaning import DAPO_SCRIPT, MEGATRON_LORA

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "recipes" / "verl_data" / "script_keys.json"
A = "actor_rollout_ref."
# Values a key may be given where verl's default is not known: plausible ones and broken ones.
VALUES = ["1", "0", "-1", "8", "0.5", "true", "False", "null", "abc", "''", "[1,2]", "{a: 1}", "['x', 'y']"]
BROKEN = ["[1,", "'open", "${", "{a:", "x=y=z", "(1", "\\", "]"]
# What makes a launch a LoRA GRPO run lorarl trains, so mutated launches reach the whole translation.
TRAINABLE = [A + "model.lora_rank=8", "algorithm.adv_estimator=grpo", A + "rollout.name=vllm"]


def corpus() -> list[tuple[str, str, list[str]]]:
    data = json.loads(CORPUS.read_text())
    return [
        (path, entry["module"], entry["keys"])
        for source in data.values()
        for path, entry in source["scripts"].items()
        if entry["module"] in GRPO_MODULES
    ]


def launch_lines(keys: list[str], rng: random.Random) -> list[str]:
    """key=value for each key: verl's default where it is a value (scripts set the others)."""
    defaults = {**verl_defaults()["megatron"], **verl_defaults()["fsdp"]}
    lines = []
    for key in keys:
        value = defaults.get(key.lstrip("+~"))
        # Most keys without a default are sizes: a whole number keeps more launches translatable.
        pick = rng.choice(["4"] * len(VALUES) + VALUES)
        lines.append(f"{key}={render(value) if value not in (None, '???') else pick}")
    return lines


def mutated(lines: list[str], rng: random.Random, rounds: int) -> list[str]:
    out = list(lines)
    for _ in range(rounds):
        if not out:
            break
        i = rng.randrange(len(out))
        key, _, value = out[i].partition("=")
        kind = rng.randrange(8)
        if kind == 0:
            out.insert(rng.randrange(len(out) + 1), f"{key}={rng.choice(VALUES)}")  # the key again
        elif kind == 1:
            rng.shuffle(out)
        elif kind == 2:
            out[i] = f"{key}="
        elif kind == 3:
            out[i] = out[i][: rng.randrange(len(out[i]) + 1)]
        elif kind == 4:
            out[i] = rng.choice(["+", "++", "~"]) + out[i]
        elif kind == 5:
            out[i] = f"{key}={rng.choice(BROKEN)}"
        elif kind == 6:
            del out[i]
        else:
            out[i] = f"{key}.{rng.choice(['x', '0', '_target_'])}={value}"  # a key under it
    return out


def attempt(args: list[str], failures: list[str], **kwargs) -> str:
    """Translate; a refusal (VerlTranslationError, one line per problem) is fine, anything else fails."""
    try:
        translate(args, **kwargs)
        return "translated"
    except VerlTranslationError as err:
        assert err.problems and all(p and "\n" not in p for p in err.problems), err.problems
        return "refused"
    except LorarlError:
        return "refused"
    except Exception:  # noqa: BLE001 - what the test exists to catch
        failures.append(f"{kwargs} {' '.join(args)}\n{traceback.format_exc(limit=-2)}")
        return "raised"


def test_mutated_published_scripts_never_raise_past_the_translator():
    failures, outcomes = [], {"translated": 0, "refused": 0, "raised": 0}
    for path, module, keys in corpus():
        rng = random.Random(zlib.crc32(path.encode()))
        lines = launch_lines(keys, rng)
        # A LoRA run of a Qwen preset with mild mutations reaches the defaults and the composed
        # config; the heavy ones test what reading and checking the keys survives.
        mild = mutated(lines, rng, rounds=2) + TRAINABLE
        outcomes[attempt(mild, failures, module=module, model="qwen2_5_0_5b_instruct")] += 1
        heavy = mutated(lines + TRAINABLE, rng, rounds=6)
        outcomes[attempt(heavy, failures, module=module, lora_rank=rng.choice([None, 16]))] += 1
    assert not failures, f"{len(failures)} launches raised past the translator:\n" + "\n".join(failures[:3])
    # Seeded: 26 translated and 288 refused; the floor keeps the mutations from only ever being refused.
    assert outcomes["translated"] >= 20 and outcomes["refused"] >= 100, outcomes


def test_mutated_launch_scripts_read_and_translate_or_refuse(tmp_path):
    failures, reached = [], 0
    for n, text in enumerate((FSDP_0_5B, MEGATRON_7B, DAPO_SCRIPT, MEGATRON_LORA)):
        rng = random.Random(n)
        lines = text.strip().splitlines()
        for k in range(6):
            script = tmp_path / f"launch_{n}_{k}.sh"
            script.write_text("\n".join(mutated(lines, rng, rounds=3)) + "\n")
            try:
                launch = script_launch(script)
            except VerlTranslationError as err:
                assert len(err.problems) == 1 and "\n" not in err.problems[0], err.problems
                continue
            attempt(launch.args, failures, module=launch.module)
            reached += 1
    assert not failures, "\n".join(failures[:3])
    assert reached >= 12  # seeded: 17 of the 24 mutated scripts still record a trainer call
