"""GRPO actor on megatron-core, built through Megatron-Bridge's provider path (GPU only).

One instance per rank; every method is collective over the ranks of the job (they all call it
with the same model-parallel group data). Data parallel size is world / (TP x PP): ranks of the
same TP/PP group must receive the same micro-batches (`dp_rank` / `dp_size` say which share).
Implements lorarl.contract.engine.Engine; the PPO update is the shared one, this class supplies
the forward/backward through Megatron's pipeline schedule.

Not supported here: the TransformerEngine spec and sequence parallelism need TransformerEngine
(the local spec runs through te_standin), fp16 and virtual pipeline stages are untested.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch

from lorarl.contract.engine import (
    EntropyMode,
    LossFn,
    TrainBatch,
    check_grad_norm,
    plan_micro_batches,
    read_metrics,
)
from lorarl.contract.specs import EngineSpec
from lorarl.engines.megatron.base_projections import megatron_base_projections, model_bases
from lorarl.engines.megatron.bridge import MegatronBridgeAdapter
from lorarl.engines.megatron.config_map import (
    apply_provider_plan,
    peft_adapter_config,
    peft_spec,
    provider_plan,
    require_cuda,
)
from lorarl.engines.megatron.experts import ExpertParallel, gather_expert_adapter, num_experts_of, torch_all_gather
from lorarl.engines.megatron.projections import megatron_lora_projections, model_lora, shape_from_config
from lorarl.errors import ConfigError, TrainingError
from lorarl.sync.semantic_merged import BaseProjections

log = logging.getLogger(__name__)

_NO_CHECKPOINTS = "resuming from a checkpoint is not supported with +backend=megatron yet; use +backend=fsdp"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_right_padded(attention_mask: torch.Tensor) -> None:
    """Megatron attention here is causal only (TE: no mask at all), so a row may not have
    padding before a real token; lorarl.contract.engine.build_batch right-pads prompt + response."""
    m = attention_mask.bool()
    if m.shape[1] > 1 and bool((~m[:, :-1] & m[:, 1:]).any()):
        raise ValueError("the Megatron engine needs right-padded rows (no padding before a real token)")


class MegatronEngine:
    """Policy with LoRA on megatron-core: log-probs (with and without the adapter), PPO update,
    weight export. Same interface as lorarl.engines.fsdp.FSDPEngine."""

    # Megatron's local attention is causal-only: rows are right-padded (check_right_padded).
    left_pad_prompts = False
    adapter_names = ("default",)  # one: the shared-base launcher runs Megatron jobs one after another

    def __init__(self, spec: EngineSpec, device: torch.device | None = None) -> None:
        """`spec` for its model, actor and backend groups (only those are kept) and its seed
        (trainer.seed) for Megatron's model-parallel CUDA RNG."""
        require_cuda()
        seed = spec.seed
        self.model_cfg, self.actor, self.backend = spec.model, spec.actor, spec.backend
        self.lora = self.model_cfg.lora
        self.path = self.model_cfg.path
        self.dtype_name = self.model_cfg.dtype
        self.compute_dtype = DTYPES[self.dtype_name]

        from transformers import AutoConfig

        hf_config = self.hf_config = AutoConfig.from_pretrained(self.path, trust_remote_code=False)
        self.pad_token_id = hf_config.pad_token_id if hf_config.pad_token_id is not None else 0
        self.tp = self.backend.tensor_model_parallel_size
        self.pp = self.backend.pipeline_model_parallel_size
        self.sp = self.backend.sequence_parallel
        self.impl = self.backend.transformer_impl
        self.peft_spec = peft_spec(self.lora)
        if self.peft_spec.widened:
            log.warning(
                "model.lora.type=lora fuses q/k/v and gate/up: %s also get LoRA; use model.lora.type=canonical_lora "
                "to adapt only the listed projections",
                ",".join(self.peft_spec.widened),
            )
        self._init_parallel(device, seed)
        self.num_experts = num_experts_of(hf_config)
        from megatron.core import parallel_state

        self.ps = parallel_state
        self.model, self.peft, self.bridge = self._build()
        self.optimizer = self._build_optimizer()
        self._steps = 0
        self._lr = self._lr_at(0)
        self._causal_masks: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ setup

    def _init_parallel(self, device: torch.device | None, seed: int) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel

        if device is not None:
            torch.cuda.set_device(device)
        elif not dist.is_initialized():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            # Ours, explicitly: provide_distributed_model would otherwise create one silently.
            # Bound to the device so that NCCL connects every group now (lorarl.workers.worker says why).
            dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=self.tp,
                pipeline_model_parallel_size=self.pp,
                expert_model_parallel_size=self.backend.expert_model_parallel_size,
                expert_tensor_parallel_size=self.backend.expert_tensor_parallel_size,
            )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    def _build(self) -> tuple[list, Any, Any]:
        from lorarl.engines.megatron.te_standin import import_megatron_bridge

        mb = import_megatron_bridge(self.impl)
        from megatron.core.distributed import DistributedDataParallelConfig

        auto = mb.AutoBridge.from_hf_pretrained(self.path, trust_remote_code=False, torch_dtype=DTYPES[self.dtype_name])
        # load_weights=True registers the HF-load hook first; ours runs after it, so LoRA wraps
        # an already loaded model and the adapter keeps its own init (B = 0).
        provider = auto.to_megatron_provider(load_weights=True)
        apply_provider_plan(provider, provider_plan(self.backend, self.dtype_name))
        peft = self.peft_spec.build()

        def apply_lora(model: list) -> list:
            model = peft(model, training=True)
            peft.set_params_to_save(model)
            return model

        provider.register_pre_wrap_hook(apply_lora)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=self.backend.use_distributed_optimizer,
            check_for_nan_in_grad=True,
        )
        model = provider.provide_distributed_model(
            ddp_config=ddp_config,
            wrap_with_ddp=True,
            bf16=self.dtype_name == "bfloat16",
            fp16=self.dtype_name == "float16",
        )
        trainable = sum(p.numel() for m in model for p in m.parameters() if p.requires_grad)
        if trainable == 0:
            raise ConfigError(
                f"model.lora.target_modules={list(self.lora.target_modules)} matched no Megatron linear; nothing to train"
            )
        return model, peft, MegatronBridgeAdapter(auto, cpu=False)

    def _build_optimizer(self) -> Any:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.utils import get_model_config

        optim = self.actor.optim
        config = OptimizerConfig(
            optimizer="adam",
            lr=float(optim.lr),
            min_lr=float(optim.lr),
            weight_decay=float(optim.weight_decay),
            adam_beta1=float(optim.betas[0]),
            adam_beta2=float(optim.betas[1]),
            clip_grad=float(self.actor.grad_clip),
            bf16=self.dtype_name == "bfloat16",
            fp16=self.dtype_name == "float16",
            params_dtype=DTYPES[self.dtype_name],
            use_distributed_optimizer=self.backend.use_distributed_optimizer,
        )
        optimizer = get_megatron_optimizer(config, self.model)
        model_config = get_model_config(self.model[0])
        # What Megatron-Bridge's own training setup wires (training/setup.py _update_model_config_funcs).
        model_config.finalize_model_grads_func = finalize_model_grads
        model_config.grad_scale_func = optimizer.scale_loss
        return optimizer

    # ------------------------------------------------------------------ topology

    @property
    def dp_rank(self) -> int:
        """Ranks with the same dp_rank form one model replica and must get the same data."""
        return self.ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return self.ps.get_data_parallel_world_size()

    @property
    def is_last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage()

    # ------------------------------------------------------------------ forward

    def _attention_mask(self, width: int) -> torch.Tensor | None:
        if self.impl != "local":
            return None  # TE attention applies the causal mask from the layer spec's mask type
        # The local spec builds its default causal mask on "cuda"; an explicit one (True =
        # masked) keeps it independent of the fused-softmax kernels we turn off.
        if width not in self._causal_masks:
            m = torch.ones(width, width, dtype=torch.bool, device="cuda").triu(1)
            self._causal_masks[width] = m.view(1, 1, width, width)
        return self._causal_masks[width]

    def _padded(self, ids: torch.Tensor) -> torch.Tensor:
        # Sequence parallelism splits the sequence evenly over the TP ranks.
        multiple = self.tp if self.sp else 1
        extra = (-ids.shape[1]) % multiple
        return torch.nn.functional.pad(ids, (0, extra)) if extra else ids

    def _token_logp(
        self, output: torch.Tensor, input_ids: torch.Tensor, temperature: float, entropy: EntropyMode
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(token t+1) [b, L-1] from the logits [b, W, V/tp] (vocab-parallel with TP), and the
        entropy when `entropy` is "grad" (part of the loss) or "metric" (no graph)."""
        from lorarl.algorithms.losses import entropy_from_logits, logprobs_and_entropy

        if self.tp == 1:
            # The whole vocabulary is on this rank: the FSDP engine's blockwise log-softmax holds
            # float32 copies of ~1k positions at a time, where the vocab-parallel cross entropy
            # below holds two of every position's (~15 GB each at the 0.5B preset's budget).
            return logprobs_and_entropy(output, input_ids[:, 1:], temperature, entropy)

        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, vocab_parallel_cross_entropy

        length = input_ids.shape[1]
        # The division always allocates: vocab_parallel_cross_entropy subtracts the row max from
        # its input in place, which must not be the model's output.
        logits = output[:, : length - 1].float() / temperature
        ent = None
        if entropy != "none":
            with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
                src = logits if entropy == "grad" else logits.detach()
                ent = entropy_from_logits(gather_from_tensor_model_parallel_region(src))
            if entropy == "grad":
                logits = logits.clone()  # the entropy graph still needs these values
        logp = -vocab_parallel_cross_entropy(logits, input_ids[:, 1:].contiguous())
        return logp, ent

    def _run(self, micro: list[torch.Tensor], loss_fn, forward_only: bool) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        width = micro[0].shape[1]
        mask = self._attention_mask(width)

        # Logits in the model's precision: Megatron's half-precision wrapper would otherwise hand
        # back a float32 copy of every position's logits (~15 GB at the 0.5B preset's budget),
        # which the loss keeps for its backward and whose gradient is float32 too. Both losses
        # upcast what they read (token_logprobs per block, the vocab-parallel path as a whole).
        half = {"fp32_output": False} if self.compute_dtype != torch.float32 else {}

        def forward_step(data_iterator: Iterator[tuple[int, torch.Tensor]], model: torch.nn.Module):
            index, ids = next(data_iterator)
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
            output = model(input_ids=ids, position_ids=positions, attention_mask=mask, **half)
            return output, partial(loss_fn, index)

        fb = get_forward_backward_func()
        return fb(
            forward_step_func=forward_step,
            data_iterator=iter(list(enumerate(micro))),
            model=self.model,
            num_microbatches=len(micro),
            seq_length=width,
            micro_batch_size=max(m.shape[0] for m in micro),
            forward_only=forward_only,
        )

    def _broadcast_from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        if self.pp > 1:
            import torch.distributed as dist

            dist.broadcast(
                t,
                src=self.ps.get_pipeline_model_parallel_last_rank(),
                group=self.ps.get_pipeline_model_parallel_group(),
            )
        return t

    def dp_all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(
            t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.ps.get_data_parallel_group()
        )
        return t.tolist()

    @torch.no_grad()
    def log_probs(self, batch: TrainBatch, *, temperature: float, reference: bool = False) -> torch.Tensor:
        """Log-probs [B, L-1] (float32, CPU) of every next token of a lorarl.contract.engine.TrainBatch.

        reference=True is the reference policy: the same model under PEFT's disable_adapter
        context, no second copy of the weights.
        """
        check_right_padded(batch.attention_mask)
        dev = torch.device("cuda", torch.cuda.current_device())
        row_sets = plan_micro_batches(self, batch, self.actor, backward=False)
        micro = [batch.select(rows).to(dev) for rows in row_sets]
        ids = [self._padded(m.input_ids) for m in micro]
        length = batch.input_ids.shape[1]

        def loss_fn(index: int, output: torch.Tensor):
            logp, _ = self._token_logp(output, micro[index].input_ids, temperature, "none")
            return torch.zeros((), device=logp.device), {"logp": logp}

        for m in self.model:
            m.eval()
        ctx = self.peft.disable_adapter(self.model) if reference else contextlib.nullcontext()
        with ctx:
            outs = self._run(ids, loss_fn, forward_only=True)
        result = torch.zeros(len(batch), length - 1, dtype=torch.float32, device=dev)
        if self.is_last_stage:
            for rows, o in zip(row_sets, outs):
                result[rows] = o["logp"]
        return self._broadcast_from_last_stage(result).cpu()

    # ------------------------------------------------------------------ update (lorarl.algorithms.ppo drives it)

    def forward_backward(
        self, micro: list[TrainBatch], loss_fn: LossFn, entropy: EntropyMode, temperature: float
    ) -> list[dict[str, float]]:
        for p in micro:
            check_right_padded(p.attention_mask)
        dev = torch.device("cuda", torch.cuda.current_device())
        parts = [p.to(dev) for p in micro]
        # The entropy metric needs the full vocabulary; with TP that is a gather, so it is only
        # paid for when the entropy is part of the loss.
        if entropy == "metric" and self.tp > 1:
            entropy = "none"

        def megatron_loss(index: int, output: torch.Tensor):
            p = parts[index]
            logp, ent = self._token_logp(output, p.input_ids, temperature, entropy)
            loss, metrics = loss_fn(p, logp, ent)
            # Megatron's schedule divides each micro-batch's loss by their count; loss_fn's
            # losses are already normalised over the mini-batch.
            return loss * len(parts), metrics

        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = read_metrics(
            list(self._run([self._padded(p.input_ids) for p in parts], megatron_loss, forward_only=False))
        )
        if self.pp > 1:
            import torch.distributed as dist

            box = [outs if self.is_last_stage else None]
            dist.broadcast_object_list(
                box,
                src=self.ps.get_pipeline_model_parallel_last_rank(),
                group=self.ps.get_pipeline_model_parallel_group(),
            )
            outs = box[0]
        return list(outs)

    def optimizer_step(self, step: int, skip: Sequence[int] = ()) -> list[float]:
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr
        ok, grad_norm, _ = self.optimizer.step()
        grad_norm = float("nan") if grad_norm is None else float(grad_norm)
        if not ok:
            raise TrainingError(f"step {step}: the optimizer skipped the update (grad norm {grad_norm}); stopping")
        return [check_grad_norm(grad_norm, step)]

    def end_step(self) -> list[float]:
        used = [self._lr]
        self._steps += 1
        self._lr = self._lr_at(self._steps)
        return used

    def _lr_at(self, steps: int) -> float:
        """Linear warm-up over optim.warmup_steps trainer steps, then constant (as FSDPEngine)."""
        lr, warmup = float(self.actor.optim.lr), self.actor.optim.warmup_steps
        return lr * min(1.0, (steps + 1) / warmup) if warmup > 0 else lr

    # ------------------------------------------------------------------ export

    def adapter_config(self, adapter: int = 0) -> dict:
        cfg = peft_adapter_config(self.lora)
        cfg["base_model_name_or_path"] = self.path
        return cfg

    # One way to gather: the bridge's export (rollout.layered_summon is FSDP's; the config refuses it here).
    EXPORT_METHODS = ("bridge",)

    def export(
        self, kind: Any, method: str | None = None, dtype: torch.dtype | None = None, adapter: int = 0
    ) -> tuple[Any, float]:
        """(WeightPayload of `kind`, gather seconds); collective, all ranks get full tensors.

        ADAPTER: export_adapter_weights, PEFT names. BASE: the pure base
        (merge_adapter_weights=False), or merged W + BA when model.lora.merge=true (then vLLM
        runs without LoRA).
        """
        from lorarl.contract.payload import PayloadKind, WeightPayload

        if method not in (None, *self.EXPORT_METHODS):
            raise ValueError(f"the Megatron engine exports through its bridge only, not {method!r}")

        t0 = time.perf_counter()
        if kind is PayloadKind.ADAPTER:
            tensors = {k: v if dtype is None else v.to(dtype) for k, v in self._adapter_tensors().items()}
            return WeightPayload.adapter(tensors, self.adapter_config()), time.perf_counter() - t0
        if kind is PayloadKind.BASE:
            return WeightPayload.base(self.base_stream(self.lora.merge)), time.perf_counter() - t0
        raise ValueError(f"unknown payload kind {kind!r}")

    def base_stream(self, merge: bool):
        """The bridge's base export, plain HF names: pure, or merged W + BA (collective)."""
        return self.bridge.export_merged(self.model) if merge else self.bridge.export_base(self.model)

    def lora_projections(self, adapter: int = 0) -> dict:
        """The semantic check's expected side (lorarl.engines.megatron.projections): u^T dW v per HF
        module from this model's own adapters. Collective over the TP, expert and pipeline groups."""
        return self._every_stage(megatron_lora_projections(*model_lora(self.model), *self._check_layout()))

    def base_projections(self) -> BaseProjections:
        """The merged check's base side (lorarl.engines.megatron.base_projections): u^T W_base v per
        HF module from this model's own sharded fused base weights, not the bridge's export. Collective."""
        mine = megatron_base_projections(*model_bases(self.model), *self._check_layout())
        return BaseProjections(self._every_stage(mine.modules), mine.roundoff)

    def _check_layout(self) -> tuple:
        """(this rank's MegatronShape, the sum over the TP group for dense layers, over the expert
        tensor-and-model-parallel group for experts), as both sides of the semantic check take them."""
        shape = shape_from_config(self.hf_config, self.lora.rank, self.ps)
        tp, experts = self.ps.get_tensor_model_parallel_group(), self.ps.get_expert_tensor_and_model_parallel_group()
        return shape, _all_reduce(tp), _all_reduce(experts)

    def _every_stage(self, mine: dict) -> dict:
        """Per-module results of this pipeline stage's layers -> those of every stage, on every stage."""
        if self.pp == 1:
            return mine
        stages: list = [None] * self.pp
        torch.distributed.all_gather_object(stages, mine, group=self.ps.get_pipeline_model_parallel_group())
        return {path: p for stage in stages for path, p in stage.items()}

    def lora_parameters(self, adapter: int = 0) -> list[torch.Tensor]:
        return [p for m in self.model for p in m.parameters() if p.requires_grad]  # this rank's, for the self-test

    def lora_state(self, adapter: int = 0) -> dict[str, torch.Tensor]:
        """Full LoRA tensors under PEFT names, on CPU (collective). Never empty: an empty adapter
        folder would load as the untrained base model."""
        return {k: v.cpu() for k, v in self._adapter_tensors().items()}

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The bridge's adapter export, completed over the expert-parallel group (MoE, EP > 1)."""
        tensors = dict(self.bridge.export_adapter(self.model))
        ep = self.backend.expert_model_parallel_size
        if self.num_experts == 0 or ep == 1:
            return tensors
        layout = ExpertParallel(self.num_experts, ep, self.ps.get_expert_model_parallel_rank())
        return gather_expert_adapter(tensors, layout, torch_all_gather(self.ps.get_expert_model_parallel_group(), ep))

    # Mid-run checkpoints are refused for this backend when the config is validated
    # (trainer.save_freq); resuming would need the adapter put back into Megatron's TP shards.
    def optimizer_state(self, adapter: int = 0) -> dict:
        raise ConfigError(_NO_CHECKPOINTS)

    def scheduler_state(self, adapter: int = 0) -> dict:
        return {"steps": self._steps}

    def load_state(self, lora: dict, optimizer: dict | None, scheduler: dict | None, adapter: int = 0) -> None:
        raise ConfigError(_NO_CHECKPOINTS)


def _all_reduce(group):
    import torch.distributed as dist

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.cuda()
        dist.all_reduce(t, group=group)
        return t.cpu()

    return reduce


__all__ = ["MegatronEngine", "check_right_padded"]
