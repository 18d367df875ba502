"""vLLM adapter: start an ``AsyncLLM`` (or attach to one the caller built), initialise genartifact's worker
runtime in every worker of every data-parallel engine, convert vLLM outputs to engine-neutral
:class:`~genartifact.types.Delta` objects, and run one request with its artifact session.

vllm and torch are imported inside the functions that need them; still, import this module lazily (only
engine commands and engine tests do).
The ``AsyncLLM`` must be created from a ``if __name__ == "__main__":`` guarded entry point (vLLM spawns
its engine-core and worker processes).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import importlib.metadata as md
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from genartifact.engine.worker_ext import QUALNAME, RPC, Handover, init_config, step_end_mode
from genartifact.errors import EngineStartError, RequestSpecError
from genartifact.host import PluginHost
from genartifact.session import ArtifactSession, check_routes_start
from genartifact.spec import parse_request
from genartifact.types import Delta, ModelInfo

log = structlog.get_logger("genartifact.engine")

#: Engine defaults for the CPU build: fp32, eager mode, 1 GiB KV cache (set before engine start).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class RequestResult:
    """One request's outcome: token ids, the engine's per-token logprob dicts, and the artifact receipt."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    receipt: dict[str, Any] | None
    finish_reason: str | None
    retained_peak_bytes: int = 0
    admitted_bytes: int = 0
    #: vLLM's ``stop_reason``: the stop string or stop token id that ended the request (None: EOS or length)
    stop_reason: int | str | None = None


def _sample_logprobs(lps: Any, n: int) -> list[dict[int, float]] | None:
    """Per position ``{token_id: logprob}`` from vLLM's ``SampleLogprobs`` (list of dicts of ``Logprob``, or
    ``FlatLogprobs`` with parallel lists, whose column 0 per position is the sampled token)."""
    if lps is None:
        return None
    starts = getattr(lps, "start_indices", None)
    if starts is not None:  # FlatLogprobs: no per-position object creation in vLLM
        ends, tids, vals = lps.end_indices, lps.token_ids, lps.logprobs
        return [dict(zip(tids[starts[i] : ends[i]], vals[starts[i] : ends[i]], strict=True)) for i in range(n)]
    return [{int(k): float(v.logprob) for k, v in lps[i].items()} for i in range(n)]


class VllmEngine:
    """One vLLM ``AsyncLLM`` plus the genartifact plugin host.

    Either ``await VllmEngine(host, model, **engine_kwargs).start()`` (genartifact builds and owns the engine),
    or ``await VllmEngine.attach(host, llm)`` (the caller built the ``AsyncLLM``, e.g. an RL framework inside
    its Ray actor, with its own ``worker_extension_cls``; genartifact neither builds nor shuts it down).

    :param host: the plugin host (enabled content plugins adjust engine options and run in workers).
    :param model: local model directory.
    :param engine_kwargs: extra ``AsyncEngineArgs`` fields (e.g. ``max_num_batched_tokens``,
        ``data_parallel_size``, ``tensor_parallel_size``, ``distributed_executor_backend``).
    :param capture_handover: hand finished requests' worker rows over out of band
        (:class:`~genartifact.engine.worker_ext.Handover`: a file per request in a private ``/dev/shm`` folder)
        where the workers share the driver's machine; False: always fetch them by ``collective_rpc``.
    :param worker_step_end: where the capturing workers run their captures' ``end_step`` hooks: ``"deferred"``
        (after the step's output went back to the engine core, off its critical path:
        :meth:`~genartifact.engine.worker_ext.WorkerRuntime.settle`) or ``"inline"`` (before; the placement before
        issue 13's twelfth pass). Switched on a running engine by ``await engine.worker_call("step_end", mode)``.
    :raises ValueError: ``worker_step_end`` is neither (naming the allowed values).
    """

    def __init__(self, host: PluginHost, model: str | os.PathLike[str], capture_handover: bool = True,
                 worker_step_end: str = "deferred", **engine_kwargs: Any) -> None:
        self.worker_step_end = step_end_mode(worker_step_end, "worker_step_end")
        self.host = host
        self.model_dir = str(Path(model).resolve())
        self.engine_kwargs = engine_kwargs
        self.llm: Any = None
        self.model_info: ModelInfo | None = None
        self.tokenizer: Any = None
        #: each worker's answer to ``init`` (enabled plugins, captures, ranks), in RPC order
        self.workers: list[dict[str, Any]] = []
        #: content -> why its worker capture could not be installed at engine start (its requests fail at admission)
        self.capture_faults: dict[str, str] = {}
        self.data_parallel_size = 1
        self.start_seconds: float | None = None
        self._owns_llm = True
        self._skip_tokenizer = True
        self._pending: dict[str, list[tuple[tuple[Any, ...], asyncio.Future[list[Any]]]]] = {}
        self.capture_handover = capture_handover
        #: the out-of-band handover folder (None: fetch by RPC), see :meth:`set_handover`
        self.handover: Handover | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the engine was started on

    async def start(self) -> VllmEngine:
        """Build and start the engine (about 20-40 s on CPU), then initialise the workers.

        :raises EngineStartError: a worker reports a different set of enabled contents/probes than sent."""
        t0 = time.monotonic()
        for k, v in CPU_ENV.items():
            os.environ.setdefault(k, v)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        opts = cpu_mla_fallback(engine_options(self.host, self.model_dir, self.engine_kwargs))
        self._loop = asyncio.get_running_loop()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**opts))
        self._owns_llm = True
        try:
            await self._setup()
        except BaseException:
            self.shutdown()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    @classmethod
    async def attach(cls, host: PluginHost, llm: Any, tokenizer: Any = None,
                     capture_handover: bool = True) -> VllmEngine:
        """Wrap an ``AsyncLLM`` the caller built and started (verl-style: in-process, inside a Ray actor).

        The workers must carry genartifact's RPC method: true wherever genartifact is installed (the
        ``vllm.general_plugins`` entry point attaches it to every vLLM worker; the caller's own
        ``worker_extension_cls`` is untouched). Worker capture then starts with the ``init`` RPC sent here.
        ``moe_routes`` via worker capture needs the caller's engine built with ``enable_prefix_caching=False``
        (admission refuses otherwise, naming the option). :meth:`shutdown` does not stop a caller's engine.

        :param tokenizer: the model's tokenizer (default: loaded from the engine's model directory).
        :raises EngineStartError: the workers disagree with ``host`` on the enabled plugins."""
        eng = cls(host, llm.vllm_config.model_config.model, capture_handover=capture_handover)
        eng.llm, eng._owns_llm = llm, False
        eng.tokenizer = tokenizer
        await eng._setup()
        return eng

    async def _setup(self) -> None:
        vcfg = self.llm.vllm_config
        mc = vcfg.model_config
        hf = mc.hf_text_config.to_dict()
        import vllm

        self._skip_tokenizer = bool(getattr(mc, "skip_tokenizer_init", False))
        self.data_parallel_size = int(vcfg.parallel_config.data_parallel_size)
        captures = await self._init_workers()
        self.model_info = ModelInfo(
            name=Path(self.model_dir).name,
            hf_config=hf,
            engine_name="vllm",
            engine_version=vllm.__version__,
            engine_options={
                "enable_prefix_caching": bool(vcfg.cache_config.enable_prefix_caching),
                "worker_rpc": bool(self.workers),
                "worker_capture": bool(captures),
                "worker_captures": sorted(captures),
                "worker_capture_faults": dict(self.capture_faults),
                "native_routed_experts": bool(_native_routes_enabled(vcfg)),
                "logprobs_mode": str(getattr(mc, "logprobs_mode", "raw_logprobs")),
                "max_model_len": int(mc.max_model_len),
                "device": str(vcfg.device_config.device_type),
                "chunked_prefill": bool(vcfg.scheduler_config.enable_chunked_prefill),
                "tensor_parallel_size": int(vcfg.parallel_config.tensor_parallel_size),
                "data_parallel_size": self.data_parallel_size,
                "seed": mc.seed,
            },
            config_sha256=hashlib.sha256(json.dumps(hf, sort_keys=True, default=str).encode()).hexdigest(),
        )
        if self.tokenizer is None:
            self.tokenizer = _load_tokenizer(self.model_dir)
        log.info("engine_started", model=self.model_info.name, vllm=vllm.__version__, attached=not self._owns_llm,
                 **self.model_info.engine_options)

    async def _init_workers(self) -> set[str]:
        """Send ``init`` (enabled plugins + settings) to every worker of every engine; check the answers.
        Returns the set of contents that capture in workers (empty when no worker carries the RPC method)."""
        cfg = {**init_config(self.host), "step_end": self.worker_step_end}
        if self.capture_handover and self.handover is None:
            self.handover = Handover()
        if self.handover is not None:
            cfg["handover"] = self.handover.config()
        try:
            answers = await self._rpc(("init", cfg))
        except Exception as e:  # noqa: BLE001 - classified below
            if self.handover is not None:
                self.handover.close()
                self.handover = None
            if f"attribute '{RPC}'" not in str(e):  # the workers have the method; their init failed
                raise EngineStartError(f"genartifact worker init failed: {str(e)[-1500:]}") from e
            log.warning("worker_rpc_missing", detail="the engine's workers have no genartifact_call method: the "
                        "'genartifact' vllm.general_plugins entry point is not installed where the workers run, "
                        "and worker_extension_cls is not genartifact's; worker capture is off", error=str(e)[:300])
            self.workers = []
            return set()
        self.workers = [dict(a) for a in answers]
        want = {"contents": cfg["contents"], "probes": cfg["probes"]}
        for a in self.workers:
            if dict(a.get("enabled", {})) != want:
                raise EngineStartError(
                    f"worker rank {a.get('rank')} (data-parallel rank {a.get('dp_rank')}, tensor-parallel rank "
                    f"{a.get('tp_rank')}) enabled {a.get('enabled')}; the engine sent {want}: the worker's "
                    "installed plugins differ from the driver's (install the same genartifact distributions "
                    "on every node)")
        capturing = [a for a in self.workers if a.get("capturing")]
        # a content whose worker capture could not be installed on some worker (its plugin's hook raised or returned a
        # wrong object) is off on every worker: its requests fail at admission, the engine and the others run on
        self.capture_faults = {}
        for a in capturing:
            for name, msg in dict(a.get("init_faults") or {}).items():
                self.capture_faults.setdefault(str(name), str(msg)[:2000])
        if self.capture_faults:
            log.error("worker_capture_unavailable", contents=sorted(self.capture_faults),
                      detail="the worker capture of these contents failed at engine start (the log's plugin_fault "
                             "lines name the plugin); their requests fail at admission, the others run")
        sets = {tuple(c for c in a.get("captures", []) if c not in self.capture_faults) for a in capturing}
        if len(sets) > 1:
            raise EngineStartError(f"capturing workers installed different captures: "
                                   f"{[(a.get('dp_rank'), a.get('captures')) for a in capturing]}")
        dp_ranks = sorted(int(a.get("dp_rank", 0)) for a in capturing)
        if sets and dp_ranks != list(range(self.data_parallel_size)):
            raise EngineStartError(f"expected one capturing worker per data-parallel engine "
                                   f"(ranks 0..{self.data_parallel_size - 1}); got data-parallel ranks {dp_ranks}")
        self._use_handover(capturing)
        return set(next(iter(sets))) if sets else set()

    def _use_handover(self, capturing: list[dict[str, Any]]) -> None:
        """Out-of-band handover for the contents every capturing worker hands over (none: the folder goes)."""
        if self.handover is None:
            return
        lists = [set(a.get("handover") or ()) for a in capturing]
        self.handover.contents = set.intersection(*lists) if lists else set()
        if not self.handover.contents:
            self.handover.close()
            self.handover = None
        log.info("capture_handover", contents=sorted(self.handover.contents) if self.handover else [],
                 detail="finished requests' worker rows come out of band" if self.handover else
                 "worker rows are fetched by collective_rpc (workers cannot see the handover folder)")

    async def set_handover(self, enabled: bool) -> list[str]:
        """Switch out-of-band handover on or off on a running engine (benchmarks and tests of both paths).
        Call between requests: rows of requests in flight at the switch are still delivered (the fetch falls
        back to RPC when no file comes). Switched on while the folder is lost (:attr:`Handover.lost`), a new one
        replaces it (where none can be made, ``/dev/shm`` full: logged, fetches stay on RPC). When the RPC telling
        the workers fails, a changed handover is dropped and its folders closed (fetches go by RPC; a folder the
        workers never heard of would make each fetch wait for files that cannot come), and the error raised.
        Returns the contents now handed over out of band."""
        if self.llm is None:
            raise RuntimeError("engine is not running")
        old = self.handover
        if enabled and (old is None or old.lost):
            try:
                self.handover = Handover()
            except OSError as e:
                if old is None:
                    raise
                log.warning("capture_handover_renew_failed", error=f"{type(e).__name__}: {e}",
                            detail="worker rows are fetched by collective_rpc from now on")
                self.handover = None
        elif not enabled:
            self.handover = None
        new = self.handover
        try:
            answers = await self._rpc(("handover", new.config() if new else None))
        except BaseException:
            if new is not old:  # the workers were not told (a dying engine, or cancelled)
                self.handover = None
                for h in (new, old):
                    if h is not None:
                        h.close()
            raise
        if old is not None and old is not new:
            old.close()
        self._use_handover([dict(a) for a in answers if a.get("capturing")])
        if self.handover is not None:  # requests whose files went to the lost folder: fetched by RPC, no wait
            self.handover.no_file(k for a in answers if isinstance(a, Mapping) for k in a.get("unwritten") or ())
        return sorted(self.handover.contents) if self.handover else []

    async def renew_handover(self) -> list[str]:
        """Replace a handover folder that was lost under the running engine (:attr:`Handover.lost`: removed or
        replaced by someone else): :meth:`set_handover` on, which makes a new folder, tells the workers (one RPC)
        and closes the old one. Rows of requests finished meanwhile were kept by their workers for the RPC fetch
        (:attr:`WorkerRuntime.unwritten`), so nothing is lost either way. Returns the contents now handed over out
        of band."""
        old = self.handover
        if self.llm is None or old is None or not old.lost:
            return sorted(old.contents) if old is not None else []
        contents = await self.set_handover(True)
        log.info("capture_handover_renewed", dir=self.handover.dir if self.handover else None)
        return contents

    async def _rpc(self, args: tuple[Any, ...]) -> list[Any]:
        """``collective_rpc("genartifact_call", args)`` on the workers of *every* engine, answers flattened in
        engine then worker order. vLLM's data-parallel client answers ``collective_rpc`` with engine 0's
        workers only (``DPLBAsyncMPClient.call_utility_async``), so with several engines each is asked."""
        core = getattr(self.llm, "engine_core", None)
        engines = getattr(core, "core_engines", None) or ()
        if len(engines) > 1 and hasattr(core, "call_utility_all_async"):
            per_engine = await core.call_utility_all_async("collective_rpc", RPC, None, args, None)
            return [w for workers in per_engine for w in workers]
        return list(await self.llm.collective_rpc(RPC, args=args))

    async def worker_call(self, method: str, *args: Any) -> list[Any]:
        """Run the genartifact worker RPC ``method`` on every worker of every data-parallel engine; one result
        per worker (engine-major order).

        Calls made in the same event-loop turn for the same method are coalesced into one ``collective_rpc``
        (each RPC pauses the engine loop between steps, and finishing requests come in waves).
        Raises ``RuntimeError`` if the engine is not running."""
        if self.llm is None:
            raise RuntimeError("engine is not running")
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        queue = self._pending.setdefault(method, [])
        queue.append((args, fut))
        if len(queue) == 1:
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush(method)))
        return await fut

    async def _flush(self, method: str) -> None:
        batch = self._pending.pop(method, [])
        if not batch:
            return
        try:
            if len(batch) == 1:
                results = [await self._rpc((method, *batch[0][0]))]
            else:
                per_worker = await self._rpc(("batch", method, [list(a) for a, _ in batch]))
                results = [[w[i] for w in per_worker] for i in range(len(batch))]
        except BaseException as e:  # noqa: BLE001 - delivered to every waiter
            for _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, f), r in zip(batch, results, strict=True):
            if not f.done():
                f.set_result(r)

    def shutdown(self) -> None:
        """Stop the engine if this object built it (an attached caller's engine is left running). Requests still
        running on it end with vLLM's ``EngineDeadError`` (their receipts: ``engine_failed`` in the ``generate``
        job): vLLM's own shutdown cancels its output handler without failing their output queues, so a request
        waiting for its next output could otherwise wait forever (seen under a busy worker: issue 13's attacker).
        Callable from any thread."""
        try:
            if self.llm is not None:
                if self._owns_llm:
                    try:
                        self.llm.shutdown()
                    finally:
                        _fail_in_flight(self.llm, self._loop)
                self.llm = None
        finally:  # the handover folder goes even when vLLM's shutdown fails (e.g. after a worker died)
            if self.handover is not None:
                self.handover.close()
                self.handover = None

    async def stream(self, prompt_token_ids: list[int], sampling: Mapping[str, Any],
                     request_id: str | None = None, final_only: bool = False) -> AsyncIterator[tuple[Delta, Any]]:
        """Generate and yield ``(Delta, vllm CompletionOutput)``: one per engine step with
        ``RequestOutputKind.DELTA``, or a single delta holding everything with ``final_only=True``
        (``FINAL_ONLY``: no per-token output processing, for callers that do not stream)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = dict(sampling)
        if self._skip_tokenizer and not sampling.get("ignore_eos"):
            # the engine has no tokenizer: stop at EOS explicitly (vLLM would take it from the tokenizer)
            eos = self.tokenizer.eos_token_id
            if eos is not None:
                sampling["stop_token_ids"] = sorted({*sampling.get("stop_token_ids", []), int(eos)})
            sampling.setdefault("detokenize", False)
        kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
        params = SamplingParams(**sampling, output_kind=kind)
        rid = request_id or uuid.uuid4().hex
        outputs = self.llm.generate(engine_input(self.llm, prompt_token_ids), params, rid)
        try:
            async for out in outputs:
                c = out.outputs[0]
                ids = list(c.token_ids)
                yield Delta(
                    prompt_token_ids=out.prompt_token_ids or prompt_token_ids,
                    new_token_ids=ids,
                    new_logprobs=_sample_logprobs(c.logprobs, len(ids)),
                    routed_experts=getattr(c, "routed_experts", None),
                    finished=bool(out.finished),
                    finish_reason=c.finish_reason,
                    arrival_ns=time.monotonic_ns(),
                ), c
        finally:  # closed early (client gone): vLLM's generate aborts the request now, not when it is collected
            await outputs.aclose()

    def prepare(self, prompt_token_ids: list[int], sampling: Mapping[str, Any],
                artifact: Mapping[str, Any] | None, target_settings: Mapping[str, Mapping[str, Any]],
                routes_start: Any = 0, journal: Any = None) -> Prepared:
        """Validate and admit one request before the engine sees it.

        Raises :class:`~genartifact.errors.GenartifactError` (spec, plugin, target, admission) with a specific
        message; nothing has been sent to the engine then."""
        assert self.model_info is not None, "engine not started"
        sampling = dict(sampling)
        opts = self.model_info.engine_options
        vocab = int(self.model_info.hf_config.get("vocab_size", 0) or 0)
        if vocab and prompt_token_ids and (max(prompt_token_ids) >= vocab or min(prompt_token_ids) < 0):
            # the engine runs with skip_tokenizer_init, so vLLM does not check ids; an out-of-range id would
            # crash the worker (embedding lookup) and take the engine down for every request
            raise RequestSpecError(f"token id out of range in prompt; allowed: 0..{vocab - 1} (the model's vocabulary)")
        if sampling.get("seed") is not None and opts.get("device") == "cpu" and opts.get("chunked_prefill"):
            raise RequestSpecError(
                "seed: per-request seeds crash vLLM-CPU 0.32 under chunked prefill ('CPU Generator does not use "
                "offset'); drop the request's seed and set the engine seed instead (generate --seed)"
            )
        n = sampling.pop("n", 1)
        session = None
        if artifact is not None:
            req = parse_request(artifact, n=n)
            session = ArtifactSession.for_request(self.host, req, self.model_info, target_settings, journal)
            session.admit(len(prompt_token_ids), sampling.get("max_tokens", 16),
                          routes_start=routes_start, sampling=sampling)
            session.sampling_overrides(sampling)
        else:  # (with an artifact, its admission checks the start)
            check_routes_start(routes_start, len(prompt_token_ids))
            if n != 1:
                raise RequestSpecError(f"n={n!r} unsupported; allowed: 1")
        return Prepared(list(prompt_token_ids), sampling, session)

    async def execute(self, prep: Prepared, stream: bool = True,
                      request_id: str | None = None) -> AsyncIterator[tuple[Delta, str | None, Any] | RequestResult]:
        """Run a prepared request: yields ``(Delta, finish_reason, output)`` per engine output (``output``: vLLM's
        ``CompletionOutput`` of that step, for its text, stop_reason and logprob tokens), then one
        :class:`RequestResult` (with the receipt). Closing the generator early (client gone) aborts the request
        in vLLM and releases every capture (worker rows included); an upload already started finishes in the
        background (journaled)."""
        session, completion, finish, stop_reason = prep.session, [], None, None
        per_step = stream or (session is not None and session.per_step_deltas)  # a content may need every step
        # every delta to the session only when a content consumes deltas; else the completion once, at the end
        per_delta = session is not None and session.consumes_deltas
        last = None
        outputs = self.stream(prep.prompt_token_ids, prep.sampling, request_id, final_only=not per_step)
        try:
            async for delta, c in outputs:
                completion.extend(delta.new_token_ids)
                if per_delta:
                    session.record_or_fail(delta)
                last = delta
                finish = c.finish_reason or finish
                stop_reason = c.stop_reason if c.stop_reason is not None else stop_reason
                yield delta, finish, c
            receipt, peak, budget = None, 0, 0
            if session is not None:
                if not per_delta and last is not None:
                    session.record_or_fail(Delta(last.prompt_token_ids, completion, finished=last.finished,
                                                 finish_reason=last.finish_reason, arrival_ns=last.arrival_ns))
                receipt = await session.finalize(self)
                peak, budget = session.peak_retained, session.budget
            yield RequestResult(prep.prompt_token_ids, completion, None, receipt, finish, peak, budget, stop_reason)
        finally:
            # closed early: vLLM's abort first, so the request stops running before its captures are discarded
            # (a discard landing first leaves it running on for the discard's round trips)
            await outputs.aclose()
            if session is not None:
                await session.aclose(self)

    async def run(self, prompt_token_ids: list[int], sampling: Mapping[str, Any],
                  artifact: Mapping[str, Any] | None, target_settings: Mapping[str, Mapping[str, Any]],
                  routes_start: Any = 0, journal: Any = None, stream: bool = True) -> RequestResult:
        """Run one request to completion (:meth:`prepare` + :meth:`execute`); returns token ids, the engine's
        logprobs when the caller asked for them, and the receipt. Admission errors propagate before the
        engine does any work; artifact failures after admission give a failed receipt, never a failed
        generation."""
        user_logprobs = sampling.get("logprobs")
        prep = self.prepare(prompt_token_ids, sampling, artifact, target_settings, routes_start, journal)
        logprobs: list[dict[int, float]] = []
        result: RequestResult | None = None
        async for ev in self.execute(prep, stream=stream):
            if isinstance(ev, RequestResult):
                result = ev
            elif user_logprobs is not None and ev[0].new_logprobs is not None:
                logprobs.extend(ev[0].new_logprobs)
        assert result is not None
        result.logprobs = logprobs if user_logprobs is not None else None
        return result


def _fail_in_flight(llm: Any, loop: asyncio.AbstractEventLoop | None) -> None:
    """End every request still waiting for output from ``llm`` (an ``AsyncLLM`` just shut down) with vLLM's
    ``EngineDeadError``, through vLLM's own ``OutputProcessor.propagate_error`` (what its output handler does when
    the engine core dies), on ``loop``'s thread: the queues are asyncio objects. Best effort: a vLLM without those
    attributes is left as it is."""
    op = getattr(llm, "output_processor", None)
    if op is None or not getattr(op, "request_states", None) or not callable(getattr(op, "propagate_error", None)):
        return
    from vllm.v1.engine.exceptions import EngineDeadError

    def fail() -> None:
        try:
            op.propagate_error(EngineDeadError("the engine was shut down while the request was running"))
        except Exception as e:  # noqa: BLE001 - shutting down anyway
            log.warning("engine_shutdown_fail_requests_failed", error=f"{type(e).__name__}: {e}")

    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is None or running is loop or loop.is_closed():
        fail()
    else:
        loop.call_soon_threadsafe(fail)


def engine_input(llm: Any, prompt_token_ids: Sequence[int]) -> Any:
    """The prompt as vLLM's rendered ``TokensInput`` (``{"type": "token", "prompt_token_ids": [...], ...}``) for
    ``llm.generate``, made by the engine's own renderer (``Renderer.render_cmpl``: the same parsing, truncation and
    checks that ``AsyncLLM.add_request`` applies to a raw ``TokensPrompt``). A raw prompt is rendered inside
    ``add_request`` on vLLM's renderer thread pool, one thread hop per request (about 0.15-0.25 ms of driver CPU on
    this project's 2-core box, docs/benchmarks.md), and vLLM 0.32 deprecates raw prompts there; a rendered one is
    taken as is ("no blocking preprocessing needed", ``vllm/v1/engine/async_llm.py``). Token prompts need no
    tokenization, so rendering them here costs less than the hop. Falls back to the raw ``TokensPrompt`` where the
    engine has no renderer (another vLLM version, a stand-in)."""
    from vllm import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
    renderer = getattr(getattr(llm, "input_processor", None), "renderer", None)
    render = getattr(renderer, "render_cmpl", None)
    return prompt if render is None else render([prompt])[0]


def freeze_startup_heap() -> int:
    """Move every object the garbage collector tracks now into its permanent generation (``gc.freeze``), after a
    full collection, so that later collections never traverse the start-up heap; returns how many objects were
    frozen. Call it once, in a process genartifact owns (``genartifact serve``, ``genartifact generate``, a
    ``--replicas`` actor), after the engine started.

    Why: the driver process of a vLLM engine holds about 680,000 tracked objects after start-up with the tiny
    model (torch, vLLM, transformers, the tokenizer; more with a real checkpoint's). Python's oldest-generation
    collection walks all of them: 0.3-0.56 s with the tiny model, once in a few thousand requests
    (``docs/benchmarks.md``, issue 13, nineteenth pass), during which the event loop, every request's output
    handling and every delivery stand still. The same convention as vLLM's own server, engine core and GPU worker
    (``vllm/utils/gc_utils.py: freeze_gc_heap``, called once start-up is done). Not called by
    :meth:`VllmEngine.start` or :meth:`VllmEngine.attach`: in a process someone else owns (an RL framework's
    trainer) its heap is that owner's to manage. A process that goes on after the engine's shutdown should call
    ``gc.unfreeze()`` then (as vLLM's ``EngineCore.shutdown`` does): a frozen object is never collected, nor a
    reference cycle through it. The count is taken once here: ``gc.get_freeze_count()`` walks the frozen objects
    (~60 ms at 680,000)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def kill_engine_processes() -> int:
    """SIGKILL this process's multiprocessing children (vLLM's engine-core and worker processes) and reap them;
    returns how many there were. For a start-up interrupted by SIGINT/SIGTERM: the half-started engine holds no
    state worth a graceful stop, and vLLM's own teardown waits for processes busy loading the model."""
    import multiprocessing

    kids = multiprocessing.active_children()
    for p in kids:
        try:
            p.kill()
        except (OSError, ValueError):
            pass
    for p in kids:
        p.join(timeout=5)
    return len(kids)


@dataclass
class Prepared:
    """A validated, admitted request: final engine sampling kwargs and its artifact session (or None)."""

    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    session: ArtifactSession | None


DEFAULT_ENGINE_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 2048,
    "enable_prefix_caching": False,
    "disable_log_stats": True,
    # token-in/token-out: the adapter tokenizes prompts itself, so the engine skips per-token
    # detokenization (which dominates the front-end cost of logprobs on CPU)
    "skip_tokenizer_init": True,
}


def vllm_plugin_installed() -> bool:
    """True if vLLM will load genartifact's ``vllm.general_plugins`` entry point in its processes (installed,
    and not excluded by vLLM's ``VLLM_PLUGINS`` allow-list)."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "genartifact" not in [x.strip() for x in allowed.split(",")]:
        return False
    target = "genartifact.engine.worker_ext:register_vllm_plugin"
    return any(ep.value.replace(" ", "") == target for ep in md.entry_points(group="vllm.general_plugins"))


def engine_options(host: PluginHost, model_dir: str, overrides: Mapping[str, Any],
                   plugin_installed: bool | None = None) -> dict[str, Any]:
    """``AsyncEngineArgs`` kwargs: defaults, then ``overrides``, then each enabled content plugin's
    ``genartifact_engine_options`` in config order.

    Worker RPC reaches the workers through the ``vllm.general_plugins`` entry point when it is installed
    (``plugin_installed``, default: :func:`vllm_plugin_installed`), leaving ``worker_extension_cls`` to the user;
    otherwise genartifact's fallback extension class is set — unless the user set their own, in which case a
    warning says worker capture is off. Plugins learn whether worker capture will run (``worker_capture``), so
    e.g. prefix caching is only forced off when it will."""
    opts: dict[str, Any] = {"model": model_dir, **DEFAULT_ENGINE_OPTIONS, **overrides}
    if plugin_installed is None:
        plugin_installed = vllm_plugin_installed()
    user_ext = opts.get("worker_extension_cls")
    worker_capture = True
    if plugin_installed:
        pass  # the entry point attaches genartifact_call to every worker; the extension slot stays the user's
    elif user_ext and user_ext != QUALNAME:
        worker_capture = False
        log.warning("worker_extension_in_use", cls=user_ext,
                    detail="the 'genartifact' vllm.general_plugins entry point is not installed and vLLM allows one "
                           "worker extension; genartifact worker capture is off (moe_routes then needs "
                           "enable_return_routed_experts)")
    else:
        opts["worker_extension_cls"] = QUALNAME
    host.hooks.engine_options(options=opts, worker_capture=worker_capture)
    for key, wanted in overrides.items():  # a requested-but-overridden option is never silent
        if key in opts and opts[key] != wanted:
            log.warning("engine_option_overridden", option=key, requested=wanted, effective=opts[key],
                        detail=f"{key}={wanted!r} was changed to {opts[key]!r} by an enabled content plugin "
                               f"({', '.join(p.name for p in host.enabled['contents'])}) that cannot work with it")
    return opts


def cpu_mla_fallback(opts: dict[str, Any], amx: bool | None = None) -> dict[str, Any]:
    """Pick vLLM-CPU's reference MLA attention (``CPU_MLA``) for an fp32 MLA model on an AMX machine.

    vLLM-CPU 0.32 prefers its ``AMX_MLA`` backend whenever the CPU has AMX tiles
    (``vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls``), but that backend packs weights with
    ``convert_weight_packed``, which accepts only bf16/fp16/int8/fp8/uint8 — an fp32 DeepSeek-style model then
    fails at load ("expect weight to be bfloat16, float16, ..."). When the model config has ``kv_lora_rank``
    (MLA), ``dtype`` is fp32, the machine has AMX and the caller chose no attention backend, this sets
    ``attention_backend="CPU_MLA"`` and logs a warning naming the option and why. Anything the caller set is
    kept; nothing changes on a non-CPU platform. ``amx``: override the platform/hardware probe (tests). Returns ``opts`` (changed in place)."""
    if str(opts.get("dtype", "auto")).replace("torch.", "") not in ("float32", "float"):
        return opts
    if opts.get("attention_backend") or (opts.get("attention_config") or {}).get("backend"):
        return opts
    try:
        cfg = json.loads((Path(str(opts["model"])) / "config.json").read_text())
    except (OSError, KeyError, ValueError):
        return opts
    if not (cfg.get("kv_lora_rank") or (cfg.get("text_config") or {}).get("kv_lora_rank")):
        return opts
    if amx is None:
        import torch
        from vllm.platforms import current_platform

        amx = current_platform.is_cpu() and bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    if amx:
        opts["attention_backend"] = "CPU_MLA"
        log.warning("engine_option_set", option="attention_backend", value="CPU_MLA",
                    reason="vLLM-CPU's AMX_MLA backend cannot load fp32 weights; using the reference CPU MLA backend")
    return opts


def _native_routes_enabled(vcfg: Any) -> bool:
    aux = getattr(vcfg, "aux_output_config", None)
    if aux is not None and getattr(aux, "enable_return_routed_experts", False):
        return True
    return bool(getattr(vcfg.model_config, "enable_return_routed_experts", False))


def _load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
