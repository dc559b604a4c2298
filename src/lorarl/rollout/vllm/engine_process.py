"""What hosting vLLM engines inside a trainer's process needs: workarounds for process state.

vLLM expects to own its process. Here several engines may come and go in one process that
also trains, so this module keeps the host intact: the RNG state and thread count vLLM changes
while starting, the parallel groups its shutdown tears down, and the tmpfs adapter folders a
killed process leaves behind.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

ADAPTER_DIR_PREFIX = "lorarl-adapter-"

# vLLM keeps its parallel groups in process globals shared by every in-process
# engine, and an engine's shutdown tears them down (and torch.distributed with them).
# Count live engines so only the last one cleans up, and never destroy a process
# group that the caller (a trainer) created before the first engine.
_live_engines = 0
_caller_owns_torch_dist = False


def first_engine_in_process() -> None:
    """Call before building an engine: notes whether the caller owns torch.distributed."""
    global _caller_owns_torch_dist
    if _live_engines == 0:
        _caller_owns_torch_dist = torch.distributed.is_available() and torch.distributed.is_initialized()


def adopt_engine(owner, llm, adapter_dir: Path | None):
    """Tie the engine's teardown to `owner`: returns a finalizer that releases it once."""
    global _live_engines
    _live_engines += 1
    client = llm.llm_engine.engine_core
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()  # ours below replaces it, so teardown always goes through _release_engine
    return weakref.finalize(owner, _release_engine, llm, adapter_dir)


def _release_engine(llm, adapter_dir: Path | None) -> None:
    global _live_engines
    _live_engines -= 1
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # InprocClient -> EngineCore
    if core is not None:
        import vllm.v1.engine.core as core_module

        full_cleanup = core_module.cleanup_dist_env_and_memory

        def cleanup(shutdown_ray: bool = False) -> None:
            if _live_engines > 0:
                return
            if _caller_owns_torch_dist:
                from vllm.distributed.parallel_state import destroy_model_parallel

                destroy_model_parallel()
                return
            full_cleanup(shutdown_ray)

        core_module.cleanup_dist_env_and_memory = cleanup
        try:
            core.shutdown()
        finally:
            core_module.cleanup_dist_env_and_memory = full_cleanup
    del llm, core
    gc.collect()
    if adapter_dir is not None:
        shutil.rmtree(adapter_dir, ignore_errors=True)


def release_distributed() -> None:
    """For a caller that owns torch.distributed and is about to destroy it: vLLM's world group
    wraps the caller's process group, and a later engine in this process would reuse the stale
    wrapper ("Process group ... is not initialized in the world group map"). Drops both once
    no engine is alive."""
    if _live_engines > 0:
        return
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment
    except ImportError:
        return
    destroy_distributed_environment()


def unlink_cpu_shm() -> None:
    """Remove the /dev/shm names of vLLM's CPU tensor-parallel shared memory once every rank of
    the group has mapped it.

    vLLM's CPU communicator names its segments after the group only (with the external launcher
    every run gets the same name) and leaves them behind, even on a clean shutdown: the next run
    then failed with "create shm in SHMManager failed. errno: 17". The mappings stay valid after
    the names are gone (POSIX shm), and the memory is freed with the last process."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
    if name is None or group.world_size == 1:
        return
    dist.barrier(group=group.cpu_group)  # every rank has joined every segment of the group
    # shm_open names may start with "/" (here "//-tp:0-[0-1]-cpushm"); the file drops them.
    (Path("/dev/shm") / f"{name.lstrip('/')}_{group.rank_in_group}").unlink(missing_ok=True)


class process_state_kept:
    """Undo what building an in-process vLLM engine does to the host process.

    vLLM seeds the global RNGs with the rollout seed and, on CPU, replaces
    torch.set_num_threads with a no-op; a trainer sharing the process keeps its own.
    """

    def __enter__(self) -> None:
        import numpy as np

        self._np = np.random.get_state()
        self._py = random.getstate()
        self._torch = torch.random.get_rng_state()
        self._set_threads = torch.set_num_threads
        self._threads = torch.get_num_threads()

    def __exit__(self, *exc) -> None:
        import numpy as np

        np.random.set_state(self._np)
        random.setstate(self._py)
        torch.random.set_rng_state(self._torch)
        torch.set_num_threads = self._set_threads
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)


# ------------------------------------------------------------------ tmpfs adapter folders


def adapter_root() -> Path | None:
    """/dev/shm where writable (the adapter never touches a disk), else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def make_adapter_dir() -> Path:
    """A private folder named after this process, so a later start can tell whether its owner lives."""
    remove_stale_adapter_dirs()
    return Path(tempfile.mkdtemp(prefix=f"{ADAPTER_DIR_PREFIX}{os.getpid()}-", dir=adapter_root()))


def remove_stale_adapter_dirs(root: Path | None = None) -> list[Path]:
    """Remove adapter folders whose owning process is gone (a killed run cannot clean up after
    itself, and tmpfs is RAM). Folders of live processes, or named otherwise, are left alone."""
    root = root or adapter_root() or Path(tempfile.gettempdir())
    removed = []
    for path in root.glob(f"{ADAPTER_DIR_PREFIX}*"):
        pid = path.name[len(ADAPTER_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)) or not path.is_dir():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to clean
    # A zombie has exited; its folder is as orphaned as a dead process's.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
