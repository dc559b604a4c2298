"""TRL's GRPOTrainer on lorarl's task and model, vLLM colocate, for a same-work comparison.

    python -m bench.trl_grpo_worker --model <tiny> --train-parquet <arith train.parquet> \
        --steps 12 --prompts 4 --n 4 --max-tokens 32 --out trl.json

Defaults: bench.peer_trl's CPU comparison; bench.gpu_step sets the GPU run's (lorarl_options).

Same model, rows (the parquet the lorarl run reads), reward (lorarl.rewards by data_source) and
batch as lorarl's run. TRL syncs by merging LoRA into the base and pushing every weight into
vLLM each step (`VLLMGeneration.sync_weights`).

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
`--vllm-is-correction/--vllm-is-mode/--vllm-is-clip-*` set TRL's importance-sampling correction
(`lorarl_options` maps a lorarl config's `algorithm.rollout_correction` onto them, so both run one algorithm).
The output file is rewritten after every step, so a run stopped early keeps its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# lorarl's rollout corrections (bench.gpu_step's names) as TRL's importance-sampling modes: the
# same ratio, the same truncation or mask; lorarl's thresholds become TRL's clip_max and clip_min.
TRL_IS_MODE = {
    "token_tis": "token_truncate",
    "seq_tis": "sequence_truncate",
    "token_mask": "token_mask",
    "seq_mask": "sequence_mask",
}


def correction_options(correction: str, rc) -> list[str]:
    """The options for lorarl's correction config `rc` (algorithm.rollout_correction): *_tis
    truncates above rollout_is_threshold; *_mask keeps ratios inside rollout_rs_threshold's bounds.
    lorarl's k1 threshold (`upper` or `lower_upper`) bounds pi_rollout / pi_trainer, TRL's clip the
    inverse ratio."""
    if correction == "none":
        return ["--vllm-is-correction", "off"]
    args = ["--vllm-is-correction", "on", "--vllm-is-mode", TRL_IS_MODE[correction]]
    if not correction.endswith("_mask"):
        return [*args, "--vllm-is-clip-max", str(rc.rollout_is_threshold)]
    parts = [float(x) for x in str(rc.rollout_rs_threshold).split("_")]
    lower, upper = (1.0 / parts[0], parts[0]) if len(parts) == 1 else parts
    return [*args, "--vllm-is-clip-max", str(1.0 / lower), "--vllm-is-clip-min", str(1.0 / upper)]


def lorarl_options(run_cfg, correction: str, cpu: bool) -> list[str]:
    """The options that run the work of a composed lorarl RunConfig with every setting the two
    share: batch, steps, LoRA, lr, KL, micro-batching, checkpointing, sampling, vLLM's memory share
    and the rollout correction. The micro-batch is lorarl's row count, or for a token budget the
    rows of the longest sequences that fit it, rounded down to a power of two (it must divide the
    step's completions). On CPU one thread: one process shares two cores with its vLLM."""
    r, d, m, a = run_cfg.rollout, run_cfg.data, run_cfg.model, run_cfg.actor
    width = d.max_prompt_length + d.max_response_length
    rows = a.ppo_max_token_len_per_gpu // width if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu
    micro = 1 << (max(1, min(rows, d.train_batch_size * r.n)).bit_length() - 1)
    args = ["--steps", str(run_cfg.trainer.total_steps), "--prompts", str(d.train_batch_size), "--samples", str(r.n)]
    args += ["--max-tokens", str(d.max_response_length), "--device", "cpu" if cpu else "cuda", "--dtype", m.dtype]
    args += ["--rank", str(m.lora.rank), "--alpha", str(m.lora.alpha), "--lr", str(a.optim.lr)]
    modules = m.lora.target_modules
    args += ["--target-modules", modules if isinstance(modules, str) else ",".join(modules)]
    args += ["--target-parameters", ",".join(m.lora.target_parameters)] if m.lora.target_parameters else []
    args += ["--beta", str(a.kl_loss_coef if a.use_kl_loss else 0.0), "--micro-batch", str(micro)]
    args += ["--gradient-checkpointing", "on" if m.enable_gradient_checkpointing else "off"]
    args += ["--max-model-len", str(r.max_model_len or width), "--temperature", str(r.temperature)]
    args += correction_options(correction, run_cfg.algorithm.rollout_correction)
    return args + (["--threads", "1"] if cpu else ["--vllm-gpu-memory-utilization", str(r.gpu_memory_utilization)])


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
    ap.add_argument("--target-modules", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    # A Qwen3-MoE layer has no gate/up/down modules: its experts are fused 3-D parameters, which
    # PEFT wraps through target_parameters (what lorarl's qwen3_30b_a3b preset targets).
    ap.add_argument("--target-parameters", default="", help="comma list, e.g. mlp.experts.gate_up_proj")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta", type=float, default=0.001, help="KL coefficient (0: no reference pass)")
    ap.add_argument("--micro-batch", type=int, default=None, help="completions per forward (per_device_train_batch_size): "
                    "the step's completions in gradient-accumulation micro-batches, one optimizer step (default: all in one)")  # fmt: skip
    ap.add_argument("--gradient-checkpointing", choices=sorted(on_off), default="on")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=None, help="default: TRL's")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--keep-order", action="store_true", help="draw prompts in file order (no shuffle)")
    ap.add_argument("--ignore-eos", action="store_true", help="every completion runs to --max-tokens")
    ap.add_argument("--vllm-is-correction", choices=sorted(on_off), default="on",
                    help="TRL's vLLM importance-sampling correction (on, TRL's default, adds an old-log-prob pass)")  # fmt: skip
    ap.add_argument("--vllm-is-mode", choices=sorted(TRL_IS_MODE.values()), default=None,
                    help="TRL's importance-sampling mode (default: TRL's)")  # fmt: skip
    ap.add_argument("--vllm-is-clip-max", type=float, default=None, help="C_max (default: TRL's)")
    ap.add_argument("--vllm-is-clip-min", type=float, default=None, help="C_min (default: TRL's, none)")
    args = ap.parse_args(argv)
    completions = args.prompts * args.n
    args.micro_batch = args.micro_batch or completions
    if completions % args.micro_batch:
        ap.error(f"--micro-batch {args.micro_batch} must divide prompts x n = {completions}")
    args.gradient_checkpointing = on_off[args.gradient_checkpointing]
    args.vllm_is_correction = on_off[args.vllm_is_correction]
    return args


def prompt_dataset(path: str):
    """The parquet's rows as TRL's conversational prompts, with what the reward needs."""
    import pyarrow.parquet as pq
    from datasets import Dataset

    rows = pq.read_table(path).to_pylist()
    return Dataset.from_list(
        [
            {"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"], "data_source": r["data_source"]}
            for r in rows
        ]
    )


def reward(completions, ground_truth, data_source, **_):
    """lorarl's reward function of each row's data source, as a TRL reward function."""
    from lorarl.rewards import get_reward_fn

    out = []
    for completion, truth, source in zip(completions, ground_truth, data_source):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        out.append(float(get_reward_fn(source)(text, truth, None)))
    return out


class PhaseTimers:
    """Wraps TRL's own methods to time a step's phases into `phase` (cleared by the step timer):
    generation, the weight sync (with the CPU build's fallback to `reload_weights`), the no-grad
    log-prob passes, and generate-and-score with the step's token counts."""

    def __init__(self, on_cuda: bool):
        import torch

        self.on_cuda = on_cuda
        self.torch = torch
        self.phase: dict[str, float] = {}
        self.sync_log: list[dict] = []

    def settle(self) -> None:
        # Timers read the clock after queued GPU work has finished.
        if self.on_cuda:
            self.torch.cuda.synchronize()

    def add(self, key: str, value: float) -> None:
        self.phase[key] = self.phase.get(key, 0.0) + value

    def install(self) -> None:
        from trl import GRPOTrainer
        from trl.generation import vllm_generation

        gen_cls = vllm_generation.VLLMGeneration
        original_sync, original_generate = gen_cls.sync_weights, gen_cls.generate
        original_logps = GRPOTrainer._get_per_token_logps_and_entropies
        original_score = GRPOTrainer._generate_and_score_completions
        timers = self

        def timed_sync(self_) -> None:
            t0 = time.perf_counter()
            try:
                timers.sync_once(self_, original_sync)
            finally:
                timers.settle()
                timers.add("sync_s", time.perf_counter() - t0)

        def timed_generate(self_, *a, **kw):
            t0 = time.perf_counter()
            try:
                return original_generate(self_, *a, **kw)
            finally:
                timers.add("generation_s", time.perf_counter() - t0)

        def timed_logps(self_, *a, **kw):
            if timers.torch.is_grad_enabled():  # the training forward: part of update_s
                return original_logps(self_, *a, **kw)
            t0 = time.perf_counter()
            try:
                out = original_logps(self_, *a, **kw)
                timers.settle()
                return out
            finally:
                timers.add("logp_s", time.perf_counter() - t0)

        def timed_score(self_, *a, **kw):
            t0 = time.perf_counter()
            out = original_score(self_, *a, **kw)
            timers.settle()
            timers.add("generate_and_score_s", time.perf_counter() - t0)
            timers.add("prompt_tokens", int(out["prompt_mask"].sum()))
            timers.add("completion_tokens", int(out["completion_mask"].sum()))
            timers.add("completions", int(out["completion_mask"].shape[0]))
            return out

        gen_cls.sync_weights, gen_cls.generate = timed_sync, timed_generate
        GRPOTrainer._get_per_token_logps_and_entropies = timed_logps
        GRPOTrainer._generate_and_score_completions = timed_score

    def sync_once(self, gen, original_sync) -> None:
        """TRL's sync as is until it fails once; from then on its merged weights through vLLM's
        reload path (the CPU build keeps re-packed weights behind empty placeholders)."""
        t0 = time.perf_counter()
        if any("error" in entry for entry in self.sync_log):
            reload_sync(gen)
            self.sync_log.append({"mode": "reload_weights", "seconds": time.perf_counter() - t0})
            return
        try:
            original_sync(gen)
            self.sync_log.append({"mode": "trl_as_is", "seconds": time.perf_counter() - t0})
        except Exception as exc:  # noqa: BLE001 - the failure is a result; the run goes on via reload
            error = f"{type(exc).__name__}: {exc}"[:400]
            self.sync_log.append({"mode": "trl_as_is", "seconds": time.perf_counter() - t0, "error": error})
            t1 = time.perf_counter()
            reload_sync(gen)
            self.sync_log.append({"mode": "reload_weights", "seconds": time.perf_counter() - t1, "after_failure": True})

    def step_row(self, step: int, seconds: float) -> dict:
        """The finished step's phases; update_s is the step minus generate-and-score."""
        row = {"step": step, "step_s": seconds, **self.phase}
        row.setdefault("sync_s", 0.0)
        row.setdefault("logp_s", 0.0)
        if "generate_and_score_s" in row:
            row["update_s"] = seconds - row["generate_and_score_s"]
            row["score_s"] = row["generate_and_score_s"] - row.get("generation_s", 0.0) - row["sync_s"] - row["logp_s"]
        return row


def reload_sync(gen) -> None:
    # TRL's merged-weight stream, handed to vLLM's reload path instead of raw load_weights.
    gen.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": gen._iter_named_params()})
    gen.llm.reset_prefix_cache()


def grpo_config(args: argparse.Namespace):
    """One generation of prompts x n completions per optimizer step: micro-batches of
    per_device_train_batch_size, accumulated over steps_per_generation = accumulation steps."""
    from trl import GRPOConfig

    accumulation = args.prompts * args.n // args.micro_batch
    optional = {}
    if args.vllm_gpu_memory_utilization is not None:
        optional["vllm_gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
    if args.ignore_eos:
        # Random weights rarely sample EOS; this makes sure no completion ends before max_tokens.
        optional["generation_kwargs"] = {"ignore_eos": True}
    for key in ("vllm_is_mode", "vllm_is_clip_max", "vllm_is_clip_min"):
        if getattr(args, key) is not None:
            optional[key.replace("vllm_is_", "vllm_importance_sampling_")] = getattr(args, key)
    return GRPOConfig(
        output_dir=str(args.workdir or Path(args.out).with_suffix(".trl_out")),
        use_cpu=args.device != "cuda",
        bf16=args.dtype == "bfloat16",
        fp16=False,
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


def run_config(args: argparse.Namespace, config) -> dict:
    """The settings the run used, as recorded beside its steps."""
    return {
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
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "steps_per_generation": config.steps_per_generation,
        "gradient_checkpointing": args.gradient_checkpointing,
        "vllm_gpu_memory_utilization": config.vllm_gpu_memory_utilization,
        "vllm_importance_sampling_correction": args.vllm_is_correction,
        "vllm_importance_sampling_mode": config.vllm_importance_sampling_mode,
        "vllm_importance_sampling_clip_max": config.vllm_importance_sampling_clip_max,
        "vllm_importance_sampling_clip_min": config.vllm_importance_sampling_clip_min,
        "vllm_enable_sleep_mode": config.vllm_enable_sleep_mode,
        "ignore_eos": args.ignore_eos,
        "keep_order": args.keep_order,
        "loss_type": config.loss_type,
    }


def write_out(path: str, obj: dict) -> None:
    # Replaced whole, never half-written: a run stopped mid-write keeps the previous steps.
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # TRL sizes vLLM's KV cache with gpu_memory_utilization, which the CPU build reads as a share
    # of host RAM minus this process's RSS; a fixed 1 GiB (whole GiB only) is what works here.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    timers = PhaseTimers(on_cuda=args.device == "cuda")
    timers.install()
    config = grpo_config(args)
    steps: list[dict] = []
    times: dict = {"init_s": None, "train_s": None}

    def result() -> dict:
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        return {
            "steps_s": [s["step_s"] for s in steps],
            "steps": steps,
            "syncs": timers.sync_log,
            **times,
            "reward_mean_per_step": rewards,
            "torch_threads": torch.get_num_threads(),
            "config": run_config(args, config),
        }

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            timers.settle()
            timers.phase.clear()
            self._t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            timers.settle()
            steps.append(timers.step_row(state.global_step, time.perf_counter() - self._t0))
            write_out(args.out, result())

    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)),
        reward_funcs=reward,
        args=config,
        train_dataset=prompt_dataset(args.train_parquet),
        processing_class=AutoTokenizer.from_pretrained(args.model),
        peft_config=LoraConfig(
            r=args.rank,
            lora_alpha=args.alpha,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
            target_modules=args.target_modules
            if args.target_modules == "all-linear"
            else args.target_modules.split(","),
            target_parameters=[name for name in args.target_parameters.split(",") if name] or None,
        ),
        callbacks=[StepTimer()],
    )
    times["init_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train()
    times["train_s"] = time.perf_counter() - t0
    write_out(args.out, result())


if __name__ == "__main__":
    main()
