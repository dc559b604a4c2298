"""One worker per device: a training engine and a vLLM rollout, colocated.

The worker owns the sync decision, and it reads exactly one state for it: whether the
rollout holds the base weights (`rollout.base_loaded`). The payload kind follows from it,
the payload carries that kind, and the rollout dispatches on the payload. No second flag
exists that could disagree.
"""

from __future__ import annotations

import gc
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lorarl import memory, sync_checks
from lorarl.batch import build_batch
from lorarl.config import RunConfig
from lorarl.engines import backend_of
from lorarl.engines.base import Engine, is_on_policy
from lorarl.memory import SleepPlan, plan_sleep
from lorarl.sync import PayloadKind, SyncStats


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def all_ranks(ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank of the job (collective: every rank calls it)."""
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag.item() == 1.0


class Worker:
    def __init__(self, run: RunConfig, rank: int, world_size: int, device: str, threads: int | None = None):
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if threads:
            torch.set_num_threads(threads)
        self.engine = None
        self.rollout = None
        self.probe_seqs: list[list[int]] | None = None  # fixed probe sequences, set once per process
        self.sleep_plan = SleepPlan(False, "not set up")
        self._free_awake = 0  # bytes free beside the awake engine, measured in setup (GPU)
        self._update_peak: tuple[int, int] | None = None  # (bytes, largest micro-batch's tokens)
        self._some_rank_sleeps = False  # the same on every rank: whether re-planning can change anything

    # Ray calls these on every worker before anything else.
    def location(self) -> dict:
        """Where Ray placed this worker: node id and IP, process id, and its GPUs (empty on CPU)."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
        }

    def free_port(self) -> int:
        """A TCP port free on this worker's node, for the process group's rendezvous (rank 0)."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> tuple[int, int, str]:
        """Process group, rollout, then engine. Returns this worker's (dp_rank, dp_size) and
        whether its rollout sleeps during the update, as a line for the log."""
        from lorarl.rollout.vllm import VLLMRollout

        tp = self.run.rollout.tensor_model_parallel_size
        if tp > 1:
            # Consecutive ranks share one vLLM engine, each holding its tensor-parallel shard
            # (vLLM's external_launcher: one engine per process, the ranks found in the
            # torchrun variables and the process group made below). Each process sees its own
            # device only (Ray sets CUDA_VISIBLE_DEVICES per worker), so its local rank is 0 on
            # GPU; on CPU the rank within the node picks the cores vLLM binds its threads to.
            local = 0 if self.device.type == "cuda" else self.rank % self.run.trainer.n_gpus_per_node
            os.environ.update(
                RANK=str(self.rank),
                LOCAL_RANK=str(local),
                WORLD_SIZE=str(self.world_size),
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(master_port),
            )

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank, world_size=self.world_size
        )
        seed_everything(self.run.trainer.seed + self.rank)
        r, m = self.run.rollout, self.run.model
        # vLLM first: on a GPU it sizes its KV cache from the memory still free.
        self.rollout = VLLMRollout(
            m.path,
            lora_rank=None if m.lora.merge else m.lora.rank,
            max_model_len=r.max_model_len or (self.run.data.max_prompt_length + self.run.data.max_response_length),
            # The ranks of one engine sample in lockstep, so they share its seed.
            seed=self.run.trainer.seed + self.rollout_rank,
            dtype=r.dtype,
            gpu_memory_utilization=r.gpu_memory_utilization,
            tensor_parallel_size=r.tensor_model_parallel_size,
            load_format=r.load_format,
            # CUDA graphs sample several times faster on GPU; vLLM's CPU build runs eager.
            enforce_eager=(self.device.type != "cuda") if r.enforce_eager is None else r.enforce_eager,
            enable_sleep_mode=self._sleep_mode,
            adapter_transport=r.adapter_transport,
            trust_remote_code=m.trust_remote_code,
            fingerprint_base=self.run.trainer.check_sync,
        )
        self.engine = make_engine(self.run, self.device)
        self.sleep_plan = self._plan_sleep()
        if self.device.type == "cuda":
            self._some_rank_sleeps = not all_ranks(not self.sleep_plan.sleeps, self.device)
        if self._sleeps:
            self.rollout.sleep()
        return self.dp_rank, self.dp_size, str(self.sleep_plan)

    @property
    def rollout_rank(self) -> int:
        """Which vLLM engine this worker holds a shard of; the workers of one engine get the same prompts."""
        return self.rank // self.run.rollout.tensor_model_parallel_size

    @property
    def dp_rank(self) -> int:
        """Workers with the same dp_rank hold one model replica (tensor/pipeline parallel) and get the same data."""
        return self.engine.dp_rank

    @property
    def dp_size(self) -> int:
        return self.engine.dp_size

    @property
    def _sleep_mode(self) -> bool:
        """The engine is built able to sleep (GPU, unless rollout.free_cache_engine=false)."""
        return self.device.type == "cuda" and self.run.rollout.free_cache_engine is not False

    @property
    def _sleeps(self) -> bool:
        """The rollout sleeps during every update (decided once in setup, see lorarl.memory)."""
        return self.sleep_plan.sleeps

    def _plan_sleep(self) -> SleepPlan:
        if self.device.type != "cuda":
            return SleepPlan(False, "CPU: vLLM's CPU build cannot sleep")
        setting = self.run.rollout.free_cache_engine
        if setting is not None:
            return plan_sleep(setting)
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        self._free_awake = free
        return plan_sleep(None, free, self._update_bytes())

    def _replan_sleep(self) -> dict:
        """After an update that ran with the rollout asleep on the estimate's word: awake from the
        next update on if the update's measured peak fits beside the awake engine
        (memory.plan_from_peak). Collective while any rank sleeps (decided once in setup, so no
        step pays for it after), because all ranks must agree (the ranks of one engine sleep
        together): one that does not fit keeps every rank's plan as it was."""
        measured, self._update_peak = self._update_peak, None
        if measured is None or not self._some_rank_sleeps or self.run.rollout.free_cache_engine is not None:
            return {}
        plan = self.sleep_plan
        if plan.sleeps:
            plan = memory.plan_from_peak(self._free_awake, *measured, memory.run_update_tokens(self.run, self.dp_size))
        if not all_ranks(not plan.sleeps, self.device):
            return {}
        self._some_rank_sleeps = False
        if plan is self.sleep_plan:
            return {}
        self.sleep_plan = plan
        return {"rollout/sleep_plan": str(plan)}

    def _update_bytes(self) -> int:
        from transformers import AutoConfig

        m = self.run.model
        hf_config = AutoConfig.from_pretrained(m.path, trust_remote_code=m.trust_remote_code)
        return memory.run_update_bytes(
            self.run,
            memory.ModelDims.of(hf_config),
            self.dp_size,
            self.run.backend.model_parallel_size(),
        )

    # ---- rollout -------------------------------------------------------------------------

    def generate(
        self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> tuple[list[list[list[int]]], list[list[list[float]]], float]:
        """Per prompt, n sampled responses and the sampler's log-prob of each token; seconds."""
        t0 = time.perf_counter()
        out = self.rollout.sample(
            prompt_ids, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed
        )
        return out.token_ids, out.logprobs, time.perf_counter() - t0

    # ---- training ------------------------------------------------------------------------

    def update(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        advantages: list[float],
        step: int,
        rollout_logprobs: list[list[float]] | None = None,
    ) -> dict:
        """Sleep the rollout, then the PPO update on this replica's samples. Collective.

        Old log-probs get their own pass only when the update is off-policy (several epochs or
        mini-batches); reference log-probs only when the KL loss uses them. The probe's
        sequences are set apart (`set_probe`, per rollout engine).
        """
        timing = {"timing/sleep": self.sleep(), "rollout/sleeps": float(self._sleeps)}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        batch = build_batch(
            prompts, responses, self.engine.pad_token_id, advantages, self.engine.left_pad_prompts, rollout_logprobs
        )
        if not is_on_policy(self.run):
            t0 = time.perf_counter()
            batch.old_logp = self.engine.log_probs(batch)
            timing["timing/old_logp"] = time.perf_counter() - t0
        if self.run.actor.use_kl_loss:
            t0 = time.perf_counter()
            batch.ref_logp = self.engine.log_probs(batch, reference=True)
            timing["timing/ref_logp"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics = self.engine.update(batch, step)
        timing["timing/update"] = time.perf_counter() - t0
        if self.device.type == "cuda":
            highest = torch.cuda.max_memory_allocated(self.device)
            self._update_peak = (highest - before, int(metrics["actor/micro_batch_tokens_max"]))
            metrics["memory/max_allocated_gib"] = highest / 2**30
            metrics["memory/update_peak_gib"] = (highest - before) / 2**30
        return {**metrics, **timing}

    # ---- sync ----------------------------------------------------------------------------

    def sync(self, probe: bool = True) -> dict:
        """Bring the rollout up to date with the trainer. Collective over all workers.

        With trainer.check_sync the fingerprint always runs, the probe when `probe` (and probe
        sequences are set)."""
        r = self.run.rollout
        t_wake = 0.0
        if self._sleeps:
            t0 = time.perf_counter()
            self.rollout.wake_up(tags=["weights"])
            t_wake = time.perf_counter() - t0
        stats: list[SyncStats] = []
        checks: dict = {}
        if self.run.model.lora.merge or not self.rollout.base_loaded:
            payload, gather_s = self.engine.export(PayloadKind.BASE)
            stats.append(self._apply(payload, gather_s))
            if self.run.trainer.check_sync:
                checks.update(sync_checks.timed_weights_check(self.rollout, self.rank))
        if not self.run.model.lora.merge:
            method = "layered" if r.layered_summon else "bucketed"
            # In the rollout's dtype: vLLM casts to it anyway, and half the bytes cross over.
            dtype = self.rollout.torch_dtype
            payload, gather_s = self.engine.export(PayloadKind.ADAPTER, method=method, dtype=dtype)
            stats.append(self._apply(payload, gather_s))
            if self.run.trainer.check_sync:
                checks.update(sync_checks.timed_adapter_check(self.rollout, payload, self.rank))
        if self._sleeps:
            t0 = time.perf_counter()
            self.rollout.wake_up(tags=["kv_cache"])
            t_wake += time.perf_counter() - t0
        out = {
            "sync/kind": "+".join(s.kind.value for s in stats),
            "sync/num_tensors": sum(s.num_tensors for s in stats),
            "sync/bytes": sum(s.bytes for s in stats),
            "sync/gather_seconds": sum(s.gather_s for s in stats),
            "sync/transfer_seconds": sum(s.transfer_s for s in stats),
            "sync/load_seconds": sum(s.load_s for s in stats),
            "sync/seconds": sum(s.seconds for s in stats),
            "sync/num_adapters": self.rollout.num_adapters(),
        }
        if self._sleeps:
            out["timing/wake"] = t_wake
        out.update(checks)
        if self.run.trainer.check_sync and probe and self.probe_seqs is not None:
            t0 = time.perf_counter()
            out.update(self.probe())
            out["sync/probe_seconds"] = time.perf_counter() - t0
        # Awake again here, so a changed plan takes effect at the next update's sleep.
        out.update(self._replan_sleep())
        return out

    def _apply(self, payload, gather_s: float) -> SyncStats:
        stats = self.rollout.apply(payload)
        stats.gather_s = gather_s
        return stats

    def sleep(self) -> float:
        if not self._sleeps:
            return 0.0
        t0 = time.perf_counter()
        self.rollout.sleep()
        gc.collect()
        torch.cuda.empty_cache()
        return time.perf_counter() - t0

    # The sync checks live in lorarl.sync_checks; these are their call sites.
    def set_probe(self, sequences: list[list[int]]) -> None:
        self.probe_seqs = sync_checks.choose_probes(sequences)

    @property
    def probe_bounds(self) -> sync_checks.ProbeBounds:
        trainer_fp32 = self.engine.compute_dtype == torch.float32
        return sync_checks.probe_bounds(trainer_fp32, self.rollout.dtype, self.run.trainer.check_sync_tolerance)

    def probe(self) -> dict[str, float]:
        """Trainer vs vLLM log-probs on the probe sequences, judged; a failure is a SyncError."""
        reading = sync_checks.measure_probe(self.engine, self.rollout, self.probe_seqs)
        sync_checks.judge_probe(reading, self.probe_bounds, rank=self.rank)
        return reading.as_metrics()

    # ---- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        """Collective; rank 0 writes the adapter (PEFT folder) and the optimizer, every rank its RNG."""
        from safetensors.torch import save_file

        from lorarl.checkpoint import ADAPTER_DIR, flatten_optimizer_state, save_peft_adapter, write_json

        out = Path(directory)
        lora = self.engine.lora_state()
        optim = self.engine.optimizer_state()
        if self.rank == 0:
            save_peft_adapter(out / ADAPTER_DIR, lora, self.engine.adapter_config())
            tensors, meta = flatten_optimizer_state(optim)
            save_file(tensors, str(out / "optimizer.safetensors"))
            write_json(out / "optimizer.json", {**meta, "scheduler": self.engine.scheduler_state()})
        save_file({"torch": torch.get_rng_state()}, str(out / f"rng_rank{self.rank}.safetensors"))
        dist.barrier()

    def load_checkpoint(self, directory: str) -> None:
        from safetensors.torch import load_file

        from lorarl.checkpoint import ADAPTER_DIR, load_peft_adapter, read_json, unflatten_optimizer_state

        src = Path(directory)
        lora, _ = load_peft_adapter(src / ADAPTER_DIR)
        meta = read_json(src / "optimizer.json")
        optim = unflatten_optimizer_state(load_file(str(src / "optimizer.safetensors")), meta)
        self.engine.load_state(lora, optim, meta["scheduler"])
        rng = src / f"rng_rank{self.rank}.safetensors"
        if rng.is_file():
            torch.set_rng_state(load_file(str(rng))["torch"])

    def export_adapter(self, directory: str) -> None:
        """The trained adapter as a standard PEFT folder (rank 0 writes; collective)."""
        from lorarl.checkpoint import save_peft_adapter

        lora = self.engine.lora_state()
        if self.rank == 0:
            save_peft_adapter(directory, lora, self.engine.adapter_config())
        dist.barrier()

    # ---- lifecycle -----------------------------------------------------------------------

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()
            self.rollout = None
        self.engine = None
        if dist.is_initialized():
            from lorarl.rollout import engine_process

            engine_process.release_distributed()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def make_engine(run: RunConfig, device: torch.device) -> Engine:
    """The training engine the backend names (lorarl.engines.BACKENDS)."""
    return backend_of(run).engine_class()(run, device)


# Communication settings the launching shell chose (e.g. NCCL_NVLS_ENABLE=0 where NVLink
# multicast must stay off) reach every worker, also on a Ray cluster whose nodes were started
# with another environment.
FORWARDED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_")


def worker_env() -> dict[str, str]:
    """Environment every worker process needs before vLLM is imported."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    return env | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore"),
    }
