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
    ``end_step`` runs after the step's output has gone back to the engine core — in vLLM's multiprocessing
    worker loop, while the worker waits for the next call (:func:`_hook_idle_wait`) — so a step's per-request
    capture work is off the engine's critical path (:meth:`WorkerRuntime.settle`).

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
import re
import struct
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import structlog

from genartifact.errors import CaptureError, PluginFault

QUALNAME = "genartifact.engine.worker_ext.GenartifactWorkerExtension"
RPC = "genartifact_call"
TOMBSTONES = 4096  # capture ids remembered after fetch/discard, per content, to name a second fetch's cause
#: handed-over answers a driver keeps untaken at most (all contents): far above the requests one engine has in flight
#: (each session takes or drops its answer when its request ends); only answers nobody asks for pile up to it
READY_MAX = 65536

log = structlog.get_logger("genartifact.worker")

#: what a plugin's code in a worker may raise without failing only its own requests: the two exceptions that mean
#: this process must stop (a signal's ``KeyboardInterrupt``; ``SystemExit``, which vLLM's workers raise on SIGTERM).
#: Anything else a plugin raises — a ``BaseException`` subclass of its own, ``asyncio.CancelledError``,
#: ``GeneratorExit`` — is that plugin's fault: it fails the requests of its content, never the engine.
_STOP = (KeyboardInterrupt, SystemExit)


# ------------------------------------------------------------------------------------------------- plugin API

@dataclass
class WorkerStep:
    """One engine step as seen by a capturing worker.

    :ivar scheduler_output: vLLM's ``SchedulerOutput`` of the step (``num_scheduled_tokens``: engine request
        id -> tokens scheduled this step; ``scheduled_new_reqs``; ``finished_req_ids``).
    :ivar flagged: content name -> {engine request id -> capture id} of the live flagged requests (only
        contents with at least one flagged request in this step appear); read-only (``MappingProxyType``) views
        of the runtime's own maps.
    :ivar model_output: vLLM's ``ModelRunnerOutput`` of the step (``sampled_token_ids``, ...), set before
        ``end_step``; None in ``begin_step`` and when the step failed.
    :ivar index: running step number on this worker (steps with flagged requests only).
    :ivar failed: the forward or sampling raised (``end_step`` still runs so that captures reset).
    :ivar closed: the step's forward and sampling are over (set before its ``end_step`` runs, which may be later:
        :meth:`WorkerRuntime.settle`). A capture's callbacks that fire inside the model or the sampler must ignore
        calls while it is set: they come from a run outside the step (a data-parallel dummy batch, a profile run)
        and would overwrite what the step left for its ``end_step``.
    :ivar faults: content name -> the first exception (redacted text) one of its callbacks raised under
        :meth:`guard` in this step; the runtime fails that content's flagged requests of the step with it.
    """

    scheduler_output: Any
    flagged: Mapping[str, Mapping[str, str]]
    index: int
    model_output: Any = None
    failed: bool = False
    closed: bool = False
    faults: dict[str, str] = field(default_factory=dict)

    def guard(self, content: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` for content ``content``, isolated: what a capture runs inside vLLM's own calls (a router
        callback, the work around a wrapped sampler) goes through here, so that its exception fails this step's
        flagged requests of ``content`` (their fetch names the exception; generation goes on) instead of raising
        into vLLM's forward or sampler, which would end the engine for every request. Returns ``fn``'s result, or
        None once it raised (then, for the rest of the step, ``content``'s guarded calls are skipped and return
        None). Keep vLLM's own call outside: ``out = orig(...)`` must run exactly once whatever the guarded work
        before or after it does. Everything but ``KeyboardInterrupt``/``SystemExit`` (:data:`_STOP`) is caught: a
        ``BaseException`` subclass of the plugin's own too."""
        if content in self.faults:
            return None
        try:
            return fn(*args)
        except _STOP:
            raise
        except BaseException as e:  # noqa: BLE001 - a plugin's fault fails its requests, not the engine
            # logged by the runtime at the step's end, with the worker's ranks, as a failing step hook is
            self.faults[content] = f"{_callable_name(fn)}: {_exc_line(e)}"
            return None


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
    #: False: :meth:`end_step` runs before the step's output goes back to the engine (on its critical path), for a
    #: capture that must finish there; True (default): after, off that path (:meth:`WorkerRuntime.settle`)
    end_step_deferred: ClassVar[bool] = True

    def begin_step(self, step: WorkerStep) -> None:
        """Before the step's forward pass (the runner has not yet applied the step's state updates)."""

    def end_step(self, step: WorkerStep) -> None:
        """After the step's sampling (``step.model_output`` set), or after a failed step.

        Deferred by default (:attr:`end_step_deferred`): it runs after the worker has returned the step's output to
        the engine, while the engine core schedules the next step (:meth:`WorkerRuntime.settle`), on the worker's
        main thread, before the next step's :meth:`begin_step` and before any fetch, discard, handover or verb of
        any capture. What the step's forward and sampling produced (``step.model_output``, tensors kept by
        reference during the forward) is still intact then: the next forward has not started. ``step.model_output``
        has already gone to the engine, so changing it changes nothing there. A failed step's ``end_step`` runs at
        once."""

    def pop(self, capture_id: str, args: Sequence[Any]) -> Any | None:
        """Return (msgpack-native) and forget the rows of ``capture_id``; None if this worker has none."""
        raise NotImplementedError

    def drop(self, capture_id: str) -> bool:
        """Forget the rows of ``capture_id``; True if there were any."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Msgpack-native counters (e.g. requests and bytes retained)."""
        return {}

    def handover(self, capture_id: str, extra_args: Mapping[str, Any]) -> Any | None:
        """Optional: return (msgpack-native, the same payload ``pop`` gives the driver) and forget everything
        recorded for ``capture_id`` of a request that has just finished, so that the runtime can hand it over
        out of band (a file in the engine's handover folder, read by :func:`fetch_capture`) instead of the
        driver's fetch RPC. ``extra_args``: the request's ``SamplingParams.extra_args`` (a driver-side plugin
        passes what ``pop``'s args would carry there). Return None if nothing was recorded. A capture that does
        not override this method is always fetched by RPC.

        The returned answer, and every ``bytes``/``bytearray`` in it, belongs to the runtime from then on: the
        capture must not change it afterwards (a step file of :data:`HANDOVER_THREAD_BYTES` or more is written by
        the worker's writer thread while the next step runs). Return new objects: a ``memoryview`` of a buffer the
        capture keeps is allowed, but its step file is then written before the next step (never by the thread)."""
        raise NotImplementedError

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
        # checked before anything is wrapped: a refused init leaves the worker as it was
        step_end = step_end_mode(str(config.get("step_end", "deferred")))
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
        #: content -> capture ids whose rows a worker may still hold (flagged, or finished and not yet fetched,
        #: discarded or handed over): one request each
        self._live: dict[str, set[str]] = {}
        self._keys: list[tuple[str, str]] = []
        self._step: WorkerStep | None = None
        self._steps = 0
        #: where ``end_step`` hooks run: ``"deferred"`` (after the step's output went back, see :meth:`settle`) or
        #: ``"inline"`` (before it goes back); the init config's ``step_end`` (``VllmEngine(worker_step_end=...)``),
        #: changed by the ``step_end`` RPC
        self.step_end = step_end
        #: a step whose ``end_step`` hooks have not run yet (``step_end == "deferred"``)
        self._pending: WorkerStep | None = None
        #: the vLLM loop whose wait for the engine's next call runs the pending hooks (:func:`_hook_idle_wait`)
        self.idle_hook: str | None = None
        self._inline_end: set[str] = set()  # contents whose capture's end_step is not deferred
        #: the engine's handover folder (same machine as the driver) or None: fetch by RPC only
        self.handover_dir: str | None = None
        self.handover_contents: list[str] = []
        self.handover_written = 0
        self._handover_files = 0  # step files written (names them: step.<pid>.<n>)
        #: step files of this many bytes or more are written by the writer thread (``handover_writer`` RPC)
        self.handover_thread_bytes = HANDOVER_THREAD_BYTES
        #: step files given to the writer thread, not yet reaped: (its future, its answers), in order
        self._writes: collections.deque[tuple[Any, Sequence[tuple[str, str, dict[str, Any]]]]] = collections.deque()
        self._writer: Any = None  # the writer thread (a one-thread executor), made on first use
        self._extra: dict[str, Mapping[str, Any]] = {}  # engine request id -> extra_args (handover only)
        #: content -> capture id -> fetch answer whose handover file could not be written (folder full or gone):
        #: kept for the driver's RPC fetch (which comes when no file came in time), dropped by discard
        self.unwritten: dict[str, dict[str, dict[str, Any]]] = {}
        #: step files (and their requests) that could not be written, since this runtime started
        self.unwritten_steps = self.unwritten_requests = 0
        #: the failures since the first one not followed by HANDOVER_FAIL_LOG_S of writes (None: none), see
        #: :meth:`_note_unwritten`
        self._unwritten_episode: dict[str, Any] | None = None
        #: content -> why its worker capture could not be installed (its plugin's hook raised or returned a wrong
        #: object): answered to the driver, which fails that content's requests at admission and no others
        self.init_faults: dict[str, str] = {}
        if self.capturing:
            settings = self.config["settings"]
            for info, cap in self.host.hooks.worker_captures(worker=worker, settings=settings):
                who = info.name if info is not None else "?"
                if isinstance(cap, PluginFault):
                    self.init_faults[who] = str(cap)
                    continue
                if not isinstance(cap, WorkerCapture) or not cap.name or not cap.capture_key:
                    fault = PluginFault(f"content plugin {info.label() if info else who} broke the "
                                        f"genartifact_worker_capture contract: returned {type(cap).__name__}; "
                                        f"expected a WorkerCapture subclass instance with name and capture_key set",
                                        plugin=info.label() if info else who, method="genartifact_worker_capture",
                                        error_type="bad_return")
                    log.error("plugin_fault", plugin=who, method="genartifact_worker_capture", error_type="bad_return",
                              error=str(fault), **self.where)
                    self.init_faults[who] = str(fault)
                    continue
                if cap.name in self.captures or cap.name in self.init_faults:
                    self.init_faults[cap.name] = (f"two worker captures for content {cap.name!r} (the second from "
                                                  f"plugin {info.label() if info else who})")
                    log.error("worker_capture_duplicate", content=cap.name, plugin=who, **self.where)
                    self._uninstall(cap.name)
                    continue
                self.captures[cap.name] = cap
                self.flagged[cap.name], self.failed[cap.name], self.unwritten[cap.name] = {}, {}, {}
                self._live[cap.name] = set()
                self.gone[cap.name] = collections.OrderedDict()
                self._keys.append((cap.capture_key, cap.name))
                if not cap.end_step_deferred:
                    self._inline_end.add(cap.name)
            if self.init_faults:
                log.error("worker_capture_unavailable", contents=sorted(self.init_faults),
                          detail="these contents' requests fail at admission; the engine and the other contents run",
                          **self.where)
            if self.captures:
                self._wrap(worker.model_runner)
                self.idle_hook = _hook_idle_wait(self)
        self.set_handover(config.get("handover"))
        log.info("worker_runtime_ready", captures=list(self.captures), handover=self.handover_dir is not None,
                 **self.where)

    def _uninstall(self, name: str) -> None:
        """Forget content ``name``'s capture (installed at init, before a second one claimed the content)."""
        self.captures.pop(name, None)
        for d in (self.flagged, self.failed, self.unwritten, self._live, self.gone):
            d.pop(name, None)
        self._keys = [(k, n) for k, n in self._keys if n != name]
        self._inline_end.discard(name)

    def set_handover(self, handover: Mapping[str, Any] | None) -> None:
        """Use the driver's handover folder ``{"dir": path, "token": str}`` when this worker sees it (the
        folder exists here and holds the same token: same machine as the driver, not e.g. a Ray worker on
        another node); otherwise (or with None) finished requests' rows wait for the driver's fetch RPC. Step files
        being written into the old folder are finished first."""
        self.reap_writes(wait=True)
        self.end_unwritten_episode()
        self.handover_dir, self.handover_contents = None, []
        if not handover or not self.capturing:
            return
        d, token = str(handover.get("dir", "")), str(handover.get("token", ""))
        try:
            with open(os.path.join(d, "token"), encoding="ascii") as f:
                same = bool(token) and f.read() == token
        except OSError:
            same = False
        if same:
            self.handover_dir = d
            self.handover_contents = sorted(n for n, c in self.captures.items()
                                            if type(c).handover is not WorkerCapture.handover)
            _at_parent_exit.append(functools.partial(_rmtree, d))

    # ----- init answer
    def answer(self) -> dict[str, Any]:
        return {"enabled": {"contents": self.config["contents"], "probes": self.config["probes"]},
                "settings": self.config["settings"], "captures": sorted(self.captures),
                "init_faults": dict(self.init_faults),
                "capturing": self.capturing, "handover": self.handover_contents, "step_end": self.step_end,
                "handover_thread_bytes": self.handover_thread_bytes,
                "idle_hook": self.idle_hook, **self.where}

    # ----- the step hook
    def _track(self, so: Any) -> bool:
        """Update the flagged maps from the step; True if any content has a live flagged request. Requests in
        the step's ``finished_req_ids`` are handed over out of band (when a handover folder is set): vLLM's
        engine core runs one more step to tell the workers about finished requests, so this happens right
        after the request's last step, before or while the driver finalizes it."""
        keys = self._keys
        for r in getattr(so, "scheduled_new_reqs", ()) or ():
            extra = getattr(getattr(r, "sampling_params", None), "extra_args", None)
            if extra:
                for key, name in keys:
                    cid = extra.get(key)
                    if cid is not None:
                        cid = str(cid)
                        fl = self.flagged[name]
                        if fl.get(r.req_id) != cid and not self._may_flag(name, cid):
                            continue
                        fl[r.req_id] = cid
                        self._live[name].add(cid)
                        if self.handover_dir is not None:
                            self._extra[r.req_id] = extra
        fin = getattr(so, "finished_req_ids", None)
        any_live = False
        handed: list[tuple[str, str, dict[str, Any]]] = []
        for name, fl in self.flagged.items():
            if fin and fl:
                for rid in fin:
                    cid = fl.pop(rid, None)
                    if cid is not None and self.handover_dir is not None and name in self.handover_contents:
                        env = self._handover_answer(name, cid, self._extra.get(rid) or {})
                        if env is not None:
                            handed.append((name, cid, env))
            any_live = any_live or bool(fl)
        if handed:
            self._write_handover(handed)
        if fin and self._extra:
            for rid in fin:
                self._extra.pop(rid, None)
        return any_live

    def _may_flag(self, name: str, cid: str) -> bool:
        """Whether a new request may be captured under ``cid`` for content ``name``. Not when ``cid`` cannot be a
        capture id (:data:`_SAFE`: 1-128 of ``[A-Za-z0-9_-]``, e.g. ``uuid4().hex``; also what makes it a handover
        key), is held for another request (running, or finished with its rows not yet fetched, discarded or handed
        over: two requests' rows would mix), or was fetched, discarded or handed over already (its rows could never
        be handed over). Such a request (a caller's own ``extra_args``, never a genartifact session's random id)
        runs uncaptured, its fetch finding no rows, instead of leaving rows nobody takes. Logged, without the id."""
        if not _SAFE.fullmatch(cid):
            why = "not 1-128 characters of [A-Za-z0-9_-]"
        elif cid in self._live[name]:
            why = "held for another request (running, or finished and not yet fetched)"
        elif cid in self.gone[name]:
            why = f"already {self.gone[name][cid].replace('_', ' ')}"
        else:
            return True
        log.warning("worker_capture_id_refused", content=name, reason=why, id_chars=len(cid),
                    detail="the request runs without capture", **self.where)
        return False

    def _handover_answer(self, name: str, cid: str, extra: Mapping[str, Any]) -> dict[str, Any] | None:
        """A finished request's fetch answer of content ``name`` for the step's handover file (its rows taken from
        the capture: ``handover``), or None when it goes no other way than RPC: a capture already fetched or
        discarded by RPC. (Every flagged id is a handover key: :meth:`_may_flag` refuses any other.)"""
        if cid in self.gone[name]:
            return None
        cap = self.captures[name]
        where = {"dp_rank": self.where["dp_rank"], "tp_rank": self.where["tp_rank"], "rank": self.where["rank"]}
        err = self.failed[name].pop(cid, None)
        if err is not None:
            _drop_quietly(cap, cid)
            return {"absent": "failed", "error": err, "fault": True, **where}
        try:
            payload = cap.handover(cid, extra)
        except _STOP:
            raise
        except BaseException as e:  # noqa: BLE001 - a plugin's fault fails its request, not the engine
            _drop_quietly(cap, cid)
            return {"absent": "failed", "error": f"handover: {_exc_line(e)}", "fault": True, **where}
        return {"found": payload, **where} if payload is not None else {"absent": "unknown", **where}

    def _write_handover(self, handed: Sequence[tuple[str, str, dict[str, Any]]]) -> None:
        """Write one step's finished requests' fetch answers (``(content, capture id, answer)``) as one file,
        ``<handover dir>/step.<worker pid>.<n>`` (:func:`step_file_parts`: a msgpack map ``"<content>.<capture id>" ->
        answer``, large binary values after it), written to a temporary name and renamed, so the driver never reads
        a partial file (:meth:`Handover.read`). One file per step, not per request and content: a wave of requests
        finishing together costs the worker and the driver one file each.

        This runs when the engine tells the worker that requests finished, before the next step's forward, on the
        engine's critical path. A file below :attr:`handover_thread_bytes` is written here (a few KiB per request:
        a thread hand-off would cost more than the write), and so is one with a ``memoryview`` blob (a view of a
        buffer the capture may reuse for the next step: written before that step, it cannot change under the
        write). A larger one of ``bytes``/``bytearray`` blobs (a long request: 32k positions of a
        48-router top-8 model are 12 MiB, ~12 ms of writing into ``/dev/shm``) goes to the writer thread, whose
        ``write`` calls release the GIL, so it is written while the next forward runs; its requests count as handed
        over once it is renamed into the folder (:meth:`reap_writes`, at the next step and before every RPC verb).
        When a write fails (``/dev/shm`` full, folder gone) every answer of the file is kept in :attr:`unwritten`
        for the driver's RPC fetch: rows are never lost to a full folder."""
        self._handover_files += 1
        path = os.path.join(str(self.handover_dir), f"step.{os.getpid()}.{self._handover_files}")
        try:
            parts, own = _step_file({f"{name}.{cid}": env for name, cid, env in handed})
        except Exception as e:  # noqa: BLE001 - not msgpack-native, header too large: the rows go by RPC instead
            self._handed(handed, e)
            return
        if own and sum(memoryview(p).nbytes for p in parts) >= self.handover_thread_bytes:
            if self._writer is None:
                from concurrent.futures import ThreadPoolExecutor

                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genartifact-handover-writer")
            try:
                self._writes.append((self._writer.submit(_write_step_file_or_mark, path, parts, handed), handed))
                return
            except Exception as e:  # noqa: BLE001 - no thread to be had (a process at its thread limit): inline
                # (submit queues the write before it starts the thread: cancelled, never run behind our back)
                self._writer.shutdown(wait=False, cancel_futures=True)
                self._writer = None
                log.warning("worker_handover_writer_unavailable", error=_exc_line(e),
                            detail="this step file is written before the step", **self.where)
        try:
            _write_step_file(path, parts)
        except Exception as e:  # noqa: BLE001 - the folder is full (ENOSPC) or gone: the rows go by RPC instead
            self._handed(handed, e)
            return
        self._handed(handed, None)

    def reap_writes(self, wait: bool = False) -> None:
        """Account for the step files the writer thread has finished (all of them, waiting, with ``wait``): their
        requests handed over, or (a failed write) their answers kept for the RPC fetch. On the worker's main
        thread only: at each step's entry, before every RPC verb, before the handover folder changes."""
        writes = self._writes
        while writes and (wait or writes[0][0].done()):
            fut, handed = writes.popleft()
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - (_write_step_file's OSError, or a writer that could not run)
                self._handed(handed, e, threaded=not fut.cancelled())  # (a cancelled one never ran: unmarked)
            else:
                self._handed(handed, None)

    def _handed(self, handed: Sequence[tuple[str, str, dict[str, Any]]], err: BaseException | None,
                threaded: bool = False) -> None:
        """A step file of ``handed`` is in the folder (``err`` None), or could not be written: its answers wait in
        :attr:`unwritten` for the driver's RPC fetch (logged)."""
        if err is None:
            for name, cid, _ in handed:
                self.handover_written += 1
                self._bury(name, cid, "handed_over")
            ep = self._unwritten_episode
            if ep is not None:
                ep["written"] += 1
                if time.monotonic() - ep["last"] >= HANDOVER_FAIL_LOG_S:  # writing, and no failure for a while
                    self.end_unwritten_episode("worker_handover_recovered")
            return
        for name, cid, env in handed:
            self.unwritten[name][cid] = env
        # (a threaded write that failed made its markers in the writer thread already, at once: not made twice)
        marked = None if threaded or self.handover_dir is None else _mark_no_file(self.handover_dir, handed)
        self._note_unwritten(handed, err, marked)

    def _note_unwritten(self, handed: Sequence[tuple[str, str, dict[str, Any]]], err: BaseException,
                        marked: Any) -> None:
        """Count a step file that could not be written and log it, rate-limited per cause (exception type and
        errno: a full ``/dev/shm`` and a plugin answer msgpack cannot hold are told apart): the first failure of a
        cause is a ``worker_handover_unwritten`` warning at once, later ones of that cause at most one line per
        :data:`HANDOVER_FAIL_LOG_S` (a full ``/dev/shm`` fails every step with a finishing request: a line per
        step flooded the log), each with the failures of that cause it stood for since the line before
        (``suppressed_steps``, ``suppressed_requests``) and the step files written meanwhile in this episode
        (``written_meanwhile``: a nearly full ``/dev/shm`` fails some writes and not others). The episode ends
        with ``worker_handover_recovered`` (info, with its totals) at the first write HANDOVER_FAIL_LOG_S or more
        after its last failure; the totals are also in the ``stats`` verb (``unwritten_steps``)."""
        now = time.monotonic()
        self.unwritten_steps += 1
        self.unwritten_requests += len(handed)
        ep = self._unwritten_episode
        if ep is None:
            ep = self._unwritten_episode = {"steps": 0, "requests": 0, "written": 0, "causes": {}}
        ep["steps"] += 1
        ep["requests"] += len(handed)
        ep["last"] = now
        cause = f"{type(err).__name__}:{getattr(err, 'errno', None)}"
        seen = ep["causes"].get(cause)
        if seen is not None and now - seen["logged"] < HANDOVER_FAIL_LOG_S:
            seen["steps"] += 1
            seen["requests"] += len(handed)
            return
        log.warning("worker_handover_unwritten", contents=sorted({n for n, _, _ in handed}), requests=len(handed),
                    error=_exc_line(err), detail="kept for the driver's RPC fetch", marked=marked,
                    suppressed_steps=seen["steps"] if seen else 0, suppressed_requests=seen["requests"] if seen else 0,
                    written_meanwhile=ep["written"], **self.where)
        ep["causes"][cause] = {"logged": now, "steps": 0, "requests": 0}

    def end_unwritten_episode(self, event: str = "worker_handover_unwritten_summary") -> None:
        """Close the current episode of step files that could not be written, if any: one info line ``event``
        with its totals (``unwritten_steps``, ``unwritten_requests``, ``written``) and the failures no line has
        reported yet (``unreported_steps``). Called at recovery, and when the handover folder changes (its
        failures belong to the old folder)."""
        ep, self._unwritten_episode = self._unwritten_episode, None
        if ep is None:
            return
        log.info(event, unwritten_steps=ep["steps"], unwritten_requests=ep["requests"], written=ep["written"],
                 unreported_steps=sum(c["steps"] for c in ep["causes"].values()), **self.where)

    def _fire(self, method: str, step: WorkerStep, deferred: bool | None = None) -> None:
        """Call ``method`` of the step's flagged contents' captures (``deferred``: only those whose
        :attr:`WorkerCapture.end_step_deferred` is that value; None: all)."""
        for name in step.flagged:
            if deferred is not None and (name in self._inline_end) == deferred:
                continue
            cap = self.captures[name]
            try:
                getattr(cap, method)(step)
            except _STOP:
                raise
            except BaseException as e:  # noqa: BLE001 - a plugin's fault fails its requests, not the engine
                self._fail_step(step, name, method, f"{method}: {_exc_line(e)}")

    def _fail_step(self, step: WorkerStep, name: str, hook: str, err: str) -> None:
        """A capture of content ``name`` failed in ``step`` (its ``hook`` raised, or a callback under
        :meth:`WorkerStep.guard`): logged with this worker's ranks, and each of the step's flagged requests of
        ``name`` failed with ``err`` (its fetch answer names it)."""
        log.error("worker_capture_step_failed", content=name, hook=hook, error=err, **self.where)
        fails = self.failed.get(name)
        if fails is not None:
            for cid in step.flagged.get(name, {}).values():
                fails.setdefault(cid, err)

    def _end(self, output: Any, failed: bool) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.model_output, step.failed, step.closed = output, failed, True
            for name, err in step.faults.items():  # a guarded callback raised: its content's requests of the step
                self._fail_step(step, name, "callback", err)
            if failed or self.step_end == "inline":
                self._fire("end_step", step)
            else:
                if self._inline_end:
                    self._fire("end_step", step, deferred=False)
                self._pending = step

    def settle(self) -> None:
        """Run the ``end_step`` hooks of the step whose output the worker has returned, if they have not run yet.

        With ``step_end = "deferred"`` (the default) a step's ``end_step`` hooks do not run before its output goes
        back to the engine, where they would delay the engine's next step: they run when the worker next waits for
        the engine's call (vLLM's multiprocessing worker loop, :func:`_hook_idle_wait`), while the engine core
        turns the output into the next schedule. Where no such wait is hooked (Ray, an in-process executor) they
        run at the worker's next entry. Whatever comes first, every entry settles before it reads or changes a
        capture: the next step's ``execute_model``, and each RPC verb (fetch, discard, stats, plugin verbs). The
        hooks so always run on the worker's main thread, in step order, before anything that could see their
        effects, and before the next forward pass may overwrite what they read (the routers' ``topk_ids`` static
        buffers under CUDA graphs, the sampler's output)."""
        step, self._pending = self._pending, None
        if step is not None:
            self._fire("end_step", step, deferred=True)

    def set_step_end(self, mode: str) -> None:
        """Where ``end_step`` hooks run: ``"deferred"`` (see :meth:`settle`) or ``"inline"`` (before the step's output
        goes back to the engine, on its critical path: the behaviour before deferral, kept as a switch for
        comparison and for a plugin that must finish its step before the output leaves). Settles first.

        :raises ValueError: another ``mode`` (naming the allowed ones)."""
        step_end_mode(mode)
        self.settle()
        self.step_end = mode

    def _wrap(self, mr: Any) -> None:
        orig_exec, orig_sample = mr.execute_model, getattr(mr, "sample_tokens", None)

        @functools.wraps(orig_exec)
        def execute_model(scheduler_output: Any, *a: Any, **kw: Any) -> Any:
            if self._pending is not None:  # the previous step's deferred end hooks (no idle wait ran them)
                self.settle()
            if self._writes:  # step files the writer thread has finished
                self.reap_writes()
            if self._step is not None:  # the previous step never reached sampling
                self._end(None, True)
            if not self._track(scheduler_output):
                return orig_exec(scheduler_output, *a, **kw)
            self._steps += 1
            # read-only views: a capture reads the step's flagged requests, it cannot change the runtime's (nor another
            # content's) tracking of them
            step = WorkerStep(scheduler_output, MappingProxyType({n: MappingProxyType(f) for n, f in self.flagged.items()
                                                                  if f}), self._steps)
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
        if self._pending is not None:
            self.settle()
        if self._writes:  # a fetch or discard must see whether its request's file got written
            self.reap_writes(wait=True)
        name, _, verb = method.partition(".")
        cap = self.captures.get(name)
        if cap is None:
            if verb in ("fetch", "discard", "stats") and name in self.config["contents"]:
                return None  # a non-capturing rank (or a content without worker capture) holds nothing
            result = _plugin_verb(method, lambda: self.host.hooks.worker_call(worker=self.worker, method=method,
                                                                              args=list(args)))
            if result is None:
                raise ValueError(f"no enabled worker plugin handles method {method!r}")
            return result
        if verb == "fetch":
            out = self._fetch(name, cap, args)
            self._unflag(name, str(args[0]))
            return out
        if verb == "discard":
            cid = str(args[0])
            self._unflag(name, cid)
            self.failed[name].pop(cid, None)
            had = self.unwritten[name].pop(cid, None) is not None
            self._bury(name, cid, "discarded")  # (an answer already in a handover file: the driver drops it)
            try:
                found = bool(cap.drop(cid))
            except _STOP:
                raise
            except BaseException as e:  # noqa: BLE001 - the runtime's own state is clean; the plugin's, logged
                log.error("worker_capture_step_failed", content=name, hook="drop",
                          error=_exc_line(e), **self.where)
                found = False
            return found or had
        if verb == "stats":
            return {**_plugin_verb(method, cap.stats), "live_flagged": len(self.flagged[name]), "unwritten": len(self.unwritten[name]), "handover": self.handover_dir is not None,
                    "handed_over": self.handover_written, "unwritten_steps": self.unwritten_steps,
                    "unwritten_requests": self.unwritten_requests, **self.where}
        fn = cap.verbs().get(verb)
        if fn is None:
            raise ValueError(f"{name} worker verb {verb!r} unknown; allowed: "
                             f"{sorted(['discard', 'fetch', 'stats', *cap.verbs()])}")
        return _plugin_verb(method, fn, list(args))

    def _unflag(self, name: str, cid: str) -> None:
        """Stop capturing ``cid`` for content ``name``: a request still running when its rows are fetched or
        discarded (a client gone: the driver discards before vLLM's abort reaches the scheduler, so the request
        may run more steps) is no longer in the steps' ``flagged`` maps, so no capture re-creates rows for it that
        nobody would ever take (its id is buried: never handed over, never fetched again)."""
        fl = self.flagged[name]
        for rid in [r for r, c in fl.items() if c == cid]:
            del fl[rid]

    def _bury(self, name: str, cid: str, how: str) -> None:
        self._live[name].discard(cid)  # its rows are gone (fetched, discarded, handed over, failed)
        g = self.gone[name]
        g[cid] = how
        while len(g) > TOMBSTONES:
            g.popitem(last=False)

    def _fetch(self, name: str, cap: WorkerCapture, args: Sequence[Any]) -> dict[str, Any]:
        cid = str(args[0])
        where = {"dp_rank": self.where["dp_rank"], "tp_rank": self.where["tp_rank"], "rank": self.where["rank"]}
        err = self.failed[name].pop(cid, None)
        if err is not None:
            _drop_quietly(cap, cid)
            self._bury(name, cid, "failed")
            return {"absent": "failed", "error": err, "fault": True, **where}
        if self.gone[name].get(cid) == "handed_over":
            return {"absent": "handed_over", **where}
        env = self.unwritten[name].pop(cid, None)
        if env is not None:  # its handover file could not be written: the answer it held comes by RPC
            self._bury(name, cid, "fetched" if "found" in env else "failed")
            return _sendable_answer(name, "handover", env, where)
        try:
            payload = cap.pop(cid, list(args[1:]))
        except _STOP:
            raise
        except BaseException as e:  # noqa: BLE001 - a plugin's fault fails its request, not the RPC (nor the engine)
            log.error("worker_capture_step_failed", content=name, hook="pop", error=_exc_line(e), **self.where)
            _drop_quietly(cap, cid)
            self._bury(name, cid, "failed")
            return {"absent": "failed", "error": f"pop: {_exc_line(e)}", "fault": True, **where}
        if payload is None:
            return {"absent": self.gone[name].get(cid, "unknown"), **where}
        self._bury(name, cid, "fetched")
        return _sendable_answer(name, "pop", {"found": payload, **where}, where)


#: what a capture id (the value of a content's ``capture_key`` in ``SamplingParams.extra_args``) must be: 1-128 of
#: ``[A-Za-z0-9_-]`` (e.g. ``os.urandom(16).hex()``), unique per request; a worker runs any other request uncaptured
CAPTURE_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")
_SAFE = CAPTURE_ID_PATTERN

#: where a capturing worker runs its captures' ``end_step`` hooks (:meth:`WorkerRuntime.settle`)
STEP_END_MODES = ("deferred", "inline")


def step_end_mode(mode: str, field: str = "step_end") -> str:
    """``mode`` when it is one of :data:`STEP_END_MODES`. :raises ValueError: naming ``field`` and the allowed values."""
    if mode not in STEP_END_MODES:
        raise ValueError(f"{field} {mode!r} unknown; allowed: {list(STEP_END_MODES)}")
    return mode


def _hook_idle_wait(rt: WorkerRuntime) -> str | None:
    """Make vLLM's worker loop settle ``rt`` (:meth:`WorkerRuntime.settle`) each time it waits for the engine's next
    call, and return the loop's class name; None where no such loop calls this init RPC (Ray, an in-process
    executor, a test).

    vLLM 0.32's multiprocessing worker (``vllm/v1/executor/multiproc_executor.py``, ``WorkerProc.worker_busy_loop``)
    runs every RPC between two ``self.rpc_broadcast_mq.dequeue(indefinite=True)`` calls, after the previous one's
    output was sent (``handle_output``). The loop is found among the callers of the init RPC (a frame whose ``self``
    has ``worker_busy_loop`` and an ``rpc_broadcast_mq`` with ``dequeue``) and that queue object's ``dequeue`` is
    wrapped (an instance attribute: the loop looks it up on every iteration). The wrapper runs the pending hooks,
    then waits as before: the worker does the work while the engine core processes the step's output and schedules
    the next one, the time this worker otherwise spends spinning in that wait."""
    import sys

    f = sys._getframe(1)
    while f is not None:
        proc = f.f_locals.get("self")
        mq = getattr(proc, "rpc_broadcast_mq", None)
        if mq is not None and hasattr(proc, "worker_busy_loop") and callable(getattr(mq, "dequeue", None)):
            break
        f = f.f_back
    else:
        return None
    orig = mq.dequeue
    if getattr(orig, "_genartifact_settles", None) is rt:  # (wrapped already)
        return type(proc).__name__

    @functools.wraps(orig)
    def dequeue(*a: Any, **kw: Any) -> Any:
        if rt._pending is not None:
            try:
                rt.settle()
            except _STOP:
                raise
            except BaseException as e:  # noqa: BLE001 - (plugins' faults are caught per content) never into vLLM's loop
                log.error("worker_step_end_failed", error=_exc_line(e), **rt.where)
        if rt._writes:  # step files the writer thread has finished: their answers freed while the engine idles
            rt.reap_writes()
        return orig(*a, **kw)

    dequeue._genartifact_settles = rt  # type: ignore[attr-defined]
    mq.dequeue = dequeue
    return type(proc).__name__


def _callable_name(fn: Any) -> str:
    """``fn``'s ``__qualname__`` as a fault text names it: redacted, at most 100 characters, ``"callback"`` when it
    has none or its lookup raises (a plugin's callable must not break the isolation that reports its fault)."""
    from genartifact.host import redact

    try:
        name = getattr(fn, "__qualname__", None)
        return redact(name, 100) if isinstance(name, str) and name else "callback"
    except Exception:  # noqa: BLE001 - a hostile __getattr__
        return "callback"


def _unsendable(obj: Any) -> str | None:
    """Why ``obj`` cannot go back to the driver in an RPC answer (None: it can). vLLM's engine core encodes utility
    results with msgpack on its output thread, and a value it cannot encode ends that thread: the engine then answers
    nothing and every request hangs. So every plugin value the worker sends is first encoded here with
    ``msgspec.msgpack``: msgpack-native values only (dict, list, tuple, str, int, float, bool, None, bytes,
    bytearray, memoryview), as the handover file's header holds them. Large blobs are lifted out first, as for
    the step file (:func:`_lift_blobs`): the check encodes the structure, it does not copy a long request's rows."""
    import msgspec

    try:
        msgspec.msgpack.encode(_lift_blobs({"answer": obj})[0])
    except _STOP:
        raise
    except BaseException as e:  # noqa: BLE001 - whatever the encoder or a hostile object raised
        return f"{type(e).__name__}: {_exc_line(e)}"
    return None


def _plugin_verb(method: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` for the worker RPC ``method`` (a plugin's verb, stats or ``genartifact_worker_call``):
    its exception is the RPC's error, as vLLM reports it to the driver (a ``BaseException`` of the plugin's own is
    turned into a ``RuntimeError`` first), and a result that could not go back (:func:`_unsendable`) is a
    ``TypeError`` here instead of an engine whose output thread died encoding it."""
    try:
        res = fn(*args)
    except _STOP:
        raise
    except Exception:
        raise
    except BaseException as e:  # noqa: BLE001 - not the engine's to die of
        raise RuntimeError(f"worker verb {method!r} raised {type(e).__name__}: {_exc_line(e)}") from None
    why = _unsendable(res)
    if why is not None:
        raise TypeError(f"worker verb {method!r} answered a value that is not msgpack-native ({why}); answer "
                        f"dict/list/str/int/float/bool/None/bytes only")
    return res


def _sendable_answer(name: str, how: str, env: dict[str, Any], where: Mapping[str, Any]) -> dict[str, Any]:
    """``env`` (a fetch answer of content ``name``) when it can go back by RPC (:func:`_unsendable`), else a failed
    answer naming why (the request fails with ``internal_error``; the engine runs on)."""
    why = _unsendable(env)
    if why is None:
        return env
    err = f"{how}: the answer is not msgpack-native ({why}); return dict/list/str/int/float/bool/None/bytes only"
    log.error("worker_capture_step_failed", content=name, hook=how, error=err, **where)
    return {"absent": "failed", "error": err, "fault": True, **where}


def _drop_quietly(cap: WorkerCapture, cid: str) -> None:
    """``cap.drop(cid)`` for a capture whose request already failed: a second fault of the plugin changes nothing
    (the request's answer names the first)."""
    try:
        cap.drop(cid)
    except _STOP:
        raise
    except BaseException:  # noqa: BLE001, S110 - the request already fails with the first fault
        pass


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _exc_line(e: BaseException) -> str:
    """``"<exception type>: <its text>"``, the text as :func:`_exc_text` makes it (redacted, bounded, never
    raising): how every fault of a plugin is named in the worker's logs and fetch answers."""
    return f"{type(e).__name__}: {_exc_text(e)}"


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
        else:
            rt.set_handover(config.get("handover"))
        return rt.answer()
    rt = getattr(worker, "_genartifact_runtime", None)
    if rt is None:
        raise RuntimeError("genartifact worker not initialised: the engine sends genartifact_call('init', "
                           "config) after start (VllmEngine.start / VllmEngine.attach)")
    if method == "handover":  # ("handover", {"dir", "token"} | None): switch out-of-band handover on/off
        rt.set_handover(args[0] if args else None)
        # the answers kept for the RPC fetch (their files could not be written): the driver does not wait for them
        return {**rt.answer(), "unwritten": [f"{n}.{c}" for n, kept in rt.unwritten.items() for c in kept]}
    if method == "handover_writer":  # ("handover_writer", min_bytes): step files of min_bytes+ go to the thread
        n = args[0] if args else HANDOVER_THREAD_BYTES
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"handover_writer min_bytes {n!r}; allowed: an int >= 0")
        rt.reap_writes(wait=True)
        rt.handover_thread_bytes = n
        return rt.answer()
    if method == "step_end":  # ("step_end", "deferred" | "inline"): where end_step hooks run
        rt.set_step_end(str(args[0]) if args else "deferred")
        return rt.answer()
    if method == "batch":  # ("batch", inner_method, [args, ...]) -> [result, ...]: one RPC for many calls,
        inner, calls = args  # each answered as if sent alone (the engine merges concurrent calls of one method)
        return [_dispatch(worker, inner, *a) for a in calls]
    return rt.call(method, args)


class GenartifactWorkerExtension:
    """Fallback ``worker_extension_cls`` carrying ``genartifact_call`` where the ``vllm.general_plugins``
    entry point is not installed. vLLM mixes it into the worker class, so ``self`` is the worker."""

    def genartifact_call(self, method: str, *args: Any) -> Any:
        """Worker RPC: ``"init"`` with the config dict, ``"batch"``, or ``"<content>.<verb>"``."""
        return _dispatch(self, method, *args)


_parent_watch: list[Any] = []
_at_parent_exit: list[Callable[[], None]] = []  # run (best effort) before a parent-death exit


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
        for fn in list(_at_parent_exit):  # e.g. the handover folder of a driver killed by SIGKILL
            try:
                fn()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
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


HANDOVER_WAIT_S = 5.0  # how long fetch_capture waits for a handover file before asking the workers by RPC
#: while a worker's step files keep failing (``/dev/shm`` full), at most one ``worker_handover_unwritten`` line per
#: cause and this many seconds (the first failure of a cause is logged at once; the lines count the failures in
#: between), and ``worker_handover_recovered`` at the first write this long after the last failure
HANDOVER_FAIL_LOG_S = 30.0
#: how often the takes waiting for step files look for them where the folder cannot be watched (no inotify): one
#: scan of the folder per period for all of them (a step file comes within about one engine step of the request's
#: last output, a few ms), the period HANDOVER_POLL_S after a new wait or a found answer, doubling after each scan
#: that finds nothing up to HANDOVER_POLL_MAX_S (a steady 0.5 ms scan cost a serving driver ~300 us per request).
#: With inotify (Linux) the takes wake when a step file is renamed into the folder, and HANDOVER_POLL_MAX_S is only
#: the safety period of a scan that no event asked for (an overflowed event queue).
HANDOVER_POLL_S = 0.0005
HANDOVER_POLL_MAX_S = 0.02

#: A handover step file (written by :meth:`WorkerRuntime._write_handover`, read by :class:`Handover`):
#: ``STEP_MAGIC``, the format version (1 byte), 3 zero bytes and the header's length (u64, little-endian); the
#: header, a msgpack map ``"<content>.<capture id>"`` -> fetch answer; then the blob region. Each bytes-like value
#: of at least :data:`STEP_BLOB_MIN` bytes found in an answer's maps (not in lists) stands in the header as msgpack
#: extension :data:`STEP_BLOB_EXT` holding its length (u64, little-endian), and its bytes follow in the blob region,
#: in the order of the header, back to back, up to the end of the file. So neither side copies a blob through
#: msgpack: the worker writes it from its own buffer, the driver reads it into its own ``bytes`` with ``pread``
#: (which releases the GIL), and a large file is read off the driver's event loop (:data:`STEP_INLINE_MAX`).
STEP_MAGIC = b"GAHO"
STEP_VERSION = 1
STEP_BLOB_EXT = 1
STEP_BLOB_MIN = 4096
#: step files up to this many bytes are read on the driver's event loop; larger ones by the handover's reader thread
#: (a 32k-token request of a 48-router top-8 model hands over ~12 MB: 25-30 ms of reading and decoding that
#: stalled every stream of the server when done on the loop; docs/benchmarks.md, issue 13 fourteenth pass)
STEP_INLINE_MAX = 256 << 10
#: a worker writes step files of this many bytes or more in its writer thread, while the next step runs
#: (:meth:`WorkerRuntime._write_handover`); smaller ones before the next step (a hand-off to a thread costs ~60 us of
#: the worker's critical path, more than writing a few KiB). Changed on a running engine by the ``handover_writer``
#: RPC (0: every file in the thread)
HANDOVER_THREAD_BYTES = 1 << 20
#: the largest header a driver reads (the answers' non-blob values: a few hundred bytes per request, so 64 MiB is
#: ~100,000 requests finishing in one step); a file declaring more is refused unread
STEP_HEADER_MAX = 64 << 20
_STEP_PREFIX = struct.Struct("<4sB3xQ")
_BLOB_LEN = struct.Struct("<Q")
_LIFT_DEPTH = 32
#: an empty file ``nofile.<content>.<capture id>`` in the handover folder: the worker could not write that answer's
#: step file (``/dev/shm`` full, an answer msgpack cannot hold) and keeps it for the RPC fetch, so the driver's take
#: ends at once instead of waiting :data:`HANDOVER_WAIT_S` for a file that cannot come. An empty file needs no data
#: blocks (a full tmpfs still makes it); where even that fails, the take waits as before.
NOFILE_PREFIX = "nofile."


def step_file_parts(entries: Mapping[str, Any]) -> list[Any]:
    """The buffers of a step file holding ``entries`` (``"<content>.<capture id>"`` -> fetch answer), in order:
    prefix and header as one ``bytes``, then each blob as a view of the answer's own buffer (no copy). A blob is a
    C-contiguous ``bytes``/``bytearray``/``memoryview`` of at least :data:`STEP_BLOB_MIN` bytes held in a map of an
    answer (maps nested up to 32 deep; values inside lists stay in the header). Raises what ``msgspec`` raises
    for a value that is not msgpack-native (``TypeError``), ``ValueError`` for a header above
    :data:`STEP_HEADER_MAX` (the worker then keeps the answers for the RPC fetch)."""
    return _step_file(entries)[0]


def _lift_blobs(entries: Mapping[str, Any]) -> tuple[dict[str, Any], list[memoryview], bool]:
    """``entries`` with each blob (a C-contiguous bytes-like of at least :data:`STEP_BLOB_MIN` bytes held in a map,
    maps nested up to :data:`_LIFT_DEPTH` deep) replaced by a msgpack extension naming its length: ``(the lifted
    entries, the blobs as byte views in order, whether every blob is a bytes or bytearray object of its own)``."""
    import msgspec

    blobs: list[memoryview] = []
    own = True

    def lift(v: Any, depth: int) -> Any:
        nonlocal own
        if isinstance(v, dict) and depth < _LIFT_DEPTH:
            return {k: lift(x, depth + 1) for k, x in v.items()}
        if isinstance(v, (bytes, bytearray, memoryview)):
            mv = memoryview(v)
            if mv.nbytes >= STEP_BLOB_MIN and mv.c_contiguous:
                blobs.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
                own = own and type(v) in (bytes, bytearray)
                return msgspec.msgpack.Ext(STEP_BLOB_EXT, _BLOB_LEN.pack(mv.nbytes))
        return v

    return {k: lift(v, 0) for k, v in entries.items()}, blobs, own


def _step_file(entries: Mapping[str, Any]) -> tuple[list[Any], bool]:
    """:func:`step_file_parts`, and whether every blob is a ``bytes`` or ``bytearray`` object of its own (no
    ``memoryview``: a view is a window on a buffer its capture may reuse, so its file is not left to the writer
    thread, see :meth:`WorkerRuntime._write_handover`)."""
    import msgspec

    lifted, blobs, own = _lift_blobs(entries)
    header = msgspec.msgpack.encode(lifted)
    if len(header) > STEP_HEADER_MAX:  # a driver would refuse it: the answers go by RPC instead
        raise ValueError(f"step file header of {len(header)} bytes above STEP_HEADER_MAX ({STEP_HEADER_MAX})")
    return [_STEP_PREFIX.pack(STEP_MAGIC, STEP_VERSION, len(header)) + header, *blobs], own


def encode_step_file(entries: Mapping[str, Any]) -> bytes:
    """The bytes of a step file holding ``entries`` (see :func:`step_file_parts`; tests and benchmarks write
    step files as a worker does with this)."""
    return b"".join(step_file_parts(entries))


def _write_step_file(path: str, parts: Sequence[Any]) -> None:
    """Write ``parts`` (:func:`step_file_parts`) as the step file ``path``: into ``path + ".tmp"``, a new file of
    ours only (never through a link, never over an entry someone else put there), then renamed to ``path``. Raises
    ``OSError`` with nothing of ours left behind."""
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            _write_all(fd, parts)  # blobs straight from the captures' buffers
        finally:
            os.close(fd)
        os.replace(path + ".tmp", path)
    except BaseException:
        _unlink(path + ".tmp")
        raise


def _mark_no_file(d: str, handed: Sequence[tuple[str, str, Any]]) -> int:
    """Tell the driver that the answers of ``handed`` (``(content, capture id, answer)``) come by RPC only: an empty
    :data:`NOFILE_PREFIX` file per answer in the handover folder ``d`` (created new under a hidden name, never
    through a link, then renamed into place). Returns how many were made; one that cannot be (the folder gone, no
    inodes left, a name above 255 bytes) leaves that request's take to wait :data:`HANDOVER_WAIT_S` before it asks
    by RPC."""
    made = 0
    for name, cid, _ in handed:
        final = os.path.join(d, f"{NOFILE_PREFIX}{name}.{cid}")
        tmp = os.path.join(d, "." + os.path.basename(final))  # (a name the driver's scan does not look at)
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        except OSError:
            continue
        try:  # renamed into place, as a step file is: the rename is what wakes the driver's watch (IN_MOVED_TO)
            os.rename(tmp, final)
            made += 1
        except OSError:
            _unlink(tmp)
    return made


def _write_step_file_or_mark(path: str, parts: Sequence[Any], handed: Sequence[tuple[str, str, Any]]) -> None:
    """The writer thread's :func:`_write_step_file`: when it fails, the answers' markers (:func:`_mark_no_file`) are
    made right away, not when the main thread reaps the write (the next step or RPC, which an idle engine may not
    have for seconds); the main thread keeps the answers for the RPC fetch when it reaps, before any RPC verb is
    served. Raises what the write raised."""
    try:
        _write_step_file(path, parts)
    except BaseException:
        _mark_no_file(os.path.dirname(path), handed)
        raise


def _write_all(fd: int, parts: Sequence[Any]) -> None:
    for p in parts:
        mv = memoryview(p)
        while mv.nbytes:
            mv = mv[os.write(fd, mv):]


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    """``n`` bytes of ``fd`` from ``offset`` (``os.pread``, repeated for a short read); ``ValueError`` when the file
    ends first."""
    b = os.pread(fd, n, offset)
    if len(b) == n:
        return b
    parts = [b]
    got = len(b)
    while got < n:
        more = os.pread(fd, n - got, offset + got)
        if not more:
            raise ValueError(f"file ends {n - got} bytes early (at byte {offset + got})")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def read_step_file(fd: int, size: int) -> Any:
    """Decode the step file open at ``fd`` (``size`` bytes, see :data:`STEP_MAGIC`): the header's entries with
    each blob read into its own ``bytes``. Raises ``ValueError`` for a file that is not a step file of this format
    (magic, version, lengths beyond the file, a header above :data:`STEP_HEADER_MAX`, an unknown extension, a
    blob below :data:`STEP_BLOB_MIN`, bytes left after the last blob),
    ``msgspec.DecodeError`` for a header that is not msgpack, ``RecursionError`` for one nested too deep, ``OSError``
    when reading fails."""
    import msgspec

    if size < _STEP_PREFIX.size:
        raise ValueError(f"{size} bytes: shorter than a step file's {_STEP_PREFIX.size}-byte prefix")
    magic, version, hlen = _STEP_PREFIX.unpack(_pread_exact(fd, _STEP_PREFIX.size, 0))
    if magic != STEP_MAGIC:
        raise ValueError(f"not a step file (starts {magic!r}, expected {STEP_MAGIC!r})")
    if version != STEP_VERSION:
        raise ValueError(f"step file format {version}; this driver reads format {STEP_VERSION}")
    if hlen > size - _STEP_PREFIX.size:
        raise ValueError(f"header of {hlen} bytes beyond the file's {size}")
    if hlen > STEP_HEADER_MAX:
        raise ValueError(f"header of {hlen} bytes; a step file's header holds at most {STEP_HEADER_MAX}")
    header = _pread_exact(fd, hlen, _STEP_PREFIX.size)
    pos = _STEP_PREFIX.size + hlen

    def blob(code: int, data: memoryview) -> bytes:
        nonlocal pos
        if code != STEP_BLOB_EXT or len(data) != _BLOB_LEN.size:
            raise ValueError(f"unknown msgpack extension {code} ({len(data)} bytes)")
        (n,) = _BLOB_LEN.unpack(data)
        if n < STEP_BLOB_MIN:  # a writer puts smaller values in the header: refused, not read one pread each
            raise ValueError(f"blob of {n} bytes; blobs are at least {STEP_BLOB_MIN}")
        if n > size - pos:
            raise ValueError(f"blob of {n} bytes at byte {pos} beyond the file's {size}")
        b = _pread_exact(fd, n, pos)
        pos += n
        return b

    batch = msgspec.msgpack.Decoder(ext_hook=blob).decode(header)
    if pos != size:
        raise ValueError(f"{size - pos} bytes after the last blob")
    return batch



class Handover:
    """Driver side of the out-of-band handover of finished requests' worker rows (one per engine).

    A private folder (mode 0700) in ``/dev/shm`` (else the temp dir) named ``genartifact-<driver pid>-<random>``
    holds a ``token`` file; :meth:`config` goes to the workers with ``init``. A capturing worker that finds the
    folder with the same token (same machine) writes, when vLLM tells it requests finished (the engine step after
    their last one), one file per step, ``step.<worker pid>.<n>`` (:data:`STEP_MAGIC`: a msgpack map
    ``"<content>.<capture id>"`` -> that capture's fetch answer, its large binary values after it), for every
    content of every flagged request that finished — instead of keeping the rows for a ``collective_rpc`` fetch
    that pauses the engine loop. :meth:`take` finds a capture's answer: read from the files present (each read
    once, then deleted: up to :data:`STEP_INLINE_MAX` bytes on the event loop, larger ones by a reader thread; the
    answers of the other captures in it kept in memory for their own take). Where workers cannot see the folder (Ray workers on other nodes) they answer that they do
    not hand over, and fetch stays on the RPC path.

    Nothing outlives the engine: :meth:`take` and :meth:`drop` forget what they concern (an answer dropped before
    its file came is discarded when the file is read), :meth:`close` (engine shutdown) removes the folder, a
    worker whose driver died removes it before exiting, and a new :class:`Handover` removes folders that no live
    process holds (:func:`sweep_handover_dirs`: each folder is ``flock``-ed by its :class:`Handover` for its
    life).

    :param root: parent folder (default ``/dev/shm`` when writable, else :func:`tempfile.gettempdir`)."""

    def __init__(self, root: str | None = None) -> None:
        import secrets
        import tempfile

        if root is None:
            root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        sweep_handover_dirs(root)
        # made under a staging name, locked, then renamed: a folder a sweep can see by its final name is always
        # locked while its engine lives (the lock, not the pid in the name, is what tells a sweep it is in use)
        staging = tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=root)
        try:
            self.token = secrets.token_hex(16)
            with open(os.path.join(staging, "token"), "w", encoding="ascii") as f:
                f.write(self.token)
            self._lock_fd: int | None = _lock_dir(staging)
            if self._lock_fd is None:
                raise OSError(f"could not lock the handover folder {staging}")
            self.dir = os.path.join(root, f"genartifact-{os.getpid()}-{secrets.token_hex(6)}")
            os.rename(staging, self.dir)
            st = os.stat(self.dir)
        except BaseException:
            _rmtree(staging)
            raise
        self._ident = (st.st_dev, st.st_ino)  # the folder itself: a removed or replaced one is lost
        #: the folder was found removed or replaced under the running engine (sticky): takes no longer wait for
        #: files that cannot come; the engine replaces the handover (``VllmEngine.renew_handover``)
        self.lost = False
        self.renewing = False  # a replacement is under way (one per lost folder)
        #: contents whose rows every capturing worker hands over (set by the engine from the init answers)
        self.contents: set[str] = set()
        self.taken = 0
        #: "<content>.<capture id>" -> answer, read from a step file and not yet taken
        self._ready: dict[str, Mapping[str, Any]] = {}
        self.evicted = 0  # answers forgotten untaken because more than READY_MAX were waiting (see _merge)
        #: keys dropped before their answer was read (discarded when it comes), oldest first, bounded
        self._dropped: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: why the latest unreadable step files could not be read (named by a fetch that finds no answer)
        self.unreadable: collections.deque[str] = collections.deque(maxlen=16)
        #: key -> the futures of the takes waiting for its answer, served by their loop's poller
        self._waiting: dict[str, list[Any]] = {}
        #: keys whose answers a worker kept for the RPC fetch (written nowhere this handover can see, see
        #: :meth:`no_file`), oldest first, bounded: their takes end at once
        self._by_rpc: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: event loop -> the task scanning for the takes waiting on it, while there are any
        self._pollers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._closed = False
        self._progress = 0.0  # time.monotonic() of the latest new wait or answer found for a waiting take
        #: an inotify descriptor watching the folder for step files renamed into it (None: polled), the loop whose
        #: reader it is registered with, whether an event came since the last scan, and the poller's pending wake
        self._notify_fd: int | None = _watch_renames(self.dir)
        self._notify_loop: Any = None
        self._notified = False
        self._wake: Any = None
        self.scans = 0  # folder scans by the poller (tests, benchmarks)
        #: large step files claimed (open, unlinked) and not yet read: (name, descriptor, size); the task reading
        #: them in the reader thread (one at a time), and that thread's pool (made at the first large file)
        self._claimed: list[tuple[str, int, int]] = []
        self._drainer: Any = None
        self._pool: Any = None
        #: reads handed to the reader thread and not finished; what they read, not yet merged (name, result)
        self._inflight: set[Any] = set()
        self._read_done: collections.deque[tuple[str, tuple[bool, Any]]] = collections.deque()

    def config(self) -> dict[str, str]:
        """The ``handover`` entry of the worker ``init`` payload."""
        return {"dir": self.dir, "token": self.token}

    def check_folder(self) -> bool:
        """True while the folder is still the one this handover made; once it is removed or replaced (by
        someone else: nothing here removes it before :meth:`close`), :attr:`lost` is set for good and a warning is
        logged. One ``stat``."""
        if self.lost or self._closed:
            return not self.lost
        try:
            st = os.stat(self.dir)
            ok = (st.st_dev, st.st_ino) == self._ident
        except OSError:
            ok = False
        if not ok:
            self.lost = True
            log.warning("capture_handover_lost", dir=self.dir,
                        detail="the handover folder was removed or replaced under the running engine; worker rows "
                               "go by RPC until the engine replaces it")
        return ok

    @staticmethod
    def key(content: str, capture_id: str) -> str | None:
        """``"<content>.<capture id>"``, or None when either cannot be one (such captures go by RPC)."""
        if not (_SAFE.fullmatch(content.replace(".", "_")) and _SAFE.fullmatch(capture_id)):
            return None
        return f"{content}.{capture_id}"

    def _scan(self, inline_all: bool = False) -> None:
        """Claim every step file present (opened, then unlinked: no other scan reads it again) and read it into
        the answers kept for :meth:`read`: a file of up to :data:`STEP_INLINE_MAX` bytes here, a larger one by the
        reader thread (:meth:`_drain`, started on the running event loop; here when there is none, or with
        ``inline_all``). Never raises and never blocks on an entry: one that is not a worker's step file — not a
        regular file (a FIFO, a directory, a symlink: opened with ``O_NONBLOCK | O_NOFOLLOW`` and checked), torn,
        not of this format, or unreadable — is removed and named in :attr:`unreadable`; an entry of a step file
        that is not a worker's answer fails its capture with an error naming the file."""
        self._merge_done()
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for n in names:
            if n.startswith(NOFILE_PREFIX):
                self._no_file_marker(n)
                continue
            if not n.startswith("step.") or n.endswith(".tmp"):
                continue
            try:
                claimed = self._claim(n)
            except Exception as e:  # noqa: BLE001 - whatever is in the folder, a scan goes on (and the loop too)
                self.unreadable.append(f"handover file {n} unreadable: {_exc_line(e)}")
                _remove_entry(os.path.join(self.dir, n))
                continue
            if claimed is None:
                continue
            fd, size = claimed
            if size <= STEP_INLINE_MAX or inline_all:
                self._merge(n, _read_claimed(n, fd, size))
            else:
                self._claimed.append((n, fd, size))
        if self._claimed:
            self._schedule_drain(inline_all)

    def _no_file_marker(self, n: str) -> None:
        """A worker's :data:`NOFILE_PREFIX` marker ``n``: removed, and its answer known to come by RPC only
        (:meth:`no_file`), unless its request was dropped meanwhile (its tombstone goes: no file will come to
        discard)."""
        path = os.path.join(self.dir, n)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return  # taken by another scan meanwhile
        except OSError:  # not a worker's (a directory): removed all the same, never read
            _remove_entry(path)
        k = n[len(NOFILE_PREFIX):]
        if k in self._dropped:
            del self._dropped[k]
            return
        self.no_file([k])

    def _claim(self, n: str) -> tuple[int, int] | None:
        """Open the step file ``n`` and unlink it: ``(descriptor, size in bytes)``, or None when another scan took
        it first. Raises for an entry that is not a regular file (nothing is left open)."""
        import stat

        path = os.path.join(self.dir, n)
        try:  # a worker renames a regular file into place: anything else is refused without blocking on it
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None  # read (and deleted) by another scan meanwhile
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"not a regular file (mode {stat.filemode(st.st_mode)})")
        except BaseException:
            os.close(fd)
            raise
        _unlink(path)
        return fd, st.st_size

    def _schedule_drain(self, inline: bool = False) -> None:
        """Have the claimed large step files read: by the reader thread, from a task on the running event loop
        (one per loop at a time: a task left on a loop that no longer runs does not hold the others up), else (no
        running loop, or ``inline``) here."""
        import asyncio

        loop = None
        if not inline:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
        if loop is None:
            claimed, self._claimed = self._claimed, []
            _read_all_claimed(claimed, self._read_done)
            self._merge_done()
            return
        d = self._drainer
        if d is None or d.done() or d.get_loop() is not loop:
            self._drainer = loop.create_task(self._drain(loop))

    def _submit(self) -> Any:
        """Hand every claimed file to the reader thread: the ``concurrent.futures.Future`` of the read (None when
        nothing is claimed). Whatever becomes of whoever awaits it, nothing read is lost: the thread puts each
        file's answers in :attr:`_read_done` (merged by the next scan, read, drain or settle on any loop), and a
        read cancelled before it started gives its files back to :attr:`_claimed` (still open, for the next
        drain or :meth:`close`)."""
        import concurrent.futures

        claimed, self._claimed = self._claimed, []
        if not claimed:
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="genartifact-handover")
        cf = self._pool.submit(_read_all_claimed, claimed, self._read_done)
        self._inflight.add(cf)

        def done(f: Any) -> None:
            self._inflight.discard(f)
            if f.cancelled():  # (cancelled by whoever awaited it, in that loop's thread) never read: kept
                if self._closed:
                    for _, fd, _ in claimed:
                        os.close(fd)
                else:
                    self._claimed.extend(claimed)

        cf.add_done_callback(done)
        return cf

    def _merge_done(self) -> None:
        """Merge the answers the reader thread has read (:meth:`_submit`)."""
        while self._read_done:
            n, res = self._read_done.popleft()
            self._merge(n, res)

    async def _drain(self, loop: Any) -> None:
        """Read the claimed large step files in the reader thread (``pread`` releases the GIL: the loop runs on
        meanwhile), merge their answers here, then hand each take waiting on ``loop`` its answer."""
        import asyncio

        while self._claimed and not self._closed:
            cf = self._submit()
            await asyncio.wrap_future(cf, loop=loop)
            self._merge_done()
            self._serve(loop)

    async def settle(self) -> None:
        """Wait until the large step files claimed so far are read, and merge their answers (they are then in
        :meth:`read`'s reach), whichever event loop's task handed them to the reader thread. A cancelled caller
        does not cancel the reading."""
        import asyncio

        if self._claimed and not self._closed:
            self._submit()
        for cf in list(self._inflight):
            await asyncio.shield(asyncio.wrap_future(cf))
        self._merge_done()

    def _merge(self, n: str, res: tuple[bool, Any]) -> None:
        """Keep the answers of step file ``n`` as :func:`_read_claimed` returned it (``(True, entries)`` or
        ``(False, why it could not be read)``) for :meth:`read`."""
        ok, batch = res
        if not ok:
            self.unreadable.append(batch)
            return
        if self._closed:
            return
        if not isinstance(batch, dict):
            self.unreadable.append(f"handover file {n} is not a worker's step file")
            return
        for k, env in batch.items():
            content, _, cid = k.rpartition(".") if isinstance(k, str) else ("", "", "")
            if not content or self.key(content, cid) != k:
                self.unreadable.append(f"handover file {n} has an entry that is not a capture's")
                continue
            if k in self._dropped:  # discarded before its answer came
                del self._dropped[k]
                continue
            if not isinstance(env, dict) or not ("found" in env or "absent" in env):
                env = {"absent": "failed", "error": f"handover file {n}: the entry of {k} is not a worker's answer"}
            self._ready[k] = env
            if len(self._ready) > READY_MAX:  # answers nobody takes (not a session's): the oldest go
                self._ready.pop(next(iter(self._ready)))
                self.evicted += 1

    def read(self, content: str, capture_id: str) -> Mapping[str, Any] | None:
        """The worker's fetch answer for ``capture_id`` (forgotten once returned), or None if not (yet) written."""
        k = self.key(content, capture_id)
        if k is None:
            return None
        self._merge_done()
        env = self._ready.pop(k, None)
        if env is None:
            self._scan()
            env = self._ready.pop(k, None)
        if env is not None:
            self.taken += 1
            if self._by_rpc:  # (a worker that left both a file and a marker: the file's answer is the one)
                self._by_rpc.pop(k, None)
        return env

    async def take(self, content: str, capture_id: str, wait_s: float | None = None) -> Mapping[str, Any] | None:
        """:meth:`read`, waiting up to ``wait_s`` seconds (a number; 0 or less: no wait; None: the module's
        :data:`HANDOVER_WAIT_S` at the time of the call) for the file, then None.
        The takes waiting on an event loop share one poller, which scans the folder when a step file is renamed
        into it (inotify), or, where it cannot be watched (no inotify, or the watch serves another live loop),
        :data:`HANDOVER_POLL_S` seconds after a new wait or answer (doubling per empty scan up to
        :data:`HANDOVER_POLL_MAX_S`), and hands each waiting take its answer as soon as a scan finds it: a wave
        of requests finishing together costs one scan per file, not one per request and period. Each take keeps
        its own deadline (a timer on its loop), whatever the poller does. A take cancelled after its answer was
        found puts the answer back (a later take or :meth:`drop` finds it). After :meth:`close`, no wait.

        :raises ValueError: ``wait_s`` is not a number (NaN included)."""
        import asyncio
        import time

        if wait_s is None:
            wait_s = HANDOVER_WAIT_S
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or wait_s != wait_s:
            raise ValueError(f"wait_s must be a number of seconds; got {wait_s!r}")
        env = self.read(content, capture_id)
        k = self.key(content, capture_id)
        if env is None and k is not None and k in self._by_rpc:
            del self._by_rpc[k]
            return None  # its worker kept the answer for the RPC fetch: no file will come
        if env is not None or k is None or wait_s <= 0 or self._closed or not self.check_folder():
            return env  # (a lost folder: no file can come, the fetch goes by RPC at once)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        deadline = loop.call_later(wait_s, _no_answer, fut)
        self._waiting.setdefault(k, []).append(fut)
        if k in self._by_rpc:  # known to come by RPC since the check above (another thread's scan): no wait
            self.no_file([k])
        self._progress = time.monotonic()  # a new wait: look often again
        self._watch_on(loop)
        poller = self._pollers.get(loop)
        if poller is None or poller.done():
            self._pollers[loop] = loop.create_task(self._poll(loop))
        try:
            return await fut
        except asyncio.CancelledError:
            found = fut.done() and not fut.cancelled() and fut.exception() is None and fut.result() is not None
            if found and not self._closed:  # found, then cancelled before it resumed: kept for a later take
                self._ready[k] = fut.result()
                self.taken -= 1
            raise
        finally:
            deadline.cancel()

    def _watch_on(self, loop: Any) -> None:
        """Let the inotify watch wake ``loop``'s poller, unless it serves another loop that is still open (that
        loop's takes are woken; this one's are polled)."""
        if self._notify_fd is None or self._notify_loop is loop:
            return
        if self._notify_loop is not None and not self._notify_loop.is_closed():
            return
        try:
            loop.add_reader(self._notify_fd, self._on_notify)
            self._notify_loop = loop
        except (OSError, ValueError, RuntimeError, NotImplementedError):  # a loop without add_reader: polled
            self._stop_watching()

    def _waits_on(self, loop: Any) -> bool:
        return any(not f.done() and f.get_loop() is loop for waiters in self._waiting.values() for f in waiters)

    async def _poll(self, loop: Any) -> None:
        """Serve the takes waiting on ``loop`` (see :meth:`take`) until none is left: after each rename event
        (inotify, when the watch is registered with ``loop``), else every period."""
        import asyncio

        pause, seen = HANDOVER_POLL_S, self._progress
        while self._waits_on(loop):
            if self._notify_loop is loop:
                if not self._notified:
                    self._wake = loop.create_future()
                    timer = loop.call_later(HANDOVER_POLL_MAX_S, _no_answer, self._wake)
                    try:
                        await self._wake
                    finally:
                        timer.cancel()
                        self._wake = None
                self._notified = False  # before the scan: an event during it asks for the next one
            else:
                await asyncio.sleep(pause)
            self._scan()  # never raises
            self.scans += 1
            if not self.check_folder():  # removed under the engine: no file can come, the takes go by RPC now
                for k, waiters in list(self._waiting.items()):
                    for f in waiters:
                        if f.get_loop() is loop:
                            _no_answer(f)
                    rest = [f for f in waiters if f.get_loop() is not loop]
                    if rest:
                        self._waiting[k] = rest
                    else:
                        del self._waiting[k]
                return
            self._serve(loop)
            # polled: look again soon after progress (a new wait, an answer found), else back off
            pause = HANDOVER_POLL_S if self._progress != seen else min(pause * 2, HANDOVER_POLL_MAX_S)
            seen = self._progress

    def _serve(self, loop: Any) -> None:
        """Hand each take waiting on ``loop`` whose answer has been read that answer."""
        import time

        for k in list(self._waiting):
            waiters = [f for f in self._waiting[k] if not f.done()]
            for f in [f for f in waiters if f.get_loop() is loop]:
                if k not in self._ready:
                    break
                waiters.remove(f)
                f.set_result(self._ready.pop(k))
                self.taken += 1
                self._progress = time.monotonic()
            if waiters:
                self._waiting[k] = waiters
            else:
                del self._waiting[k]

    def _on_notify(self) -> None:
        """The inotify descriptor is readable: drain its events (their content does not matter: a scan reads
        whatever is there) and wake the poller."""
        fd = self._notify_fd
        if fd is None:
            return
        try:
            while os.read(fd, 65536):
                pass
        except BlockingIOError:
            pass
        except OSError:  # the descriptor broke: stop watching, the poller falls back to its period
            self._stop_watching()
        self._notified = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _stop_watching(self) -> None:
        fd, loop = self._notify_fd, self._notify_loop
        self._notify_fd = self._notify_loop = None
        if fd is None:
            return
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(fd)
            except (RuntimeError, ValueError):  # (another thread's loop, or already gone)
                pass
        try:
            os.close(fd)
        except OSError:  # closed elsewhere already (EBADF): nothing left to release
            pass

    def no_file(self, keys: Iterable[str]) -> None:
        """The workers kept the answers of ``keys`` (``"<content>.<capture id>"``) for the RPC fetch: their step
        files could not be written (the folder was lost before the workers heard of this one; or ``/dev/shm`` full:
        a worker's :data:`NOFILE_PREFIX` marker, read by the scan), so none will come here. Takes waiting for them
        end now (None: the fetch goes by RPC; on their own loop, whatever thread calls this), later ones at once.
        Keys that cannot be this handover's (another content, an impossible capture id, not a string) are ignored; at
        most :data:`READY_MAX` are remembered."""
        for k in keys:
            content, _, cid = k.rpartition(".") if isinstance(k, str) else ("", "", "")
            if content not in self.contents or self.key(content, cid) != k:
                continue  # not a key of this handover (a worker's answer is not trusted to be one)
            # remembered first, then the waiting takes ended: a take registering its wait meanwhile (another
            # thread's loop) finds the key here when it checks again (take); forgotten by the RPC fetch
            # (fetched_by_rpc), a discard (drop), or the next take of the key
            self._by_rpc[k] = None
            while len(self._by_rpc) > READY_MAX:
                self._by_rpc.popitem(last=False)
            for f in self._waiting.pop(k, ()):
                _no_answer_threadsafe(f)

    def fetched_by_rpc(self, content: str, capture_id: str) -> None:
        """``capture_id``'s answer of ``content`` came by the RPC fetch: forget that it would (:meth:`no_file`) and
        remove the worker's :data:`NOFILE_PREFIX` marker for it if one is still in the folder."""
        k = self.key(content, capture_id)
        if k is None:
            return
        self._by_rpc.pop(k, None)
        _unlink(os.path.join(self.dir, NOFILE_PREFIX + k))

    def drop(self, content: str, capture_id: str) -> None:
        """Forget ``capture_id``'s answer (discarded request): now if it was read, else when its file comes."""
        k = self.key(content, capture_id)
        if k is None:
            return
        self._scan()
        if k in self._by_rpc:  # its answer was kept by the worker for RPC (the discard RPC drops it there): no file
            del self._by_rpc[k]  # will come
            return
        if self._ready.pop(k, None) is None:
            self._dropped[k] = None
            while len(self._dropped) > TOMBSTONES:
                self._dropped.popitem(last=False)

    def files(self) -> list[str]:
        """Keys (``"<content>.<capture id>"``) of the answers handed over and not yet taken or dropped, after
        reading every step file present and waiting for the reader thread's reads under way (tests, leak checks)."""
        import concurrent.futures

        self._scan(inline_all=True)
        concurrent.futures.wait(list(self._inflight))
        self._merge_done()
        return sorted(self._ready)

    def close(self) -> None:
        """Remove the folder and everything in it (engine shutdown), then release its lock. Takes still waiting
        get no answer (None: their fetch goes to the workers by RPC, which fails on a stopped engine); later takes
        do not wait. Each step is done even when an earlier one fails."""
        self._closed = True
        try:
            claimed, self._claimed = self._claimed, []
            for _, fd, _ in claimed:
                os.close(fd)
            if self._pool is not None:
                self._pool.shutdown(wait=False)  # a read under way finishes, closing its files; its answers go
            _rmtree(self.dir)
            self._ready.clear()
            self._read_done.clear()
            self._stop_watching()
        finally:
            waiting, self._waiting = self._waiting, {}
            for waiters in waiting.values():
                for f in waiters:
                    _no_answer_threadsafe(f)
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                os.close(fd)


#: inotify(7): IN_MOVED_TO (a name moved into the watched folder: a worker's step file renamed into place);
#: inotify_init1 flags IN_NONBLOCK | IN_CLOEXEC
_IN_MOVED_TO = 0x80
_IN_INIT_FLAGS = os.O_NONBLOCK | os.O_CLOEXEC


def _watch_renames(path: str) -> int | None:
    """A non-blocking inotify descriptor reporting names renamed into folder ``path``, or None where there is no
    inotify (not Linux, no libc symbol, the per-user instance limit reached): the handover is then polled."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fd = libc.inotify_init1(_IN_INIT_FLAGS)
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None
    if libc.inotify_add_watch(fd, os.fsencode(path), _IN_MOVED_TO) < 0:
        os.close(fd)
        return None
    return fd


def _read_claimed(n: str, fd: int, size: int) -> tuple[bool, Any]:
    """Read the claimed step file ``n`` (open at ``fd``, ``size`` bytes; closed here): ``(True, entries)``, or
    ``(False, why it is unreadable)``. Any thread; never raises."""
    try:
        return True, read_step_file(fd, size)
    except Exception as e:  # noqa: BLE001 - not msgpack, not this format, torn, unreadable: never out of a scan
        return False, f"handover file {n} unreadable ({size} bytes): {_exc_line(e)}"
    finally:
        os.close(fd)


def _read_all_claimed(claimed: Sequence[tuple[str, int, int]], sink: collections.deque[Any]) -> None:
    """:func:`_read_claimed` of each claimed file, in order, each result appended to ``sink`` as ``(name,
    result)`` as soon as it is read (the handover's reader thread). Every file is closed, whatever happens."""
    i = 0
    try:
        for i, (n, fd, size) in enumerate(claimed):  # noqa: B007 - i is read in finally
            sink.append((n, _read_claimed(n, fd, size)))
    finally:
        for _, fd, _ in claimed[i + 1:]:
            try:
                os.close(fd)
            except OSError:
                pass


def _remove_entry(path: str) -> None:
    """Remove ``path`` whatever it is: a directory (not a link to one) with its contents, anything else unlinked;
    errors are ignored (what cannot be removed is named again by the next scan)."""
    if os.path.isdir(path) and not os.path.islink(path):
        _rmtree(path)
    else:
        _unlink(path)


def _no_answer(fut: Any) -> None:
    if not fut.done():
        fut.set_result(None)


def _no_answer_threadsafe(fut: Any) -> None:
    """End a take's wait (:func:`_no_answer`) on its own loop, from whatever thread: a take may wait on another
    thread's loop than the caller's (``close``, ``no_file``)."""
    try:
        fut.get_loop().call_soon_threadsafe(_no_answer, fut)
    except RuntimeError:  # its loop is closed: nobody waits any more
        pass


#: handover folders being made (not yet locked and renamed to ``genartifact-<pid>-<random>``)
_STAGING_PREFIX = ".genartifact-new-"
#: a staging folder older than this (seconds) and not locked was left by a process killed while making it
_STAGING_STALE_S = 60.0


def _lock_dir(path: str) -> int | None:
    """An fd of folder ``path`` holding a non-blocking exclusive ``flock`` on it, or None when another open file
    description holds it (the folder's engine is alive: its driver, or a process forked from it that may still
    write). The kernel drops the lock when its last holder exits, kill -9 included, and the lock means the same
    in every pid namespace sharing the folder, unlike a pid. Raises OSError when the folder cannot be opened."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep_handover_dirs(root: str) -> list[str]:
    """Remove ``genartifact-<pid>-*`` handover folders under ``root`` that no live engine holds (left by a driver
    killed together with its engine); returns the removed paths. In use means locked (:func:`_lock_dir`: each
    :class:`Handover` holds an ``flock`` on its folder for its life), not "a process with that pid exists": a pid
    is reused, and a driver in another pid namespace sharing ``/dev/shm`` (containers with ``--ipc=host``) has
    a pid this process cannot see. Unlocked staging folders (``.genartifact-new-*``) older than
    :data:`_STAGING_STALE_S` go too; folders this user cannot open are left alone."""
    import time

    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for n in names:
        path = os.path.join(root, n)
        if n.startswith(_STAGING_PREFIX):
            try:
                if time.time() - os.lstat(path).st_mtime < _STAGING_STALE_S:
                    continue  # being made right now (not locked yet)
            except OSError:
                continue
        elif re.fullmatch(r"genartifact-\d+-\w+", n) is None:
            continue
        try:
            fd = _lock_dir(path)
        except OSError:
            continue  # not a folder, gone, or not ours
        if fd is None:
            continue  # held: its engine is alive
        try:
            _rmtree(path)
        finally:
            os.close(fd)
        removed.append(path)
    return removed


async def fetch_capture(engine: Any, content: str, capture_id: str, *args: Any) -> Any:
    """Fetch (and so hand over) ``capture_id``'s worker rows of ``content`` from whichever worker holds them.

    Out of band first: when ``engine.handover`` (:class:`Handover`) covers ``content``, the capturing worker has
    written the rows to a file when the request finished, read here without pausing the engine. Otherwise, or
    when no file came within :data:`HANDOVER_WAIT_S` seconds, ``engine.worker_call`` asks every worker of every
    data-parallel engine (``args`` go to the capture's ``pop``; they are unused by the out-of-band path, where
    the worker took them from the request's ``extra_args``). Returns the payload of the single
    ``{"found": ...}`` answer.

    :raises PluginFault: the content's worker plugin raised for this request (a step hook, a callback under
        :meth:`WorkerStep.guard`, ``pop`` or ``handover``): its receipt is ``internal_error``, as for a driver-side
        plugin fault (logged as ``plugin_fault`` with the worker's ranks).
    :raises CaptureError: no worker holds the id (naming the cause: a second fetch, a discard, an unreadable
        handover entry, no capturing worker, or answers from fewer engines than the engine has), or more than one
        worker holds it."""
    ho = getattr(engine, "handover", None)
    env = None
    if isinstance(ho, Handover) and content in ho.contents:
        env = await ho.take(content, capture_id)
        if env is None and ho.lost and not ho.renewing:
            await _renew_handover(engine, ho)
    if env is not None:
        answers: list[Any] = [env]
    else:
        answers = await engine.worker_call(f"{content}.fetch", capture_id, *args)
        if isinstance(ho, Handover) and content in ho.contents:
            ho.fetched_by_rpc(content, capture_id)
        if isinstance(ho, Handover) and any(isinstance(a, Mapping) and a.get("absent") == "handed_over"
                                            for a in answers):
            await ho.settle()  # a large step file being read in the reader thread
            env = ho.read(content, capture_id)  # written between the wait's deadline and the RPC
            if env is None and ho.unreadable:  # its step file could not be read
                raise CaptureError(f"{content}: capture {capture_id} was handed over, but no answer for it was read; "
                                   f"{len(ho.unreadable)} handover file(s) could not be read, the latest: "
                                   f"{ho.unreadable[-1]}")
            answers = [env] if env is not None else answers
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
            msg = f"{content}: worker capture failed on dp rank {a.get('dp_rank')}: {a.get('error')}"
            if a.get("fault"):  # the content's worker plugin raised (a hook, a guarded callback, pop, handover)
                err = str(a.get("error") or "")
                hook, _, rest = err.partition(": ")
                etype = rest.partition(": ")[0] if rest else ""
                who = f"{content} worker capture"
                log.warning("plugin_fault", plugin=who, method=hook, error=err, dp_rank=a.get("dp_rank"),
                            tp_rank=a.get("tp_rank"), content=content)
                raise PluginFault(msg, plugin=who, method=hook, error_type=etype)
            raise CaptureError(msg)
    for how in ("fetched", "discarded", "handed_over"):
        if any(a.get("absent") == how for a in absent):
            raise CaptureError(f"{content}: capture {capture_id} was already {how.replace('_', ' ')} on its "
                               "worker (rows are handed over once)")
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


async def _renew_handover(engine: Any, ho: Handover) -> None:
    """The engine's handover folder ``ho`` was lost (removed under the running engine): have the engine replace it
    (``engine.renew_handover()``, one RPC to the workers), once per lost folder; where the engine cannot, or the
    replacement fails, fetches stay on RPC (logged). Never raises but for cancellation."""
    ho.renewing = True
    renew = getattr(engine, "renew_handover", None)
    if renew is None:
        return
    try:
        await renew()
    except Exception as e:  # noqa: BLE001 - rows still go by RPC; only the out-of-band path is lost
        log.warning("capture_handover_renew_failed", error=_exc_line(e))


async def discard_capture(engine: Any, content: str, capture_id: str) -> None:
    """Drop ``capture_id``'s worker rows of ``content`` on every worker, and its handover file if one was
    written (idempotent; failed or cancelled request). An engine that cannot be asked (dead, shutting down) holds
    no rows to drop: logged, not raised — it is not the content plugin's fault (its discard would otherwise be
    reported as a ``plugin_fault``). Raises only ``asyncio.CancelledError``."""
    try:
        await engine.worker_call(f"{content}.discard", capture_id)
    except Exception as e:  # noqa: BLE001 - EngineDeadError and friends: nothing left on the workers to drop
        log.warning("capture_discard_unreachable", content=content, error_type=type(e).__name__,
                    error=_exc_text(e))
    finally:
        ho = getattr(engine, "handover", None)
        if isinstance(ho, Handover):
            ho.drop(content, capture_id)


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


__all__ = ["HANDOVER_POLL_MAX_S", "HANDOVER_POLL_S", "HANDOVER_WAIT_S", "QUALNAME", "RPC",
           "GenartifactWorkerExtension", "Handover", "WorkerCapture", "WorkerRuntime", "WorkerStep",
           "discard_capture", "fetch_capture", "init_config", "register_vllm_plugin", "sweep_handover_dirs", "track_flagged"]
