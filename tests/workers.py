"""The real Worker in this process, composed from the real config: what the sync, shared-base and
probe tests drive directly (no Ray). On CPU: vLLM's CPU build and FSDP2 over gloo; on a GPU:
FSDP2 over NCCL (world 1) and vLLM on that GPU."""

from __future__ import annotations

import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_worker(*overrides: str, device: str = "cpu", cache: Path | None = None):
    """A set-up Worker of rank 0 in a world of 1 for `grpo.yaml` with `+backend=fsdp` and
    `overrides`. `cache`: the LORARL_CACHE it builds the embedded models in (left set)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lorarl.config.compose import to_run_config
    from lorarl.contract.messages import Rendezvous
    from lorarl.driver.prepare import prepare_model, worker_spec
    from lorarl.workers.worker import Worker

    if cache is not None:
        os.environ["LORARL_CACHE"] = str(cache)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "grpo",
            overrides=["+backend=fsdp", "trainer.experiment_name=x", f"trainer.device={device}", *overrides],
        )
    GlobalHydra.instance().clear()
    run = to_run_config(cfg)
    prepare_model(run)
    worker = Worker(worker_spec(run, device), rank=0, world_size=1, device=device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker.setup(Rendezvous(master_addr="127.0.0.1", master_port=port))
    return worker
