"""Checkpoints: safetensors + JSON only, written atomically, resumable. Every file of the
format is written and read here.

    <root>/global_step_<N>/
        adapter/adapter_model.safetensors, adapter/adapter_config.json   (a standard PEFT folder)
        optimizer.safetensors, optimizer.json                             (full AdamW state, LR schedule)
        rng_rank<R>.safetensors                                           (each worker's torch RNG)
        trainer_state.json                                                (step, data position, Python RNG)
        config.yaml                                                       (resolved run config, secrets redacted)
        manifest.json                                                     (every file and its size; written last)

A step folder is built as `global_step_<N>.tmp-*` and renamed into place only when whole,
so a crash mid-save leaves the last good checkpoint untouched. Resume picks the newest
folder whose manifest matches its files, falling back past truncated ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch

from lorarl.errors import LorarlError
from lorarl.files.jsonio import read_json, write_json

# A step folder's adapter is a PEFT folder; its reader and writer live in lorarl.files.peft_io.
from lorarl.files.peft_io import load_peft_adapter, save_peft_adapter

ADAPTER_DIR = "adapter"
STEP_RE = re.compile(r"^global_step_(\d+)$")


def flatten_optimizer_state(osd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Full optimizer state dict -> (tensors for safetensors, JSON-able rest)."""
    tensors, scalars = {}, {}
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{fqn}::{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{fqn}::{key}"] = value
    return tensors, {"param_groups": osd["param_groups"], "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[str, dict] = {}
    for flat, value in [*tensors.items(), *meta["scalars"].items()]:
        fqn, key = flat.rsplit("::", 1)
        state.setdefault(fqn, {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, max_to_keep: int | None = None):
        self.root = Path(root)
        self.max_to_keep = max_to_keep

    def begin(self, step: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"global_step_{step}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, prune: bool = True) -> Path:
        """`tmp` made whole as the checkpoint of `step`; older ones beyond max_to_keep go unless
        `prune` is off (a sweep group prunes once every job's checkpoint of the step is whole)."""
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {str(p.relative_to(tmp)): p.stat().st_size for p in files}
        (tmp / "manifest.json").write_text(json.dumps({"step": step, "files": manifest}, indent=1))
        final = self.root / f"global_step_{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if prune:
            self.prune()
        return final

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def clean_partial(self) -> None:
        """Temp folders of saves that never finished (a crash or a kill mid-save)."""
        if self.root.exists():
            for p in self.root.glob("global_step_*.tmp-*"):
                shutil.rmtree(p, ignore_errors=True)

    def complete_steps(self) -> list[tuple[int, Path]]:
        if not self.root.exists():
            return []
        found = []
        for p in self.root.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and is_complete(p):
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        steps = self.complete_steps()
        return steps[-1][1] if steps else None

    def prune(self) -> None:
        if not self.max_to_keep or self.max_to_keep <= 0:
            return
        steps = self.complete_steps()
        for _, path in steps[: -self.max_to_keep]:
            shutil.rmtree(path, ignore_errors=True)


def is_complete(path: Path) -> bool:
    """Every file the manifest lists is there with its recorded size."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in files.items())


def resolve_resume(mode: str, manager: CheckpointManager) -> Path | None:
    """auto: newest complete checkpoint or none; disable: none; anything else: that folder."""
    if mode == "disable":
        return None
    if mode == "auto":
        return manager.latest()
    path = Path(os.path.expanduser(mode))
    if not path.is_dir() or not is_complete(path):
        raise LorarlError(
            f"trainer.resume_mode={mode!r}: not a complete checkpoint folder (needs manifest.json and every file it lists); "
            "use trainer.resume_mode=auto to pick the newest complete one"
        )
    return path


def common_resume(jobs: list[tuple[CheckpointManager, Path | None]]) -> list[Path] | None:
    """The checkpoint each job resumes from, all of one step (None: a fresh start). `jobs` are
    (manager, the checkpoint trainer.resume_mode picked). One job resumes from its pick; a sweep
    group's jobs resume from the newest step every one of them has whole (a kill between their
    commits leaves some a step ahead), and all or none of them resume."""
    if len(jobs) == 1:
        return None if jobs[0][1] is None else [jobs[0][1]]
    picked = [path for _, path in jobs]
    if all(p is None for p in picked):
        return None
    steps = [dict(manager.complete_steps()) for manager, _ in jobs]
    common = set.intersection(*(set(s) for s in steps))
    if not common or any(p is None for p in picked):
        missing = [str(manager.root) for (manager, p) in jobs if p is None]
        raise LorarlError(
            f"the group's jobs have no checkpoint step in common ({', '.join(missing) or 'steps differ'}); "
            "resume them from one step with trainer.resume_mode=auto, or start the sweep in a new hydra.sweep.dir"
        )
    step = max(common)
    return [s[step] for s in steps]


# ---- what the workers write (collective: every rank calls) -----------------------------------


def save_engine_state(engine, directory: str | os.PathLike, rank: int) -> None:
    """Rank 0 writes the adapter (PEFT folder) and the optimizer with its LR schedule; every rank
    its torch RNG. `engine` is a lorarl.contract.engine.Engine."""
    from safetensors.torch import save_file

    out = Path(directory)
    lora = engine.lora_state()
    optim = engine.optimizer_state()
    if rank == 0:
        save_peft_adapter(out / ADAPTER_DIR, lora, engine.adapter_config())
        tensors, meta = flatten_optimizer_state(optim)
        save_file(tensors, str(out / "optimizer.safetensors"))
        write_json(out / "optimizer.json", {**meta, "scheduler": engine.scheduler_state()})
    save_file({"torch": torch.get_rng_state()}, str(out / f"rng_rank{rank}.safetensors"))


def load_engine_state(engine, directory: str | os.PathLike, rank: int) -> None:
    from safetensors.torch import load_file

    src = Path(directory)
    lora, _ = load_peft_adapter(src / ADAPTER_DIR)
    meta = read_json(src / "optimizer.json")
    optim = unflatten_optimizer_state(load_file(str(src / "optimizer.safetensors")), meta)
    engine.load_state(lora, optim, meta["scheduler"])
    rng = src / f"rng_rank{rank}.safetensors"
    if rng.is_file():
        torch.set_rng_state(load_file(str(rng))["torch"])


# ---- what the driver writes -------------------------------------------------------------------

TRAINER_STATE = "trainer_state.json"


def write_trainer_state(directory: Path, step: int, loader_state: dict, python_rng, config_yaml: str) -> None:
    write_json(
        directory / TRAINER_STATE,
        {"step": step, "loader": loader_state, "python_rng": [python_rng[0], list(python_rng[1]), python_rng[2]]},
    )
    (directory / "config.yaml").write_text(config_yaml)


def read_trainer_state(directory: Path) -> tuple[int, dict, tuple]:
    """(step, the prompt loader's state, Python's RNG state as random.setstate takes it)."""
    state = read_json(directory / TRAINER_STATE)
    version, internal, gauss = state["python_rng"]
    return state["step"], state["loader"], (version, tuple(internal), gauss)
