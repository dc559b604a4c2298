"""What the machine was doing around a timed run: GPU clocks, temperature, power and memory
(nvidia-smi, so the bench process never holds a CUDA context), host load and free memory.

Two runs of one command in one lease differed by 20% (7B step 4.66 vs 5.59 s); these records
are what tells a slower GPU (clocks, temperature, power cap) from a busier host (load, memory)
or the run before still leaving (GPU memory in use at the start). Across leases the host itself
differs: the 7B update launches ~46k kernels, and its host time per launch (aten dispatch,
autograd, PEFT's Python) is what bounds it on a slow host (2026-12-04: the same kernels, 2.46
against 2.43 s of GPU time, took 3.2-3.4 s against 2.75 s, with every op's CPU time ~20% higher),
so every reading also times a fixed pure-Python loop (`python_loop_us`) and names the CPU.
"""

from __future__ import annotations

import getpass
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# nvidia-smi --query-gpu fields; one unknown field fails the whole query, so the driver's
# older name for the throttle reasons is tried when the newer one is refused.
GPU_FIELDS = (
    "clocks.sm",
    "clocks.mem",
    "clocks.max.sm",
    "temperature.gpu",
    "power.draw",
    "power.limit",
    "utilization.gpu",
    "memory.used",
    "memory.free",
    "pstate",
)
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
# Microseconds since the driver loaded that each cause held the clocks below the requested ones
# (driver 580 on the H200 has them); a run's share is the difference across it.
SLOWDOWN_COUNTERS = tuple(
    f"clocks_event_reasons_counters.{c}"
    for c in ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sync_boost")
)
SAMPLED = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "utilization.gpu", "memory.used")


def _number(text: str) -> float | str | None:
    text = text.strip()
    if not text or text.startswith("[") or text in ("N/A", "Not Supported"):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def nvidia_smi(fields: tuple[str, ...]) -> dict | None:
    """One nvidia-smi reading of the first GPU, or None without a working nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    values = out.stdout.strip().splitlines()[0].split(",")
    return dict(zip(fields, map(_number, values))) if len(values) == len(fields) else None


def gpu_state() -> dict | None:
    for reasons in REASON_FIELDS:
        state = nvidia_smi((*GPU_FIELDS, reasons))
        if state is not None:
            state["clock_reasons"] = state.pop(reasons)
            return state
    return nvidia_smi(GPU_FIELDS)


def gpu_memory_used_mib() -> int | None:
    state = nvidia_smi(("memory.used",))
    return None if state is None or state["memory.used"] is None else int(state["memory.used"])


def wait_for_free_gpu(limit_mib: int = 2048, timeout_s: float = 180.0) -> tuple[int | None, float]:
    """(GPU memory in use, seconds waited) once at most `limit_mib` is in use or after `timeout_s`.

    A process of the run before (a TRL worker outliving its killed launcher) can still be
    releasing memory, and vLLM refuses to start when free memory grows during its profile."""
    t0 = time.perf_counter()
    used = gpu_memory_used_mib()
    while used is not None and used > limit_mib and time.perf_counter() - t0 < timeout_s:
        time.sleep(2.0)
        used = gpu_memory_used_mib()
    return used, time.perf_counter() - t0


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat), None where it is absent."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def meminfo_gib(key: str) -> float | None:
    """A /proc/meminfo entry (`MemAvailable`, `Cached`: the page cache) in GiB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def python_loop_us(iterations: int = 100_000, repeats: int = 3) -> float:
    """Microseconds per iteration of a fixed pure-Python loop (a call, an attribute read, a dict
    write), the best of `repeats`: one core's speed for the interpreted work that launches
    kernels (nn.Module calls, PEFT's LoRA forward, vLLM's per-step scheduling). ~0.1 s."""

    class Box:
        value = 1

    def touch(box: Box, store: dict, i: int) -> None:
        store[i & 1023] = box.value + i

    box, store, best = Box(), {}, float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(iterations):
            touch(box, store, i)
        best = min(best, time.perf_counter() - t0)
    return best / iterations * 1e6


def kernel_cache_dirs() -> dict[str, Path]:
    """Where the runs' compiled kernels persist across processes, as the children (which inherit
    this environment) find them: Triton's (Liger's kernels, vLLM's), Inductor's, vLLM's."""
    home = Path.home()
    return {
        "triton": Path(os.environ.get("TRITON_CACHE_DIR") or home / ".triton" / "cache"),
        "inductor": Path(
            os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            or Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
        ),
        "vllm": Path(
            os.environ.get("VLLM_CACHE_ROOT") or Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "vllm"
        ),
    }


def kernel_cache_files() -> dict[str, int]:
    """Files in each kernel cache: a run that compiled kernels leaves more than it found, one
    that found them compiled leaves as many. (A lease's first run of a shape was slower in every
    step, not only the first; this tells whether it was compiling.)"""
    return {name: sum(len(files) for _, _, files in os.walk(d)) for name, d in kernel_cache_dirs().items()}


def host_state() -> dict:
    """The host and GPU right now: what is recorded before and after every run."""
    return {
        "time": time.strftime("%H:%M:%S"),
        "loadavg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python_loop_us": python_loop_us(),
        "mem_available_gib": meminfo_gib("MemAvailable"),
        "page_cache_gib": meminfo_gib("Cached"),
        "kernel_cache_files": kernel_cache_files(),
        "gpu": gpu_state(),
        "slowdown_us": nvidia_smi(SLOWDOWN_COUNTERS),
    }


def slowdown_s(before: dict, after: dict) -> dict | None:
    """Seconds each cause held the GPU's clocks down between two host_state() readings."""
    b, a = before.get("slowdown_us"), after.get("slowdown_us")
    if not b or not a:
        return None
    return {
        key.rsplit(".", 1)[1]: (a[key] - b[key]) / 1e6
        for key in SLOWDOWN_COUNTERS
        if isinstance(a.get(key), float) and isinstance(b.get(key), float)
    }


def _spread(values: list[float]) -> dict | None:
    values = [v for v in values if isinstance(v, float)]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


class Sampler:
    """Samples the host's CPU busy share and the GPU's clocks, temperature, power and use every
    `interval_s` seconds in a thread while a run goes on; `summary()` gives min/median/max of each."""

    def __init__(self, interval_s: float = 1.0, gpu: bool = True):
        self.interval_s = interval_s
        self.gpu = gpu
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        # One closing sample after the stop covers the tail, so a run shorter than the
        # interval still records the host once.
        last = cpu_times()
        while not self._stop.wait(self.interval_s):
            last = self._sample(last)
        self._sample(last)

    def _sample(self, last):
        sample: dict = {}
        now = cpu_times()
        if last and now and now[1] > last[1]:
            sample["cpu_busy"] = (now[0] - last[0]) / (now[1] - last[1])
        if self.gpu:
            sample.update(nvidia_smi(SAMPLED) or {})
        self.samples.append(sample)
        return now

    def summary(self) -> dict:
        keys = ("cpu_busy", *SAMPLED) if self.gpu else ("cpu_busy",)
        return {
            "interval_s": self.interval_s,
            "samples": len(self.samples),
            **{key: _spread([s.get(key) for s in self.samples]) for key in keys},
        }


def _copy_timed(stream, out, t0: float) -> None:
    # Each line as it arrives, after the seconds since the launch: the log is the run's timeline.
    for line in iter(stream.readline, b""):
        out.write(f"{time.perf_counter() - t0:7.1f} ".encode() + line)
        out.flush()


def run_logged(cmd: list[str], cwd: Path, env: dict, timeout: int, log: Path) -> tuple[int | None, str]:
    """Run `cmd` in its own process group with stdout+stderr into `log`, each line after the
    seconds since the launch (the child unbuffered, so lines carry the time they were printed);
    on timeout the whole group gets SIGTERM (lorarl shuts vLLM and Ray down on it), then SIGKILL
    after 30 s, so no engine is left holding GPU memory for the next run. Returns (exit code or
    None, log text)."""
    env = {**env, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        copier = threading.Thread(target=_copy_timed, args=(proc.stdout, out, t0), daemon=True)
        copier.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # The pipe closes when the last process holding it exits (Ray's may outlive the driver).
        copier.join(timeout=30)
        out.write(f"{time.perf_counter() - t0:7.1f} [exit {code}]\n".encode())
    return code, log.read_text(errors="replace")
