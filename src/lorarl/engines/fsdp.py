"""FSDP2 training engine around a PEFT LoRA model.

`fully_shard` wraps every decoder layer, then the root. Only LoRA weights train; the frozen
base keeps its load dtype while LoRA weights and optimizer state stay float32 (FSDP2 only
asks trainable params to share a dtype). The reference policy is this same model under
`disable_adapter()`: no second model is built.

Export is explicit: `export(kind)` returns a `WeightPayload` whose kind the caller chose.
Adapter tensors can be gathered two ways:
- bucketed (default): one all-gather of every rank's local LoRA shards, never touching base
  weights;
- layered (`rollout.layered_summon`): unshard one FSDP unit at a time, copy its LoRA params.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lorarl.algorithms import losses
from lorarl.contract.engine import (
    EntropyMode,
    LossFn,
    TrainBatch,
    causal_mask,
    plan_micro_batches,
    position_ids,
    read_metrics,
)
from lorarl.contract.payload import PayloadKind, WeightPayload
from lorarl.contract.specs import EngineSpec
from lorarl.engines import fsdp_export
from lorarl.engines.adapter_routing import AdapterRouter, Segments, route_adapters
from lorarl.engines.fsdp_export import peft_name
from lorarl.engines.fsdp_shard import compile_layers, reshard_all, shard
from lorarl.engines.liger import LIGER_MODEL_TYPES, apply_liger_kernel
from lorarl.engines.lora_linear import fuse_lora_linears
from lorarl.engines.routed_expert_lora import route_expert_lora
from lorarl.engines.shared_base import frozen_params, model_on_views
from lorarl.errors import ModelError, first_line
from lorarl.files.peft_io import peft_lora_config
from lorarl.sync.experts import expert_wrappers
from lorarl.sync.semantic import Projection, trainer_loras, trainer_projections
from lorarl.sync.semantic_merged import BaseProjections, base_projections, trainer_bases

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_lora_model(spec: EngineSpec, base: dict[str, torch.Tensor] | None = None, router: AdapterRouter | None = None):
    """HF causal LM with the spec's PEFT LoRA adapters, ready to shard: loaded on CPU, or over
    `base`'s views. Several adapters train side by side, each row routed through its own by
    `router` (lorarl.engines.adapter_routing)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    m = spec.model
    liger = spec.liger_kernel
    try:
        model = (
            AutoModelForCausalLM.from_pretrained(
                m.path,
                dtype=DTYPES[m.dtype],
                trust_remote_code=m.trust_remote_code,
                attn_implementation="sdpa",
                use_safetensors=True,
            )
            if base is None
            else model_on_views(m.path, DTYPES[m.dtype], base, m.trust_remote_code)
        )
    except (OSError, ValueError) as err:
        raise ModelError(f"model.path={m.path!r} could not be loaded as a causal LM: {first_line(err)}") from err
    # Automatic (null) only where Liger has kernels for the model (not Qwen3-MoE); asked for
    # explicitly, an unsupported model is an error.
    if liger and (spec.backend.liger_kernel or model.config.model_type in LIGER_MODEL_TYPES):
        apply_liger_kernel(model)
    if m.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    adapters = spec.adapters
    peft_model = None
    for adapter in adapters:
        lora = adapter.lora
        try:
            if peft_model is None:
                peft_model = get_peft_model(model, peft_lora_config(lora), adapter_name=adapter.name)
            else:
                peft_model.add_adapter(adapter.name, peft_lora_config(lora))
        except ValueError as err:
            raise ModelError(
                f"model.lora.target_modules={list(lora.target_modules)} / target_parameters="
                f"{list(lora.target_parameters)} matched nothing in {m.path}: {first_line(err)}"
            ) from err
    if len(adapters) > 1:
        peft_model.base_model.set_adapter([a.name for a in adapters])  # every adapter trains
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if spec.backend.fused_lora:
        fuse_lora_linears(peft_model)
    if spec.backend.routed_expert_lora:
        route_expert_lora(peft_model)
    if len(adapters) > 1:
        route_adapters(peft_model, router)
    return peft_model


def takes_prepared_masks(config) -> bool:
    """Whether the model's forward takes the attention masks ready-made, as a dict keyed by
    layer type (transformers' Qwen2/Qwen3 code; `generate` hands them over so). Only for models
    whose every layer attends fully: one causal mask then serves all of them."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return config.model_type in ("qwen2", "qwen3") and set(layer_types) == {"full_attention"}


class FSDPEngine:
    def __init__(self, spec: EngineSpec, device: torch.device, *, base: dict | None = None):
        """`spec` for its model, actor and backend groups. Its seed is not used: LoRA's init draws
        from the process RNG the worker and vLLM seeded (lorarl.workers.worker.Worker.setup). `base`: the
        shared base's views (load_lora_model); each rank then holds the whole base and FSDP
        manages only the LoRA parameters."""
        self.spec = spec
        self.device = device
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        on_gpu = device.type == "cuda"
        self.router = AdapterRouter()
        peft_model = load_lora_model(spec, base, self.router)
        b = spec.backend
        mp = MixedPrecisionPolicy(
            param_dtype=DTYPES[b.mixed_precision] if on_gpu else None,
            reduce_dtype=torch.float32,
        )
        kwargs = dict(mp_policy=mp, reshard_after_forward=b.reshard_after_forward)
        kwargs["ignored_params"] = frozen_params(peft_model) if base is not None else None
        if on_gpu and (b.param_offload or b.optimizer_offload):
            kwargs["offload_policy"] = CPUOffloadPolicy()
        mesh = dist.device_mesh.init_device_mesh(device.type, (self.world,))
        if b.compile:
            compile_layers(peft_model)
        # Before sharding: fully_shard keeps module names, and PEFT's saved names are module names.
        self.expert_wrappers = expert_wrappers(peft_model)
        self.model = shard(peft_model, mesh, device, **kwargs)
        self.adapter_names = [a.name for a in spec.adapters]
        # Each adapter's own factors, optimizer and schedule: its parameters are no other's.
        self.trainable = [adapter_params(self.model, name) for name in self.adapter_names]
        self.optimizers, self.schedulers = [], []
        for params, adapter in zip(self.trainable, spec.adapters, strict=True):
            o = adapter.actor.optim
            optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
            self.optimizers.append(optimizer)
            self.schedulers.append(torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup(o.warmup_steps)))
        self.prepared_masks = takes_prepared_masks(self.model.config) and not spec.model.trust_remote_code

    # ---- the Engine contract's plain facts ----------------------------------------------

    @property
    def pad_token_id(self) -> int:
        pad = self.model.config.pad_token_id
        return 0 if pad is None else int(pad)

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world

    @property
    def compute_dtype(self) -> torch.dtype:
        # FSDP's mixed precision casts the gathered params on GPU only.
        if self.device.type == "cuda" and self.spec.backend.mixed_precision == "bfloat16":
            return torch.bfloat16
        return DTYPES[self.spec.model.dtype]

    # Responses start in one column, so logits are computed for the response columns only.
    left_pad_prompts = True

    def dp_all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    # ---- forward -------------------------------------------------------------------------

    def _prepare(self, mb: TrainBatch) -> tuple[TrainBatch, int, bool]:
        """The micro-batch without its all-padding columns, on the device, the first column
        whose logits score a response token, and whether any position is padding; found on
        the host, before the copy."""
        mb = mb.trimmed()
        cols = mb.response_mask.bool().any(0).nonzero()
        first = int(cols[0]) if cols.numel() else mb.input_ids.shape[1] - 2
        padded = not bool(mb.attention_mask.all())
        return mb.to(self.device), first, padded

    def _forward(
        self, mb: TrainBatch, first: int, padded: bool, temperature: float, entropy: EntropyMode
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs [b, T], entropy [b, T] or None) of a prepared micro-batch.

        The LM head runs only from column `first`: at a 152k vocabulary the head is a large
        share of the forward, and its logits the largest activation.
        """
        ids, attn = mb.input_ids, mb.attention_mask
        masks = attn
        if self.prepared_masks:
            # Given the 2D mask, transformers reads it on the host to choose between SDPA's
            # causal kernel and a mask (a wait for the device in every forward); the host
            # already knows which micro-batches hold padding.
            masks = {"full_attention": causal_mask(attn) if padded else None}
        out = self.model(
            input_ids=ids,
            attention_mask=masks,
            position_ids=position_ids(attn),
            use_cache=False,
            logits_to_keep=ids.shape[1] - first,
        )
        # Positions first .. L-1; each but the last predicts a token of the batch. The last is
        # skipped by reading, not by a slice (a slice would copy every logit).
        labels = ids[:, first + 1 :]
        if isinstance(temperature, float | int):
            logp, ent = losses.logprobs_and_entropy(out.logits, labels, temperature, entropy)
        else:  # one temperature per adapter: each adapter's rows at its own
            parts = [
                losses.logprobs_and_entropy(out.logits[rows], labels[rows], temperature[i], entropy)
                for i, rows in mb.segments()
            ]
            logp = torch.cat([p[0] for p in parts])
            ent = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
        logp = F.pad(logp, (first, 0))
        return logp, None if ent is None else F.pad(ent, (first, 0))

    # Both passes below copy every micro-batch to the device before the first forward and read
    # results back after the last: a copy from pageable host memory, or a read of a device
    # value, makes the host wait for the device, and the GPU then idles while the host queues
    # the next micro-batch's kernels.

    @torch.no_grad()
    def log_probs(self, batch: TrainBatch, *, temperature: float, reference: bool = False) -> torch.Tensor:
        """Log-probs of every next token at `temperature`; `reference=True` runs the base with
        the adapter disabled."""
        self.model.eval()
        row_sets = plan_micro_batches(self, batch, self.spec.actor, backward=False)
        if batch.adapter is not None:  # one segment per adapter (lorarl.engines.adapter_routing)
            of = batch.adapter.tolist()
            row_sets = [sorted(rows, key=of.__getitem__) for rows in row_sets]
        micro = [batch.select(rows) for rows in row_sets]
        prepared = [self._prepare(mb) for mb in micro]
        ctx = self.model.disable_adapter() if reference else contextlib.nullcontext()
        with ctx:
            results = []
            for p in prepared:
                with self._routed(p[0]):
                    results.append(self._forward(*p, temperature, entropy="none")[0])
            if not self.spec.backend.reshard_after_forward:
                # Before the adapter is turned back on, which sets requires_grad on whichever
                # parameters are registered at that moment (see reshard_all).
                reshard_all(self.model)
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        for rows, mb, logp in zip(row_sets, micro, results, strict=True):
            first, last = mb.trim_span()
            out[rows, first : last - 1] = logp.float().cpu()
        return out

    # ---- update (lorarl.algorithms.ppo drives it) ----------------------------------------------------

    def forward_backward(
        self, micro: list[TrainBatch], loss_fn: LossFn, entropy: EntropyMode, temperature: float
    ) -> list[dict[str, float]]:
        self.model.train()
        prepared = [self._prepare(mb) for mb in micro]
        metrics = []
        for i, (mb, first, padded) in enumerate(prepared):
            # Reduce-scatter the gradients once, after the last micro-batch.
            self.model.set_requires_gradient_sync(i == len(prepared) - 1)
            # The backward too: activation checkpointing runs the forward again there.
            with self._routed(mb):
                logp, ent = self._forward(mb, first, padded, temperature, entropy)
                loss, m = loss_fn(mb, logp, ent)
                loss.backward()
            metrics.append(m)
        return read_metrics(metrics)

    def _routed(self, mb: TrainBatch):
        """The block inside which each row of `mb` goes through its own adapter (nothing to route
        with one adapter)."""
        if len(self.adapter_names) == 1:
            return contextlib.nullcontext()
        return self.router.route(Segments.of(mb.adapter.tolist(), self.adapter_names))

    def optimizer_step(self, step: int, skip: Sequence[int] = ()) -> list[float]:
        """Clip each adapter's gradient by its own norm and step its optimizer; every gradient
        zeroed after. The grad norm per adapter; an adapter in `skip`, or whose norm is not
        finite, is left as it was."""
        norms = []
        for i, (params, adapter, optimizer) in enumerate(zip(self.trainable, self.spec.adapters, self.optimizers)):
            norm = torch.nn.utils.clip_grad_norm_(params, adapter.actor.grad_clip)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            norm = float(norm)
            if i not in skip and math.isfinite(norm):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            norms.append(norm)
        return norms

    def end_step(self) -> list[float]:
        used = [scheduler.get_last_lr()[0] for scheduler in self.schedulers]
        for scheduler in self.schedulers:
            scheduler.step()
        return used

    # ---- export --------------------------------------------------------------------------

    def adapter_config(self, adapter: int = 0) -> dict:
        cfg = self.model.peft_config[self.adapter_names[adapter]].to_dict()
        # JSON-friendly: PEFT stores target_modules as a set and task_type as an enum.
        cfg["target_modules"] = (
            sorted(cfg["target_modules"]) if not isinstance(cfg["target_modules"], str) else cfg["target_modules"]
        )
        if cfg.get("target_parameters"):  # a set in PEFT; PEFT needs it back to rebuild the expert wrappers
            cfg["target_parameters"] = sorted(cfg["target_parameters"])
        cfg["task_type"] = str(getattr(cfg.get("task_type"), "value", cfg.get("task_type")))
        cfg["peft_type"] = str(getattr(cfg.get("peft_type"), "value", cfg.get("peft_type")))
        cfg["base_model_name_or_path"] = self.spec.model.path
        return {k: v for k, v in cfg.items() if _jsonable(v)}

    # How an adapter can be gathered; the first is the default.
    EXPORT_METHODS = ("bucketed", "layered")

    def export(
        self, kind: PayloadKind, method: str | None = None, dtype: torch.dtype | None = None, adapter: int = 0
    ) -> tuple[WeightPayload, float]:
        """The payload of `kind` plus the seconds spent gathering it (collective: all ranks call);
        an adapter payload holds adapter number `adapter` (the run's one, or one of a group's).
        Adapter tensors are cast to `dtype` (the rollout's) and stay on the training device: an
        in-process rollout on the same GPU takes them device to device (a host round trip of
        0.3 GB at 7B cost more than the rest of the sync); consumers that need host memory
        (a PEFT folder, a checkpoint) copy them there."""
        t0 = time.perf_counter()
        if kind is PayloadKind.ADAPTER:
            gather = {"bucketed": fsdp_export.adapter_bucketed, "layered": fsdp_export.adapter_layered}
            tensors = gather[method or self.EXPORT_METHODS[0]](
                self.model, self.adapter_names[adapter], self.device, dtype
            )
            # Experts stay in PEFT's stacks (one pair per fused parameter, not 6 x E tensors a layer):
            # the rollout writes them into vLLM's per-expert slots (lorarl.sync.experts).
            payload = WeightPayload.adapter(tensors, self.adapter_config(adapter), self.expert_wrappers)
            return payload, time.perf_counter() - t0
        merge = self.spec.model.lora.merge
        return WeightPayload.base(self.base_stream(merge=merge)), time.perf_counter() - t0

    def base_stream(self, merge: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Plain-HF-named base weights, one FSDP unit unsharded at a time; merged W + BA if asked."""
        lora = self.spec.model.lora
        return fsdp_export.base_stream(self.model, self.expert_wrappers, lora.alpha / lora.rank, merge)

    # ---- sync checks -----------------------------------------------------------------------

    def lora_projections(self, adapter: int = 0) -> dict[str, Projection]:
        """The semantic check's expected side: u^T dW v per LoRA module, from this model's own
        factors and per-module scaling (lorarl.sync.semantic). Collective: one all-reduce."""
        loras = trainer_loras(self.model, self.adapter_names[adapter])
        return trainer_projections(loras, _all_reduce if self.world > 1 else None)

    def base_projections(self) -> BaseProjections:
        """The merged check's cached base side (lorarl.sync.semantic_merged). Collective."""
        return base_projections(trainer_bases(self.model), _all_reduce if self.world > 1 else None)

    def lora_parameters(self, adapter: int = 0) -> list[torch.Tensor]:
        """An adapter's trainable LoRA factors (FSDP shards), for the first sync's self-test."""
        return self.trainable[adapter]

    # ---- checkpoint ------------------------------------------------------------------------

    def lora_state(self, adapter: int = 0) -> dict[str, torch.Tensor]:
        """An adapter's full LoRA tensors under PEFT names, in host memory (collective)."""
        named = fsdp_export.adapter_bucketed(self.model, self.adapter_names[adapter], self.device)
        return {name: t.cpu() for name, t in named.items()}

    def optimizer_state(self, adapter: int = 0) -> dict:
        """An adapter's full (unsharded) optimizer state keyed by parameter name (collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.model, self.optimizers[adapter], options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_state(
        self, lora: dict[str, torch.Tensor], optimizer: dict | None, scheduler: dict | None, adapter: int = 0
    ) -> None:
        """Put an adapter's full LoRA tensors (PEFT names) back into the shards; restore its
        optimizer and schedule."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        from torch.distributed.tensor import distribute_tensor

        mine = f".{self.adapter_names[adapter]}."
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if not p.requires_grad or mine not in name:
                    continue
                key = peft_name(name)
                if key not in lora:
                    raise ModelError(
                        f"checkpoint adapter has no tensor {key}; was it saved with another model.lora config?"
                    )
                full = lora[key].to(dtype=p.dtype)
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements).to_local())
                else:
                    p.copy_(full)
        if optimizer is not None:
            set_optimizer_state_dict(
                self.model, self.optimizers[adapter], optimizer, options=StateDictOptions(full_state_dict=True)
            )
        if scheduler is not None:
            lambdas = [None] * len(self.optimizers[adapter].param_groups)
            self.schedulers[adapter].load_state_dict({**scheduler, "lr_lambdas": lambdas})

    def scheduler_state(self, adapter: int = 0) -> dict:
        return {k: v for k, v in self.schedulers[adapter].state_dict().items() if k != "lr_lambdas"}


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu" and dist.get_backend() == "nccl":  # shards offloaded to the host
        t = t.cuda()
    dist.all_reduce(t)
    return t


def _jsonable(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool, list, dict))


def adapter_params(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    """The trainable parameters of adapter `name`, in the model's order."""
    mine = f".{name}."
    return [p for n, p in model.named_parameters() if p.requires_grad and mine in n]


def _warmup(steps: int):
    """The learning-rate factor at a step: linear warm-up over `steps`, then 1."""
    warm = max(steps, 0)
    return lambda step: min(1.0, (step + 1) / warm) if warm else 1.0
