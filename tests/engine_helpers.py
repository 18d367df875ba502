"""Helpers shared by the real-engine tests (on ``pythonpath`` via the root pytest config)."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
from genartifact import format as fmt

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village near the mountains, there lived an old woman who kept bees.",
    "Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in many sentences.",
    "Science is the patient work of asking questions and testing answers against the world.",
    "The ocean is deep and blue.",
    "History remembers kings and queens, but also farmers, sailors, builders, teachers, and poets.",
]


def settings(root: Path):
    return {"managed_fsspec": {"profiles": {"t": {"url": f"file://{root}", "allowed_prefixes": ["runs/"]}}}}


def spec(contents=("moe_routes", "selected_logprobs")):
    return {"format": "generation_artifact_v1", "contents": list(contents), "codec": "zstd",
            "delivery": {"mode": "object_store",
                         "target": {"kind": "managed_fsspec", "profile": "t", "object_key": f"runs/{uuid.uuid4().hex}.gart"}}}


def read(root: Path, receipt) -> fmt.Artifact:
    assert receipt["state"] == "ready", receipt
    data = (root / receipt["object_id"].split(":", 1)[1]).read_bytes()
    art = fmt.decode(data)
    assert art.sha256 == receipt["sha256"] and art.byte_count == receipt["byte_count"] == len(data)
    return art


_hf_cache: dict = {}


def hf_topk(model_dir: Path, token_ids: np.ndarray) -> np.ndarray:
    """Oracle: ``[tokens, moe_layers, top_k]`` expert ids chosen by HF transformers' own routers (the product's
    replay-check oracle, :class:`genartifact_route_capture.replay_check.HFOracle`)."""
    from genartifact_route_capture.replay_check import HFOracle

    m = _hf_cache.get(model_dir)
    if m is None:
        m = _hf_cache[model_dir] = HFOracle(model_dir)
    return m.topk(token_ids)


def agreement(captured: np.ndarray, oracle: np.ndarray) -> float:
    """Fraction of (token, layer) whose top-k expert *sets* agree."""
    return float((np.sort(captured, -1) == np.sort(oracle, -1)).all(-1).mean())
