"""Shared fixtures: tiny checkpoints (built once, cached in .models/) and one real vLLM-CPU engine per
test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import pytest_asyncio

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("GENARTIFACT_TEST_MODELS", ROOT / ".models"))


def tiny_model(family: str) -> Path:
    from genartifact.engine.tiny_model import make_tiny_model

    path = MODELS / f"tiny-{family.replace('_', '-')}"
    if not (path / "model.safetensors").exists():
        make_tiny_model(path, family=family)
    return path


@pytest.fixture(scope="session")
def qwen_model() -> Path:
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="session")
def deepseek_model() -> Path:
    return tiny_model("deepseek")


@pytest.fixture(scope="session")
def host():
    from genartifact.host import PluginHost

    return PluginHost({"contents": ["moe_routes", "selected_logprobs", "top_logprobs", "moe_route_weights"],
                       "targets": ["managed_fsspec"]})


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine(host, qwen_model):
    """The shared engine: small max_num_batched_tokens so long prompts take chunked prefill."""
    from genartifact.engine.vllm_adapter import VllmEngine

    eng = await VllmEngine(host, qwen_model, max_num_batched_tokens=64, max_num_seqs=16, seed=0).start()
    yield eng
    eng.shutdown()
