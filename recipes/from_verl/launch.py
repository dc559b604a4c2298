"""The arguments a verl launch script passes to its trainer.

The script runs in bash inside an empty temporary folder with `python`, `python3`, `torchrun`,
`ray`, `srun` and `nohup` replaced by a recorder: variables, arrays and arithmetic expand as they would for
verl. The first call that runs a `-m <module>` of verl or verl-recipe (directly, or after
`ray job submit ... --` or `srun ...`) is recorded. Commands the script runs before it (conda, exports,
mkdir, nvidia-smi) cannot stop it: `conda` and `source activate` do nothing, a missing command
is skipped, and `set -e` failures are not fatal. Paths built from the temporary folder
(`$PWD`, `$(pwd)`) are given back as the folder the translation was started in.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from recipes.from_verl.errors import VerlTranslationError

# Entry points lorarl translates; others get a one-line reason.
GRPO_MODULES = ("verl.trainer.main_ppo", "recipe.dapo.main_dapo", "recipe.dapo.dapo_transfer_queue.main_dapo")
OTHER_MODULES = {
    "verl.trainer.fsdp_sft_trainer": "verl's SFT trainer; lorarl trains with GRPO only",
    "verl.trainer.sft_trainer": "verl's SFT trainer; lorarl trains with GRPO only",
    "verl.trainer.main_generation": "verl's offline generation; lorarl trains with GRPO only",
    "verl.trainer.main_eval": "verl's offline evaluation; lorarl trains with GRPO only",
}

SHIM = r"""
record() {
  local i=0 args=("$@")
  [[ -s "$RECORD" ]] && return 0
  for ((i = 0; i < ${#args[@]}; i++)); do
    if [[ "${args[i]}" == "-m" && ( "${args[i+1]}" == verl.* || "${args[i+1]}" == recipe.* ) ]]; then
      printf "%s\0" "${args[@]:i+1}" > "$RECORD"; return 0
    fi
  done
  return 0
}
python() { record "$@"; }
python3() { record "$@"; }
torchrun() { record "$@"; }
ray() { record "$@"; }
srun() { record "$@"; }
nohup() { record "$@"; }
conda() { return 0; }
nvidia-smi() { return 0; }
command_not_found_handle() { return 0; }
source() { [[ "$1" == activate || "$1" == */activate ]] && return 0; builtin source "$@"; }
set() { builtin set "$@"; builtin set +eu; }
builtin source "$SCRIPT"
"""


@dataclass
class Launch:
    module: str
    args: list[str]


def script_launch(script: Path, cwd: Path | None = None) -> Launch:
    """The module and arguments of the trainer call in a verl launch script."""
    if not script.is_file():
        raise VerlTranslationError(f"{script}: no such launch script")
    cwd = Path(cwd or os.getcwd())
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / ".verl_args"
        env = {**os.environ, "RECORD": str(record), "SCRIPT": str(script.resolve())}
        done = subprocess.run(
            ["bash", "-c", SHIM],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if not record.is_file():
            tail = [line for line in done.stderr.strip().splitlines() if not line.startswith("+")][-1:] or [""]
            raise VerlTranslationError(
                f"{script}: no `python3 -m verl...` or `-m recipe...` call ran (exit {done.returncode}"
                f"{': ' + tail[0] if tail[0] else ''}); pass its overrides instead"
            )
        argv = record.read_text().split("\0")[:-1]
        real = os.path.realpath(tmp)
        args = [a.replace(real, str(cwd)).replace(tmp, str(cwd)) for a in argv[1:]]
    return Launch(argv[0], args)


def check_module(module: str) -> None:
    if module in GRPO_MODULES:
        return
    why = OTHER_MODULES.get(module, "not a verl PPO/GRPO entry point")
    raise VerlTranslationError(f"-m {module}: {why}; lorarl translates {' / '.join(GRPO_MODULES[:2])} launches")
