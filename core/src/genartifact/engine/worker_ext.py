"""The one worker-capture mechanism: genartifact's methods inside vLLM workers.

How it gets into the workers
    vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (API server, engine cores,
    workers, Ray actors). genartifact's entry point, :func:`register_vllm_plugin`, only attaches one RPC method,
    ``genartifact_call``, to vLLM's ``WorkerBase`` class — no wrapping, no capture, nothing per step. It does not
    own ``worker_extension_cls``, so a framework's own worker extension (verl, OpenRLHF) keeps working beside
    it. Where the entry point is not installed, :class:`GenartifactWorkerExtension` carries the same method as
    a ``worker_extension_cls`` (the adapter falls back to it only when the user has not set one).

When it acts (the gate)
    A worker does nothing until a genartifact engine sends ``genartifact_call("init", config)`` once after
    engine start. ``config`` carries everything the worker needs — the enabled contents and probes and their
    settings (no environment variables: Ray's V1 executor, for one, does not copy them to its workers).
    Only one rank of a tensor-parallel group captures (TP rank 0: every TP rank sees the same routing and the
    same sampled tokens); the other ranks load the plugins, report them, and bind nothing. The init answer
    (:func:`init_answer`) tells the engine what each worker enabled and whether it captures; the engine checks
    that every worker agrees (``VllmEngine.start``).

The step hook
    On a capturing worker the runtime wraps ``model_runner.execute_model`` and ``model_runner.sample_tokens``
    once. It keeps, per content, the live flagged requests (engine request id -> capture id, from
    ``SamplingParams.extra_args[capture.capture_key]`` of the step's new requests; finished ids dropped) and,
    for steps with at least one flagged request, fires the typed step hook of each content's
    :class:`WorkerCapture`: ``begin_step(step)`` before the forward and ``end_step(step)`` after sampling, with
    :class:`WorkerStep` (scheduler output, model output). Steps without a flagged request cost one dict check.

The capture-id / fetch / discard pattern
    Contents hand their worker rows over by capture id: ``"<content>.fetch"`` pops and returns them,
    ``"<content>.discard"`` drops them, ``"<content>.stats"`` reports. The runtime answers with an envelope
    (``{"found": payload}`` / ``{"absent": reason}`` plus the worker's ranks, ``None`` from a non-capturing
    rank); the driver side, :func:`fetch_capture`, picks the one worker that holds the id among the answers of
    all workers of all data-parallel engines and, when none does, says why.
"""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import structlog

QUALNAME = "genartifact.engine.worker_ext.GenartifactWorkerExtension"
RPC = "genartifact_call"
TOMBSTONES = 4096  # capture ids remembered after fetch/discard, per content, to name a second fetch's cause

log = structlog.get_logger("genartifact.worker")


# ------------------------------------------------------------------------------------------------- plugin API

@dataclass
class WorkerStep:
    """One engine step as seen by a capturing worker.

    :ivar scheduler_output: vLLM's ``SchedulerOutput`` of the step (``num_scheduled_tokens``: engine request
        id -> tokens scheduled this step; ``scheduled_new_reqs``; ``finished_req_ids``).
    :ivar flagged: content name -> {engine request id -> capture id} of the live flagged requests (only
        contents with at least one flagged request in this step appear).
    :ivar model_output: vLLM's ``ModelRunnerOutput`` of the step (``sampled_token_ids``, ...), set before
        ``end_step``; None in ``begin_step`` and when the step failed.
    :ivar index: running step number on this worker (steps with flagged requests only).
    :ivar failed: the forward or sampling raised (``end_step`` still runs so that captures reset).
    """

    scheduler_output: Any
    flagged: dict[str, dict[str, str]]
    index: int
    model_output: Any = None
    failed: bool = False


class WorkerCapture:
    """Base class of one content's worker-side capture; a content plugin returns an instance from its
    ``genartifact_worker_capture`` hook (called once on each capturing worker, after the model is loaded).

    Subclasses set :attr:`name` (the content name: its RPC methods are ``"<name>.<verb>"``) and
    :attr:`capture_key` (the ``SamplingParams.extra_args`` key whose value is the request's capture id), and
    implement :meth:`pop` and :meth:`drop`. Step methods run only for steps in which this content has a
    flagged request. A method that raises does not stop the engine: the step's flagged requests of this
    content are marked failed and their fetch reports the exception."""

    name: ClassVar[str] = ""
    capture_key: ClassVar[str] = ""

    def begin_step(self, step: WorkerStep) -> None:
        """Before the step's forward pass (the runner has not yet applied the step's state updates)."""

    def end_step(self, step: WorkerStep) -> None:
        """After the step's sampling (``step.model_output`` set), or after a failed step."""

    def pop(self, capture_id: str, args: Sequence[Any]) -> Any | None:
        """Return (msgpack-native) and forget the rows of ``capture_id``; None if this worker has none."""
        raise NotImplementedError

    def drop(self, capture_id: str) -> bool:
        """Forget the rows of ``capture_id``; True if there were any."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Msgpack-native counters (e.g. requests and bytes retained)."""
        return {}

    def verbs(self) -> Mapping[str, Callable[[Sequence[Any]], Any]]:
        """Extra RPC verbs beyond fetch/discard/stats: verb -> function of the call's args."""
        return {}


# ------------------------------------------------------------------------------------------------ the runtime

def _ranks(worker: Any) -> dict[str, int]:
    pc = worker.vllm_config.parallel_config
    try:
        from vllm.distributed.parallel_state import get_tp_group

        tp_rank = int(get_tp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - groups not initialised (a bare test worker)
        tp_rank = int(getattr(worker, "rank", 0)) % max(1, int(pc.tensor_parallel_size))
    return {"rank": int(getattr(worker, "rank", 0)), "tp_rank": tp_rank,
            "tp_size": int(pc.tensor_parallel_size), "dp_rank": int(pc.data_parallel_rank),
            "dp_size": int(pc.data_parallel_size), "pid": os.getpid()}


class WorkerRuntime:
    """Per-worker state: the plugin host built from the init config, the captures (capturing rank only),
    the live flagged requests per content, and the execute_model/sample_tokens wrapping."""

    def __init__(self, worker: Any, config: Mapping[str, Any], host: Any = None) -> None:
        self.worker = worker
        self.config = {"contents": list(config.get("contents", [])), "probes": list(config.get("probes", [])),
                       "settings": dict(config.get("settings", {}) or {})}
        if host is None:
            from genartifact.host import PluginHost

            host = PluginHost({"contents": self.config["contents"], "probes": self.config["probes"]},
                              content_settings=self.config["settings"])
        self.host = host
        self.where = _ranks(worker)
        self.capturing = self.where["tp_rank"] == 0
        self.captures: dict[str, WorkerCapture] = {}
        self.failed: dict[str, dict[str, str]] = {}  # content -> capture id -> error of a failed step hook
        self.gone: dict[str, collections.OrderedDict[str, str]] = {}  # content -> capture id -> how it went
        self.flagged: dict[str, dict[str, str]] = {}
        self._keys: list[tuple[str, str]] = []
        self._step: WorkerStep | None = None
        self._steps = 0
        if self.capturing:
            settings = self.config["settings"]
            for cap in self.host.hooks.worker_captures(worker=worker, settings=settings):
                if not isinstance(cap, WorkerCapture) or not cap.name or not cap.capture_key:
                    raise TypeError(f"genartifact_worker_capture returned {cap!r}; expected a WorkerCapture "
                                    "subclass instance with name and capture_key set")
                if cap.name in self.captures:
                    raise ValueError(f"two worker captures for content {cap.name!r}")
                self.captures[cap.name] = cap
                self.flagged[cap.name], self.failed[cap.name] = {}, {}
                self.gone[cap.name] = collections.OrderedDict()
                self._keys.append((cap.capture_key, cap.name))
            if self.captures:
                self._wrap(worker.model_runner)
        log.info("worker_runtime_ready", captures=list(self.captures), **self.where)

    # ----- init answer
    def answer(self) -> dict[str, Any]:
        return {"enabled": {"contents": self.config["contents"], "probes": self.config["probes"]},
                "settings": self.config["settings"], "captures": sorted(self.captures),
                "capturing": self.capturing, **self.where}

    # ----- the step hook
    def _track(self, so: Any) -> bool:
        """Update the flagged maps from the step; True if any content has a live flagged request."""
        keys = self._keys
        for r in getattr(so, "scheduled_new_reqs", ()) or ():
            extra = getattr(getattr(r, "sampling_params", None), "extra_args", None)
            if extra:
                for key, name in keys:
                    cid = extra.get(key)
                    if cid is not None:
                        self.flagged[name][r.req_id] = str(cid)
        fin = getattr(so, "finished_req_ids", None)
        any_live = False
        for fl in self.flagged.values():
            if fin and fl:
                for rid in fin:
                    fl.pop(rid, None)
            any_live = any_live or bool(fl)
        return any_live

    def _fire(self, method: str, step: WorkerStep) -> None:
        for name in step.flagged:
            cap = self.captures[name]
            try:
                getattr(cap, method)(step)
            except Exception as e:  # noqa: BLE001 - a plugin's fault fails its requests, not the engine
                err = f"{type(e).__name__}: {_exc_text(e)}"
                log.error("worker_capture_step_failed", content=name, hook=method, error=err, **self.where)
                for cid in step.flagged[name].values():
                    self.failed[name].setdefault(cid, f"{method}: {err}")

    def _end(self, output: Any, failed: bool) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.model_output, step.failed = output, failed
            self._fire("end_step", step)

    def _wrap(self, mr: Any) -> None:
        orig_exec, orig_sample = mr.execute_model, getattr(mr, "sample_tokens", None)

        @functools.wraps(orig_exec)
        def execute_model(scheduler_output: Any, *a: Any, **kw: Any) -> Any:
            if self._step is not None:  # the previous step never reached sampling
                self._end(None, True)
            if not self._track(scheduler_output):
                return orig_exec(scheduler_output, *a, **kw)
            self._steps += 1
            step = WorkerStep(scheduler_output, {n: f for n, f in self.flagged.items() if f}, self._steps)
            self._step = step
            self._fire("begin_step", step)
            try:
                out = orig_exec(scheduler_output, *a, **kw)
            except BaseException:
                self._end(None, True)
                raise
            if out is not None:  # the runner produced the step's output without a separate sampling call
                self._end(out, False)
            return out

        mr.execute_model = execute_model
        if orig_sample is None:
            return

        @functools.wraps(orig_sample)
        def sample_tokens(*a: Any, **kw: Any) -> Any:
            if self._step is None:
                return orig_sample(*a, **kw)
            try:
                out = orig_sample(*a, **kw)
            except BaseException:
                self._end(None, True)
                raise
            self._end(out, False)
            return out

        mr.sample_tokens = sample_tokens

    # ----- RPC verbs
    def call(self, method: str, args: Sequence[Any]) -> Any:
        name, _, verb = method.partition(".")
        cap = self.captures.get(name)
        if cap is None:
            if verb in ("fetch", "discard", "stats") and name in self.config["contents"]:
                return None  # a non-capturing rank (or a content without worker capture) holds nothing
            result = self.host.hooks.worker_call(worker=self.worker, method=method, args=list(args))
            if result is None:
                raise ValueError(f"no enabled worker plugin handles method {method!r}")
            return result
        if verb == "fetch":
            return self._fetch(name, cap, args)
        if verb == "discard":
            cid = str(args[0])
            self.failed[name].pop(cid, None)
            found = cap.drop(cid)
            self._bury(name, cid, "discarded")
            return found
        if verb == "stats":
            return {**cap.stats(), "live_flagged": len(self.flagged[name]), **self.where}
        fn = cap.verbs().get(verb)
        if fn is None:
            raise ValueError(f"{name} worker verb {verb!r} unknown; allowed: "
                             f"{sorted(['discard', 'fetch', 'stats', *cap.verbs()])}")
        return fn(list(args))

    def _bury(self, name: str, cid: str, how: str) -> None:
        g = self.gone[name]
        g[cid] = how
        while len(g) > TOMBSTONES:
            g.popitem(last=False)

    def _fetch(self, name: str, cap: WorkerCapture, args: Sequence[Any]) -> dict[str, Any]:
        cid = str(args[0])
        where = {"dp_rank": self.where["dp_rank"], "tp_rank": self.where["tp_rank"], "rank": self.where["rank"]}
        err = self.failed[name].pop(cid, None)
        if err is not None:
            cap.drop(cid)
            self._bury(name, cid, "failed")
            return {"absent": "failed", "error": err, **where}
        payload = cap.pop(cid, list(args[1:]))
        if payload is None:
            return {"absent": self.gone[name].get(cid, "unknown"), **where}
        self._bury(name, cid, "fetched")
        return {"found": payload, **where}


def _exc_text(e: BaseException) -> str:
    """A plugin exception's text as logs and fetch answers carry it: secrets redacted, at most 300 characters,
    and never itself a failure (a plugin exception whose ``__str__`` raises must not escape the step hook's
    isolation and take the engine step down)."""
    from genartifact.host import redact

    try:
        return redact(str(e), 300)
    except Exception:  # noqa: BLE001 - a hostile __str__
        return "<exception text unavailable>"


def _dispatch(worker: Any, method: str, *args: Any) -> Any:
    """Body of the ``genartifact_call`` worker RPC (see the module docstring)."""
    if method == "init":
        rt = getattr(worker, "_genartifact_runtime", None)
        config = args[0] if args else {}
        if rt is None:
            rt = WorkerRuntime(worker, config)
            worker._genartifact_runtime = rt
        elif rt.config["contents"] != list(config.get("contents", [])) or \
                rt.config["probes"] != list(config.get("probes", [])):
            raise RuntimeError(f"worker already initialised with {rt.config}; a second genartifact engine "
                               f"config {dict(config)} cannot share it")
        return rt.answer()
    rt = getattr(worker, "_genartifact_runtime", None)
    if rt is None:
        raise RuntimeError("genartifact worker not initialised: the engine sends genartifact_call('init', "
                           "config) after start (VllmEngine.start / VllmEngine.attach)")
    if method == "batch":  # ("batch", inner_method, [args, ...]) -> [result, ...]: one RPC for many calls
        inner, calls = args
        return [rt.call(inner, a) for a in calls]
    return rt.call(method, args)


class GenartifactWorkerExtension:
    """Fallback ``worker_extension_cls`` carrying ``genartifact_call`` where the ``vllm.general_plugins``
    entry point is not installed. vLLM mixes it into the worker class, so ``self`` is the worker."""

    def genartifact_call(self, method: str, *args: Any) -> Any:
        """Worker RPC: ``"init"`` with the config dict, ``"batch"``, or ``"<content>.<verb>"``."""
        return _dispatch(self, method, *args)


_parent_watch: list[Any] = []


def exit_with_parent() -> bool:
    """In a process started by :mod:`multiprocessing` (vLLM's engine core, its workers), end this process when
    the process that started it dies — even by SIGKILL, which gives it no chance to shut its engine down. Without
    it a killed ``generate``/``serve`` (or test run) left ``VLLM::EngineCore`` and ``VLLM::Worker`` running,
    holding their memory, orphaned to init. A daemon thread waits on the parent's sentinel (the pipe
    :mod:`multiprocessing` gives every child; it becomes readable when the parent exits) and then calls
    ``os._exit(70)``; a worker whose engine core ends this way follows it. Not ``PR_SET_PDEATHSIG``: that fires
    when the parent's *thread* that spawned the child exits, and engines may be started from any thread.
    Returns True when armed (once per process); False in a process without a multiprocessing parent (the main
    process, Ray actors)."""
    import multiprocessing
    import threading

    if _parent_watch:
        return True
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if parent is None or sentinel is None:
        return False

    def watch() -> None:
        from multiprocessing.connection import wait

        try:
            wait([sentinel])
        except (OSError, ValueError):  # the sentinel was closed under us: no way to tell; stay up
            return
        os._exit(70)

    t = threading.Thread(target=watch, name="genartifact-exit-with-parent", daemon=True)
    t.start()
    _parent_watch.append(t)
    return True


def register_vllm_plugin() -> None:
    """``vllm.general_plugins`` entry point (runs in every vLLM process): attach ``genartifact_call`` to
    ``vllm.v1.worker.worker_base.WorkerBase`` when absent, and in vLLM's child processes
    :func:`exit_with_parent`. Passive otherwise: nothing runs until the init RPC."""
    exit_with_parent()
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except Exception:  # noqa: BLE001 - a vLLM without that module: the extension fallback applies
        return
    if not hasattr(WorkerBase, RPC):
        setattr(WorkerBase, RPC, GenartifactWorkerExtension.genartifact_call)


# ------------------------------------------------------------------------------------------------ driver side

def init_config(host: Any) -> dict[str, Any]:
    """The worker ``init`` payload for ``host``: enabled contents and probes (config order) and the enabled
    contents' settings (``host.content_settings``: config ``[contents.<name>]``), made msgpack-native (values
    that are not JSON types, e.g. paths, become strings)."""
    import json

    contents = [p.name for p in host.enabled["contents"]]
    probes = [p.name for p in host.enabled["probes"]]
    known = getattr(host, "content_settings", None) or {}
    settings = {n: json.loads(json.dumps(dict(known[n]), default=str)) for n in contents if known.get(n)}
    return {"contents": contents, "probes": probes, "settings": settings}


async def fetch_capture(engine: Any, content: str, capture_id: str, *args: Any) -> Any:
    """Fetch (and so hand over) ``capture_id``'s worker rows of ``content`` from whichever worker holds them.

    ``engine.worker_call`` returns one answer per worker of every data-parallel engine. Returns the payload of
    the single ``{"found": ...}`` answer.

    :raises CaptureError: no worker holds the id (naming the cause: a failed worker step hook, a second fetch,
        a discard, no capturing worker, or answers from fewer engines than the engine has), or more than one
        worker holds it."""
    from genartifact.errors import CaptureError

    answers = await engine.worker_call(f"{content}.fetch", capture_id, *args)
    found = [a for a in answers if isinstance(a, Mapping) and "found" in a]
    if len(found) == 1:
        return found[0]["found"]
    if found:
        ranks = [(a.get("dp_rank"), a.get("tp_rank")) for a in found]
        raise CaptureError(f"{content}: {len(found)} workers (dp, tp) {ranks} hold capture {capture_id}; "
                           "expected exactly one")
    absent = [a for a in answers if isinstance(a, Mapping)]
    for a in absent:
        if a.get("absent") == "failed":
            raise CaptureError(f"{content}: worker capture failed on dp rank {a.get('dp_rank')}: {a.get('error')}")
    for how in ("fetched", "discarded"):
        if any(a.get("absent") == how for a in absent):
            raise CaptureError(f"{content}: capture {capture_id} was already {how} on its worker "
                               "(rows are handed over once)")
    if not absent:
        raise CaptureError(f"{content}: no capturing worker answered ({len(answers)} answers): worker capture "
                           "is not installed in this engine")
    dp_size = max(int(a.get("dp_size", 1) or 1) for a in absent) if absent else 1
    dp_seen = sorted({int(a.get("dp_rank", 0)) for a in absent})
    expected = getattr(engine, "data_parallel_size", None) or dp_size
    if len(dp_seen) < int(expected):
        raise CaptureError(f"{content}: no answering worker holds capture {capture_id}; answers came from "
                           f"data-parallel ranks {dp_seen} of {expected} (the engine serving the request did "
                           "not answer the fetch)")
    raise CaptureError(f"{content}: none of the {len(absent)} capturing workers (data-parallel ranks {dp_seen}) "
                       f"saw capture {capture_id}: the request never reached a worker with its capture id "
                       f"(SamplingParams.extra_args) or was aborted before its first step")


async def discard_capture(engine: Any, content: str, capture_id: str) -> None:
    """Drop ``capture_id``'s worker rows of ``content`` on every worker (idempotent; failed request)."""
    await engine.worker_call(f"{content}.discard", capture_id)


def track_flagged(scheduler_output: Any, key: str, flagged: dict[str, str]) -> None:
    """Keep ``flagged`` (engine request id -> capture id) current from one step's ``SchedulerOutput``: add new
    requests whose ``SamplingParams.extra_args`` carry ``key``, drop the step's ``finished_req_ids``. (The
    runtime keeps one such map per content; this single-key form is kept for custom runners and tests.)"""
    for r in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
        extra = getattr(getattr(r, "sampling_params", None), "extra_args", None) or {}
        if key in extra:
            flagged[r.req_id] = str(extra[key])
    for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
        flagged.pop(rid, None)


__all__ = ["QUALNAME", "RPC", "GenartifactWorkerExtension", "WorkerCapture", "WorkerRuntime", "WorkerStep",
           "discard_capture", "fetch_capture", "init_config", "register_vllm_plugin", "track_flagged"]
