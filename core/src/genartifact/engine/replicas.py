"""``genartifact generate --replicas N [--ray ADDRESS]``: the main job scaled out over N engine replicas.

Each replica is a Ray actor running its own, ordinary in-process :class:`~genartifact.engine.vllm_adapter.VllmEngine`
(vLLM's default executor inside the actor; no Ray *executor*, so vLLM-CPU's refusal of Ray executors does not
apply). The driver checks every row first (exactly as the single-engine job), then deals the accepted rows out
dynamically: each replica has at most ``max_inflight`` rows in flight and pulls the next row when one finishes,
so a slow replica gets fewer rows. Artifacts go from the replicas straight to the configured target; receipts come
back to the driver, which merges them into one list in input order.

A replica that dies (process killed, engine crash, node lost: Ray raises ``RayActorError``) fails only the rows it
had in flight — each gets a ``failed`` receipt with ``error_code`` ``replica_failed`` naming the replica — and its
remaining share goes to the surviving replicas; :class:`ReplicaReport` tells the caller which replica died and
why. Rows still queued when no replica is left get ``replica_failed`` receipts too.

Ray is an optional dependency: imported only here, only when replicas are asked for.
Without ``ray_address`` a private local Ray instance is started (``address="local"``: never someone else's
cluster) and stopped at the end; with it, the job connects to that cluster and leaves it running.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from genartifact import config as config_mod
from genartifact.errors import ConfigError

log = structlog.get_logger("genartifact.replicas")

REPLICA_FAILED = "replica_failed"


@dataclass
class ReplicaReport:
    """One replica's outcome: rows it returned receipts for, rows it failed by dying, and the death (None if
    it lived). ``start_s``: seconds from actor creation to a started engine."""

    index: int
    pid: int | None = None
    start_s: float | None = None
    rows: int = 0
    failed_rows: list[int] = field(default_factory=list)
    died: str | None = None


class Replica:
    """The body of one replica actor (wrapped with ``ray.remote`` at run time): one started engine that runs
    preflighted rows concurrently (Ray async actor) and returns their receipts."""

    def __init__(self, model: str, cfg: config_mod.Config, engine_kwargs: Mapping[str, Any], max_tokens: int) -> None:
        self.model, self.cfg, self.engine_kwargs, self.max_tokens = model, cfg, dict(engine_kwargs), max_tokens
        self.engine: Any = None
        self.frozen = 0  # objects frozen by start (freeze_startup_heap)

    async def start(self) -> int:
        """Start the engine (tens of seconds on CPU); returns this actor's process id."""
        from genartifact.engine.vllm_adapter import VllmEngine, freeze_startup_heap
        from genartifact.logging import configure_logging

        configure_logging(json_lines=True)
        self.settings, self.journal = self.cfg.target_settings(), self.cfg.journal()
        self.engine = await VllmEngine(self.cfg.host(), self.model, **self.engine_kwargs).start()
        self.frozen = freeze_startup_heap()  # the actor's process is this replica's alone: no full-heap GC pauses
        return os.getpid()

    async def run(self, index: int, row: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
        """One row's receipt (see :func:`genartifact.engine.job.run_row`)."""
        from genartifact.engine.job import run_row

        return await run_row(self.engine, index, row, spec, self.settings, self.journal, self.max_tokens)

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def heap_frozen(self) -> int:
        """How many objects :meth:`start` froze out of garbage collection (this actor's start-up heap; 0 before)."""
        return self.frozen

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.frozen:  # as vLLM's EngineCore.shutdown: what start-up made is collectable again
            gc.unfreeze()
            self.frozen = 0


def actor_name(run_id: str, index: int) -> str:
    """The Ray actor name of replica ``index`` of run ``run_id`` (``ray list actors`` shows it)."""
    return f"genartifact-{run_id}-replica-{index}"


def _died(index: int, e: BaseException) -> str:
    return f"replica {index} died: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def preflight(cfg: config_mod.Config, prompts: list[Any], contents: list[str], target: str, run_id: str,
              emit: Callable[[int, dict[str, Any]], None]) -> dict[int, dict[str, Any]]:
    """Check every row without an engine, exactly as the single-engine job does: ``emit`` gets the ``rejected``
    (or plugin-fault) receipt of each refused row; returns the request spec of each accepted row by index."""
    from genartifact.engine.job import _fault_receipt, check_target_tables, preflight_row
    from genartifact.errors import GenartifactError, PluginFault, RequestSpecError

    host = cfg.host()
    targets = check_target_tables(cfg, host)
    specs: dict[int, dict[str, Any]] = {}
    for i, row in enumerate(prompts):
        if isinstance(row, RequestSpecError):
            emit(i, {"index": i, "state": "rejected", "error_code": "request_invalid", "error": str(row)})
            continue
        try:
            specs[i] = preflight_row(host, targets, row, contents, target, run_id, i, allow_groups=False)
        except PluginFault:
            emit(i, _fault_receipt(i, None))
        except (GenartifactError, ValueError, TypeError, OverflowError) as e:
            emit(i, {"index": i, "state": "rejected", "error_code": "request_invalid", "error": str(e)})
    return specs


async def run_replicated(*, model: str, prompts: list[Any], cfg: config_mod.Config, contents: list[str],
                         target: str, max_tokens: int, run_id: str, engine_kwargs: Mapping[str, Any], replicas: int,
                         ray_address: str | None = None, max_inflight: int = 8, progress: bool = True,
                         actor_options: Mapping[str, Any] | None = None,
                         on_receipt: Callable[[dict[str, Any]], None] | None = None,
                         start_together: bool = False,
                         ) -> tuple[list[dict[str, Any]], list[ReplicaReport]]:
    """Run the job on ``replicas`` engine replicas (Ray actors); returns one receipt per prompt in input order
    and one :class:`ReplicaReport` per replica.

    :param replicas: number of engine replicas (>= 1).
    :param ray_address: a Ray cluster to connect to (``ray.init(address=...)``); None starts a private local one.
    :param max_inflight: rows in flight per replica (>= 1): the bound on what one replica's death can fail.
    :param start_together: deal rows only once every replica's engine has started (or failed to): even sharding
        for benchmarks and tests. Default False: each replica takes rows as soon as its own engine is up.
    :param actor_options: extra ``ray.remote`` options per replica actor (e.g. ``{"num_gpus": 1}``); the
        default asks for one CPU (``num_cpus=1``).
    :param on_receipt: called with each receipt as it arrives (any order), e.g. for progress.
    :raises ConfigError: ``replicas``/``max_inflight`` out of range, or ray is not installed.
    """
    if not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"--replicas {replicas!r} invalid; allowed: an integer >= 1")
    if not isinstance(max_inflight, int) or max_inflight < 1:
        raise ConfigError(f"--max-inflight {max_inflight!r} invalid; allowed: an integer >= 1")
    try:
        import ray
        from ray.exceptions import RayActorError, RayTaskError
    except ImportError:
        raise ConfigError("--replicas needs Ray: pip install 'genartifact[ray]' (or 'ray>=2.50'; an optional dependency)") from None
    from tqdm import tqdm

    receipts: list[dict[str, Any] | None] = [None] * len(prompts)

    def done(i: int, receipt: dict[str, Any]) -> None:
        receipts[i] = receipt
        if on_receipt is not None:
            on_receipt(receipt)

    specs = preflight(cfg, prompts, contents, target, run_id, done)
    reports = [ReplicaReport(i) for i in range(replicas)]
    if not specs:
        return [r for r in receipts if r is not None], reports
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(address=ray_address or "local", include_dashboard=False, log_to_driver=False,
                 **({} if ray_address else {"num_cpus": max(replicas, os.cpu_count() or 1)}))
    actor_cls = ray.remote(Replica)
    opts = {"num_cpus": 1, "max_concurrency": max_inflight + 2, **(actor_options or {})}
    actors = [actor_cls.options(name=actor_name(run_id, k), **opts).remote(model, cfg, dict(engine_kwargs), max_tokens)
              for k in range(replicas)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in specs:
        queue.put_nowait(i)
    bar = tqdm(total=len(specs), desc=f"generate x{replicas}", unit="req", disable=not progress)

    settled = 0  # replicas whose start finished (started or failed)
    all_settled = asyncio.Event()

    def settle() -> None:
        nonlocal settled
        settled += 1
        if settled == replicas:
            all_settled.set()

    async def replica(k: int) -> None:
        rep, actor = reports[k], actors[k]
        t0 = time.perf_counter()
        try:
            rep.pid = await actor.start.remote()
        except (RayActorError, RayTaskError) as e:  # died, or its engine did not start: the others go on
            rep.died = _died(k, e)
            log.error("replica_died", replica=k, during="start", error=rep.died)
            return
        finally:
            settle()
        rep.start_s = round(time.perf_counter() - t0, 2)
        log.info("replica_started", replica=k, pid=rep.pid, start_s=rep.start_s)
        if start_together:
            await all_settled.wait()
        inflight: set[int] = set()

        async def lane() -> None:
            while rep.died is None:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                inflight.add(i)
                try:
                    receipt = await actor.run.remote(i, prompts[i], specs[i])
                except RayActorError as e:
                    if rep.died is None:
                        rep.died = _died(k, e)
                        log.error("replica_died", replica=k, in_flight=sorted(inflight), error=rep.died)
                    rep.failed_rows.append(i)
                    done(i, {"index": i, "state": "failed", "error_code": REPLICA_FAILED, "replica": k,
                             "error": f"{rep.died}; this row was in flight on it"})
                    continue
                except RayTaskError as e:  # a bug in the row's code path, not the row's fault: this row only
                    log.error("replica_row_error", replica=k, index=i, error_type=type(e.cause).__name__)
                    done(i, {"index": i, "state": "failed", "error_code": "internal_error", "replica": k,
                             "error": f"replica {k} raised {type(e.cause).__name__} running this row"})
                    continue
                finally:
                    inflight.discard(i)
                rep.rows += 1
                done(i, {**receipt, "replica": k})
                bar.update(1)

        await asyncio.gather(*(lane() for _ in range(max_inflight)))

    try:
        await asyncio.gather(*(replica(k) for k in range(replicas)))
        while not queue.empty():  # every replica died: what nobody ran fails, never silently disappears
            i = queue.get_nowait()
            done(i, {"index": i, "state": "failed", "error_code": REPLICA_FAILED,
                     "error": "no live replica left to run this row: " + "; ".join(r.died or "" for r in reports)})
    finally:
        bar.close()
        for i in specs:  # stopped (Ctrl-C, an error): every row still gets a receipt
            if receipts[i] is None:
                done(i, {"index": i, "state": "failed", "error_code": "interrupted",
                         "error": "the run was stopped before this request finished"})
        for rep, actor in zip(reports, actors, strict=True):
            if rep.died is None:
                try:
                    await asyncio.wait_for(actor.shutdown.remote(), 60)
                except Exception as e:  # noqa: BLE001 - cleanup: report and go on
                    log.warning("replica_shutdown_failed", replica=rep.index, error_type=type(e).__name__)
            ray.kill(actor)
        if own_ray:
            ray.shutdown()
    return [r for r in receipts if r is not None], reports


def run_generate_replicated(*, writer: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """``generate --replicas``: :func:`run_replicated` with every receipt appended (and fsync'ed) to ``writer``
    as it arrives; at the end the file is rewritten in input order (atomically: a temporary file renamed over
    it; on failure the arrival-order file stays). Prints each dead replica on stderr. Returns the receipts."""
    import sys

    receipts, reports = asyncio.run(run_replicated(**kwargs, on_receipt=writer.write))
    for rep in reports:
        if rep.died:
            print(f"error: {rep.died}; {len(rep.failed_rows)} in-flight row(s) failed: {rep.failed_rows}",
                  file=sys.stderr)
    if not writer.unwritten:
        path = writer.path
        tmp = path.with_name(f".{path.name}.{os.getpid()}.sorted")
        try:
            tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in receipts), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as e:
            log.warning("receipts_not_reordered", error=e.strerror)
            tmp.unlink(missing_ok=True)
    return receipts


def check_replica_args(replicas: int | None, ray_address: str | None, max_inflight: int, resume: bool = False) -> None:
    """CLI checks before anything starts; raises :class:`ConfigError` naming the flag."""
    if resume and replicas is not None:
        raise ConfigError("--resume is not supported with --replicas yet; resume on one engine (drop --replicas)")
    if replicas is not None and (not isinstance(replicas, int) or replicas < 1):
        raise ConfigError(f"--replicas {replicas!r} invalid; allowed: an integer >= 1")
    if ray_address is not None and replicas is None:
        raise ConfigError("--ray ADDRESS needs --replicas N")
    if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
        raise ConfigError(f"--max-inflight {max_inflight!r} invalid; allowed: an integer >= 1")
