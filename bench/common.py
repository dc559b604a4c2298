"""What the benchmarks share: the models they run (the embedded tiny Qwen2 and random models
with real Qwen2.5/Qwen3 shapes), the state of the machine around a timed run, and a logged
subprocess that is stopped whole on timeout.
"""

from __future__ import annotations

import contextlib
import getpass
import importlib.metadata
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]

# Shapes of the real Qwen2.5/Qwen3 configs (random weights stand in for the real ones). head_dim is
# 128 at 7B and 64 at 0.5B; 64 is also what vLLM's CPU attention needs.
# fmt: off
SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
        num_hidden_layers=24, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
        num_hidden_layers=28, vocab_size=152064, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
    # Qwen3: q_norm/k_norm per head, no q/k/v bias; head_dim 128 is not hidden / heads.
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, num_hidden_layers=28, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
    # Qwen/Qwen3-30B-A3B's config.json (hard-coded: the GPU machine has no network): 128 experts of
    # width 768, top-8 routing; 30.5B parameters, 3.3B active per token; 61 GB in bf16.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
}
# The same MoE layout at CPU size: tests/gpu/moe_step.sh exercised off the GPU.
SHAPES["qwen3-moe-tiny"] = dict(
    SHAPES["qwen3-30b-a3b"], hidden_size=256, intermediate_size=512, moe_intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, vocab_size=512,
)
# fmt: on


def tail(text: str, lines: int = 40, chars: int = 4000) -> str:
    return "\n".join(text.splitlines()[-lines:])[-chars:]


def child_env(cache: Path, extra: dict | None = None) -> dict:
    """The environment of a measured subprocess: this checkout importable, the model cache, output unbuffered."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "LORARL_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    return {**env, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false", **(extra or {})}


def versions() -> dict:
    """The versions that decide a timing, and the GPU, recorded beside every result."""
    out = {"python": sys.version.split()[0], "gpu": nvidia_smi(("name", "memory.total", "driver_version"))}
    for dist in ("torch", "vllm", "transformers", "peft", "accelerate", "trl", "ray", "megatron-core"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """Where benchmark models live: --cache, else $LORARL_CACHE, else ~/.cache/lorarl."""
    if explicit:
        return Path(explicit).expanduser().absolute()
    from lorarl.config.schema import cache_dir as lorarl_cache

    return Path(lorarl_cache()).absolute()


def tiny_model(cache: Path) -> Path:
    """The embedded tiny Qwen2 where the GRPO config expects it (`<cache>/qwen2_tiny`)."""
    from lorarl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(cache / "qwen2_tiny", seed=0)


def shaped_model_path(
    cache: Path, shape: str, layers: int | None = None, dtype: str = "bfloat16", token_share: bool = False
) -> Path:
    """Where shaped_model puts (or has put) that model; complete once SHAPED_MODEL_DONE is in it."""
    depth = SHAPES[shape]["num_hidden_layers"] if layers is None else layers
    return cache / "bench" / f"{shape.replace('.', '_')}_shape_l{depth}_{dtype}{'_token_share' if token_share else ''}"


SHAPED_MODEL_DONE = "bench_model.json"


def shaped_model(cache: Path, shape: str, layers=None, dtype="bfloat16", device="cpu", token_share=False) -> Path:
    """A random model with a real Qwen2.5/Qwen3/Qwen3-MoE shape (optionally fewer layers) and the tiny
    model's tokenizer (ids < 512 are valid in any Qwen vocab), built once under <cache>/bench/ on
    `device`. `token_share`: data=token_share's subset gets a direction, so its reward can climb."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    dims = dict(SHAPES[shape])
    family = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[dims.pop("model_type", "qwen2")]
    config_cls, model_cls = (getattr(transformers, family + suffix) for suffix in ("Config", "ForCausalLM"))
    dims.setdefault("head_dim", dims["hidden_size"] // dims["num_attention_heads"])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    path = shaped_model_path(cache, shape, layers, dtype, token_share)
    if (path / SHAPED_MODEL_DONE).is_file():
        return path
    tok = AutoTokenizer.from_pretrained(tiny_model(cache))
    ids = dict(bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = config_cls(**dims, max_position_embeddings=32768, **ids)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # init in the target dtype: a 7B fp32 copy is 30 GB
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(default)
    if token_share:
        from lorarl.data.token_share import give_subset_a_direction

        give_subset_a_direction(model.get_output_embeddings().weight)
    model.config.dtype = dtype
    tmp = path.with_name(path.name + ".tmp")
    save_by_shard(model, tmp)
    tok.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    (tmp / SHAPED_MODEL_DONE).write_text(
        json.dumps({"shape": shape, "dims": dims, "dtype": dtype, "params": n_params, "token_share": token_share})
    )
    del model
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def save_by_shard(model, path: Path, shard_bytes: int = 4 << 30) -> None:
    """save_pretrained's checkpoint, copied to the host one shard at a time: transformers' own save
    first splits every fused expert stack per expert on the model's device, a second 61 GB copy."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]  # vLLM picks its model class by this name
    for config in (model.config, model.generation_config):
        config.save_pretrained(path)
    state, weight_map, shard, seen, total = model.state_dict(), {}, {}, set(), 0
    for i, (key, tensor) in enumerate(state.items()):
        if tensor.data_ptr() not in seen:  # else a tied head: the checkpoint holds the embedding once
            seen.add(tensor.data_ptr())
            total += tensor.nbytes
            stem, _, leaf = key.rpartition(".")
            if stem.endswith("mlp.experts"):  # gate_up_proj [E, 2I, H] (gate rows, then up), down_proj [E, H, I]
                half = tensor.shape[1] // 2
                parts = {"down_proj": slice(None)} if leaf == "down_proj" else {"gate_proj": slice(None, half), "up_proj": slice(half, None)}  # fmt: skip
                shard.update({f"{stem}.{e}.{p}.weight": t[rows].cpu() for e, t in enumerate(tensor) for p, rows in parts.items()})  # fmt: skip
            else:
                shard[key] = tensor.detach().to("cpu", copy=True)
        if shard and (sum(t.nbytes for t in shard.values()) >= shard_bytes or i == len(state) - 1):
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard.clear()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def model_in_subprocess(shape: str | None, cache: Path, device: str, layers: int | None = None) -> tuple[Path, float]:
    """(path, seconds spent building) of shaped_model(cache, shape, layers), or of the tiny model
    for None, built in a subprocess so the calling process never holds GPU memory."""
    if shape is not None and (shaped_model_path(cache, shape, layers) / SHAPED_MODEL_DONE).is_file():
        return shaped_model_path(cache, shape, layers), 0.0  # built by an earlier command: no torch import
    t0 = time.perf_counter()
    where = f"Path({str(cache)!r})"
    call = f"shaped_model({where}, {shape!r}, {layers!r}, device={device!r})" if shape else f"tiny_model({where})"
    code = f"from pathlib import Path; from bench.common import shaped_model, tiny_model; print({call})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(cache), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the {shape or 'tiny'} model failed: {tail(proc.stderr or proc.stdout)}")
    return Path(proc.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def model_params(path: Path) -> int:
    """Parameter count from the saved safetensors headers (no tensors loaded)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())  # noqa: SIM118 - no __iter__
    return total


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str))


def ppo_step(run, engine, batch, step: int, device: torch.device) -> dict:
    """One PPO update as the worker runs it (lorarl.algorithms.ppo.ppo_update) on an engine built from `run`
    on `device` (either engine: the Megatron one keeps only its own config groups)."""
    from lorarl.algorithms.ppo import AdapterPlan, Correction, ppo_update
    from lorarl.driver.jobs import sampling_of

    correction = Correction.of(run.algorithm.rollout_correction, device.type)
    return ppo_update(engine, batch, step, [AdapterPlan(run.actor, sampling_of(run), correction)])[0].metrics()


# --- The machine around a run. Two runs of one command in one lease differed by 20%; these
# readings tell a slower GPU (clocks, temperature, the driver's power cap) from a slower or busier
# host (the 7B update is bound by the host's time per kernel launch) or the run before still
# leaving (GPU memory in use). nvidia-smi, so this process never holds a CUDA context.
GPU_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "power.limit", "memory.used", "memory.free")
GPU_FIELDS += ("pstate",)
SAMPLED = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "utilization.gpu", "memory.used")
# Microseconds since the driver loaded that each cause held the clocks below the requested ones.
SLOWDOWN = ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
SLOWDOWN_COUNTERS = tuple(f"clocks_event_reasons_counters.{c}" for c in SLOWDOWN)
KERNEL_CACHES = {  # env var, default: where compiled kernels persist across processes
    "triton": ("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"),
    "inductor": ("TORCHINDUCTOR_CACHE_DIR", Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"),
    "vllm": ("VLLM_CACHE_ROOT", Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"),
}


def nvidia_smi(fields: tuple[str, ...]) -> dict | None:
    """One reading of the first GPU (numbers as floats), or None without a working nvidia-smi or
    where the driver refuses a field."""
    try:
        cmd = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = [v.strip() for v in (out.stdout.strip().splitlines() or [""])[0].split(",")]
    if out.returncode != 0 or len(values) != len(fields):
        return None
    missing = ("", "N/A", "Not Supported")
    return {
        f: float(v) if re.fullmatch(r"[0-9]+(\.[0-9]+)?", v) else None if v in missing or v.startswith("[") else v
        for f, v in zip(fields, values)
    }


def wait_for_free_gpu(limit_mib: int = 2048, timeout_s: float = 180.0) -> tuple[float | None, float]:
    """(GPU MiB in use, seconds waited) once at most `limit_mib` is in use or after `timeout_s`: a
    process of the run before can still be leaving, and vLLM refuses to start when free memory
    grows during its profile."""
    t0 = time.perf_counter()
    while (used := (nvidia_smi(("memory.used",)) or {}).get("memory.used")) and used > limit_mib:
        if time.perf_counter() - t0 > timeout_s:
            break
        time.sleep(2.0)
    return used, time.perf_counter() - t0


def python_loop_us(iterations: int = 100_000) -> float:
    """Microseconds per iteration of a fixed pure-Python loop, the best of three: one core's speed
    for the interpreted work that launches kernels. ~0.1 s."""
    best, store = float("inf"), {}
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(iterations):
            store.__setitem__(i & 1023, i + 1)
        best = min(best, time.perf_counter() - t0)
    return best / iterations * 1e6


def host_state() -> dict:
    """The host and GPU right now: what is recorded before and after every run."""
    mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    gpu = nvidia_smi((*GPU_FIELDS, "clocks_event_reasons.active"))
    if gpu:
        gpu["clock_reasons"] = gpu.pop("clocks_event_reasons.active")
    return {
        "time": time.strftime("%H:%M:%S"),
        "loadavg_1m": os.getloadavg()[0],
        "python_loop_us": python_loop_us(),
        "mem_available_gib": int(mem["MemAvailable"].split()[0]) / 2**20,
        "page_cache_gib": int(mem["Cached"].split()[0]) / 2**20,
        "kernel_cache_files": {
            name: sum(len(files) for _, _, files in os.walk(os.environ.get(var) or default))
            for name, (var, default) in KERNEL_CACHES.items()
        },
        "gpu": gpu or nvidia_smi(GPU_FIELDS),
        "slowdown_us": nvidia_smi(SLOWDOWN_COUNTERS),
    }


def slowdown_s(before: dict, after: dict) -> dict | None:
    """Seconds each cause held the GPU's clocks down between two host_state() readings."""
    b, a = before.get("slowdown_us"), after.get("slowdown_us")
    if not b or not a:
        return None
    both = [k for k in SLOWDOWN_COUNTERS if isinstance(a.get(k), float) and isinstance(b.get(k), float)]
    return {k.rsplit(".", 1)[1]: (a[k] - b[k]) / 1e6 for k in both}


def cpu_jiffies() -> tuple[float, float]:
    """(idle + iowait, total) jiffies of all CPUs since boot."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


class Sampler:
    """Samples the host's CPU busy share and the GPU's clocks, temperature, power and use every
    `interval_s` in a thread while a run goes on, and once when it ends (a short run has one);
    `summary()` gives min/median/max of each."""

    def __init__(self, interval_s: float = 1.0, gpu: bool = True):
        self.interval_s, self.gpu, self.samples = interval_s, gpu, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        last, stopped = cpu_jiffies(), False
        while not stopped:
            stopped = self._stop.wait(self.interval_s)
            now = cpu_jiffies()
            sample = {"cpu_busy": 1.0 - (now[0] - last[0]) / (now[1] - last[1])} if now[1] > last[1] else {}
            sample["children_rss_gib"] = children_rss_gib()
            self.samples.append({**sample, **((nvidia_smi(SAMPLED) or {}) if self.gpu else {})})
            last = now

    def summary(self) -> dict:
        out = {"interval_s": self.interval_s, "samples": len(self.samples)}
        for key in ("cpu_busy", "children_rss_gib", *(SAMPLED if self.gpu else ())):
            xs = [v for s in self.samples if isinstance(v := s.get(key), float)]
            out[key] = {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)} if xs else None
        return out


def children_rss_gib() -> float:
    """Resident memory of this process's descendants (a run, its Ray workers, vLLM), summed."""
    import psutil

    total = 0
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total / 2**30


def run_logged(cmd: list[str], env: dict, timeout: int, log: Path) -> tuple[int | None, str]:
    """Run `cmd` in its own process group, stdout+stderr into `log`, each line after the seconds
    since the launch; on timeout the group gets SIGTERM (lorarl shuts vLLM and Ray down on it),
    then SIGKILL after 30 s, so no engine holds GPU memory into the next run. (exit code or None, log)."""

    def copy(stream, out, t0: float) -> None:
        for line in iter(stream.readline, b""):
            out.write(f"{time.perf_counter() - t0:7.1f} ".encode() + line)
            out.flush()

    with open(log, "wb") as out:
        t0, code = time.perf_counter(), None
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        copier = threading.Thread(target=copy, args=(proc.stdout, out, t0), daemon=True)
        copier.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        copier.join(timeout=30)  # the pipe closes when its last holder exits (Ray's may outlive the driver)
        out.write(f"{time.perf_counter() - t0:7.1f} [exit {code}]\n".encode())
    return code, log.read_text(errors="replace")
