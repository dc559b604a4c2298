"""The command line: translate, print, and optionally check or run the lorarl command.

stdout: the lorarl command (and with --check, the checks passed and the table of differences);
stderr: each ignored verl key with its reason, notes, warnings, and `error:` lines (exit 2),
every problem of a launch at once.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

import recipes.from_verl as package
from recipes.from_verl.errors import VerlTranslationError
from recipes.from_verl.launch import check_module, script_launch
from recipes.from_verl.translate import translate

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipes.from_verl", description=package.__doc__.split("\n")[0])
    p.add_argument("--run", action="store_true", help="run the lorarl command")
    p.add_argument(
        "--check",
        action="store_true",
        help="run lorarl's validation and the start-up checks that need no GPU on the command, and print "
        "the keys whose lorarl value differs from verl's",
    )
    p.add_argument("--model", help="conf/model preset, for a model outside the Qwen2/Qwen2.5/Qwen3 families")
    p.add_argument("--data", help="conf/data preset (default: math when a train file names math, else gsm8k)")
    p.add_argument("--lora-rank", type=int, help="train a LoRA of this rank where the verl launch fine-tunes fully")
    p.add_argument("verl", nargs="+", help="verl overrides, or one verl launch script (.sh)")
    return p


def verl_launch(given: list[str]) -> tuple[str, list[str]]:
    """(verl module, its arguments) of a launch script, or of overrides given directly."""
    if len(given) == 1 and given[0].endswith(".sh"):
        launch = script_launch(Path(given[0]))
        check_module(launch.module)
        return launch.module, launch.args
    return "verl.trainer.main_ppo", given


def check(cmd: list[str], result) -> int:
    from lorarl.errors import LorarlError
    from recipes.from_verl.check import difference_table, run_checks

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print("# keys whose lorarl value differs from verl's:")
    print(difference_table(result))
    try:
        done = run_checks(cmd[3:], result.splits)
    except LorarlError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for line in done:
        print(f"# checked: {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ns = parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    try:
        module, args = verl_launch(ns.verl)
        result = translate(args, model=ns.model, data=ns.data, lora_rank=ns.lora_rank, module=module)
    except VerlTranslationError as err:
        for problem in err.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    for key, value, reason in result.ignored:
        print(f"# ignored {key}={value}: {reason}", file=sys.stderr)
    for key, override in result.carried:
        print(f"# verl's default for {key}: {override}", file=sys.stderr)
    for note in result.notes:
        print(f"# note: {note}", file=sys.stderr)
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    cmd = result.command() + extra
    print(shlex.join(["python", *cmd[1:]]))
    if ns.check:
        return check(cmd, result)
    if ns.run:
        return subprocess.run(cmd, cwd=ROOT).returncode
    return 0
