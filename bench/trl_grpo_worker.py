"""TRL's GRPOTrainer on lorarl's task and model, vLLM colocate, for a same-work comparison.

    python -m bench.trl_grpo_worker --model <tiny> --train-parquet <arith train.parquet> \
        --steps 12 --prompts 4 --n 4 --max-tokens 32 --out trl.json

The defaults are the CPU comparison of bench.peer_trl (below); bench.gpu_step sets the GPU
run's options (--device cuda --dtype bfloat16, rank, lr, beta, micro-batch, ...).

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

Per step (`steps` in the output) the phases are timed by wrappers around TRL's own methods:
`generation_s` (VLLMGeneration.generate), `sync_s` (sync_weights: merge LoRA, push every
weight, unmerge), `logp_s` (the no-grad log-prob passes in _generate_and_score_completions:
old log-probs for vLLM importance-sampling correction, reference log-probs when beta > 0),
`score_s` (the rest of _generate_and_score_completions: tokenising, rewards, advantages), and
`update_s` (the step minus _generate_and_score_completions: forward+backward of every
micro-batch and the optimizer step). On CUDA each timer ends with a device synchronize.
The output file is rewritten after every step, so a run stopped early keeps its steps.
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    on_off = {"on": True, "off": False}
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train-parquet", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=4)
    # --samples for launchers that take abbreviated options of their own (torchrun reads --n as --nnodes).
    ap.add_argument("--n", "--samples", dest="n", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta", type=float, default=0.001, help="KL coefficient (0: no reference pass)")
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="completions per forward (per_device_train_batch_size); the step's prompts x n completions are "
        "split into gradient-accumulation micro-batches of this size, one optimizer step per generation "
        "(default: all in one)",
    )
    ap.add_argument("--gradient-checkpointing", choices=sorted(on_off), default="on")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=None, help="default: TRL's")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--keep-order", action="store_true", help="draw prompts in file order (no shuffle)")
    ap.add_argument("--ignore-eos", action="store_true", help="every completion runs to --max-tokens")
    ap.add_argument(
        "--vllm-is-correction",
        choices=sorted(on_off),
        default="on",
        help="TRL's vLLM importance-sampling correction (on, TRL's default, adds an old-log-prob pass)",
    )
    args = ap.parse_args(argv)
    completions = args.prompts * args.n
    args.micro_batch = args.micro_batch or completions
    if completions % args.micro_batch:
        ap.error(f"--micro-batch {args.micro_batch} must divide prompts x n = {completions}")
    args.gradient_checkpointing = on_off[args.gradient_checkpointing]
    args.vllm_is_correction = on_off[args.vllm_is_correction]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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

    on_cuda = args.device == "cuda"

    def settle() -> None:
        # Timers read the clock after queued GPU work has finished.
        if on_cuda:
            torch.cuda.synchronize()

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
    phase: dict[str, float] = {}  # seconds and tokens of the step in progress
    original_sync = vllm_generation.VLLMGeneration.sync_weights

    def add(key: str, value: float) -> None:
        phase[key] = phase.get(key, 0.0) + value

    def reload_sync(self) -> None:
        # TRL's merged-weight stream, handed to vLLM's reload path instead of raw load_weights.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._iter_named_params()})
        self.llm.reset_prefix_cache()

    def timed_sync(self) -> None:
        t_all = time.perf_counter()
        try:
            sync_once(self)
        finally:
            settle()
            add("sync_s", time.perf_counter() - t_all)

    def sync_once(self) -> None:
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

    original_generate = vllm_generation.VLLMGeneration.generate

    def timed_generate(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return original_generate(self, *a, **kw)
        finally:
            add("generation_s", time.perf_counter() - t0)

    vllm_generation.VLLMGeneration.generate = timed_generate

    original_logps = GRPOTrainer._get_per_token_logps_and_entropies

    def timed_logps(self, *a, **kw):
        if torch.is_grad_enabled():  # the training forward: part of update_s
            return original_logps(self, *a, **kw)
        t0 = time.perf_counter()
        try:
            out = original_logps(self, *a, **kw)
            settle()
            return out
        finally:
            add("logp_s", time.perf_counter() - t0)

    GRPOTrainer._get_per_token_logps_and_entropies = timed_logps

    original_score = GRPOTrainer._generate_and_score_completions

    def timed_score(self, *a, **kw):
        t0 = time.perf_counter()
        out = original_score(self, *a, **kw)
        settle()
        add("generate_and_score_s", time.perf_counter() - t0)
        prompt_tokens = int(out["prompt_mask"].sum())
        completion_tokens = int(out["completion_mask"].sum())
        add("prompt_tokens", prompt_tokens)
        add("completion_tokens", completion_tokens)
        add("completions", int(out["completion_mask"].shape[0]))
        return out

    GRPOTrainer._generate_and_score_completions = timed_score

    steps: list[float] = []
    step_rows: list[dict] = []

    workdir = Path(args.workdir or Path(args.out).with_suffix(".trl_out"))
    completions = args.prompts * args.n
    accumulation = completions // args.micro_batch
    optional = {}
    if args.vllm_gpu_memory_utilization is not None:
        optional["vllm_gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
    if args.ignore_eos:
        # Random weights rarely sample EOS; this makes sure no completion ends before max_tokens.
        optional["generation_kwargs"] = {"ignore_eos": True}
    config = GRPOConfig(
        output_dir=str(workdir),
        use_cpu=not on_cuda,
        bf16=args.dtype == "bfloat16",
        fp16=False,
        # One generation of prompts x n completions per optimizer step: micro-batches of
        # per_device_train_batch_size, accumulated over steps_per_generation = accumulation steps.
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        gradient_checkpointing=args.gradient_checkpointing,
        shuffle_dataset=not args.keep_order,
        vllm_importance_sampling_correction=args.vllm_is_correction,
        num_generations=args.n,
        max_completion_length=args.max_tokens,
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=args.beta,
        temperature=args.temperature,
        loss_type="dapo",
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=1,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=args.max_model_len,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **optional,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    peft_config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )

    def result(train_s: float | None) -> dict:
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h] if trainer else []
        return {
            "steps_s": steps,
            "steps": step_rows,
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
                "lora_rank": args.rank,
                "lora_alpha": args.alpha,
                "lr": args.lr,
                "beta": args.beta,
                "device": args.device,
                "dtype": args.dtype,
                "per_device_train_batch_size": args.micro_batch,
                "gradient_accumulation_steps": accumulation,
                "steps_per_generation": accumulation,
                "gradient_checkpointing": args.gradient_checkpointing,
                "vllm_gpu_memory_utilization": config.vllm_gpu_memory_utilization,
                "vllm_importance_sampling_correction": args.vllm_is_correction,
                "vllm_enable_sleep_mode": config.vllm_enable_sleep_mode,
                "ignore_eos": args.ignore_eos,
                "keep_order": args.keep_order,
                "loss_type": config.loss_type,
            },
        }

    def write_out(obj: dict) -> None:
        # Replaced whole, never half-written: a run stopped mid-write keeps the previous steps.
        tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, args.out)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            settle()
            phase.clear()
            self._t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            settle()
            seconds = time.perf_counter() - self._t0
            steps.append(seconds)
            row = {"step": state.global_step, "step_s": seconds, **phase}
            row.setdefault("sync_s", 0.0)
            row.setdefault("logp_s", 0.0)
            if "generate_and_score_s" in row:
                row["update_s"] = seconds - row["generate_and_score_s"]
                row["score_s"] = (
                    row["generate_and_score_s"] - row.get("generation_s", 0.0) - row["sync_s"] - row["logp_s"]
                )
            step_rows.append(row)
            write_out(result(None))

    trainer = None
    init_s = None
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
    write_out(result(train_s))


if __name__ == "__main__":
    main()
