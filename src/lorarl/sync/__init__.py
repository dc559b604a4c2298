"""The weight sync from a training engine into the vLLM rollout, and the checks that it is right.

payload     the one payload type, carrying its own kind (base or adapter)
experts     PEFT's stacked expert LoRA -> vLLM's per-expert layout (the export's MoE part)
session     one worker's sync: export -> apply -> check -> probe
fingerprint exact bit fingerprints of tensors
transport   vLLM holds exactly the bits sent (exact, per slot)
semantic    the delta vLLM applies per module equals the delta the trainer trains (meaning)
probe       trainer vs vLLM log-probs on fixed sequences (numerics, end to end)
faults      test switch that corrupts the export before it is sent (trainer.sync_fault)
"""
