"""Fixtures of the fpm_bench suite: the tiny model (built once into the repo's .models/) and a free port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from genartifact.engine.tiny_model import make_tiny_model

    model = ROOT / ".models" / "tiny-qwen3-moe"
    if not (model / "model.safetensors").exists():
        make_tiny_model(model)
    return model


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
