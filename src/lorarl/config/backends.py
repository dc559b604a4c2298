"""The schemas of the backend group (+backend=fsdp|megatron), each with its own checks; like
lorarl.config.schema, types and docs only: the values are in conf/backend/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from lorarl.errors import check, one_of

TRANSFORMER_IMPLS = ("transformer_engine", "local")


@dataclass
class FSDPBackendConfig:
    strategy: str = MISSING
    reshard_after_forward: bool = MISSING
    # GPU only: keep sharded params / optimizer state in CPU memory between uses.
    param_offload: bool = MISSING
    optimizer_offload: bool = MISSING
    # float32 or bfloat16: dtype of the all-gathered params during compute (GPU).
    mixed_precision: str = MISSING
    # Liger's Triton kernels for RMSNorm, SwiGLU and RoPE in the training forward and backward
    # (liger-kernel, in the gpu extra). null: on when training on CUDA and not compiled, off on
    # CPU (Triton).
    liger_kernel: bool | None = MISSING
    # torch.compile each decoder layer (regional compilation: one compiled graph serves every
    # layer; fewer, fused kernels and less host work per layer). Off: at 7B on one H200 it did
    # not speed the update (bench/results/update_profile_2026-12-02c).
    compile: bool = MISSING
    # Each PEFT LoRA linear as one autograd node with the scale inside its GEMMs
    # (lorarl.engines.lora_linear): fewer kernels and less host work per layer, the same math.
    # Off: at 7B on one H200 the update took 2.76 against 2.79 s, within the spread
    # (bench/results/update_profile_2026-12-04b).
    fused_lora: bool = MISSING
    # Expert LoRA (model.lora.target_parameters) applied to each expert's routed tokens through
    # rank-r products (lorarl.engines.routed_expert_lora) instead of PEFT folding B A into the
    # whole expert stack on every forward and back-propagating through it; the same math, no
    # gradient for the frozen stacks. On: at 30B-A3B's shape (16 layers, one H100) the update took
    # 2.43 s against the fold's 3.16 s (bench/results/update_profile_2026-12-06_moe), and without
    # the folded stacks all 48 layers fit beside vLLM on one H100 (tests/gpu_logs/moe).
    routed_expert_lora: bool = MISSING
    # auto | true | false. Shared: the trainer's frozen base is a view of the colocated vLLM
    # engine's weights (one copy per device, no base load, shard, all-gather or sync; only the LoRA
    # parameters are FSDP's). auto shares wherever it can and says why not once at start-up
    # (merged sync, rollout TP > 1, dummy load, param offload, a dtype that differs, MoE on CPU);
    # true there is an error (lorarl.driver.base_plan).
    share_base: Any = MISSING

    def model_parallel_size(self) -> int:
        """Devices that hold one model replica (and see the same data)."""
        return 1

    def check(self) -> None:
        one_of("backend.strategy", self.strategy, ("fsdp2",))
        one_of("backend.share_base", self.share_base, ("auto", True, False))
        one_of("backend.mixed_precision", self.mixed_precision, ("float32", "bfloat16"))


@dataclass
class MegatronBackendConfig:
    strategy: str = MISSING
    # The HF<->Megatron bridge: megatron_bridge (LoRA adapters, merged and base HF exports) is
    # the one lorarl exports through; the key stays so verl's bridge choice has a home.
    bridge: str = MISSING
    tensor_model_parallel_size: int = MISSING
    pipeline_model_parallel_size: int = MISSING
    # MoE only: experts split over this many ranks (must divide the experts); each expert's
    # linears split over expert_tensor_parallel_size ranks (only 1 exports correctly).
    expert_model_parallel_size: int = MISSING
    expert_tensor_parallel_size: int = MISSING
    sequence_parallel: bool = MISSING
    use_distributed_optimizer: bool = MISSING
    recompute_granularity: str | None = MISSING
    recompute_method: str | None = MISSING
    recompute_num_layers: int | None = MISSING
    # transformer_engine or local (megatron-core's own layers; no TransformerEngine needed).
    transformer_impl: str = MISSING
    override_transformer_config: dict[str, Any] = MISSING

    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def check(self) -> None:
        """What megatron-core would assert later, with lorarl's key names (the model's shape:
        lorarl.config.validate.check_model_shape)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel_size
        for key, v in (
            ("tensor_model_parallel_size", tp),
            ("pipeline_model_parallel_size", pp),
            ("expert_model_parallel_size", ep),
            ("expert_tensor_parallel_size", etp),
        ):
            check(v >= 1, f"backend.{key}={v!r} must be an integer >= 1")
        # Megatron-Bridge splits an expert's fused gate/up LoRA as if unsharded (lorarl.engines.megatron.experts).
        check(
            etp == 1,
            f"backend.expert_tensor_parallel_size={etp}: Megatron-Bridge splits an expert's fused gate/up LoRA as if "
            "unsharded, so the exported expert adapter would be silently wrong; set backend.expert_tensor_parallel_size=1 "
            "and spread experts with backend.expert_model_parallel_size",
        )
        one_of("backend.strategy", self.strategy, ("megatron",))
        check(
            self.bridge != "mbridge",
            "backend.bridge=mbridge is not supported (it cannot export LoRA adapters); set backend.bridge=megatron_bridge",
        )
        one_of("backend.bridge", self.bridge, ("megatron_bridge",))
        one_of("backend.transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        check(
            not (self.sequence_parallel and tp == 1),
            "backend.sequence_parallel=true needs backend.tensor_model_parallel_size > 1 (megatron-core refuses SP "
            "without TP)",
        )
        check(
            not (self.sequence_parallel and self.transformer_impl == "local"),
            "backend.sequence_parallel=true needs backend.transformer_impl=transformer_engine: the local spec's "
            "RMSNorm (torch.nn.RMSNorm wrapper) does not support sequence parallelism",
        )
        self._check_recompute()
        for key in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "sequence_parallel",
        ):
            check(
                key not in self.override_transformer_config,
                f"backend.override_transformer_config.{key} duplicates backend.{key}; set backend.{key} instead",
            )

    def _check_recompute(self) -> None:
        gran, method, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        check(
            gran in (None, "full", "selective"),
            f"backend.recompute_granularity={gran!r} is not valid; use null, full or selective",
        )
        check(
            method in (None, "uniform", "block"),
            f"backend.recompute_method={method!r} is not valid; use null, uniform or block",
        )
        if gran is None:
            check(
                method is None and n is None,
                "backend.recompute_method / backend.recompute_num_layers need backend.recompute_granularity=full",
            )
        elif gran == "selective":
            check(
                n is None,
                "backend.recompute_granularity=selective takes no backend.recompute_num_layers; set it to null",
            )
        else:
            check(
                method is not None,
                "backend.recompute_granularity=full needs backend.recompute_method=uniform or block",
            )
            check(
                n is not None and n >= 1,
                f"backend.recompute_granularity=full needs backend.recompute_num_layers >= 1 (got {n!r})",
            )
