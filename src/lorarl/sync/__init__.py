"""The weight sync from a training engine into the vLLM rollout, and the checks that it is right.

session          one worker's sync: export -> apply -> check -> probe
split            the same across processes (trainer.placement=split): a sender and a receiver
experts          PEFT's stacked expert LoRA -> vLLM's per-expert layout (the export's MoE part)
fingerprint      exact bit fingerprints of tensors
transport        vLLM holds exactly the bits sent (exact, per slot)
semantic         the delta vLLM applies per module equals the delta the trainer trains (meaning)
semantic_merged  the same in merged mode: vLLM serves W_base + the trainer's delta
probe            trainer vs vLLM log-probs on fixed sequences (numerics, end to end)
faults           test switch that corrupts the export before it is sent (trainer.sync_fault);
                 faults_merged makes the same faults in merged weights

The payload itself, carrying its own kind (base or adapter), is lorarl.contract.payload's.
"""
