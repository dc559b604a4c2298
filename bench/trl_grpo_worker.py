"""TRL's GRPOTrainer on lorarl's task and model, vLLM colocate, for a same-work comparison.

    python -m bench.trl_grpo_worker --model <tiny> --train-parquet <arith train.parquet> \
        --steps 12 --prompts 4 --n 4 --max-tokens 32 --out trl.json

Same model (the tiny Qwen2, fp32), same rows (the arith parquet the lorarl run reads), same
reward function (lorarl.rewards by data_source), same batch (prompts x n completions of at
most max-tokens), LoRA r=16 alpha=32 on the seven projections, lr 1e-3, KL coef 0.001, one
update per batch. TRL syncs by merging LoRA into the base and pushing every weight into vLLM
each step (`VLLMGeneration.sync_weights`).

On the CPU build of vLLM that push fails: TRL calls the model's raw `load_weights`, and the CPU
build keeps re-packed GEMM weights behind empty placeholder parameters. This script first
runs TRL's sync unchanged; if it raises, the error is recorded and every later sync sends the
same merged weights (TRL's own `_iter_named_params`) through vLLM's `reload_weights`, the path
that re-packs them; that is the only change. Per-step wall time comes from a trainer callback,
sync time from a wrapper around `sync_weights`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# TRL sizes vLLM's KV cache with gpu_memory_utilization, which the CPU build reads as a share
# of host RAM minus this process's RSS; a fixed 1 GiB (whole GiB only) is what works here.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train-parquet", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation

    from lorarl.rewards import get_reward_fn

    rows = pq.read_table(args.train_parquet).to_pylist()
    data = Dataset.from_list(
        [
            {"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"], "data_source": r["data_source"]}
            for r in rows
        ]
    )

    def reward(completions, ground_truth, data_source, **_):
        out = []
        for completion, truth, source in zip(completions, ground_truth, data_source):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            out.append(float(get_reward_fn(source)(text, truth, None)))
        return out

    sync_log: list[dict] = []
    original_sync = vllm_generation.VLLMGeneration.sync_weights

    def reload_sync(self) -> None:
        # TRL's merged-weight stream, handed to vLLM's reload path instead of raw load_weights.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._iter_named_params()})
        self.llm.reset_prefix_cache()

    def timed_sync(self) -> None:
        as_is = not any("error" in entry for entry in sync_log)
        t0 = time.perf_counter()
        if not as_is:
            reload_sync(self)
            sync_log.append({"mode": "reload_weights", "seconds": time.perf_counter() - t0})
            return
        try:
            original_sync(self)
            sync_log.append({"mode": "trl_as_is", "seconds": time.perf_counter() - t0})
        except Exception as exc:  # noqa: BLE001 - the failure is a result; the run goes on via reload
            sync_log.append(
                {
                    "mode": "trl_as_is",
                    "seconds": time.perf_counter() - t0,
                    "error": f"{type(exc).__name__}: {exc}"[:400],
                }
            )
            t1 = time.perf_counter()
            reload_sync(self)
            sync_log.append({"mode": "reload_weights", "seconds": time.perf_counter() - t1, "after_failure": True})

    vllm_generation.VLLMGeneration.sync_weights = timed_sync

    steps: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            self._t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            steps.append(time.perf_counter() - self._t0)

    workdir = Path(args.workdir or Path(args.out).with_suffix(".trl_out"))
    completions = args.prompts * args.n
    config = GRPOConfig(
        output_dir=str(workdir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=completions,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.n,
        max_completion_length=args.max_tokens,
        num_iterations=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=0.001,
        temperature=1.0,
        loss_type="dapo",
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=1,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    peft_config = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[StepTimer()],
    )
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    out = {
        "steps_s": steps,
        "syncs": sync_log,
        "init_s": init_s,
        "train_s": train_s,
        "reward_mean_per_step": rewards,
        "torch_threads": torch.get_num_threads(),
        "config": {
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "steps": args.steps,
            "lora_rank": 16,
        },
    }
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
