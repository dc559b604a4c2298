"""Every start-up check of a run, on the driver, and the specs the workers are given.

`prepare(run)` runs before Ray starts: the device, the model (built on first use for the
embedded preset), the data files, the loggers, the model checks that read only its config
(lorarl.driver.preflight), rollout.engine_kwargs against the installed vLLM, the model's sizes against
the parallel sizes (lorarl.config.validate.check_model_shape_of), the tokenizer, the prompts and
whether each can be scored. Each failure is one line (a LorarlError). What it returns holds the
WorkerSpec (lorarl.contract.specs): the only part of the configuration a worker receives, with vLLM's
engine arguments assembled here, once (lorarl.rollout.vllm.engine_args.build).

The checks of single keys and of several groups run earlier, when the config is made
(lorarl.config.compose.to_run_config: the schemas' own checks, lorarl.config.validate). What only
a worker can check, with its device in hand, stays there (lorarl.contract.specs says which).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorarl.config.run import RunConfig
from lorarl.config.schema import cache_dir
from lorarl.config.validate import check_model_shape_of
from lorarl.contract.specs import AdapterSpec, EngineSpec, LLMArgs, RolloutSpec, SleepSpec, SyncSpec, WorkerSpec
from lorarl.driver.base_plan import plan_for_run
from lorarl.engines import backend_of
from lorarl.engines.liger import use_liger_kernel
from lorarl.errors import ConfigError, DataError
from lorarl.rollout import memory
from lorarl.rollout.sleep import can_sleep
from lorarl.rollout.vllm import engine_args


@dataclass
class Prepared:
    """A checked run: where it trains, the model's config and tokenizer, its prompts, and what
    each worker is given."""

    device: str  # cuda or cpu
    hf_config: Any  # the model's transformers config
    tokenizer: Any
    loader: Any  # lorarl.data.batches.PromptLoader: the training prompts, round by round
    val_items: list  # validation prompts (empty without validation)
    dropped_prompts: int  # training prompts longer than data.max_prompt_length
    worker_spec: WorkerSpec
    checkpoints: Any  # lorarl.files.checkpoint.CheckpointManager of the run's checkpoint folder
    resume_from: Path | None  # the checkpoint this run resumes from (trainer.resume_mode)
    seconds: float  # how long the checks took (init/timing/prepare)


def prepare(run: RunConfig, out_dir: Path) -> Prepared:
    """Check everything the driver can check, in the order a user would fix it; build the specs.
    Expands paths in `run` (model.path, data files) in place. `out_dir`: the run's folder, which a
    relative trainer.default_local_dir is under."""
    from lorarl.data.batches import prompt_batches
    from lorarl.driver.preflight import check_engine_kwargs, check_model, load_tokenizer
    from lorarl.rewards import check_items
    from lorarl.telemetry.tracking import check_loggers

    t0 = time.perf_counter()
    device = resolve_device(run.trainer.device)
    backend = backend_of(run.backend.strategy)
    if backend.needs_cuda and device != "cuda":
        why = "no CUDA GPU is visible" if not torch.cuda.is_available() else f"trainer.device={run.trainer.device}"
        raise ConfigError(f"+backend={backend.option} requires CUDA ({why}); use +backend=fsdp to train on CPU")
    prepare_model(run)
    prepare_data(run)
    check_loggers(run.trainer.logger)
    checkpoints, resume_from = prepare_checkpoints(run, out_dir)
    # Model mistakes fail here in one line, before Ray starts and a worker loads weights.
    hf_config = check_model(run)
    check_engine_kwargs(run)
    check_model_shape_of(run, hf_config)
    tokenizer = load_tokenizer(run)
    spec = worker_spec(run, device, hf_config)
    validation = run.trainer.test_freq > 0 or run.trainer.val_before_train
    # DAPO oversampling: each generation round draws data.gen_batch_size prompts (prompt_batches).
    loader, val_items, dropped = prompt_batches(run.data, tokenizer, run.trainer.seed, validation)
    for items in (loader.items, val_items):
        check_items(items, run.data.reward_fn)  # every prompt can be scored, before any rollout
    return Prepared(
        device=device,
        hf_config=hf_config,
        tokenizer=tokenizer,
        loader=loader,
        val_items=val_items,
        dropped_prompts=dropped,
        worker_spec=spec,
        checkpoints=checkpoints,
        resume_from=resume_from,
        seconds=time.perf_counter() - t0,
    )


def prepare_checkpoints(run: RunConfig, out_dir: Path):
    """The run's CheckpointManager, with the partial saves a killed run left removed, and the
    checkpoint trainer.resume_mode names (None: a fresh start); a resume_mode that is not a
    complete checkpoint fails here, before anything loads."""
    from lorarl.files.checkpoint import CheckpointManager, resolve_resume

    root = Path(os.path.expanduser(run.trainer.default_local_dir))
    checkpoints = CheckpointManager(root if root.is_absolute() else Path(out_dir) / root, run.trainer.max_ckpt_to_keep)
    checkpoints.clean_partial()
    return checkpoints, resolve_resume(run.trainer.resume_mode, checkpoints)


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu or auto")
    return requested


def prepare_model(run: RunConfig) -> str:
    """Local path of the model, building the embedded one on first use.

    The builder writes only inside the lorarl cache (where the preset keeps it): a path the user
    gives means that model, so a mistyped one fails in preflight instead of training a toy."""
    path = os.path.expanduser(run.model.path)
    if run.model.builder is not None and Path(path).absolute().is_relative_to(Path(cache_dir()).absolute()):
        from lorarl.models.tiny import ensure_built

        ensure_built(run.model.builder, path, seed=0)
    run.model.path = path
    return path


def prepare_data(run: RunConfig) -> None:
    """Expand the data paths and check that each file the run reads exists.

    A generator (data.generator) writes its task only inside the lorarl cache, where its data
    preset puts it: a path the user gives means that file, so a mistyped one fails here in one
    line, before anything starts, and nothing is written there."""
    d = run.data
    d.train_files = [os.path.expanduser(f) for f in d.train_files]
    d.val_files = [os.path.expanduser(f) for f in d.val_files]
    cache = Path(cache_dir()).absolute()
    if d.generator is not None and Path(d.train_files[0]).absolute().is_relative_to(cache):
        from lorarl.data import dataset, token_share

        ensure = {"arith": dataset.ensure_arith_parquet, "token_share": token_share.ensure_parquet}[d.generator]
        if not d.val_files:
            d.val_files = [str(Path(d.train_files[0]).with_name("val.parquet"))]
        if Path(d.val_files[0]).absolute().is_relative_to(cache):
            ensure(d.train_files[0], d.val_files[0], n_train=d.generator_size, seed=0)
    validation = run.trainer.test_freq > 0 or run.trainer.val_before_train
    read = [("data.train_files", d.train_files)] + ([("data.val_files", d.val_files)] if validation else [])
    for key, files in read:
        for file in files:
            if not Path(file).is_file():
                raise DataError(
                    f"{key}: data file {file!r} not found; fix the path, or write the file with "
                    f"scripts/prepare_gsm8k.py or scripts/prepare_math.py (docs/data.md)"
                )


# ---- the specs ---------------------------------------------------------------------------


def worker_spec(run: RunConfig, device: str, hf_config: Any = None, lora_ranks: list[int] | None = None) -> WorkerSpec:
    """What every worker of `run` is given, training on `device` (cuda or cpu). `hf_config`, the
    model's transformers config, sizes the update for the sleep plan (read when not given);
    `lora_ranks`, a sweep group's adapters' ranks, the LoRA state it counts (default: the run's)."""
    t, r = run.trainer, run.rollout
    base_plan = plan_for_run(run, device, hf_config)
    return WorkerSpec(
        engine=engine_spec(run, device),
        rollout=RolloutSpec(
            engine_args=tuple(rollout_args(run, device, engine) for engine in range(rollout_engines(run))),
            tensor_parallel_size=r.tensor_model_parallel_size,
            n_gpus_per_node=t.n_gpus_per_node,
            adapter_transport=r.adapter_transport,
            fingerprint_base=t.check_sync,
        ),
        sleep=sleep_spec(
            run, device, hf_config, shared_base=base_plan.shared, lora_rank=sum(lora_ranks or [0]) or None
        ),
        sync=SyncSpec(
            merge=run.model.lora.merge,
            layered_summon=r.layered_summon,
            check=t.check_sync,
            semantic=t.check_sync and backend_of(run.backend.strategy).checks_meaning(run.model.lora.merge),
            tolerance=t.check_sync_tolerance,
            probe_freq=t.check_sync_probe_freq,
            fault=t.sync_fault,
        ),
        base_plan=base_plan,
        rollout_correction=run.algorithm.rollout_correction,
        train_batch_size=run.data.train_batch_size,
        off_policy_steps=t.off_policy_steps,
        seed=t.seed,
        stall_report_s=t.stall_report_s,
    )


def group_worker_spec(runs: list[RunConfig], labels: list[str], device: str) -> WorkerSpec:
    """What every worker of a sweep group is given (lorarl.driver.groups): the first job's spec,
    with one adapter per job in the engine (its own LoRA shape, actor settings and test fault) and
    one LoRA slot per job in vLLM (the largest rank) admitting every job's sequences of a step at
    once; the update's memory counts every adapter's LoRA state. The jobs agree on everything else."""
    run = runs[0]
    ranks = [r.model.lora.rank for r in runs]
    spec = worker_spec(run, device, lora_ranks=ranks)
    adapters = tuple(
        AdapterSpec(adapter_name(i), r.model.lora, r.actor, label, r.trainer.sync_fault)
        for i, (r, label) in enumerate(zip(runs, labels, strict=True))
    )
    engines = rollout_engines(run)
    engine_args = tuple(
        rollout_args(run, device, engine, lora_rank=max(ranks), max_loras=len(runs)) for engine in range(engines)
    )
    if "max_num_seqs" not in run.rollout.engine_kwargs:
        # One generate call holds every job's sequences of a step: admitted at once, they decode in
        # one wave where vLLM's default (256 on CPU, 1024 on an H100) would cut them into several.
        wave = -(-run.data.train_batch_size // engines) * run.rollout.n * len(runs)
        engine_args = tuple(
            dataclasses.replace(a, engine_kwargs={**a.engine_kwargs, "max_num_seqs": wave}) for a in engine_args
        )
    return dataclasses.replace(
        spec,
        engine=dataclasses.replace(spec.engine, adapters=adapters),
        rollout=dataclasses.replace(spec.rollout, engine_args=engine_args),
    )


def adapter_name(index: int) -> str:
    """PEFT's name of adapter `index` in the training model: PEFT's own default for the first."""
    return "default" if index == 0 else f"adapter{index}"


def rollout_engines(run: RunConfig) -> int:
    """vLLM engines of the run: one per rollout worker on split placement (rollout.n_workers, null:
    1), else one per tensor-parallel group of training workers."""
    if run.trainer.placement == "split":
        return run.rollout.n_workers or 1
    return run.world_size // run.rollout.tensor_model_parallel_size


def engine_spec(run: RunConfig, device: str) -> EngineSpec:
    b = run.backend
    return EngineSpec(
        model=run.model,
        actor=run.actor,
        backend=b,
        engine=backend_of(b.strategy).engine,
        seed=run.trainer.seed,
        # A setting this device cannot run fails here, before any worker loads the model.
        liger_kernel=use_liger_kernel(b.liger_kernel, b.compile, device) if hasattr(b, "liger_kernel") else False,
        adapters=(AdapterSpec("default", run.model.lora, run.actor, "the adapter", run.trainer.sync_fault),),
    )


def rollout_args(run: RunConfig, device: str, engine: int, lora_rank: int | None = None, max_loras: int = 1) -> LLMArgs:
    """The `vllm.LLM` arguments of rollout engine `engine` (its workers share them): lorarl's keys,
    then rollout.engine_kwargs. `lora_rank` and `max_loras`: a sweep group's largest rank and its
    number of adapters (default: the run's one)."""
    r, m, d = run.rollout, run.model, run.data
    return engine_args.build(
        m.path,
        lora_rank=None if m.lora.merge else (lora_rank or m.lora.rank),
        max_loras=max_loras,
        max_model_len=r.max_model_len or (d.max_prompt_length + d.max_response_length),
        # The ranks of one engine sample in lockstep, so they share its seed.
        seed=run.trainer.seed + engine,
        # Every worker's vLLM is the build this driver has installed: the CPU one when training on CPU.
        on_cpu=device != "cuda",
        dtype=r.dtype,
        gpu_memory_utilization=r.gpu_memory_utilization,
        tensor_parallel_size=r.tensor_model_parallel_size,
        enable_expert_parallel=r.enable_expert_parallel,
        load_format=r.load_format,
        # CUDA graphs sample several times faster on GPU; vLLM's CPU build runs eager.
        enforce_eager=(device != "cuda") if r.enforce_eager is None else r.enforce_eager,
        enable_sleep_mode=can_sleep(r.free_cache_engine, device),
        trust_remote_code=m.trust_remote_code,
        engine_kwargs=r.engine_kwargs,
    )


def sleep_spec(
    run: RunConfig, device: str, hf_config: Any = None, shared_base: bool = False, lora_rank: int | None = None
) -> SleepSpec:
    """The sleep setting, and the update's size when the setting leaves it to memory (GPU, null)."""
    setting = run.rollout.free_cache_engine
    if device != "cuda" or setting is not None:
        return SleepSpec(setting, update_bytes=None, update_tokens=None)
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(run.model.path, trust_remote_code=run.model.trust_remote_code)
    mp = run.backend.model_parallel_size()
    dp = max(1, run.world_size // mp)
    return SleepSpec(
        setting,
        update_bytes=run_update_bytes(
            run, memory.ModelDims.of(hf_config), dp, mp, shared_base=shared_base, lora_rank=lora_rank
        ),
        update_tokens=run_update_tokens(run, dp),
    )


def run_update_tokens(run: RunConfig, dp_size: int) -> int:
    """Padded tokens of a run's largest possible update micro-batch: the token budget, or the
    micro-batch's rows at the longest prompt + response the data allows."""
    a, d = run.actor, run.data
    seq = d.max_prompt_length + d.max_response_length
    if a.use_dynamic_bsz:
        return max(a.ppo_max_token_len_per_gpu, seq)
    rows_per_replica = max(1, a.ppo_mini_batch_size * run.rollout.n // dp_size)
    return min(a.ppo_micro_batch_size_per_gpu, rows_per_replica) * seq


def run_update_bytes(
    run: RunConfig,
    dims: memory.ModelDims,
    dp_size: int,
    model_parallel: int,
    shared_base: bool = False,
    lora_rank: int | None = None,
) -> int:
    """lorarl.rollout.memory.update_bytes for a run's largest micro-batch on one device (`run_update_tokens`).
    With `shared_base` FSDP manages only LoRA, so no gathered base weights are kept between passes.
    `lora_rank`: the LoRA state to count (a sweep group's ranks summed; default the run's rank)."""
    d, b = run.data, run.backend
    seq = d.max_prompt_length + d.max_response_length
    tokens = run_update_tokens(run, dp_size)
    backend = backend_of(b.strategy)
    return memory.update_bytes(
        dims,
        tokens=tokens,
        response_tokens=tokens * d.max_response_length // seq,
        checkpointing=run.model.enable_gradient_checkpointing,
        rank=lora_rank or run.model.lora.rank,
        targets=list(run.model.lora.target_modules),
        dtype_bytes=torch.finfo(getattr(torch, run.model.dtype)).bits // 8,
        model_parallel=model_parallel,
        head_at_every_position=backend.head_at_every_position,
        vocab_parallel=backend.head_at_every_position and getattr(b, "tensor_model_parallel_size", 1) > 1,
        gathered_weights_held=getattr(b, "reshard_after_forward", True) is False and not shared_base,
        attention_scores_width=seq if getattr(b, "transformer_impl", None) == "local" else 0,
        expert_targets=list(run.model.lora.target_parameters or ()),
        # FSDP trains them through PEFT, which folds them into the stacks unless routed.
        folded_expert_lora=bool(run.model.lora.target_parameters) and getattr(b, "routed_expert_lora", True) is False,
    )
