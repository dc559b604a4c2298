"""What every measurement shares: repeat statistics, result records, the benchmark models.

A result is a `Record`: what was measured, under which config, the per-repeat samples and
their median and spread, plus (where it has one) the ratio to a baseline measured in the
same process, so two numbers taken minutes apart on a noisy machine are never divided.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
# Short names the GPU measurements take in --models.
GPU_MODELS = {"qwen05": "qwen2.5-0.5b", "qwen7": "qwen2.5-7b"}

# Shapes of the real Qwen2.5 configs (random weights stand in for the real ones). head_dim is
# 128 at 7B and 64 at 0.5B; 64 is also what vLLM's CPU attention needs.
SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        num_hidden_layers=24,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        num_hidden_layers=28,
        vocab_size=152064,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
    # Qwen3: q_norm/k_norm per head, no q/k/v bias; head_dim 128 is not hidden / heads.
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        num_hidden_layers=28,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
}
QWEN05_SHAPE = SHAPES["qwen2.5-0.5b"]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The project's default LoRA (conf/model/qwen2_tiny.yaml): rank 16, alpha 32, all seven projections.
LORA_RANK, LORA_ALPHA = 16, 32


@dataclass
class Stat:
    """Median and spread of repeated samples (seconds, tokens/s, ... as `unit` says)."""

    median: float
    p25: float
    p75: float
    min: float
    max: float
    n: int
    unit: str = "s"
    samples: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, samples: Sequence[float], unit: str = "s") -> Stat:
        xs = sorted(float(x) for x in samples)
        if not xs:
            raise ValueError("no samples")
        if len(xs) >= 2:
            q = statistics.quantiles(xs, n=4, method="inclusive")
            p25, p75 = q[0], q[2]
        else:
            p25 = p75 = xs[0]
        return cls(statistics.median(xs), p25, p75, xs[0], xs[-1], len(xs), unit, [float(x) for x in samples])


@dataclass
class Record:
    """One line of the results table."""

    measurement: str  # which module (sync_latency, export_gather, ...)
    what: str  # the method, e.g. "(a) ours: adapter, tmpfs"
    config: str  # model, rank, world size, ...
    stat: Stat | None
    baseline: str | None = None  # `what` of the row the ratio divides by
    ratio: Stat | None = None  # per-repeat paired ratios this / baseline where paired, else one value
    extra: dict = field(default_factory=dict)  # bytes, tensors, checks, breakdowns
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def set_threads(n: int) -> None:
    """Intra-op threads for this process. On a small shared host two OpenMP threads spin
    against other processes: a 2 ms tiny-model merge took 0.2-0.8 s with 2 threads under
    load and 2 ms with 1, so the CPU suite defaults to 1 and records the choice."""
    import torch

    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def ratio_stat(num: Sequence[float], den: Sequence[float]) -> Stat:
    """Per-repeat ratios of paired samples (same repeat index, taken back to back)."""
    return Stat.of([a / b for a, b in zip(num, den)], unit="x")


def ratio_of_medians(num: Stat, den: Stat) -> Stat:
    """Samples not taken in pairs (separate runs or engines): one ratio of medians."""
    return Stat.of([num.median / den.median], unit="x")


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """Where benchmark models live: --cache, else $LORARL_CACHE, else ~/.cache/lorarl."""
    if explicit:
        return Path(explicit).expanduser().absolute()
    from lorarl.schema import cache_dir as lorarl_cache

    return Path(lorarl_cache()).absolute()


def tiny_model(cache: Path) -> Path:
    """The embedded tiny Qwen2 under the name the GRPO config expects (`<cache>/qwen2_tiny`),
    so the end-to-end runs reuse the same build."""
    from lorarl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(cache / "qwen2_tiny", seed=0)


def qwen05_shaped_model(cache: Path, layers: int = 24, dtype: str = "bfloat16") -> Path:
    return shaped_model(cache, "qwen2.5-0.5b", layers, dtype)


def shaped_model_path(cache: Path, shape: str, layers: int | None = None, dtype: str = "bfloat16") -> Path:
    """Where shaped_model puts (or has put) that model; complete once SHAPED_MODEL_DONE is in it."""
    depth = SHAPES[shape]["num_hidden_layers"] if layers is None else layers
    return cache / "bench" / f"{shape.replace('.', '_')}_shape_l{depth}_{dtype}"


SHAPED_MODEL_DONE = "bench_model.json"


def shaped_model(
    cache: Path, shape: str, layers: int | None = None, dtype: str = "bfloat16", device: str = "cpu"
) -> Path:
    """A random model with a real Qwen2.5/Qwen3 shape (optionally fewer decoder layers), saved as
    safetensors with the tiny model's tokenizer (its ids < 512 are valid in any Qwen vocab).
    Built once per (shape, layers, dtype) under <cache>/bench/; `device` only speeds up init."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    dims = dict(SHAPES[shape])
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        dims.pop("model_type", "qwen2")
    ]
    dims.setdefault("head_dim", dims["hidden_size"] // dims["num_attention_heads"])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    path = shaped_model_path(cache, shape, layers, dtype)
    done = path / SHAPED_MODEL_DONE
    if done.is_file():
        return path
    tiny = tiny_model(cache)
    tok = AutoTokenizer.from_pretrained(tiny)
    config = config_cls(
        **dims,
        max_position_embeddings=32768,
        bos_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # init in the target dtype: a 7B fp32 copy is 30 GB
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(default)
    model.config.dtype = dtype
    tmp = path.with_name(path.name + ".tmp")
    model.to("cpu").save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    (tmp / SHAPED_MODEL_DONE).write_text(json.dumps({"shape": shape, "dims": dims, "dtype": dtype, "params": n_params}))
    del model
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def model_params(path: Path) -> int:
    """Parameter count from the saved safetensors headers (no tensors loaded)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                total += n
    return total


def peft_lora_config(rank: int = LORA_RANK, alpha: int = LORA_ALPHA):
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(PROJECTIONS), lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
    )


def adapter_config_dict(peft_model) -> dict:
    """The adapter config as the trainer sends it: JSON-friendly LoraConfig.to_dict()."""
    cfg = peft_model.peft_config["default"].to_dict()
    cfg["target_modules"] = sorted(cfg["target_modules"])
    for key in ("task_type", "peft_type"):
        cfg[key] = str(getattr(cfg.get(key), "value", cfg.get(key)))
    return {k: v for k, v in cfg.items() if v is None or isinstance(v, (str, int, float, bool, list, dict))}


def perturb_lora(peft_model, seed: int, std: float = 0.02) -> None:
    """New, non-zero LoRA weights, as after an optimizer step (PEFT starts with B = 0)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str))


def environment() -> dict:
    """Versions and machine facts recorded beside every result."""
    import platform

    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        import torch

        out["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    for mod in ("torch", "vllm", "transformers", "peft", "trl"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing package is a fact to record, not an error
            out[mod] = None
    try:
        out["loadavg"] = os.getloadavg()
    except OSError:
        pass
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        out["mem_total_gib"] = round(int(meminfo[0].split()[1]) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return out


def torchrun(
    module: str, args: list[str], world: int, timeout: int, threads: int | None = None
) -> subprocess.CompletedProcess:
    """`python -m <module> args` on `world` ranks of this host (torchrun --standalone)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PYTHONWARNINGS": "ignore",
    }
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        "-m",
        module,
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def gpu_args(name: str, description: str, argv: list[str] | None) -> argparse.Namespace:
    """The command line every multi-GPU measurement takes; stops unless enough GPUs are visible."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--models", default="qwen05,qwen7")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < args.world:
        raise SystemExit(f"{name} needs {args.world} CUDA GPUs; found {found}")
    return args


def ppo_step(run, engine, batch, step: int, device: torch.device) -> dict:
    """One PPO update as the worker runs it (lorarl.ppo.ppo_update) on an engine built from `run`
    on `device` (either engine: the Megatron one keeps only its own config groups)."""
    from lorarl.ppo import Correction, ppo_update
    from lorarl.trainer import sampling_of

    correction = Correction.of(run.algorithm.rollout_correction, device.type)
    return ppo_update(engine, batch, step, sampling_of(run), run.actor, correction)
