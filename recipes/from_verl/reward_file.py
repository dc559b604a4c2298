"""verl's custom_reward_function.path and .name -> lorarl's data.reward_fn.

verl loads the file at `path` (a plain or `file://` path, or a `pkg://` module) and calls the
function `name` (default compute_score) by keyword for every sample; lorarl's data.reward_fn
takes the same file and calls the function the same way (lorarl.rewards.custom). A relative
path is made absolute against the folder the translation runs in, where the user would have
started verl: `--run` starts lorarl elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from recipes.from_verl.errors import Problems
from recipes.from_verl.result import Translation, parsed, render

PATH, NAME = "custom_reward_function.path", "custom_reward_function.name"
DEFAULT_NAME = "compute_score"  # verl's default for custom_reward_function.name
FILE_PREFIX, PKG_PREFIX = "file://", "pkg://"


def reward_target(path: str) -> tuple[str, Path | None]:
    """(what data.reward_fn names before `:NAME`, the file to check or None for a module)."""
    if path.startswith(PKG_PREFIX):
        return path[len(PKG_PREFIX) :].replace("/", "."), None
    file = Path(path.removeprefix(FILE_PREFIX)).expanduser().absolute()
    return str(file), file


def reward_file(values: dict[str, str], mapped: dict, result: Translation, problems: Problems) -> None:
    """Maps the two keys onto data.reward_fn=TARGET:NAME; a missing file is a problem."""
    path = parsed(values[PATH]) if PATH in values else None
    name = parsed(values[NAME]) if NAME in values else None
    if path in (None, ""):
        if name not in (None, DEFAULT_NAME):
            result.ignored.append((NAME, values[NAME], f"used only with {PATH}, which the launch leaves unset"))
        return
    name = str(name or DEFAULT_NAME)
    target, file = reward_target(str(path))
    if file is not None and not file.is_file():
        problems.append(
            f"{PATH}={values[PATH]}: no file {file} (a relative path is read from {Path.cwd()}, where verl would "
            "start); give the reward file's path or run the translation from verl's folder"
        )
        return
    mapped["data.reward_fn"] = (render(f"{target}:{name}"), PATH)
    result.notes.append(
        f"{PATH}={values[PATH]}: data.reward_fn={target}:{name}; lorarl runs the file and calls {name}(data_source=, "
        "solution_str=, ground_truth=, extra_info=) for every sample, as verl does"
    )
