"""Which files and functions of lorarl one FSDP step of the default run runs, in call order, and
how much of each file a reader reads for it.

    python scripts/trace_step.py [hydra overrides...]

Builds the default run on CPU (the trainer's start-up checks, one Worker in this process with
its vLLM CPU engine and FSDP2 over gloo), syncs once as the trainer does at start, then traces
the trainer's next step (GRPOTrainer.train_step) with sys.setprofile: every Python call whose
code lives under src/lorarl, the first call of each function listed once (comprehensions,
lambdas and closures are read with the function that holds them, and not listed). The worker
group's three calls go straight to the worker here (Ray would run them in another process,
where this profile cannot see): lorarl/workers/group.py's part of the step (WorkerGroup.generate,
update and sync, _first_of, _get) is named at the end instead of traced.

Printed: each file in the order the step first enters it, with the lines of the functions the
step runs there (what a reader opens the file for) and those functions (docs/design.md's step
trace is this output); the files entered for fewer than SMALL lines; the calls from train_step
down to the policy loss.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
import tempfile
from pathlib import Path

import lorarl

SRC = Path(lorarl.__file__).resolve().parent
SMALL = 15  # a file entered for fewer lines than this is a detour for the reader


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


def trace(call) -> tuple[dict[tuple[str, str], int], list[str]]:
    """(file under src/lorarl, qualified name) -> source lines, of every named lorarl function
    `call` runs, in the order of their first calls; and the lorarl functions on the way from
    `call` to the first call of the policy loss (algorithms/losses.py's policy_loss), both ends included."""
    seen: dict[tuple[str, str], int] = {}
    chain: list[str] = []

    def profile(frame, event, arg):
        if event != "call" or not Path(frame.f_code.co_filename).is_relative_to(SRC):
            return
        code = frame.f_code
        if "<" not in code.co_qualname:
            key = (str(Path(code.co_filename).relative_to(SRC)), code.co_qualname)
            if key not in seen:
                seen[key] = len(inspect.getsourcelines(code)[0])
        if code.co_name == "policy_loss" and not chain:
            while frame is not None and frame.f_code is not call.__code__:
                if Path(frame.f_code.co_filename).is_relative_to(SRC):
                    chain.insert(0, frame.f_code.co_qualname)
                frame = frame.f_back
            chain.insert(0, call.__qualname__)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen, chain


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
    calls, chain = trace(trainer.train_step)
    worker.shutdown()
    files: dict[str, dict[str, int]] = {}  # in the order the step first enters them
    for (file, name), n in calls.items():
        files.setdefault(file, {})[name] = n
    lines = {file: sum(names.values()) for file, names in files.items()}
    print("file, the lines of the functions the step runs there, those functions (docs/design.md):")
    for file, names in files.items():
        print(f"{file:34s}{lines[file]:4d}  {', '.join(names)}")
    print(f"{len(files)} files of src/lorarl traced, plus workers/group.py (the Ray calls)")
    small = [file for file, n in lines.items() if n < SMALL]
    print(f"\nentered for fewer than {SMALL} lines: {len(small)} ({', '.join(small)})")
    print(f"from train_step to the policy loss: {' -> '.join(chain)} ({len(chain) - 2} calls between)")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(sys.argv[1:])
