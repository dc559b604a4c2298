"""Where step metrics go: console, metrics.jsonl in the run folder, wandb, tensorboard."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorarl import metrics as keys

SECRET_KEYS = re.compile(r"(api[_-]?key|token|secret|password)", re.IGNORECASE)
# What the console shows of a row, besides every validation key.
CONSOLE_KEYS = tuple(
    m.key
    for m in (
        keys.REWARD_MEAN,
        keys.VAL_ACC,
        keys.ACTOR_PG_LOSS,
        keys.ACTOR_KL_LOSS,
        keys.ACTOR_GRAD_NORM,
        keys.RESPONSE_LENGTH_MEAN,
        keys.SYNC_KIND,
        keys.SYNC_SECONDS,
        keys.SYNC_LOGPROB_DIFF_MAX,
        keys.TIMING_STEP,
    )
)


# trainer.logger value -> (the module it imports, the lorarl extra that installs it).
LOGGER_PACKAGES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard")}


def check_loggers(loggers: list[str]) -> None:
    """Each logger in trainer.logger can be imported, checked before anything starts: a missing
    package is one line naming the extra that installs it, not a traceback at the first step."""
    import importlib

    from lorarl.errors import ConfigError

    for name in loggers:
        if name not in LOGGER_PACKAGES:
            continue
        module, extra = LOGGER_PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(
                f"trainer.logger={name} needs the {module} package ({err}): pip install 'lorarl[{extra}]' "
                f"(or pip install -e '.[{extra}]' in a checkout), or drop {name} from trainer.logger"
            ) from err


def console(show: Callable[[str], None]) -> Callable[[str], None]:
    """A line for the user: `show` puts it on the screen (tqdm.write keeps a progress bar whole)
    and the run's log file keeps it (conf/hydra/default.yaml gives this logger the file only)."""
    log = logging.getLogger("lorarl.console")

    def say(line: str) -> None:
        show(line)
        log.info(line)

    return say


def job_log(out_dir: Path) -> logging.Logger:
    """The logger that writes a sweep group's job's <out_dir>/grpo.log (and nothing else)."""
    log = logging.getLogger(f"lorarl.console.{Path(out_dir).name}")
    log.propagate = False
    if not log.handlers:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(Path(out_dir) / "grpo.log")
        handler.setFormatter(logging.Formatter("[%(asctime)s][lorarl.console][%(levelname)s] - %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    return log


def job_console(out_dir: Path, label: str, show: Callable[[str], None]) -> Callable[[str], None]:
    """A line for the user from one job of a sweep group: `show` puts it on the screen with the
    job's label, and the job's own <out_dir>/grpo.log keeps it as a run alone would."""
    log = job_log(out_dir)

    def say(line: str) -> None:
        show(f"[{label}] {line}")
        log.info(line)

    return say


def redact(obj: Any) -> Any:
    """Copy of a config with secret-looking keys blanked: never written to logs or files."""
    if isinstance(obj, dict):
        return {k: ("<redacted>" if SECRET_KEYS.search(str(k)) and v else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


class Tracker:
    def __init__(
        self,
        loggers: list[str],
        out_dir: Path,
        project: str,
        experiment: str,
        config: dict,
        write=print,
        concurrent: bool = False,
    ):
        """`concurrent`: other trackers log beside this one in the process (a sweep group's jobs),
        so a wandb run of its own is started rather than the last one finished."""
        self.loggers = set(loggers)
        self.out_dir = Path(out_dir)
        self.write = write
        self._jsonl = None
        self._wandb = None
        self._tb = None
        config = redact(config)
        if "jsonl" in self.loggers:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.out_dir / "metrics.jsonl", "a", buffering=1)
        if "wandb" in self.loggers:
            import wandb

            self._wandb = wandb.init(
                project=project,
                name=experiment,
                config=config,
                dir=str(self.out_dir),
                reinit="create_new" if concurrent else "finish_previous",
            )
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))

    def drop_after(self, step: int) -> None:
        """Remove the rows of steps after `step` from metrics.jsonl (and a line cut short by a
        kill): a resumed run trains those steps again and logs them anew, so each step keeps one
        row and the curves go on without a jump back."""
        if self._jsonl is None:
            return
        self._jsonl.close()
        path = self.out_dir / "metrics.jsonl"
        kept = [row for row in _rows(path.read_text()) if row.get("step", 0) <= step]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(row, default=_plain) + "\n" for row in kept))
        os.replace(tmp, path)
        self._jsonl = open(path, "a", buffering=1)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, **metrics}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row, default=_plain) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items()}, step=step)
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if "console" in self.loggers and any(k in CONSOLE_KEYS or keys.is_validation(k) for k in metrics):
            shown = [f"{k}={_fmt(v)}" for k, v in row.items() if k in CONSOLE_KEYS or keys.is_validation(k)]
            self.write(f"step {step}: " + " ".join(shown))

    def finish(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rows(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # empty, or the last line of a process killed mid-write
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def _plain(v: Any) -> Any:
    return float(v) if hasattr(v, "__float__") else str(v)
