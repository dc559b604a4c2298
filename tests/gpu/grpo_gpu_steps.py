"""A few GRPO-LoRA steps on GPUs: colocated FSDP2 (NCCL) or Megatron + vLLM (CUDA, sleep mode) per rank.

    torchrun --standalone --nproc_per_node=2 tests/gpu/grpo_gpu_steps.py --model tiny|qwen2_5_0_5b|qwen3_0_6b --steps 4 --out DIR
    torchrun --standalone --nproc_per_node=2 tests/gpu/grpo_gpu_steps.py --backend megatron --tp 2 ...
    ... --merge      merged sync: vLLM without LoRA, W + BA pushed every step (level-2 sleep)

(`--device cpu` runs the same flow on the CPU build of vLLM, without sleep mode, so the
script itself is checked where no GPU is.)

Each rank drives its own `Worker` (the same class the Ray trainer places on every device):
generate -> reward -> GRPO advantages -> sleep vLLM -> old/ref log-probs + PPO update ->
wake + sync + parity probe. Rank 0 writes DIR/grpo_<backend>_<model>[_merged][_graphs]_<world>gpu.json
with per-step timings, sync sizes, probe differences, adapter counts and peak memory, rollout
tokens/s, and the sleep/wake regression: level-1 sleep keeps the base, level-2 sleep drops it
and the next sync must resend it; both are checked tensor by tensor against the engine's state
before sleeping (on CPU: a resend after marking the base gone).

The 0.5B/0.6B cases use random weights with Qwen2.5-0.5B's or Qwen3-0.6B's real shape (nothing can be
downloaded on the GPU machine) and a reward that prefers low token ids, so advantages are
non-zero and the adapter moves; the tiny case uses the warmed-up embedded model and the
real arithmetic reward."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

# One visible GPU per rank, as Ray gives each worker: vLLM's in-process engine then uses cuda:0.
os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("LOCAL_RANK", "0")

import torch  # noqa: E402
import torch.distributed as dist

# Random weights with a real model's shape come from the benchmarks' model builder.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
SHAPES = {"qwen2_5_0_5b": "qwen2.5-0.5b", "qwen3_0_6b": "qwen3-0.6b"}


def model_dir(kind: str, cache: Path) -> tuple[Path, str]:
    """(the model folder, the file whose presence says it is complete)."""
    from bench.common import SHAPED_MODEL_DONE, shaped_model_path
    from lorarl.models.tiny import MARKER, default_tiny_model_path

    if kind == "tiny":  # in $LORARL_CACHE, as the recipe's default
        return default_tiny_model_path(), MARKER
    return shaped_model_path(cache, SHAPES[kind], dtype="bfloat16"), SHAPED_MODEL_DONE


def build_model(kind: str, cache: Path, device: str) -> Path:
    from bench.common import shaped_model
    from lorarl.models.tiny import default_tiny_model_path, ensure_tiny_model

    if kind == "tiny":
        return ensure_tiny_model(default_tiny_model_path())
    return shaped_model(cache, SHAPES[kind], dtype="bfloat16", device=device)


def make_run(
    model_path: Path,
    world: int,
    kind: str,
    n: int,
    batch: int,
    device: str,
    backend: str,
    tp: int,
    merge: bool,
    cuda_graphs: bool = False,
):
    from lorarl.config.compose import compose

    tiny = kind == "tiny"
    dp = world // tp
    overrides = [
        f"+backend={backend}",
        f"model.path={model_path}",
        "model.builder=null",
        f"model.dtype={'float32' if tiny else 'bfloat16'}",
        f"model.enable_gradient_checkpointing={str(not tiny).lower()}",
        f"model.lora.rank={16 if tiny else 64}",
        "model.lora.alpha=32",
        f"model.lora.merge={str(merge).lower()}",
        f"data.train_batch_size={batch * dp}",
        "data.max_prompt_length=64",
        f"data.max_response_length={8 if tiny else 128}",
        f"rollout.n={n}",
        "rollout.temperature=1.0",
        "rollout.gpu_memory_utilization=0.3",
        "rollout.load_format=auto",
        f"rollout.layered_summon={str(not tiny and not merge).lower()}",
        f"rollout.enforce_eager={str(not cuda_graphs).lower()}",
        "rollout.free_cache_engine=true",  # these steps measure sleep and wake
        # Two copies of the base: the resend below drops vLLM's and sends the trainer's (the
        # shared base is never sent; tests/gpu/test_shared_base_gpu.py covers its sleep).
        *(["backend.share_base=false"] if backend == "fsdp" else []),
        f"actor.optim.lr={2e-3 if tiny else 1e-4}",
        f"actor.ppo_mini_batch_size={batch * dp}",
        f"actor.ppo_micro_batch_size_per_gpu={batch * n}",
        "actor.use_kl_loss=true",
        f"trainer.n_gpus_per_node={world}",
        f"trainer.device={device}",
        "trainer.check_sync=true",
        "trainer.check_sync_probe_freq=1",  # the parity probe after every step's sync
        f"trainer.check_sync_tolerance={0.1 if tiny else 0.25}",
    ]
    if backend == "megatron":
        overrides.append(f"backend.tensor_model_parallel_size={tp}")
    else:
        overrides.append(f"backend.mixed_precision={'float32' if tiny else 'bfloat16'}")
    return compose(overrides)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", *SHAPES], default="tiny")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="prompts per rank per step")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=None, help="model cache (default $LORARL_CACHE or ~/.cache/lorarl)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--backend", choices=["fsdp", "megatron"], default="fsdp")
    ap.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size")
    ap.add_argument("--merge", action="store_true", help="merged sync: vLLM without LoRA, W + BA pushed every step")
    ap.add_argument("--cuda-graphs", action="store_true", help="rollout.enforce_eager=false: vLLM captures CUDA graphs")
    args = ap.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A hang must leave a trace: every thread's stack after 240 s, then exit.
    faulthandler.dump_traceback_later(int(os.environ.get("LORARL_GPU_HANG_S", "240")), exit=True, file=sys.stderr)

    def phase(msg: str) -> None:
        print(f"[rank {rank}] {time.strftime('%H:%M:%S')} {msg}", flush=True)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer

    from bench.common import cache_dir
    from lorarl.algorithms import advantages
    from lorarl.contract.messages import GenerateRequest, Rendezvous, SyncRequest, UpdateRequest
    from lorarl.data.arith import make_rows
    from lorarl.driver.jobs import sampling_of
    from lorarl.driver.prepare import worker_spec
    from lorarl.rewards import get_reward_fn
    from lorarl.workers.worker import Worker

    cache = cache_dir(args.cache)
    if rank == 0:
        model_path = build_model(args.model, cache, args.device)
    else:  # no process group yet: wait for rank 0's files
        model_path, done = model_dir(args.model, cache)
        while not (model_path / done).is_file():
            time.sleep(1)
    run = make_run(
        model_path,
        world,
        args.model,
        args.n,
        args.batch,
        args.device,
        args.backend,
        args.tp,
        args.merge,
        args.cuda_graphs,
    )
    cuda = args.device == "cuda"
    tok = AutoTokenizer.from_pretrained(model_path)
    phase(f"model ready at {model_path}; setting up worker")
    t0 = time.perf_counter()
    worker = Worker(worker_spec(run, args.device), rank=rank, world_size=world, device=args.device)
    # Under torchrun every tcp:// rendezvous is a client of the launcher's store
    # (TORCHELASTIC_USE_AGENT_STORE), so the process group must meet at MASTER_PORT itself.
    setup = worker.setup(Rendezvous(master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"])))
    dp_rank, dp_size = setup.dp_rank, setup.dp_size
    setup_s = time.perf_counter() - t0
    phase(
        f"worker set up in {setup_s:.1f} s (vLLM {setup.rollout_start_seconds:.1f} s, "
        f"engine {setup.engine_build_seconds:.1f} s); first sync"
    )
    first = worker.sync(SyncRequest(step=0, last=False))[0]
    phase(f"first sync: {first}")

    rows = make_rows(args.batch * dp_size * (args.steps + 1), seed=1, split="train")
    mine = rows[dp_rank::dp_size]
    arith = get_reward_fn("arith")
    vocab_half = len(tok) // 2
    log = []
    for step in range(1, args.steps + 1):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t_step = time.perf_counter()
        batch = mine[(step - 1) * args.batch : step * args.batch]
        prompts = [
            tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"] for r in batch
        ]
        # The first training rollout also sets the sync probe's sequences (lorarl.sync.session).
        out = worker.generate(
            GenerateRequest(prompts, args.n, 1.0, 1.0, run.data.max_response_length, 1000 * step + dp_rank, True)
        )
        responses, t_gen = out.token_ids, out.seconds
        if dp_size < world:  # ranks of one model-parallel replica train on one set of samples, as the trainer does
            every = [None] * world
            dist.all_gather_object(every, (dp_rank, responses))
            responses = next(r for d, r in every if d == dp_rank)
        p_ids, r_ids, rewards, groups = [], [], [], []
        for g, (row, prompt, samples) in enumerate(zip(batch, prompts, responses)):
            for s in samples:
                p_ids.append(prompt)
                r_ids.append(s)
                groups.append(g)
                if args.model == "tiny":
                    rewards.append(
                        arith(tok.decode(s, skip_special_tokens=True), row["reward_model"]["ground_truth"], None)
                    )
                else:  # random weights: reward the share of low token ids so groups differ
                    rewards.append(sum(t < vocab_half for t in s) / max(1, len(s)))
        adv = advantages.grpo_advantages(torch.tensor(rewards), torch.tensor(groups)).tolist()
        train = worker.update(UpdateRequest(step, p_ids, r_ids, adv, None, (sampling_of(run),)))
        t_sleep = train.sleep_seconds
        t_sync0 = time.perf_counter()
        sync = worker.sync(SyncRequest(step=step, last=step == args.steps))[0]
        t_sync = time.perf_counter() - t_sync0
        tokens = sum(len(r) for r in r_ids)
        log.append(
            {
                "step": step,
                "reward/mean": sum(rewards) / len(rewards),
                "timing/gen": t_gen,
                "timing/sleep": t_sleep,
                "timing/old_logp": train.old_logp_seconds or 0.0,
                "timing/ref_logp": train.ref_logp_seconds or 0.0,
                "timing/update": train.update_seconds,
                "timing/sync_wall": t_sync,
                "timing/step": time.perf_counter() - t_step,
                "rollout/tokens_per_s": tokens / t_gen,
                "memory/max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                "actor/grad_norm": train.ppo[0].grad_norm,
                "actor/kl_loss": train.ppo[0].kl_loss,
                **sync.metrics(),
            }
        )
        assert sync.kind == ("base" if args.merge else "adapter"), sync
        assert sync.num_adapters == (0 if args.merge else 1), sync
        if rank == 0:
            print(json.dumps(log[-1]), flush=True)

    phase("steps done; measuring rollout speed")
    # Rollout speed with and without the adapter, same prompts (greedy, fixed length).
    prompts = [
        tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"] for r in mine[:64]
    ]
    new_tokens = min(128, run.data.max_prompt_length + run.data.max_response_length - max(map(len, prompts)))
    speed = {}
    for label, lora in (("merged", False),) if args.merge else (("adapter", True), ("base", False)):
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outs = worker.rollout.llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            params,
            lora_request=worker.rollout.lora_request() if lora else None,
            use_tqdm=False,
        )
        secs = time.perf_counter() - start
        speed[label] = sum(len(o.outputs[0].token_ids) for o in outs) / secs
    phase(f"rollout tokens/s ({len(prompts)} x {new_tokens} tokens) {speed}")

    regression = sleep_wake_regression(worker, prompts[:8]) if cuda else resend_regression(worker, prompts[:8])
    worker.shutdown()
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "backend": args.backend,
            "tp": args.tp,
            "merge": args.merge,
            "cuda_graphs": args.cuda_graphs,
            "model": args.model,
            "world": world,
            "setup_s": setup_s,
            "first_sync": first.metrics(),
            "steps": log,
            "rollout_tokens_per_s": speed,
            "rollout_speed_shape": [len(prompts), new_tokens],
            "sleep_wake": regression,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
        }
        (out / f"{run_name(args.backend, args.model, world, args.merge, cuda, args.cuda_graphs)}.json").write_text(
            json.dumps(result, indent=1)
        )
        print("RESULT", json.dumps({"speed": speed, "sleep_wake": regression}), flush=True)
    phase("done")


def engine_tensors(vllm_worker) -> dict[str, torch.Tensor]:
    """Inside the vLLM worker: host copies of every tensor the model holds (parameters,
    buffers, and tensor attributes such as the LoRA stacks), the KV cache excepted."""
    model = vllm_worker.model_runner.get_model()
    out = {f"param:{n}": t.detach().to("cpu", copy=True) for n, t in model.named_parameters()}
    out |= {f"buffer:{n}": t.detach().to("cpu", copy=True) for n, t in model.named_buffers()}
    for module_name, module in model.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_") or key == "kv_cache":
                continue
            for i, t in enumerate(value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(t, torch.Tensor) and t.numel():
                    out[f"attr:{module_name}.{key}[{i}]"] = t.detach().to("cpu", copy=True)
    return out


def tensor_changes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict:
    """What differs between two engine_tensors snapshots: names and max |difference|."""
    changed = {}
    for name, old in before.items():
        new = after.get(name)
        if new is None or new.shape != old.shape:
            changed[name] = "missing or reshaped"
        elif not torch.equal(new, old):
            changed[name] = float((new.double() - old.double()).abs().max())
    worst = sorted(changed.items(), key=lambda kv: -1.0 if isinstance(kv[1], str) else -kv[1])
    return {"tensors": len(before), "changed": len(changed), "worst": dict(worst[:20])}


def _snapshot(worker) -> dict[str, torch.Tensor]:
    return worker.rollout.run_in_worker(engine_tensors)


def _resend(worker) -> tuple:
    """worker.sync with the parity probe measured, not enforced: (SyncReport, probe max diff)."""
    from lorarl.contract.messages import SyncRequest
    from lorarl.sync import probe

    session = worker.sync_sessions[0]
    check, session.check = session.check, False
    try:
        out = worker.sync(SyncRequest(step=0, last=False))[0]
    finally:
        session.check = check
    return out, probe.measure_probe(worker.engine, worker.rollout, session.probe_seqs).sync_max


def _greedy_and_probe(worker, prompts):
    """Greedy tokens and the probe's log-probs, each read with the prefix cache emptied,
    so cached and fresh prefills are never compared."""
    r = worker.rollout
    seq, start = worker.sync_sessions[0].probe_seqs[0], 1
    r.reset_prefix_cache()
    tokens = r.sample(prompts, n=1, temperature=0.0, max_tokens=16).token_ids
    r.reset_prefix_cache()
    return tokens, torch.tensor(r.prompt_logprobs(seq, start))


def resend_regression(worker, prompts: list[list[int]]) -> dict:
    """CPU stand-in for the level-2 path (no sleep mode there): mark the base as gone, let
    the next sync resend base + adapter, and compare the engine tensor by tensor."""
    before = _snapshot(worker)
    tokens0, logp0 = _greedy_and_probe(worker, prompts)
    worker.rollout.base_loaded = False
    resend, probe = _resend(worker)
    tokens1, logp1 = _greedy_and_probe(worker, prompts)
    return {
        "sync_after_resend": resend.kind,
        "resend_probe_vs_trainer": probe,
        "resend_tensor_changes": tensor_changes(before, _snapshot(worker)),
        "resend_logprob_diff": float((logp1 - logp0).abs().max()),
        "resend_greedy_unchanged": tokens1 == tokens0,
    }


def sleep_wake_regression(worker, prompts: list[list[int]]) -> dict:
    """Level 1 keeps the base: the engine's tensors, the probe's log-probs and greedy tokens
    are unchanged after wake. Level 2 drops it; vLLM still lists the adapter, the rollout
    knows better, and the next sync resends base + adapter, after which every tensor of the
    engine must equal its state before sleeping. Every rank runs it (syncs are collective)."""
    r = worker.rollout
    before = _snapshot(worker)
    tokens0, logp0 = _greedy_and_probe(worker, prompts)
    t0 = time.perf_counter()
    r.sleep(level=1)
    t_sleep1 = time.perf_counter() - t0
    free_asleep = torch.cuda.mem_get_info()[0] / 2**30
    t0 = time.perf_counter()
    r.wake_up()
    t_wake1 = time.perf_counter() - t0
    level1_changes = tensor_changes(before, _snapshot(worker))
    tokens1, logp1 = _greedy_and_probe(worker, prompts)
    probe1 = worker.sync_sessions[0].probe().sync_max
    listed_before = r.num_adapters()
    r.sleep(level=2)
    base_loaded = r.base_loaded
    listed_after = r.num_adapters()
    resend, probe2 = _resend(worker)  # wakes, sees the base is gone, resends base + adapter
    level2_changes = tensor_changes(before, _snapshot(worker))
    tokens2, logp2 = _greedy_and_probe(worker, prompts)
    return {
        "level1_sleep_s": t_sleep1,
        "level1_wake_s": t_wake1,
        "level1_free_gib_while_asleep": free_asleep,
        "level1_tensor_changes": level1_changes,
        "level1_logprob_diff": float((logp1 - logp0).abs().max()),
        "level1_greedy_unchanged": tokens1 == tokens0,
        "level1_probe_vs_trainer": probe1,
        "adapters_listed_before_level2": listed_before,
        "adapters_listed_after_level2_sleep": listed_after,
        "base_loaded_after_level2_sleep": base_loaded,
        "sync_after_level2": resend.kind,
        "sync_after_level2_bytes": resend.bytes,
        "sync_after_level2_seconds": resend.seconds,
        "sync_after_level2_probe_vs_trainer": probe2,
        "level2_tensor_changes": level2_changes,
        "level2_logprob_diff": float((logp2 - logp0).abs().max()),
        "level2_greedy_unchanged": tokens2 == tokens0,
    }


def run_name(backend: str, model: str, world: int, merge: bool, cuda: bool = True, cuda_graphs: bool = False) -> str:
    return f"grpo_{backend}_{model}{'_merged' if merge else ''}{'_graphs' if cuda_graphs else ''}_{world}{'gpu' if cuda else 'cpu'}"


if __name__ == "__main__":
    main()
