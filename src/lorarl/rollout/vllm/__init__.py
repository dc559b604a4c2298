"""vLLM as the rollout engine, hosted in the worker's process.

engine          VLLMRollout: sampling, sleep/wake, applying weight payloads, the state it owns
engine_args     one engine's `vllm.LLM` arguments, assembled once on the driver
dtype           the dtype vLLM computes in, from rollout.dtype and the checkpoint
engine_process  what hosting vLLM engines inside a trainer's process needs
in_worker       functions that run inside vLLM's worker (collective_rpc)
names           HF weight names and the vLLM parameters that serve them
base_views      vLLM's weights as views for a trainer that shares the base
lora_write      an adapter written straight into vLLM's LoRA slots
lora_slots      the LoRA slots vLLM computes with, read for the sync checks
fingerprints    what the sync checks read from a VLLMRollout (a mixin of it)
weights         the weights vLLM serves, projected for the merged semantic check
"""
