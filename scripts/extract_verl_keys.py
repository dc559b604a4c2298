"""Regenerate recipes/verl_data/ from checkouts of verl and verl-recipe.

python scripts/extract_verl_keys.py --verl path/to/verl --recipe path/to/verl-recipe

Writes two files, each naming the commit it was read from:
  verl_defaults.json  verl's trainer defaults, flat dotted key -> value, for the FSDP config
                      (verl/trainer/config/_generated_ppo_trainer.yaml) and the Megatron one
                      (_generated_ppo_megatron_trainer.yaml), interpolations resolved where
                      they resolve inside the file; and under "dapo", the keys verl-recipe's
                      DAPO configs (dapo/config/dapo_*trainer.yaml) set on top of those;
  script_keys.json    for every shell script under verl's examples/ and verl-recipe's dapo/:
                      the `-m` module it launches and the config keys it sets.
A checkout is a work tree or a bare git directory (read at HEAD). The keys are read from the
script text, not by running it: a key is a dotted word under one of verl's top-level config
sections followed by `=`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

from omegaconf import OmegaConf

OUT = Path(__file__).resolve().parents[1] / "recipes" / "verl_data"
CONFIGS = {
    "fsdp": "verl/trainer/config/_generated_ppo_trainer.yaml",
    "megatron": "verl/trainer/config/_generated_ppo_megatron_trainer.yaml",
}
DAPO_CONFIGS = {"fsdp": "dapo/config/dapo_trainer.yaml", "megatron": "dapo/config/dapo_megatron_trainer.yaml"}
TREES = {"verl": ("examples/",), "verl-recipe": ("dapo/",)}
MODULE = re.compile(r"-m\s+([A-Za-z_][\w.]*)")


def git(repo: Path, *args: str) -> str:
    gitdir = repo if (repo / "HEAD").is_file() and not (repo / ".git").exists() else repo / ".git"
    return subprocess.run(["git", f"--git-dir={gitdir}", *args], check=True, capture_output=True, text=True).stdout


def flatten(node, prefix: str = "") -> dict:
    out = {}
    for key in node:
        path = f"{prefix}{key}"
        try:
            value = node[key]
        except Exception:  # an interpolation that only resolves in a full verl run
            value = OmegaConf.to_container(node, resolve=False)[key]
        if OmegaConf.is_dict(value) and len(value):
            out.update(flatten(value, path + "."))
        else:
            out[path] = OmegaConf.to_container(value, resolve=False) if OmegaConf.is_config(value) else value
    return out


def defaults(verl: Path) -> dict:
    out = {}
    for backend, path in CONFIGS.items():
        cfg = OmegaConf.create(git(verl, "show", f"HEAD:{path}"))
        out[backend] = dict(sorted(flatten(cfg).items()))
    return out


def dapo_overlay(recipe: Path) -> dict:
    """The keys verl-recipe's DAPO configs set over verl's (their own body, not the defaults list)."""
    out = {}
    for backend, path in DAPO_CONFIGS.items():
        cfg = OmegaConf.create(git(recipe, "show", f"HEAD:{path}"))
        for key in ("hydra", "defaults"):
            cfg.pop(key, None)
        out[backend] = {k: v for k, v in sorted(flatten(cfg).items()) if not k.endswith("._target_")}
    return out


def script_keys(text: str, roots: set[str]) -> list[str]:
    body = re.sub(r"#[^\n'\"]*", "", text)  # comments (a `#` inside quotes stays)
    found = set()
    for match in re.finditer(r"(?<![\w.$/{-])[+~]{0,2}([A-Za-z_]\w*(?:\.[\w@-]+)+)=", body):
        key = match.group(1)
        if key.split(".")[0] in roots:
            found.add(key)
    return sorted(found)


def scripts(repo: Path, trees: tuple[str, ...], roots: set[str]) -> dict:
    out = {}
    for path in git(repo, "ls-tree", "-r", "HEAD", "--name-only").splitlines():
        if path.endswith(".sh") and path.startswith(trees):
            text = git(repo, "show", f"HEAD:{path}")
            module = MODULE.search(text)
            out[path] = {"module": module.group(1) if module else None, "keys": script_keys(text, roots)}
    return out


def one_script_a_line(keys: dict) -> str:
    """JSON with each script's entry on one line, so a diff shows which scripts changed."""
    parts = []
    for source, body in keys.items():
        head = json.dumps({k: v for k, v in body.items() if k != "scripts"})[:-1]
        lines = [f"  {json.dumps(path)}: {json.dumps(entry)}" for path, entry in body["scripts"].items()]
        parts.append(f'{json.dumps(source)}: {head}, "scripts": {{\n' + ",\n".join(lines) + "\n}}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verl", type=Path, required=True)
    parser.add_argument("--recipe", type=Path, required=True)
    ns = parser.parse_args()
    verl_commit = git(ns.verl, "rev-parse", "HEAD").strip()
    recipe_commit = git(ns.recipe, "rev-parse", "HEAD").strip()
    flat = defaults(ns.verl)
    roots = {k.split(".")[0] for b in flat.values() for k in b} | {"hydra", "reward"}
    OUT.mkdir(parents=True, exist_ok=True)
    dapo = {"repository": "verl-project/verl-recipe", "commit": recipe_commit, "files": DAPO_CONFIGS}
    dapo.update(dapo_overlay(ns.recipe))
    head = {"repository": "volcengine/verl", "commit": verl_commit, "files": CONFIGS}
    (OUT / "verl_defaults.json").write_text(json.dumps({**head, **flat, "dapo": dapo}, indent=1) + "\n")
    keys = {
        "verl": {
            "repository": "volcengine/verl",
            "commit": verl_commit,
            "scripts": scripts(ns.verl, TREES["verl"], roots),
        },
        "verl-recipe": {
            "repository": "verl-project/verl-recipe",
            "commit": recipe_commit,
            "scripts": scripts(ns.recipe, TREES["verl-recipe"], roots),
        },
    }
    (OUT / "script_keys.json").write_text(one_script_a_line(keys))


if __name__ == "__main__":
    main()
