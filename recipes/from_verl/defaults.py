"""verl's own defaults (recipes/verl_data/verl_defaults.json, flattened from its trainer YAMLs
at the commit recorded there by scripts/extract_verl_keys.py), and the mapped keys whose verl
default lorarl deliberately does not carry, each with the reason.

A verl script sets only what differs from verl's defaults, so the translation starts from
them: every mapped key the script leaves unset gets verl's default when lorarl's would differ,
unless DELIBERATE lists it (tests walk every mapped key).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from recipes.from_verl.keys import A, Key

DATA = Path(__file__).resolve().parents[1] / "verl_data"

DELIBERATE: dict[str, str] = {
    A + "model.path": "verl's placeholder; every launch names its model",
    A + "model.lora_rank": "0 means full fine-tuning, which is refused (--lora-rank R opts in to LoRA)",
    A + "model.lora.rank": "0 means full fine-tuning, which is refused (--lora-rank R opts in to LoRA)",
    A + "model.target_modules": "the preset's projections: all-linear on a dense Qwen is these seven; on a MoE "
    "model the preset adapts the experts (target_parameters) and not the router, which vLLM cannot serve",
    A + "model.lora.target_modules": "Megatron's names of the same projections (linear_qkv, linear_proj, "
    "linear_fc1, linear_fc2); lorarl names them as HF does",
    A + "model.use_liger": "lorarl's null uses the Liger kernels on CUDA: the same math, fused",
    A + "actor.use_torch_compile": "verl compiles its log-prob helpers; lorarl's backend.compile compiles the "
    "model, off unless asked",
    A + "actor.ppo_micro_batch_size_per_gpu": "verl's null must be set unless use_dynamic_bsz; lorarl's default stands",
    A + "actor.ppo_micro_batch_size": "verl's null defers to ppo_micro_batch_size_per_gpu; lorarl's default stands",
    A + "actor.megatron.expert_tensor_parallel_size": "verl's null follows tensor parallelism; lorarl exports "
    "expert adapters only unsliced (1)",
    A + "actor.megatron.vanilla_mbridge": "verl's LoRA on Megatron goes through Megatron-Bridge, as lorarl's "
    "always does",
    A + "actor.megatron.sequence_parallel": "carried as verl applies it: on when tensor parallel > 1",
    A + "ref.log_prob_max_token_len_per_gpu": "verl's default follows actor.ppo_max_token_len_per_gpu; lorarl's "
    "null is twice that (passes without backward keep no activations)",
    A + "rollout.log_prob_max_token_len_per_gpu": "verl's default follows actor.ppo_max_token_len_per_gpu; "
    "lorarl's null is twice that (passes without backward keep no activations)",
    A + "rollout.load_format": "verl's dummy weights are replaced by a full sync; lorarl syncs only the adapter, "
    "so vLLM loads the base from model.path",
    A + "rollout.enforce_eager": "lorarl's null uses CUDA graphs on GPU, as verl's false does",
    A + "rollout.free_cache_engine": "lorarl's null puts the engine to sleep when the update needs the memory",
    A + "rollout.max_num_seqs": "vLLM's own default: scheduling only, the same samples",
    A + "rollout.max_num_batched_tokens": "vLLM's own default: scheduling only, the same samples",
    A + "rollout.enable_chunked_prefill": "vLLM's own default: scheduling only, the same samples",
    A + "rollout.enable_prefix_caching": "vLLM's own default: caching only, the same samples",
    A + "rollout.disable_log_stats": "vLLM's logging only",
    "data.train_files": "verl's placeholder; the data preset's files unless the launch names them",
    "data.val_files": "verl's placeholder; the data preset's files unless the launch names them",
    "reward.reward_kwargs.overlong_buffer_cfg.len": "verl-recipe's 0 with the buffer off; lorarl's null is 20% of "
    "data.max_response_length, used only when the buffer is on",
    "algorithm.filter_groups.metric": "verl-recipe's null must be named when filtering is on; lorarl's acc is the "
    "reward function's value, as verl's DAPO scripts name it",
    "custom_reward_function.name": "a name inside the file of custom_reward_function.path, read with it "
    "(data.reward_fn=PATH:NAME)",
    "trainer.logger": "lorarl logs to the console and a jsonl file; add wandb with trainer.logger",
    "trainer.project_name": "a name only",
    "trainer.experiment_name": "a name only",
    "trainer.default_local_dir": "checkpoints go under the run folder",
    "trainer.device": "lorarl's auto picks CUDA when present",
}


@cache
def verl_defaults() -> dict:
    """{"commit": ..., "fsdp": {key: value}, "megatron": {key: value}} as extracted."""
    return json.loads((DATA / "verl_defaults.json").read_text())


def defaults_for(backend: str, dapo: bool = False) -> dict:
    """verl's defaults for a backend's config; with `dapo`, as verl-recipe's DAPO configs change them.
    Values that only resolve in a whole verl run (`${...}`) are left out."""
    values = dict(verl_defaults()[backend])
    if dapo:
        values.update(verl_defaults()["dapo"][backend])
    return {k: v for k, v in values.items() if not (isinstance(v, str) and "${" in v)}


def default_of(row: Key, backend: str, defaults: dict) -> tuple[bool, object]:
    """(whether `defaults`, verl's for `backend`, hold one for this row, the default)."""
    if row.verl.endswith(".*") or (row.backend and row.backend != backend):
        return False, None
    return (row.verl in defaults), defaults.get(row.verl)
