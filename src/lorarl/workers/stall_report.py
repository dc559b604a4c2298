"""What a worker was doing when one of its calls ran too long, without stopping it.

A hung step (a collective one rank never joins, a kernel that never returns, a lock) shows
nothing: the driver waits and the worker prints no line. Each worker call arms a timer thread
that, past the limit, writes every thread's Python stack to the worker's stacks file
(`faulthandler.dump_traceback` called with the GIL held). The call goes on; a call that
returns in time leaves no file. The driver says the same once in its log, naming the files
(`WorkerGroup._get`).

Not `faulthandler.dump_traceback_later`: its watchdog reads the other threads' frames without
the GIL, and a busy process can crash under it (a vLLM start-up compiling with sympy died
0.1 s after the dump, its stack showing a line number of 64225299). Waits in NCCL, CUDA
synchronisation, vLLM's output queue and sockets release the GIL, so the timer gets it there;
a call blocked inside C while holding the GIL gets no file, only the driver's line.
"""

from __future__ import annotations

import faulthandler
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STACKS_NAME = "worker_stacks_rank{rank}.txt"
STACKS_GLOB = STACKS_NAME.format(rank="*")  # every rank's, in the run folder


def stacks_file(run_dir: Path, rank: int) -> Path:
    return run_dir / STACKS_NAME.format(rank=rank)


@contextmanager
def stacks_after(path: Path | None, seconds: float | None) -> Iterator[None]:
    """Within the block: after `seconds`, append every thread's stack to `path` (once).

    The file is opened only then, so a call that returns (or raises) in time touches nothing,
    and appending means a later call never erases an earlier one's stacks."""
    if path is None or not seconds:
        yield
        return

    def dump() -> None:
        try:
            f = open(path, "a")
        except OSError:  # e.g. a worker on a node without the driver's run folder: no report there
            return
        with f:
            f.write(f"still running after {seconds:g} s; every thread's stack (most recent call first):\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)

    timer = threading.Timer(seconds, dump)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # a dump under way finishes before the call returns
