"""TRL's GRPOTrainer on the Qwen3-MoE model with LoRA on the experts too, for the GPU step comparison.

bench.trl_grpo_worker targets the seven dense projections by module name; a Qwen3-MoE layer has
no gate_proj/up_proj/down_proj modules (its experts are fused 3-D parameters), so there PEFT
would train the attention alone. This runs that same worker with PEFT's `target_parameters`
added to its LoraConfig, so TRL trains what lorarl's qwen3_30b_a3b preset trains (attention plus
every expert's gate/up/down); every other option is the worker's own.

    python -m torch.distributed.run --standalone --nproc_per_node=1 -m tests.gpu.moe_trl_peer <worker args>
"""

from __future__ import annotations

import peft

from bench import trl_grpo_worker
from lorarl.sync.experts import QWEN3_MOE_EXPERT_PARAMETERS

_LoraConfig = peft.LoraConfig


def _with_experts(*args, **kwargs):
    kwargs.setdefault("target_parameters", list(QWEN3_MOE_EXPERT_PARAMETERS))
    return _LoraConfig(*args, **kwargs)


if __name__ == "__main__":
    peft.LoraConfig = _with_experts  # the worker imports it from peft inside main()
    trl_grpo_worker.main()
