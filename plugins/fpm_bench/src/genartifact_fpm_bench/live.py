"""``genartifact bench live``: the end-to-end check of a fitted step-time model on a real ``generate`` run.

It runs genartifact's ``generate`` job (:func:`genartifact.engine.job.run_generate`: capture, encode, store,
receipts — the real product path) with the instrumented scheduler and the FPM stream on, on a **mixed
workload** (prompts of varied lengths and output lengths submitted together, so the engine runs chunked
prefills, mixed prefill+decode passes and decode passes whose batch shrinks as requests finish), subscribes to
the stream, and compares every live pass's ``wall_time`` with the model's prediction for its shape.

Passes are classed as ``prefill`` / ``decode`` (pure) or ``mixed``; a pure pass is *in grid* when
:meth:`StepModel.in_domain` holds (its coordinates lie within the grid's bounds). The headline is the MAPE over
in-grid pure passes, per phase; out-of-grid pure passes and mixed passes (never on the grid; predicted by adding
the phases' linear models) are reported separately. This is the FPM-level end-to-end error, kept apart from the
model's holdout error on benchmark points (``bench fit``).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from genartifact_fpm_bench import SCHEDULER_QUALNAME
from genartifact_fpm_bench.fit import StepModel, phase_of
from genartifact_fpm_bench.runner import FpmCollector

LIVE_SCHEMA = "genartifact.fpm_bench.live_check"
#: contents captured by default (the RL captures; contents that need per-request parameters, e.g. top_logprobs'
#: ``logprobs=k``, only when asked for)
DEFAULT_CONTENTS = ("moe_routes", "selected_logprobs")
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "signal", "vector", "matrix", "token",
         "expert", "router", "window", "garden", "engine")


def mixed_workload(n: int = 24, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` prompt rows (``{"prompt": str, "max_tokens": int}``) with lengths drawn from a seeded generator:
    prompts of 4–400 words (this tokenizer: ~3 tokens a word, so < max_model_len 2048), 4–64 output tokens — long and short requests overlap, so passes mix."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(4, 400)))
        rows.append({"prompt": " ".join(words.tolist()), "max_tokens": int(rng.integers(4, 65))})
    return rows


def _summ(ape: list[float]) -> dict[str, Any]:
    if not ape:
        return {"n": 0, "mape_pct": None, "median_ape_pct": None, "max_error_pct": None}
    return {"n": len(ape), "mape_pct": statistics.fmean(ape), "median_ape_pct": statistics.median(ape),
            "max_error_pct": max(ape)}


def compare(model: StepModel, fpms: list[Any]) -> dict[str, Any]:
    """Per-pass comparison and summary. ``fpms``: FPM records (``genartifact_fpm_bench.fpm.FPM``). Returns
    ``{"passes": [...], "summary": {"in_grid": {phase: …}, "out_of_grid": {phase: …}, "mixed": …}}``; each
    summary has ``n``, ``mape_pct``, ``median_ape_pct``, ``max_error_pct`` (percent, |pred − wall| / wall)."""
    passes = []
    groups: dict[str, list[float]] = {}
    for f in fpms:
        shape = msgspec.structs.asdict(f.scheduled)
        phase = phase_of(shape)
        fitted = phase == "mixed" or phase in model.doc["phases"]
        if not fitted or f.wall_time <= 0:
            continue
        pred = model.predict(shape)
        inside = phase != "mixed" and model.in_domain(shape)
        ape = abs(pred - f.wall_time) / f.wall_time * 100.0
        cls = "mixed" if phase == "mixed" else f"{'in_grid' if inside else 'out_of_grid'}:{phase}"
        groups.setdefault(cls, []).append(ape)
        passes.append({"counter_id": f.counter_id, "phase": phase, "in_grid": inside, "wall_time": f.wall_time,
                       "predicted": pred, "ape_pct": ape, "scheduled": shape})
    summary: dict[str, Any] = {"in_grid": {}, "out_of_grid": {}, "mixed": _summ(groups.get("mixed", []))}
    for phase in ("prefill", "decode"):
        summary["in_grid"][phase] = _summ(groups.get(f"in_grid:{phase}", []))
        summary["out_of_grid"][phase] = _summ(groups.get(f"out_of_grid:{phase}", []))
    return {"passes": passes, "summary": summary}


async def live_check(*, model_dir: str, step_model: str | Path, prompts: list[dict[str, Any]] | None = None,
                     max_tokens: int = 32, port_base: int = 20380, engine_kwargs: dict[str, Any] | None = None,
                     contents: list[str] | None = None, target: str = "managed_fsspec:local",
                     run_id: str | None = None) -> dict[str, Any]:
    """Run ``generate`` on ``prompts`` (default :func:`mixed_workload`) capturing ``contents`` (default
    :data:`DEFAULT_CONTENTS` among the enabled ones) with the FPM stream on ``port_base``,
    collect every pass, and compare with ``step_model`` (a ``bench fit`` JSON). Returns the live-check document
    (schema ``genartifact.fpm_bench.live_check`` v1): receipts' states, stream gaps, per-pass records, summary.
    Raises ``FitError`` for a foreign model file before the engine starts."""
    from genartifact import config as config_mod
    from genartifact.engine.job import run_generate

    model = StepModel.load(step_model)
    cfg = config_mod.load(None)
    enabled = list(cfg.plugins["contents"])
    contents = contents or [c for c in DEFAULT_CONTENTS if c in enabled] or enabled
    rows = prompts if prompts is not None else mixed_workload()
    run_id = run_id or f"bench-live-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    os.environ.update(GENARTIFACT_FPM_STREAM="1", GENARTIFACT_FPM_PORT_BASE=str(port_base),
                      GENARTIFACT_FPM_DP_RANK="0")
    collector = FpmCollector(port_base)  # ZMQ: connecting before the engine binds is fine
    got: list[Any] = []
    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            got.extend(collector.drain(0.2))

    t = threading.Thread(target=pump, name="fpm-live-sub", daemon=True)
    t.start()
    kwargs = {"scheduler_cls": SCHEDULER_QUALNAME, "enable_prefix_caching": True, "seed": 0,
              "max_num_batched_tokens": 1024, **(engine_kwargs or {})}
    try:
        receipts = await run_generate(model=model_dir, prompts=rows, cfg=cfg, contents=contents, target=target,
                                      max_tokens=max_tokens, run_id=run_id, engine_kwargs=kwargs, progress=False)
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        t.join(timeout=5)
        got.extend(collector.drain(0.3))
        collector.close()
    result = compare(model, got)
    return {"schema": LIVE_SCHEMA, "schema_version": 1, "run_id": run_id, "model_source": model.doc["source"],
            "contents": contents, "engine_kwargs": {k: v for k, v in kwargs.items() if k != "scheduler_cls"},
            "requests": len(rows), "receipts": {s: sum(r.get("state") == s for r in receipts)
                                                for s in sorted({r.get("state") for r in receipts})},
            "not_ready": sorted({str(r.get("error"))[:200] for r in receipts if r.get("state") != "ready"})[:5],
            "passes_observed": len(got), "stream_gaps": collector.gaps, **result}


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """One line per class of passes."""
    def fmt(name: str, s: dict[str, Any]) -> str:
        if not s["n"]:
            return f"{name:22} n=0"
        return (f"{name:22} n={s['n']:4d}  MAPE {s['mape_pct']:6.2f} %  median {s['median_ape_pct']:6.2f} %  "
                f"max {s['max_error_pct']:6.2f} %")

    sm = doc["summary"]
    return ([fmt(f"in grid, {p}", sm["in_grid"][p]) for p in ("prefill", "decode")] +
            [fmt(f"out of grid, {p}", sm["out_of_grid"][p]) for p in ("prefill", "decode")] +
            [fmt("mixed (extrapolated)", sm["mixed"])])
