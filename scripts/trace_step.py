"""Which files and functions of lorarl one FSDP step of the default run runs, in call order.

    python scripts/trace_step.py [hydra overrides...]

Builds the default run on CPU (the trainer's start-up checks, one Worker in this process with
its vLLM CPU engine and FSDP2 over gloo), syncs once as the trainer does at start, then traces
the trainer's next step (GRPOTrainer.train_step) with sys.setprofile: every Python call whose
code lives under src/lorarl, the first call of each function listed once. The worker group's
three calls go straight to the worker here (Ray would run them in another process, where this
profile cannot see): lorarl/workers/group.py's part of the step (WorkerGroup.generate, update and
sync, _first_of, _get) is named at the end instead of traced. docs/design.md's step trace is
read from this output.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import lorarl

SRC = Path(lorarl.__file__).resolve().parent


class InProcessGroup:
    """WorkerGroup's step calls, on one Worker in this process (world size 1)."""

    def __init__(self, worker):
        self.worker = worker
        self.dp_size, self.rollout_size = 1, 1

    def generate(self, per_engine):
        return [self.worker.generate(per_engine[0])]

    def update(self, per_replica):
        return [self.worker.update(per_replica[0])]

    def sync(self, request):
        return self.worker.sync(request)


def trace(call) -> list[tuple[str, str]]:
    """(file under src/lorarl, function's qualified name) of every lorarl function `call` runs,
    each listed at its first call."""
    seen: dict[tuple[str, str], None] = {}

    def profile(frame, event, arg):
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(SRC):
            seen.setdefault((str(path.relative_to(SRC)), frame.f_code.co_qualname), None)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return list(seen)


def main(overrides: list[str]) -> None:
    from lorarl.config.compose import compose
    from lorarl.contract.messages import Rendezvous, SyncRequest
    from lorarl.driver.jobs import Job
    from lorarl.driver.trainer import GRPOTrainer
    from lorarl.workers.worker import Worker

    run = compose(["+backend=fsdp", "trainer.device=cpu", "trainer.logger=[console]", *overrides])
    trainer = GRPOTrainer([Job(run, Path(tempfile.mkdtemp(prefix="lorarl_trace_")))])
    worker = Worker(trainer.worker_spec, rank=0, world_size=1, device="cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker.setup(Rendezvous(master_addr="127.0.0.1", master_port=port))
    trainer.workers = InProcessGroup(worker)
    trainer.workers.sync(SyncRequest(step=0, last=False))
    trainer.step = 1
    calls = trace(trainer.train_step)
    worker.shutdown()
    files: dict[str, list[str]] = {}
    for file, name in calls:
        files.setdefault(file, []).append(name)
    for file, names in files.items():
        print(f"{file:34s} {', '.join(names)}")
    print(f"{len(files)} files of src/lorarl traced, plus worker_group.py (the Ray calls)")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(sys.argv[1:])
