"""Whether a worker's vLLM engine sleeps while the trainer updates, and the sleeping itself.

Decided once, at setup, from lorarl.rollout.memory's estimate of the update's peak against the memory
free beside the awake engine (a wrong "awake" would be an out-of-memory error, a wrong "sleep"
costs only time); revised once after the first update that slept, from its measured peak. All
ranks agree on it: the ranks of one vLLM engine sleep together.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from lorarl.contract.specs import SleepSpec
from lorarl.rollout import memory
from lorarl.rollout.memory import SleepPlan, plan_sleep


def all_ranks(ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank of the job (collective: every rank calls it)."""
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag.item() == 1.0


def can_sleep(free_cache_engine: bool | None, device: str) -> bool:
    """The engine is built able to sleep (GPU, unless rollout.free_cache_engine=false)."""
    return device == "cuda" and free_cache_engine is not False


class RolloutSleep:
    def __init__(self, spec: SleepSpec, device: torch.device, rollout):
        self.spec, self.device, self.rollout = spec, device, rollout
        self._free_awake = 0  # bytes free beside the awake engine, measured in setup (GPU)
        self._update_peak: tuple[int, int] | None = None  # (bytes, largest micro-batch's tokens)
        self._said_still_asleep = False
        self.plan = self._initial_plan()
        # The same on every rank: whether re-planning can change anything.
        self._some_rank_sleeps = device.type == "cuda" and not all_ranks(not self.plan.sleeps, device)
        if self.sleeps:
            rollout.sleep()

    @property
    def sleeps(self) -> bool:
        """The rollout sleeps during every update."""
        return self.plan.sleeps

    def _initial_plan(self) -> SleepPlan:
        if self.device.type != "cuda":
            return SleepPlan(False, "CPU: vLLM's CPU build cannot sleep")
        setting = self.spec.free_cache_engine
        if setting is not None:
            return plan_sleep(setting)
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        self._free_awake = free
        return plan_sleep(None, free, self.spec.update_bytes)

    def sleep(self) -> float:
        """Before an update: the engine to sleep if the plan says so; seconds spent."""
        if not self.sleeps:
            return 0.0
        t0 = time.perf_counter()
        self.rollout.sleep()
        gc.collect()
        torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def wake(self, tags: list[str]) -> float:
        """Wake the engine's `tags` (weights before a sync, kv_cache after); seconds spent."""
        if not self.sleeps:
            return 0.0
        t0 = time.perf_counter()
        # The update's freed blocks stay in torch's cache, where vLLM's allocator (cuMem, outside
        # it) cannot reach them: a Megatron 0.5B update's ~75 GiB left the KV cache no room.
        torch.cuda.empty_cache()
        self.rollout.wake_up(tags=tags)
        return time.perf_counter() - t0

    def record_update(self, peak_bytes: int, micro_batch_tokens_max: int) -> None:
        self._update_peak = (peak_bytes, micro_batch_tokens_max)

    def replan(self) -> str | None:
        """After an update that ran with the rollout asleep on the estimate's word: awake from the
        next update on if the update's measured peak fits beside the awake engine
        (memory.plan_from_peak). Collective while any rank sleeps (decided once in setup, so no
        step pays for it after), because all ranks must agree: one that does not fit keeps every
        rank's plan as it was. Called awake, so a changed plan takes effect at the next sleep. Returns the new plan, as a
        line for the log, when it changed, and the measured plan the first time it keeps the sleep."""
        measured, self._update_peak = self._update_peak, None
        if measured is None or not self._some_rank_sleeps or self.spec.free_cache_engine is not None:
            return None
        plan = self.plan
        if plan.sleeps:
            plan = memory.plan_from_peak(self._free_awake, *measured, self.spec.update_tokens)
        if not all_ranks(not plan.sleeps, self.device):
            # Still asleep: the measured reason is said once (on the ranks whose own peak does
            # not fit), so that a log shows why a run keeps paying for the sleep.
            said, self._said_still_asleep = self._said_still_asleep, True
            return None if said or not plan.sleeps else str(plan)
        self._some_rank_sleeps = False
        if plan is self.plan:
            return None
        self.plan = plan
        return str(plan)
