"""Shared fixtures: a real tiny Qwen2 built by the project's own builder, once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Engines in tests run in-process; set before anything imports vLLM.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def lorarl_cache(tmp_path_factory) -> Path:
    """A session-private LORARL_CACHE, so tests never read or write ~/.cache/lorarl."""
    root = tmp_path_factory.mktemp("lorarl-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("LORARL_CACHE", str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="session")
def tiny_model_path(lorarl_cache: Path) -> Path:
    from lorarl.models.tiny import default_tiny_model_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_model_path())


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def run_cache(tiny_model_path: Path) -> Path:
    """A LORARL_CACHE for runs of `python -m recipes.grpo`: the session's tiny model under the
    name conf/model/qwen2_tiny.yaml expects, so no run builds its own."""
    root = tiny_model_path.parent / "run_cache"
    root.mkdir(exist_ok=True)
    link = root / "qwen2_tiny"
    if not link.exists():
        link.symlink_to(tiny_model_path, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def model_cache(run_cache: Path) -> Path:
    """run_cache with the session's Qwen3 and Qwen3-MoE under their presets' names."""
    from lorarl.models.tiny import default_tiny_model_path, ensure_tiny_model

    for arch in ("qwen3", "qwen3_moe"):
        link = run_cache / f"{arch}_tiny"
        if not link.exists():
            link.symlink_to(ensure_tiny_model(default_tiny_model_path(arch=arch), arch=arch), target_is_directory=True)
    return run_cache
