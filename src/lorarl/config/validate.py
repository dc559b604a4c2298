"""Validation of the run config: keys no schema defines, each group's own checks, then the ones
that need several groups: among them the vLLM engine arguments lorarl sets from its own keys,
which rollout.engine_kwargs may not name (SET_BY_LORARL), and what rules out one copy of the
frozen base (backend.share_base; the driver adds what needs the device, lorarl.driver.base_plan).
These are answered from the config alone, so the config asks neither a backend nor the rollout.

Each check raises ConfigError with one line naming the key and what to do. `check_known_keys`
and `validate` run on every composed config before the trainer starts anything;
`check_model_shape` runs once the model's config is read (heads, layers, vocabulary and experts
against the parallel sizes).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from lorarl.config.backends import FSDPBackendConfig, MegatronBackendConfig
from lorarl.config.run import GROUPS, RunConfig
from lorarl.config.schema import SEND_FAULTS
from lorarl.errors import ConfigError, check

# vLLM's engine arguments that lorarl sets (lorarl.contract.specs.LLMArgs), and the key that sets
# each ("" when it is fixed: the reason). rollout.engine_kwargs may name any other of them.
SET_BY_LORARL: dict[str, tuple[str, str]] = {
    "model": ("model.path", ""),
    "tokenizer": ("model.path", ""),
    "dtype": ("rollout.dtype", ""),
    "seed": ("trainer.seed", ""),
    "max_model_len": ("rollout.max_model_len", ""),
    "tensor_parallel_size": ("rollout.tensor_model_parallel_size", ""),
    "enable_expert_parallel": ("rollout.enable_expert_parallel", ""),
    "load_format": ("rollout.load_format", ""),
    "enforce_eager": ("rollout.enforce_eager", ""),
    "enable_sleep_mode": ("rollout.free_cache_engine", ""),
    "gpu_memory_utilization": ("rollout.gpu_memory_utilization", ""),
    "kv_cache_memory_bytes": ("rollout.gpu_memory_utilization", ""),
    "trust_remote_code": ("model.trust_remote_code", ""),
    "enable_lora": ("model.lora.merge", ""),
    "max_lora_rank": ("model.lora.rank", ""),
    "max_loras": ("", "the engine serves one LoRA slot per adapter the run trains (hydra/launcher=shared_base)"),
    "logprobs_mode": ("", "the trainer compares its log-probs with vLLM's after the temperature"),
    "distributed_executor_backend": ("", "each worker holds its engine in its own process"),
}


def check_known_keys(config: Any) -> None:
    """Refuse every key the schemas do not define, in one line naming each with its close matches.

    `config` is the typed object OmegaConf.to_object makes of a composed config. Hydra refuses
    `key=value` for a key the schema lacks, but `+key=value` adds it, and to_object keeps it as an
    attribute of the typed object that nothing reads: a misspelt key would be silently ignored.
    Every dataclass-typed group is closed. A field typed as a dict is a pass-through map whose keys
    are another program's and stay open: rollout.engine_kwargs (vLLM's engine arguments, checked
    against the installed vLLM by lorarl.driver.preflight) and backend.override_transformer_config
    (Megatron's TransformerConfig fields).
    """
    children: dict[str, list[str]] = {}
    unknown: list[str] = []
    _walk(config, "", children, unknown)
    if not unknown:
        return
    named = ", ".join(_with_close_matches(key, children) for key in unknown)
    plural = "s" if len(unknown) > 1 else ""
    raise ConfigError(
        f"unknown config key{plural} {named}: no schema defines {'them' if plural else 'it'}; fix the spelling "
        "or drop the + override (the YAML files under conf/ show every key)"
    )


def _walk(obj: Any, prefix: str, children: dict[str, list[str]], unknown: list[str]) -> None:
    """Collect the schema's keys under `prefix` (parent path -> child names) and the keys an
    override added beside them (attributes that are not dataclass fields)."""
    names = [f.name for f in dataclasses.fields(obj)]
    children[prefix] = names
    unknown.extend(prefix + name for name in vars(obj) if name not in names)
    for name in names:
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _walk(value, f"{prefix}{name}.", children, unknown)


def _with_close_matches(key: str, children: dict[str, list[str]]) -> str:
    """`key`, plus the keys it may have meant: siblings spelt alike (difflib), siblings it begins
    or shares a word of 5+ letters with (`temp` for temperature, `lr_warmup` for warmup_steps),
    and keys of the same name in another group (`trainer.lr` for actor.optim.lr)."""
    parent, _, leaf = key.rpartition(".")
    prefix = f"{parent}." if parent else ""
    siblings = children.get(prefix, [])
    words = {w for w in leaf.split("_") if len(w) >= 5}
    related = [n for n in siblings if n.startswith(leaf) or words & set(n.split("_"))]
    alike = list(dict.fromkeys(difflib.get_close_matches(leaf, siblings, n=3) + related))[:3]
    elsewhere = [p + leaf for p, names in children.items() if p != prefix and leaf in names]
    matches = [prefix + name for name in alike] + elsewhere
    return f"{key} (did you mean {' or '.join(matches)}?)" if matches else key


def validate(run: RunConfig) -> None:
    """Each group's own checks, then the ones that need several groups. One line per error."""
    for name in GROUPS:
        getattr(run, name).check()
    check_batch_split(run)
    check_not_set_by_lorarl(run.rollout.engine_kwargs)
    r, lora, d = run.rollout, run.model.lora, run.data
    check(
        d.gen_batch_size is None or (run.algorithm.filter_groups.enable and d.gen_batch_size >= d.train_batch_size),
        f"data.gen_batch_size={d.gen_batch_size} oversamples for dynamic sampling: it needs "
        f"algorithm.filter_groups.enable=true and a value >= data.train_batch_size={d.train_batch_size} (or null)",
    )
    check(
        not (r.layered_summon and lora.merge),
        "rollout.layered_summon=true exports only the adapter, but model.lora.merge=true pushes merged full "
        "weights; pick one",
    )
    check(
        not (run.trainer.off_policy_steps and run.algorithm.filter_groups.enable),
        "trainer.off_policy_steps=1 generates one round ahead, but algorithm.filter_groups.enable=true decides "
        "after scoring whether to generate more rounds; set one of them off (trainer.off_policy_steps=0)",
    )
    ob = run.algorithm.overlong_buffer
    check(
        ob.len is None or 0 < ob.len < d.max_response_length,
        f"algorithm.overlong_buffer.len={ob.len} must be in (0, data.max_response_length={d.max_response_length})",
    )
    tp, per_node = r.tensor_model_parallel_size, run.trainer.n_gpus_per_node
    # T consecutive workers of one node share a vLLM engine, each holding a shard of it; an
    # engine never spans nodes (its all-reduces run every layer of every decoded token).
    check(
        per_node % tp == 0,
        f"rollout.tensor_model_parallel_size={tp} must divide trainer.n_gpus_per_node={per_node}: "
        "the workers of one vLLM engine sit on one node",
    )
    if isinstance(run.backend, MegatronBackendConfig):
        check_megatron(run)
    check_placement(run)
    check_share_base(run, base_not_shareable(run))


def check_not_set_by_lorarl(engine_kwargs: dict[str, Any]) -> None:
    """ConfigError for the first engine argument in rollout.engine_kwargs that lorarl sets from a key of its own."""
    for name in engine_kwargs:
        if name in SET_BY_LORARL:
            key, fixed = SET_BY_LORARL[name]
            raise ConfigError(
                f"rollout.engine_kwargs.{name}: lorarl sets vLLM's {name} from {key}; set {key} instead"
                if key
                else f"rollout.engine_kwargs.{name}: lorarl fixes vLLM's {name} ({fixed}); remove it"
            )


def base_not_shareable(run: RunConfig) -> str | None:
    """Why the config alone rules out one copy of the frozen base (backend.share_base), or None.
    The driver adds the reasons that need the device, vLLM's dtype and the checkpoint
    (lorarl.driver.base_plan)."""
    b, r, m = run.backend, run.rollout, run.model
    if run.trainer.placement == "split":
        return "trainer.placement=split puts vLLM on devices of its own, so the trainer cannot view its weights"
    if not isinstance(b, FSDPBackendConfig):
        return "the Megatron backend holds its own copy"
    if m.lora.merge:
        return "model.lora.merge=true writes merged weights into vLLM's base every step"
    if r.tensor_model_parallel_size > 1:
        return f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} splits vLLM's weights over ranks"
    if r.load_format == "dummy":
        return "rollout.load_format=dummy starts vLLM without the base, which the trainer then sends"
    if b.param_offload:
        return "backend.param_offload=true keeps the trainer's sharded base in host memory"
    return None


def check_share_base(run: RunConfig, why: str | None) -> None:
    """backend.share_base=true where `why` rules sharing out: one line naming the key (auto falls
    back to two copies and says why; lorarl.driver.base_plan)."""
    if why is not None and getattr(run.backend, "share_base", False) is True:
        raise ConfigError(f"backend.share_base=true cannot apply: {why}; set backend.share_base=auto or false")


def check_placement(run: RunConfig) -> None:
    """trainer.placement=split: training workers and vLLM workers on devices of their own, the
    adapter sent through Ray (lorarl.workers.split_group). What it cannot do soundly is refused by key."""
    t, r = run.trainer, run.rollout
    if t.placement != "split":
        check(
            r.n_workers is None,
            f"rollout.n_workers={r.n_workers} places vLLM workers of their own, but trainer.placement=colocated puts "
            "vLLM in every training worker; set trainer.placement=split or rollout.n_workers=null",
        )
        check(
            t.sync_fault not in SEND_FAULTS,
            f"trainer.sync_fault={t.sync_fault} acts on the send to rollout workers of their own; it needs "
            "trainer.placement=split",
        )
        return
    split = "trainer.placement=split"
    check(
        not isinstance(run.backend, MegatronBackendConfig),
        f"{split} runs with +backend=fsdp only; use trainer.placement=colocated with Megatron",
    )
    check(
        not run.model.lora.merge,
        f"{split} sends the adapter; model.lora.merge=true would send merged full weights every step; set "
        "model.lora.merge=false or trainer.placement=colocated",
    )
    check(
        r.tensor_model_parallel_size == 1,
        f"{split} runs one vLLM engine per rollout worker; set rollout.tensor_model_parallel_size=1",
    )
    check(t.nnodes == 1, f"{split} places its workers on one node; set trainer.nnodes=1")
    check(
        r.load_format != "dummy",
        f"{split}: vLLM must read the base from disk (the trainer sends only the adapter); set rollout.load_format=auto",
    )
    check(
        not r.free_cache_engine,
        f"{split}: vLLM has its own device and never sleeps; set rollout.free_cache_engine=null or false",
    )


def check_batch_split(run: RunConfig) -> None:
    """Batches split over data-parallel replicas: every device with FSDP; with Megatron, the
    devices of one tensor x pipeline group share a replica and see the same sequences."""
    a, d, world = run.actor, run.data, run.world_size
    mp = run.backend.model_parallel_size()
    if mp > 1:
        check(
            world % mp == 0,
            f"backend.tensor_model_parallel_size x backend.pipeline_model_parallel_size = {mp} must divide the "
            f"{world} devices",
        )
    dp = world // mp
    replicas = f"{dp} data-parallel replicas" if mp > 1 else f"{world} devices"
    check(
        a.ppo_mini_batch_size <= d.train_batch_size and d.train_batch_size % a.ppo_mini_batch_size == 0,
        f"data.train_batch_size={d.train_batch_size} must be a multiple of actor.ppo_mini_batch_size="
        f"{a.ppo_mini_batch_size} (both count prompts)",
    )
    check(
        d.train_batch_size % dp == 0,
        f"data.train_batch_size={d.train_batch_size} must divide over {replicas} (trainer.nnodes x "
        "trainer.n_gpus_per_node" + (" / model-parallel size)" if mp > 1 else ")"),
    )
    mini_seqs = a.ppo_mini_batch_size * run.rollout.n
    check(
        mini_seqs % dp == 0,
        f"actor.ppo_mini_batch_size x rollout.n = {mini_seqs} sequences must divide over {replicas}",
    )
    per_device = mini_seqs // dp
    check(
        a.use_dynamic_bsz or per_device % a.ppo_micro_batch_size_per_gpu == 0,
        f"actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu} must divide the {per_device} "
        f"sequences each device gets per mini-batch (ppo_mini_batch_size x rollout.n / "
        f"{'replicas' if mp > 1 else 'devices'})",
    )


def check_megatron(run: RunConfig) -> None:
    b, lora = run.backend, run.model.lora
    check(
        not run.rollout.layered_summon,
        "rollout.layered_summon=true gathers the adapter one FSDP unit at a time; +backend=megatron exports it "
        "through its bridge: set rollout.layered_summon=false",
    )
    check(
        not (run.actor.use_dynamic_bsz and b.pipeline_model_parallel_size > 1),
        "actor.use_dynamic_bsz=true with backend.pipeline_model_parallel_size>1: pipeline stages exchange "
        "activations of one fixed shape; set actor.use_dynamic_bsz=false",
    )
    check(
        lora.rank % b.tensor_model_parallel_size == 0,
        f"model.lora.rank={lora.rank} must be divisible by backend.tensor_model_parallel_size="
        f"{b.tensor_model_parallel_size}",
    )
    check(
        run.trainer.save_freq <= 0,
        "trainer.save_freq: mid-run checkpoints are not supported with +backend=megatron yet (the final adapter "
        "is still exported); set trainer.save_freq=-1 or use +backend=fsdp",
    )
    ep, world = b.expert_model_parallel_size, run.world_size
    check(
        not (ep > 1 and lora.merge),
        f"model.lora.merge=true with backend.expert_model_parallel_size={ep}: Megatron-Bridge numbers expert "
        "adapters per rank but gathers base experts over ranks, so a merge could pair an expert with another's "
        "adapter; use model.lora.merge=false (adapter sync)",
    )
    # megatron-core builds expert groups as ETP x EP x expert-DP inside each pipeline stage.
    mp = ep * b.expert_tensor_parallel_size * b.pipeline_model_parallel_size
    check(
        world % mp == 0,
        f"backend.expert_model_parallel_size x backend.expert_tensor_parallel_size x "
        f"backend.pipeline_model_parallel_size = {mp} must divide the {world} devices",
    )


def check_model_shape_of(run: RunConfig, hf_config) -> None:
    """check_model_shape with the sizes read from a transformers config."""
    check_model_shape(
        run,
        hf_config.num_attention_heads,
        getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        num_layers=hf_config.num_hidden_layers,
        vocab_size=hf_config.vocab_size,
        num_experts=int(getattr(hf_config, "num_experts", None) or 0),
    )


def check_model_shape(
    run: RunConfig,
    num_attention_heads: int,
    num_key_value_heads: int,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    num_experts: int | None = None,
) -> None:
    """Checks that need the model's config: tensor parallel sizes must split the heads; with
    Megatron, pipeline stages the layers, tensor parallelism the vocabulary and expert
    parallelism the experts (`num_experts`: 0 for a dense model, None when not known)."""
    tp = run.rollout.tensor_model_parallel_size
    key = "rollout.tensor_model_parallel_size"
    check(
        num_attention_heads % tp == 0, f"{key}={tp} does not divide the model's {num_attention_heads} attention heads"
    )
    check(
        num_key_value_heads % tp == 0 or tp % num_key_value_heads == 0,
        f"{key}={tp} does not divide the model's {num_key_value_heads} key/value heads",
    )
    if not isinstance(run.backend, MegatronBackendConfig):
        return
    b = run.backend
    tp, pp = b.tensor_model_parallel_size, b.pipeline_model_parallel_size
    key = "backend.tensor_model_parallel_size"
    check(
        num_attention_heads % tp == 0, f"{key}={tp} does not divide the model's {num_attention_heads} attention heads"
    )
    # Megatron can replicate KV heads when tp > groups, but the per-group qkv layout the adapter
    # export relies on assumes each rank holds whole groups.
    check(
        num_key_value_heads % tp == 0,
        f"{key}={tp} does not divide the model's {num_key_value_heads} key/value heads; use a tensor parallel size "
        "that divides it",
    )
    if num_layers is not None:
        check(
            num_layers % pp == 0,
            f"backend.pipeline_model_parallel_size={pp} does not divide the model's {num_layers} layers",
        )
        n = b.recompute_num_layers
        check(
            n is None or n <= num_layers // pp,
            f"backend.recompute_num_layers={n} exceeds the {num_layers // pp} layers per pipeline stage",
        )
    # VocabParallelEmbedding splits rows evenly; Megatron-Bridge does not pad Qwen2's vocab.
    check(
        vocab_size is None or vocab_size % tp == 0,
        f"{key}={tp} does not divide the model's vocab_size={vocab_size}",
    )
    if num_experts is not None:
        check_experts(b, num_experts)


def check_experts(b: MegatronBackendConfig, num_experts: int) -> None:
    ep, tp = b.expert_model_parallel_size, b.tensor_model_parallel_size
    if num_experts < 1:
        check(
            ep == 1,
            f"backend.expert_model_parallel_size={ep} needs a mixture-of-experts model; this one has no experts",
        )
        return
    check(
        num_experts % ep == 0,
        f"backend.expert_model_parallel_size={ep} does not divide the model's {num_experts} experts",
    )
    # megatron-core's MoELayer.forward raises in training when attention TP > 1 without SP.
    check(
        tp == 1 or b.sequence_parallel,
        f"backend.tensor_model_parallel_size={tp} on a mixture-of-experts model needs backend.sequence_parallel=true "
        "(megatron-core refuses MoE training with tensor parallelism alone); or use tensor parallel 1 with "
        "backend.expert_model_parallel_size",
    )
