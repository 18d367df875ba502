"""``genartifact bench run``: one data-parallel rank's self-benchmark, written as one rank artifact."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from genartifact_fpm_bench import SCHEDULER_QUALNAME, __version__
from genartifact_fpm_bench.artifact import RANK_SCHEMA, SCHEMA_VERSION, rank_path, write_once
from genartifact_fpm_bench.content import HASH_ENCODING, IDENTITY, content_seed
from genartifact_fpm_bench.grid import Limits, grid_digest, load_points, plan_grid
from genartifact_fpm_bench.runner import NOISY_CV, UNOBSERVED, BenchRunner, FpmCollector, combine_rounds

log = structlog.get_logger("genartifact.fpm_bench")
#: the built-in probes every rank runs: their blocks make up the rank artifact's ``engine`` block, compared across
#: ranks by the merge
PROBES = ["engine_config", "runtime_versions", "kv_cache_spec", "worker_probe"]


def bench_probes(enabled: Sequence[str] = ()) -> list[str]:
    """The probes a rank runs: :data:`PROBES`, then each name of ``enabled`` (the config's ``[plugins].probes``, in
    its order) not among them."""
    from genartifact.host import normalize

    out = list(PROBES)
    for n in enabled:
        if normalize(n) not in out:
            out.append(normalize(n))
    return out


def limits_of(vcfg: Any) -> Limits:
    sc, cc, mc = vcfg.scheduler_config, vcfg.cache_config, vcfg.model_config
    blocks = getattr(cc, "num_gpu_blocks", None)
    cap = int(blocks) * int(cc.block_size) if blocks else int(mc.max_model_len) * int(sc.max_num_seqs)
    return Limits(max_num_batched_tokens=int(sc.max_num_batched_tokens), max_num_seqs=int(sc.max_num_seqs),
                  max_model_len=int(mc.max_model_len), kv_capacity_tokens=cap, block_size=int(cc.block_size),
                  prefix_caching=bool(cc.enable_prefix_caching))


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """The FPM publisher binds ``host:port`` inside the engine; refuse before the engine starts when it is
    taken. Raises :class:`GridError` naming the port and the fix."""
    import socket

    from genartifact_fpm_bench.grid import GridError

    if not 1 <= port <= 65535:
        raise GridError(f"FPM port {port} out of range; allowed: 1..65535 (set --port-base so base + rank fits)")
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            raise GridError(f"FPM port {host}:{port} is already in use (another bench rank or process); pass "
                            f"--port-base with a free range, e.g. --port-base {port + 100}") from None


async def run_rank(*, model: str, mode: str, out_dir: str, rank: int = 0, dp_size: int = 1, run_id: str | None = None,
                   points_file: str | None = None, repeats: int = 3, port_base: int = 20380,
                   engine_kwargs: dict[str, Any] | None = None, max_points: int = 64, progress: bool = True,
                   rounds: int = 1, probes: Sequence[str] = ()) -> Path:
    """Start an engine with the instrumented scheduler, measure the grid ``rounds`` times round-robin (each
    execution takes ``repeats`` measured samples; a point's rounds are combined by
    :func:`~genartifact_fpm_bench.runner.combine_rounds`), collect provenance, write ``<out_dir>/fpm_rank<rank>.json``
    (create-only). Returns its path.

    ``probes``: further provenance probes to run after the built-in :data:`PROBES` (the config's
    ``[plugins].probes``): their blocks go to the artifact's ``provenance`` (probe name -> block), their faults to
    ``provenance_errors``, apart from the built-ins' ``engine`` block and ``capture_errors``, so a third-party
    probe never changes what the merge compares across ranks.

    :raises ValueError: ``rounds`` < 1.
    :raises UnknownPluginError: a probe of ``probes`` is not installed (before the engine starts)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.host import PluginHost
    from tqdm import tqdm

    from genartifact_fpm_bench import probes as probe_mod

    out = rank_path(out_dir, rank)
    if out.exists():
        raise FileExistsError(f"rank artifact {out} exists; rank artifacts are written once")
    check_port_free(port_base + rank)  # one clear error now, not a bind failure buried in the engine's log
    host = PluginHost({"probes": bench_probes(probes)})  # an unknown probe fails here, with nothing changed yet
    os.environ.update(GENARTIFACT_FPM_STREAM="1", GENARTIFACT_FPM_PORT_BASE=str(port_base),
                      GENARTIFACT_FPM_DP_RANK=str(rank))
    kwargs = {"scheduler_cls": SCHEDULER_QUALNAME, "enable_prefix_caching": True, "seed": 0, **(engine_kwargs or {})}
    started = time.time()
    engine = await VllmEngine(host, model, **kwargs).start()
    collector = FpmCollector(port_base + rank)
    try:
        await asyncio.sleep(0.3)  # ZMQ slow joiner: the subscription must reach the publisher
        limits = limits_of(engine.llm.vllm_config)
        if points_file:
            points, excluded = load_points(points_file, limits, repeats), []
        else:
            plan = plan_grid(limits, mode, max_points=max_points, repeats=repeats)
            points, excluded = plan.points, plan.excluded_dicts()
        for x in excluded:  # said before anything runs
            log.info("bench_point_excluded", point=x["key"], reason=x["reason"])
        vocab = int(engine.model_info.hf_config.get("vocab_size", 512))  # type: ignore[union-attr]
        runner = BenchRunner(engine.llm, collector, rank, (4, vocab), limits, repeats=repeats)
        await runner.warmup()
        by_key: dict[str, list[dict[str, Any]]] = {p.key(): [] for p in points}
        with tqdm(total=len(points) * rounds, desc=f"bench rank {rank}", unit="pt", disable=not progress) as bar:
            for _ in range(rounds):  # round-robin: each point's samples spread over the whole run
                for p in points:
                    by_key[p.key()].append(await runner.run_point(p))
                    bar.update(1)
        records = [combine_rounds(by_key[p.key()]) for p in points]
        blocks, errors = await probe_mod.collect(host, {"engine": engine})
    finally:
        collector.close()
        engine.shutdown()
    engine_block = blocks.get("engine_config")
    if engine_block is not None:
        engine_block = {**engine_block, "kv_cache": blocks.get("kv_cache_spec"),
                        "versions": blocks.get("runtime_versions"), "worker_probe": blocks.get("worker_probe")}
    done = sum(r["status"] == "completed" for r in records)
    doc = {
        "schema": RANK_SCHEMA, "schema_version": SCHEMA_VERSION, "artifact_type": "rank",
        "run_id": run_id or uuid.uuid4().hex, "grid_digest": grid_digest(points), "mode": mode,
        "dp": {"rank": rank, "size": dp_size},
        "protocol": {"content_seed": content_seed(), "content_identity": IDENTITY, "prompt_hash_encoding": HASH_ENCODING,
                     "timing_metric": "scheduler_wall_time", "timing_basis": "schedule_to_output",
                     "estimate": "median of measured samples", "repeats": repeats, "rounds": rounds, "noisy_cv": NOISY_CV,
                     "prefill": "single_step", "decode": "steady_steps_after_admission", "unobserved": UNOBSERVED,
                     "fpm_bench_version": __version__},
        "limits": limits.__dict__,
        "coverage": {"expected_points": len(points), "completed_points": done, "failed_points": len(points) - done,
                     "excluded_points": excluded},
        "points": records,
        "warmup_evidence": runner.warmup_evidence,
        "stream": {"gaps": collector.gaps},
        "engine": engine_block,
        "capture_errors": {n: e for n, e in errors.items() if n in PROBES},
        "provenance": {n: b for n, b in blocks.items() if n not in PROBES},
        "provenance_errors": {n: e for n, e in errors.items() if n not in PROBES},
        "timing": {"started_at": started, "completed_at": time.time()},
    }
    write_once(out, doc)
    log.info("bench_rank_written", path=str(out), points=len(points), completed=done)
    return out
