"""The rollout: vLLM hosted in the worker's process (vllm/), and whether it sleeps while the
trainer updates (sleep.py), decided from memory.py's estimate of the update's peak.
"""
