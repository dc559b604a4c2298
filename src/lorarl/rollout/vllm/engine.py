"""In-process vLLM engine for rollouts, and the receiving end of weight sync.

The rollout owns one fact, `base_loaded` ("the base weights are in the engine"),
set by loading from disk or by a base payload and cleared by a sleep that discards
weights. Whether an adapter may be applied, and which sleep level to use, read it;
it is never inferred from vLLM, which still lists an adapter after `sleep(level=2)`
has dropped the base weights under it. Likewise `has_adapter`: true only after an
adapter loaded; a rejected one leaves the rollout refusing to generate until the next
adapter loads, never serving the previous one.

What runs inside vLLM's worker lives in `in_worker`, the LoRA slots in `adapters`; the process-level workarounds
for hosting engines in a trainer's process in `engine_process`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from lorarl.contract.messages import Rollouts
from lorarl.contract.payload import PayloadKind, SyncStats, WeightPayload
from lorarl.contract.specs import LLMArgs
from lorarl.errors import ConfigError, SyncError, one_line
from lorarl.rollout.vllm import base_views, engine_process, in_worker
from lorarl.rollout.vllm.adapters import AdapterSlots, SlotState
from lorarl.rollout.vllm.fingerprints import FingerprintReads
from lorarl.rollout.vllm.names import hf_parts, resolve_base_name
from lorarl.sync.experts import is_moe_checkpoint
from lorarl.sync.fingerprint import fingerprint_sums
from lorarl.sync.transport import AdapterLayout

AdapterTransport = Literal["tmpfs", "memory"]


class VLLMRollout(AdapterSlots, FingerprintReads):
    def __init__(
        self,
        args: LLMArgs,
        *,
        adapter_transport: AdapterTransport = "tmpfs",
        fingerprint_base: bool = False,
        share_weights: bool = False,
    ) -> None:
        """`args`: the engine's arguments, assembled by lorarl.rollout.vllm.engine_args.build.
        `fingerprint_base`: record a fingerprint of every base tensor as it streams in, so
        `sent_weight_fingerprints` / `held_weight_fingerprints` can be compared after a base sync."""
        # The engine must live in this process: weights are pushed into its worker
        # by reference (reload_weights with an iterator, adapters from tensors).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        self._is_cpu = current_platform.is_cpu()
        # Checked here, with vLLM's build in hand: the driver does not import vLLM.
        if args.enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ConfigError(
                "rollout.enable_sleep_mode=true but this vLLM build has no sleep mode (CPU); set it to false"
            )
        model_path = args.model
        self.lora_rank = args.lora_rank
        self.max_lora_rank = args.max_lora_rank
        self.dtype = args.dtype
        self.adapter_transport: AdapterTransport = adapter_transport
        self.enable_sleep_mode = args.enable_sleep_mode
        self.base_loaded = args.load_format != "dummy"
        # The trainer computes with this engine's weights: kept readable, never slept (lorarl.rollout.vllm.base_views).
        self.base_shared = share_weights
        # One per LoRA slot vLLM serves (lorarl.rollout.vllm_adapters): a run's one adapter, or a
        # sweep group's one per job. Whether writing in place matches vLLM's loader (None: not yet
        # checked in this process).
        self._slots = [SlotState() for _ in range(args.max_loras if self.max_lora_rank is not None else 1)]
        self._writes_in_place: bool | None = None
        self._adapter_dir: Path | None = None
        self._param_names: frozenset[str] | None = None  # read from the live engine on first need
        self._served_names: frozenset[str] | None = None
        self._layout: AdapterLayout | None = None
        self.fingerprint_base = fingerprint_base
        # Per HF name, of the last base payload: fingerprint sums (read when checked) and numel.
        self._sent: dict[str, tuple[Tensor, int]] = {}
        # What vLLM has put to sleep ("weights", "kv_cache"): a sync needs the weights awake,
        # generation both (vLLM does not refuse a generate with its cache asleep; it hangs).
        self._asleep: set[str] = set()
        # vLLM's CPU build picks its Triton fused-MoE kernel whenever LoRA is enabled and fails at
        # the first forward (AttributeError: module 'triton.language' has no attribute 'float32');
        # the engine still starts and loads adapters, so the layout can be checked, not served.
        self._cpu_moe_lora = self._is_cpu and self.max_lora_rank is not None and is_moe_checkpoint(model_path)
        tensor_parallel_size = args.tensor_parallel_size

        engine_process.first_engine_in_process()
        with engine_process.process_state_kept(), base_views.dense_linear_weights(share_weights):
            self._llm = LLM(**args.kwargs)
        if self.lora_enabled and adapter_transport == "tmpfs":
            self._adapter_dir = engine_process.make_adapter_dir()
        self._release = engine_process.adopt_engine(self, self._llm, self._adapter_dir)
        # This process's shard of the engine (0 of 1 without tensor parallelism): sync checks
        # compare the part of each tensor that vLLM sliced out for it.
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.tp_size = tensor_parallel_size
        self.tp_rank = get_tensor_model_parallel_rank() if tensor_parallel_size > 1 else 0
        if self._is_cpu and tensor_parallel_size > 1:
            engine_process.unlink_cpu_shm()

    # ------------------------------------------------------------------ state
    @property
    def torch_dtype(self):
        """The dtype the engine holds its weights (and LoRA stacks) in, as vLLM resolved it."""
        return self.llm.llm_engine.vllm_config.model_config.dtype

    @property
    def lora_enabled(self) -> bool:
        return self.max_lora_rank is not None

    @property
    def sleep_level(self) -> int:
        # Read from the one state: a loaded base that only adapters will update must survive
        # the sleep (level 1, kept in host RAM); merged mode resends the base every step, and
        # a base not loaded yet (dummy load) is not worth keeping (level 2).
        return 1 if self.lora_enabled and self.base_loaded else 2

    def num_adapters(self) -> int:
        if not self.lora_enabled:
            return 0  # vLLM raises on list_loras without LoRA
        return len(self.llm.llm_engine.list_loras())

    # ------------------------------------------------------------ public seams
    @property
    def llm(self):
        """The vLLM `LLM` behind this rollout, for benchmarks and checks that call vLLM directly.

        Weights must change only through `apply`, or the rollout's own state stops being true."""
        if self._llm is None:
            raise SyncError("the rollout engine was shut down; build a new VLLMRollout")
        return self._llm

    def run_in_worker(self, fn: Callable, *args):
        """Run `fn(worker, *args)` inside vLLM's worker (one per engine here) and return its result."""
        return self.llm.collective_rpc(fn, args=args)[0]

    # ------------------------------------------------------------- generation
    def sample(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 64,
        seed: int | None = None,
        slots: Sequence[int] | None = None,
        temperatures: Sequence[float] | None = None,
        top_ps: Sequence[float] | None = None,
    ) -> Rollouts:
        """Per prompt, `n` responses and the log-prob of each sampled token, with the seconds taken.
        Each prompt is sampled with the adapter of its LoRA slot (`slots`, default 0) and, where
        given, its own temperature and top_p: a sweep group's adapters in one call.

        Log-probs are vLLM's "processed" ones: after temperature (and top-k/top-p, which the
        trainer does not apply: with top_p < 1 they are renormalised over the nucleus).
        """
        self._check_awake()
        t0 = time.perf_counter()
        from vllm import SamplingParams

        # One seed per call, for the process RNG that vLLM's sampler draws from, not one per
        # request: vLLM draws a seeded request's noise row by row in a Python loop every decode
        # step (256 launches per step at 32 prompts x 8 samples), and on CPU vLLM 0.32 crashes
        # on seeded requests whose prefill gets chunked ("CPU Generator does not use offset").
        # Reproducible for the same prompts and engine; the ranks of a tensor-parallel engine
        # seed alike, so they sample in lockstep. The caller's RNG state is restored after.
        def drawn(t: float, p: float) -> SamplingParams:
            return SamplingParams(n=n, temperature=t, top_p=p, max_tokens=max_tokens, logprobs=0, detokenize=False)

        requests = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        if slots is None:
            params, adapters = drawn(temperature, top_p), self.lora_request()
        else:
            ts, ps = temperatures or [temperature] * len(slots), top_ps or [top_p] * len(slots)
            params = [drawn(t, p) for t, p in zip(ts, ps, strict=True)]
            adapters = [self.lora_request(slot) for slot in slots]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and not self._is_cpu else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            outs = self.llm.generate(requests, params, lora_request=adapters, use_tqdm=False)
        tokens, logprobs = [], []
        for out in outs:
            tokens.append([list(c.token_ids) for c in out.outputs])
            logprobs.append([[step[t].logprob for step, t in zip(c.logprobs or [], c.token_ids)] for c in out.outputs])
        return Rollouts(tokens, logprobs, time.perf_counter() - t0)

    def _check_awake(self) -> None:
        if self._asleep:
            tags = sorted(self._asleep)
            raise SyncError(
                f"the rollout engine is asleep ({' and '.join(tags)}); call wake_up({tags}) before generating"
            )

    def prompt_logprobs(self, token_ids: Sequence[int], start: int, slot: int = 0) -> list[float]:
        """Log-probs vLLM gives token_ids[start:] after their prefix (slot `slot`'s adapter attached)."""
        return self.prompt_logprobs_many([token_ids], start, slot)[0]

    def prompt_logprobs_many(self, sequences: Sequence[Sequence[int]], start: int, slot: int = 0) -> list[list[float]]:
        """prompt_logprobs for several sequences, one engine call each: vLLM's LoRA logits
        processor (Qwen3 wraps lm_head) sizes its per-token LoRA indices for the sampled tokens,
        so prompt log-probs of a batch of several requests fail in its shrink kernel
        ("einsum(): subscript b has size 3 ... size 7", vLLM 0.32 CPU); one request at a time works."""
        from vllm import SamplingParams

        self._check_awake()
        for token_ids in sequences:
            if not 1 <= start < len(token_ids):
                raise ValueError(f"start={start} must lie in 1..{len(token_ids) - 1}")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = [
            self.llm.generate(
                [{"prompt_token_ids": list(t)}], params, lora_request=self.lora_request(slot), use_tqdm=False
            )[0]
            for t in sequences
        ]
        return [
            [out.prompt_logprobs[i][token_ids[i]].logprob for i in range(start, len(token_ids))]
            for out, token_ids in zip(outs, sequences)
        ]

    # ------------------------------------------------------------------- sync
    def apply(self, payload: WeightPayload, slot: int = 0) -> SyncStats:
        """Load a base payload, or an adapter payload into LoRA slot `slot`."""
        if not isinstance(payload, WeightPayload):
            raise SyncError(f"rollout.apply needs a WeightPayload, got {type(payload).__name__}")
        if "weights" in self._asleep:
            raise SyncError("the rollout engine is asleep; call wake_up(['weights']) before a sync")
        if payload.kind is PayloadKind.BASE:
            stats = self._apply_base(payload)
        else:
            stats = self._apply_adapter(payload, slot)
        self.reset_prefix_cache()  # cached KV was computed with the old weights
        return stats

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def _apply_base(self, payload: WeightPayload) -> SyncStats:
        stats = SyncStats(PayloadKind.BASE)

        cast = self.run_in_worker(in_worker.model_dtype) if self.fingerprint_base else None
        self._sent = {}

        def counted() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in payload.tensors:
                stats.num_tensors += 1
                stats.bytes += tensor.numel() * tensor.element_size()
                if cast is not None:  # where the tensor lives, before vLLM takes it
                    self._sent[name] = (fingerprint_sums(tensor, cast), tensor.numel())
                yield name, tensor

        start = time.perf_counter()
        # A failure part-way leaves some layers old and some new: whatever the cause,
        # the engine no longer holds a known base until a full base payload succeeds.
        self.base_loaded = False
        try:
            # reload_weights, not load_weights: on CPU vLLM re-packs linear weights into
            # its GEMM layout and leaves empty placeholders, so raw parameter writes land
            # nowhere; the reload path re-runs that processing, with or without LoRA.
            live = self._live_param_names()
            sent: list[str] = []

            def resolved() -> Iterator[tuple[str, Tensor]]:
                for name, tensor in counted():
                    sent.append(name)
                    yield resolve_base_name(name, live), tensor

            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": resolved()})
            if self._is_cpu:
                self.run_in_worker(in_worker.prepack_cpu_experts)
        except Exception as exc:
            # Close vLLM's half-done reload so the next base payload starts clean (without
            # this, a second failed sync in a row wedged every later reload).
            self.run_in_worker(in_worker.finish_interrupted_reload)
            if isinstance(exc, SyncError):
                raise
            raise SyncError(f"vLLM could not load the base payload: {one_line(exc)}") from exc
        stats.load_s = time.perf_counter() - start
        if stats.num_tensors == 0:
            raise SyncError("base payload was empty; nothing was loaded into the engine")
        self._check_base_complete(sent)
        self.base_loaded = True
        # vLLM drops every adapter when base weights are replaced; put ours back.
        stats.load_s += self._reload_adapters()
        return stats

    def _live_param_names(self) -> frozenset[str]:
        """Parameter names that need `.base_layer` spelled out (empty where the engine's
        LoRA wrappers load plain HF names themselves), read once from the live model."""
        if self._param_names is None:
            self._param_names = frozenset(self.run_in_worker(in_worker.wrapped_param_names))
        return self._param_names

    def _check_base_complete(self, sent: list[str]) -> None:
        """Every parameter vLLM serves was in the payload: after a level-2 sleep (or a dummy
        load) whatever a base payload leaves out is garbage, and vLLM does not say so. Names
        vLLM has no parameter for (a tied lm_head) are its loader's business."""
        if self._served_names is None:
            served = self.run_in_worker(in_worker.param_names)
            self._served_names = frozenset(part for name in served for part in hf_parts(name))
        missing = sorted(self._served_names - set(sent))
        if missing:
            raise SyncError(
                f"base payload covered {len(self._served_names) - len(missing)} of the {len(self._served_names)} "
                f"weights vLLM serves ({len(sent)} tensors sent); missing e.g. {', '.join(missing[:3])}: "
                "the engine now holds stale or garbage weights there"
            )

    # ------------------------------------------------------------------ sleep
    def sleep(self, level: int | None = None) -> None:
        if not self.enable_sleep_mode:
            raise ConfigError("rollout.enable_sleep_mode is false; this engine cannot sleep")
        if self.base_shared:  # the trainer computes with these weights while the engine sleeps
            return self._asleep.update(base_views.release_kv_cache(self.llm))
        level = self.sleep_level if level is None else level
        if level not in (1, 2):
            raise ConfigError(f"sleep level {level} is not 1 or 2")
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}
        if level == 2:  # level 2 discards weights (LoRA slots too); the adapter listing lies
            self.base_loaded = False
            for state in self._slots:
                state.structure = None

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags)
        woke = self._asleep if tags is None else self._asleep & set(tags)
        self._asleep = self._asleep - woke
        if "weights" in woke:
            if self.lora_enabled:
                self.refresh_lora_mapping()
        self.llm.reset_prefix_cache()

    def refresh_lora_mapping(self) -> None:
        """Make vLLM rewrite its per-batch LoRA index tensors before the next forward.

        They live in the weights memory pool, so a level-2 sleep discards them, and vLLM only
        rewrites them when a batch's LoRA mapping differs from the last one: the same probe
        sequence after a level-2 sleep then ran with garbage indices (H200, vLLM 0.26: log-prob
        off by 0.3-2.6 while every weight was right)."""
        self.run_in_worker(in_worker.forget_lora_mapping)

    # --------------------------------------------------------------- teardown
    def shutdown(self) -> None:
        """Free the engine (and its adapter folder); safe to call twice."""
        self._llm = None
        self._slots = [SlotState() for _ in self._slots]
        self._layout = None
        release = getattr(self, "_release", None)
        if release is not None:
            release()

    def __enter__(self) -> VLLMRollout:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
