"""Regenerate recipes/verl_data/ from checkouts of verl and verl-recipe.

python scripts/extract_verl_keys.py --verl path/to/verl --recipe path/to/verl-recipe
python scripts/extract_verl_keys.py --verl path/to/verl --releases v0.3.0.post1 v0.4.0 ...

The first form writes two files, each naming the commit it was read from:
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

The second form writes releases/<tag>.json per release tag: every key of verl's FSDP and
Megatron trainer configs at that tag with its default, composed by Hydra as verl composes them
(ppo_trainer.yaml / ppo_megatron_trainer.yaml with the component files of their defaults
lists), so keys no published script sets are known too.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import tarfile
import tempfile
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
CONFIG_DIR = "verl/trainer/config"
TRAINER_CONFIGS = {"fsdp": "ppo_trainer", "megatron": "ppo_megatron_trainer"}


def gitdir(repo: Path) -> Path:
    return repo if (repo / "HEAD").is_file() and not (repo / ".git").exists() else repo / ".git"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={gitdir(repo)}", *args], check=True, capture_output=True, text=True
    ).stdout


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


def release_defaults(verl: Path, tag: str) -> dict:
    """{backend: {key: default}} of verl's trainer configs at `tag`, composed by Hydra from that
    tag's config folder (as `python -m verl.trainer.main_ppo` composes them, without overrides)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    archive = subprocess.run(
        ["git", f"--git-dir={gitdir(verl)}", "archive", tag, CONFIG_DIR], check=True, capture_output=True
    ).stdout
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tarfile.open(fileobj=io.BytesIO(archive)).extractall(tmp, filter="data")
        for backend, name in TRAINER_CONFIGS.items():
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(Path(tmp) / CONFIG_DIR), version_base=None):
                out[backend] = dict(sorted(flatten(compose(name)).items()))
    GlobalHydra.instance().clear()
    return out


def write_releases(verl: Path, tags: list[str]) -> None:
    (OUT / "releases").mkdir(parents=True, exist_ok=True)
    for tag in tags:
        head = {
            "repository": "volcengine/verl",
            "tag": tag,
            "commit": git(verl, "rev-list", "-n1", tag).strip(),
            "files": {b: f"{CONFIG_DIR}/{n}.yaml" for b, n in TRAINER_CONFIGS.items()},
        }
        body = json.dumps({**head, **release_defaults(verl, tag)}, indent=1, default=str)
        (OUT / "releases" / f"{tag}.json").write_text(body + "\n")


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
    parser.add_argument("--recipe", type=Path, help="a verl-recipe checkout (the first form)")
    parser.add_argument("--releases", nargs="+", metavar="TAG", help="verl release tags (the second form)")
    ns = parser.parse_args()
    if ns.releases:
        write_releases(ns.verl, ns.releases)
        return
    if ns.recipe is None:
        parser.error("--recipe is needed unless --releases is given")
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
