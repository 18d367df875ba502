"""Fixtures of the fpm_bench suite: the tiny model (built once into the repo's .models/) and a free port."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
from genartifact_fpm_bench import fit as fitmod

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
    """The base of two loopback ports (base + data-parallel rank 0 and 1) outside the ephemeral range."""
    from genartifact.testing import free_port as kit_free_port

    return kit_free_port(count=2)


# ---- synthetic FPM benchmark artifacts from a known step-time law (engine-free fit/report tests)

PRE = np.array([2e-3, 1e-4, 3e-5, 2e-9])  # intercept, requests, tokens, attention pairs
DEC = np.array([3e-3, 2e-4, 1e-7])  # intercept, requests, kv tokens


def law(shape: dict) -> float:
    phase = fitmod.phase_of(shape)
    return float(fitmod.linear_features(phase, shape) @ (PRE if phase == "prefill" else DEC))


def shape_of(pt: dict) -> dict:
    if pt["phase"] == "prefill":
        return {"num_prefill_requests": pt["batch"], "sum_prefill_tokens": pt["tokens"],
                "sum_prefill_kv_tokens": pt["batch"] * pt.get("kv", 0), "num_decode_requests": 0,
                "sum_decode_kv_tokens": 0}
    return {"num_prefill_requests": 0, "sum_prefill_tokens": 0, "sum_prefill_kv_tokens": 0,
            "num_decode_requests": pt["batch"], "sum_decode_kv_tokens": pt["batch"] * (pt["context"] - 1)}


def key(pt: dict) -> str:
    if pt["phase"] == "prefill":
        return f"prefill:t{pt['tokens']}:b{pt['batch']}:kv{pt.get('kv', 0)}"
    return f"decode:b{pt['batch']}:c{pt['context']}"


def artifact(points: list[dict], *, rank: int = 0, run_id: str = "run", digest: str = "g", noise: float = 0.01,
             scale: float = 1.0, seed: int = 0, engine: dict | None = None) -> dict:
    rng = np.random.default_rng(seed)
    recs = []
    for pt in points:
        pt = {"tokens": 0, "kv": 0, "context": 0, **pt}
        sh = shape_of(pt)
        walls = [law(sh) * scale * (1 + noise * rng.standard_normal()) for _ in range(5)]
        samples = [{"sample_index": i, "role": "measure", "timing": {"wall_time": w}, "scheduled": sh}
                   for i, w in enumerate(walls)]
        cv = float(np.std(walls) / np.mean(walls))
        recs.append({"key": key(pt), "point": pt, "dp_rank": rank, "status": "completed", "raw_samples": samples,
                     "estimate": {"wall_time": float(np.median(walls)), "raw_sample_indices": list(range(5)),
                                  "cv": cv, "noisy": cv > 0.1}})
    return {"schema": "genartifact.fpm_bench.rank", "schema_version": 1, "artifact_type": "rank", "run_id": run_id,
            "grid_digest": digest, "mode": "agg", "dp": {"rank": rank, "size": 1},
            "protocol": {"timing_basis": "schedule_to_output", "estimate": "median of measured samples"},
            "points": recs, "engine": engine or {"model": {"model": "tiny"}, "parallel": {"data_parallel_rank": rank}}}


GRID = ([{"phase": "prefill", "batch": b, "tokens": t, "kv": kv} for b in (1, 2, 4) for t in (64, 128, 256, 512, 1024)
         for kv in (0, 128)] +
        [{"phase": "decode", "batch": b, "context": c} for b in (1, 2, 4, 8, 16) for c in (16, 64, 256, 1024)])
OFF = ([{"phase": "prefill", "batch": b, "tokens": t, "kv": 0} for b in (1, 2, 4) for t in (96, 384, 768)] +
       [{"phase": "decode", "batch": b, "context": c} for b in (3, 6, 12) for c in (48, 192, 768)])


@pytest.fixture
def synth() -> types.SimpleNamespace:
    """Synthetic artifacts whose step times follow a known law: ``artifact(points, rank=, scale=, noise=, ...)``,
    the ``GRID`` and off-grid ``OFF`` point lists, ``law(shape)`` seconds, ``shape_of(point)``, ``PRE``/``DEC``."""
    return types.SimpleNamespace(PRE=PRE, DEC=DEC, law=law, shape_of=shape_of, key=key, artifact=artifact, GRID=GRID,
                                 OFF=OFF)
