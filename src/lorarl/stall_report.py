"""What a worker was doing when one of its calls ran too long, without stopping it.

A hung step (a collective one rank never joins, a kernel that never returns, a lock) shows
nothing: the driver waits and the worker prints no line. Each worker call arms
`faulthandler.dump_traceback_later`, whose watchdog thread writes every thread's Python stack
to the worker's stacks file even while the main thread is blocked inside C (NCCL, CUDA) and
holds the GIL. The call goes on; a call that returns in time leaves no file. The driver says
the same once in its log, naming the files (`WorkerGroup._get`).
"""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STACKS_NAME = "worker_stacks_rank{rank}.txt"


def stacks_file(run_dir: Path, rank: int) -> Path:
    return run_dir / STACKS_NAME.format(rank=rank)


@contextmanager
def stacks_after(path: Path | None, seconds: float | None) -> Iterator[None]:
    """Within the block: after `seconds`, append every thread's stack to `path` (once).

    Appends, so a later call that returns in time never erases an earlier one's stacks; the
    file is removed only when nothing was ever written to it. One watchdog per process
    (faulthandler's): calls do not nest on a worker."""
    try:
        f = open(path, "a") if path is not None and seconds else None
    except OSError:  # e.g. a worker on a node without the driver's run folder: no report there
        f = None
    if f is None:
        yield
        return
    with f:
        faulthandler.dump_traceback_later(seconds, repeat=False, file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    if path.stat().st_size == 0:
        path.unlink(missing_ok=True)
