"""``genartifact serve``: an OpenAI-compatible and token-in/token-out HTTP server on vLLM's async engine whose
requests may ask for generation artifacts and whose responses carry receipts.

Extension field (request and response): ``generation_artifact``. In a request it holds an artifact request
spec (``docs/receipts.md``); OpenAI clients send it with ``extra_body={"generation_artifact": {...}}``. In a
response it holds the receipt; when streaming, on the final chunk only. A request without it is plain serving.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (stream and non-stream), ``POST /generate``
(token ids in, token ids + per-token logprobs out), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
Admission happens before the engine sees a request: a malformed or over-budget artifact request gets a 4xx JSON
error naming the field; the engine does no work for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, generate_latest

from genartifact import config as config_mod
from genartifact.engine.tiny_model import CHAT_TEMPLATE
from genartifact.engine.vllm_adapter import RequestResult, VllmEngine, freeze_startup_heap
from genartifact.errors import GenartifactError, PluginFault, RequestSpecError
from genartifact.limits import pipeline_concurrency, small_pipeline_concurrency

log = structlog.get_logger("genartifact.serve")
EXT = "generation_artifact"
MAX_LOGPROBS = 20
MAX_BODY_BYTES = 8 << 20  # 8 MiB: far above any prompt a max_model_len engine accepts
CHARS_PER_TOKEN_CAP = 32  # a prompt string longer than max_model_len x this cannot fit: refuse before tokenizing
MAX_N = 16  # choices per request (each its own engine request, artifact and receipt)
MAX_STOP = 64  # stop strings / stop token ids per request
VLLM_PARAMS = {"stop", "stop_token_ids", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "skip_special_tokens", "include_stop_str_in_output"}  # passed to vLLM's SamplingParams as is
COMMON_KEYS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream", "ignore_eos",
               EXT, "routed_experts_prompt_start", "user", "stream_options"} | VLLM_PARAMS
ENDPOINT_KEYS = {"completions": COMMON_KEYS | {"prompt", "logprobs"},
                 "chat": COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"},
                 "generate": {"token_ids", "sampling_params", EXT, "routed_experts_prompt_start"}}
SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "n", "ignore_eos", "logprobs",
                 "routed_experts_prompt_start", "stop_token_ids", "min_tokens", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"}
PARAMS = sorted({*COMMON_KEYS, "prompt", "messages", "token_ids", "sampling_params", "top_logprobs",
                 "max_completion_tokens"} - {"n"}, key=len, reverse=True)


class _ClientGone(Exception):
    """The client hung up before its request body arrived in full."""


class BodyTooLarge(GenartifactError):
    """The request body exceeds :data:`MAX_BODY_BYTES` (HTTP 413)."""


class Metrics:
    """Prometheus metrics of one server (own registry: several servers may share a process in tests)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("genartifact_requests", "Requests by outcome (admitted, rejected) and reason",
                                ["outcome", "reason"], registry=r)
        self.engine_requests = Counter("genartifact_engine_requests", "Requests handed to the engine", registry=r)
        self.artifacts = Counter("genartifact_artifacts", "Artifacts by state and error code", ["state", "error_code"],
                                 registry=r)
        self.bytes = Counter("genartifact_artifact_bytes", "Bytes of delivered artifacts", registry=r)
        self.finalize = Histogram("genartifact_finalize_seconds", "Collect + encode + deliver latency (seconds)",
                                  registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                       2.5, 5, 10, 30))
        self.slots = Gauge("genartifact_pipeline_slots_in_use", "Encode+deliver slots in use", registry=r)
        self.slots_peak = Gauge("genartifact_pipeline_slots_in_use_peak", "Peak encode+deliver slots in use",
                                registry=r)
        self.inflight = Gauge("genartifact_inflight_requests", "Requests being served", registry=r)
        # the process's garbage collections (prometheus_client's standard python_gc_* counters, by generation) and
        # how many start-up objects were frozen out of them (freeze_startup_heap: a full collection of an unfrozen
        # driver heap stalls every request for 0.3-0.6 s). Set once: gc.get_freeze_count() walks the frozen
        # objects (~60 ms at 680k), far too slow for a scrape on the event loop
        GCCollector(registry=r)
        self.frozen = Gauge("genartifact_gc_frozen_objects", "Objects frozen out of garbage collection when the "
                            "engine had started (0: not frozen)", registry=r)


def _error(status: int, message: str, param: str | None = None, code: str = "invalid_request") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": "invalid_request_error",
                                                               "param": param, "code": code}})


def _field(msg: str) -> str | None:
    """The request parameter an error message is about (for the OpenAI error's ``param``)."""
    if re.match(r"n=", msg):
        return "n"
    for name in PARAMS:
        if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", msg):
            return name
    if re.search(r"generation artifacts|object_key|profile|target|content|max_bytes|decoded artifact", msg):
        return EXT
    return None


def _num(body: Mapping[str, Any], key: str, default: Any, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi
    if integer:
        ok = ok and isinstance(v, int)
    if not ok:
        kind = "an integer" if integer else "a number"
        fmt = (lambda x: str(int(x))) if integer else (lambda x: f"{x}")
        raise RequestSpecError(f"{key}={v!r} invalid; allowed: {kind} in {fmt(lo)}..{fmt(hi)}")
    return v


def _check_keys(body: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise RequestSpecError(f"unsupported parameter(s) {extra} in {where}; supported: {sorted(allowed)}")


class Server:
    """Wires HTTP requests to one :class:`VllmEngine` and the artifact sessions."""

    def __init__(self, engine: VllmEngine, cfg: config_mod.Config, model_name: str, drain_s: float = 30.0) -> None:
        self.engine = engine
        self.cfg = cfg
        self.model_name = model_name
        self.settings = cfg.target_settings()
        self.journal = cfg.journal()
        self.metrics = Metrics()
        self.drain_s = drain_s
        #: encode+deliver slots of both pipeline lanes (PluginHost.pipeline: large and small artifacts)
        self.capacity = pipeline_concurrency() + small_pipeline_concurrency()
        tok = engine.tokenizer
        self.chat_template = getattr(tok, "chat_template", None) or CHAT_TEMPLATE
        mc = getattr(getattr(engine.llm, "vllm_config", None), "model_config", None)
        #: the engine detokenizes (text, stop strings and logprob tokens come from vLLM, as in ``vllm serve``)
        self.detok = mc is not None and not getattr(mc, "skip_tokenizer_init", True)

    # ---------------------------------------------------------------- request parsing
    def sampling(self, body: Mapping[str, Any], kind: str) -> tuple[dict[str, Any], int, int | None]:
        """Engine sampling kwargs, the number of choices ``n`` and the response's logprobs count (None: the
        response carries no logprobs) of one request, with vLLM's semantics for every parameter (``stop``,
        ``stop_token_ids``, ``min_tokens``, the penalties, ``skip_special_tokens``,
        ``include_stop_str_in_output``: vLLM's ``SamplingParams`` fields; completions ``logprobs`` = top-k;
        chat ``logprobs``/``top_logprobs``). Raises :class:`RequestSpecError` naming the field; the final values
        are checked by vLLM's own ``SamplingParams`` validation."""
        max_len = self.max_model_len()
        s: dict[str, Any] = {
            "max_tokens": _num(body, "max_tokens", 16, 1, max_len, integer=True),
            "temperature": _num(body, "temperature", 1.0, 0.0, 100.0),
            "top_p": _num(body, "top_p", 1.0, 1e-9, 1.0),
        }
        if body.get("top_k") is not None:
            s["top_k"] = _num(body, "top_k", -1, -1, 1 << 20, integer=True)
        if body.get("seed") is not None:
            s["seed"] = _num(body, "seed", 0, 0, 2**63 - 1, integer=True)
        lp = body.get("logprobs")
        if kind == "chat":  # OpenAI chat: logprobs is a bool, top_logprobs the count (vLLM: top_logprobs or 0)
            if lp is not None and not isinstance(lp, bool):
                raise RequestSpecError(f"logprobs={lp!r} invalid; allowed: true or false (top_logprobs gives the count)")
            top = body.get("top_logprobs")
            if top is not None:
                top = _num(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
                if not lp:
                    raise RequestSpecError("top_logprobs requires logprobs=true (as in vLLM and OpenAI)")
            user_lp = (top or 0) if lp else None
        elif kind == "completions":
            user_lp = None if lp is None else _num(body, "logprobs", 0, 0, MAX_LOGPROBS, integer=True)
        else:  # /generate: the sampled token's logprob always
            user_lp = 0 if lp is None else _num(body, "logprobs", 0, 0, MAX_LOGPROBS, integer=True)
        if user_lp is not None:
            s["logprobs"] = user_lp
        ext = body.get(EXT)  # a top_logprobs artifact stores the same k (the OpenAI fields feed it too)
        if (kind != "generate" and user_lp is not None and user_lp < 1 and isinstance(ext, Mapping)
                and isinstance(ext.get("contents"), list) and "top_logprobs" in ext["contents"]):
            raise RequestSpecError(f"top_logprobs must be an integer 1..{MAX_LOGPROBS} for a top_logprobs artifact")
        for key in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if body.get(key) is not None:  # vLLM's extension parameters of the same names
                if not isinstance(body[key], bool):
                    raise RequestSpecError(f"{key}={body[key]!r} invalid; allowed: true or false")
                s[key] = body[key]
        for key, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                            ("repetition_penalty", 1e-9, 100.0)):
            if body.get(key) is not None:
                s[key] = _num(body, key, 0.0, lo, hi)
        if body.get("min_tokens") is not None:
            s["min_tokens"] = _num(body, "min_tokens", 0, 0, s["max_tokens"], integer=True)
        stop = body.get("stop")
        if stop is not None:
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(x, str) and x for x in stop):
                raise RequestSpecError(f"stop invalid; allowed: a non-empty string or a list of at most {MAX_STOP}")
            if stop:
                s["stop"] = stop
        ids = body.get("stop_token_ids")
        if ids is not None:
            vocab = int(self.engine.model_info.hf_config.get("vocab_size", 0) or 0)  # type: ignore[union-attr]
            if not isinstance(ids, list) or len(ids) > MAX_STOP or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (vocab or 2**31) for t in ids):
                raise RequestSpecError(f"stop_token_ids invalid; allowed: a list of at most {MAX_STOP} token ids "
                                       f"0..{(vocab or 2**31) - 1}")
            if ids:
                s["stop_token_ids"] = list(ids)
        n = body.get("n", 1)
        n = 1 if n is None else n
        top_n = MAX_N if kind != "generate" else 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= top_n:
            raise RequestSpecError(f"n={n!r} unsupported; allowed: an integer 1..{top_n}")
        self.vllm_check({**s, "n": n})  # vLLM's rules, e.g. "n must be 1 when using greedy sampling"
        return s, n, user_lp

    def vllm_check(self, sampling: Mapping[str, Any]) -> None:
        """vLLM's own ``SamplingParams`` validation of the final kwargs, before any engine work; raises
        :class:`RequestSpecError` with vLLM's message (e.g. ``min_tokens`` above ``max_tokens``, stop strings
        on an engine without detokenizer)."""
        from vllm import SamplingParams

        kw = {k: v for k, v in sampling.items() if k != "routed_experts_prompt_start"}
        if not self.detok:
            kw["detokenize"] = False
        try:
            SamplingParams(**kw)
        except Exception as e:  # noqa: BLE001 - ValueError, TypeError or vLLM's VLLMValidationError: all refusals
            raise RequestSpecError(str(e)[:500]) from None

    def max_model_len(self) -> int:
        """The engine's context length in tokens (as vLLM's ``/v1/models`` reports it)."""
        return int(self.engine.model_info.engine_options.get("max_model_len", 2048))  # type: ignore[union-attr]

    def tokenize_check(self, text: str, what: str) -> None:
        max_len = int(self.engine.model_info.engine_options.get("max_model_len", 2048))  # type: ignore[union-attr]
        if len(text) > max_len * CHARS_PER_TOKEN_CAP:
            raise RequestSpecError(f"{what} has {len(text)} characters; it cannot fit max_model_len={max_len} tokens")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestSpecError(f"{what} is not valid Unicode (lone surrogate)") from None

    def prepare_choices(self, ids: list[int], sampling: dict[str, Any], body: Mapping[str, Any], n: int) -> list[Any]:
        """One prepared (validated, admitted) engine request per choice. With ``n > 1`` each choice is its own
        engine request (as vLLM's parallel sampling: a per-request ``seed`` becomes ``seed + index``) with its
        own artifact: the target is ``delivery.target[index]`` when ``target`` is a list of ``n`` targets, else
        ``object_key`` must contain ``{choice}``. All choices are admitted before any engine work; on a refusal
        the admitted ones are released (nothing left behind). Raises :class:`GenartifactError`."""
        artifact = body.get(EXT)
        preps: list[Any] = []
        try:
            for i in range(n):
                s = dict(sampling)
                if n > 1 and s.get("seed") is not None:
                    s["seed"] = (s["seed"] + i) % 2**63
                spec = _choice_spec(artifact, i, n)
                preps.append(self.prepare(ids, s, {**body, EXT: spec} if spec is not None else body))
            seen: dict[tuple[str, str], int] = {}
            for i, p in enumerate(preps):  # two choices on one object: the second could only fail object_exists
                v = getattr(p.session, "_validated", None) if p.session is not None else None
                if v is None:
                    continue
                j = seen.setdefault((v.kind, v.object_id), i)
                if j != i:
                    raise RequestSpecError(f"generation_artifact.delivery.target: choices {j} and {i} name the same "
                                           f"object; allowed: a different object per choice")
        except BaseException:
            for p in preps:
                if p.session is not None:
                    p.session.release()
            raise
        return preps

    def prepare(self, ids: list[int], sampling: dict[str, Any], body: Mapping[str, Any]) -> Any:
        max_len = int(self.engine.model_info.engine_options.get("max_model_len", 2048))  # type: ignore[union-attr]
        if len(ids) >= max_len:
            raise RequestSpecError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}")
        if not ids:
            raise RequestSpecError("prompt is empty")
        artifact = body.get(EXT)
        if artifact is not None and not isinstance(artifact, dict):
            raise RequestSpecError(f"{EXT} must be a JSON object (the artifact request spec)")
        return self.engine.prepare(ids, sampling, artifact, self.settings,
                                   routes_start=body.get("routed_experts_prompt_start", 0), journal=self.journal)

    # ---------------------------------------------------------------- running
    async def events(self, prep: Any, stream: bool) -> AsyncIterator[Any]:
        self.metrics.engine_requests.inc()
        self.metrics.inflight.inc()
        t_final = None
        try:
            async for ev in self.engine.execute(prep, stream=stream):
                if isinstance(ev, RequestResult):
                    if t_final is not None:
                        self.metrics.finalize.observe(time.perf_counter() - t_final)
                    self._count_receipt(ev.receipt)
                elif ev[0].finished and prep.session is not None:
                    t_final = time.perf_counter()
                self._sample_slots()
                yield ev
        finally:
            self.metrics.inflight.dec()
            self._sample_slots()

    def _free_slots(self) -> int:
        host = self.engine.host
        return host.pipeline()._value + host.pipeline(small=True)._value

    def _sample_slots(self) -> None:
        used = self.capacity - self._free_slots()
        self.metrics.slots.set(used)
        if used > self.metrics.slots_peak._value.get():
            self.metrics.slots_peak.set(used)

    def _count_receipt(self, receipt: Mapping[str, Any] | None) -> None:
        if receipt is None:
            return
        self.metrics.artifacts.labels(receipt["state"], receipt.get("error_code", "")).inc()
        if receipt["state"] == "ready":
            self.metrics.bytes.inc(receipt["byte_count"])

    def text(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int, decoded: str | None) -> str:
        """A logprob entry's token text: vLLM's detokenized token, else ``tokenizer.decode([id])`` (as vLLM's
        ``_get_decoded_token``)."""
        return decoded if decoded is not None else self.engine.tokenizer.decode([token_id])

    def completion_logprobs(self, ids: list[int], steps: list[Any], k: int, offset: int) -> dict[str, Any]:
        """OpenAI completions ``logprobs`` (``text_offset``, ``token_logprobs``, ``tokens``, ``top_logprobs``)
        built as vLLM's ``OpenAIServingCompletion._create_completion_logprobs``: per position the sampled
        token and up to ``k + 1`` entries of vLLM's logprob dict (sampled first), logprobs floored at -9999."""
        text_offset: list[int] = []
        token_logprobs: list[float | None] = []
        tokens: list[str] = []
        tops: list[dict[str, float] | None] = []
        last = 0
        for tid, step in zip(ids, steps, strict=True):
            if step is None:
                tok = self.token(tid, None)
                token_logprobs.append(None)
                tops.append(None)
            else:
                d = step[tid]
                tok = self.token(tid, d.decoded_token)
                token_logprobs.append(max(d.logprob, -9999.0))
                tops.append({self.token(t, x.decoded_token): max(x.logprob, -9999.0)
                             for j, (t, x) in enumerate(step.items()) if k >= j})
            tokens.append(tok)
            text_offset.append(offset if not text_offset else text_offset[-1] + last)
            last = len(tok)
        return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}

    def chat_logprobs(self, ids: list[int], steps: list[Any], k: int) -> list[dict[str, Any]]:
        """OpenAI chat ``logprobs.content`` entries built as vLLM's ``_create_chat_logprobs``: ``token``,
        ``logprob`` (floored at -9999), ``bytes`` (UTF-8 of the token), ``top_logprobs`` (the first ``k`` entries
        of vLLM's logprob dict)."""
        out = []
        for tid, step in zip(ids, steps, strict=True):
            if step is None or step.get(tid) is None:
                tok = self.token(tid, None)
                out.append({"token": tok, "logprob": -9999.0, "bytes": list(tok.encode("utf-8", errors="replace")),
                            "top_logprobs": []})
                continue
            d = step[tid]
            tops = []
            for j, (t, x) in enumerate(step.items()):
                if j >= k:
                    break
                tt = self.token(t, x.decoded_token)
                tops.append({"token": tt, "logprob": max(x.logprob, -9999.0),
                             "bytes": list(tt.encode("utf-8", errors="replace"))})
            out.append({"token": self.token(tid, d.decoded_token), "logprob": max(d.logprob, -9999.0),
                        "bytes": None if d.decoded_token is None else list(d.decoded_token.encode("utf-8", errors="replace")),
                        "top_logprobs": tops})
        return out

    async def drain(self) -> int:
        """Wait up to ``drain_s`` for started deliveries; returns how many were still running (abandoned)."""
        deadline = time.monotonic() + self.drain_s
        while self._free_slots() < self.capacity and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.capacity - self._free_slots()


def create_app(engine_factory: Any, cfg: config_mod.Config, model_name: str, drain_s: float = 30.0,
               freeze_heap: bool = False) -> FastAPI:
    """The ASGI app. ``engine_factory()`` returns a started :class:`VllmEngine` (awaitable). ``freeze_heap``: this
    process is the server's own (``genartifact serve``): once the engine started, freeze its start-up heap
    (:func:`~genartifact.engine.vllm_adapter.freeze_startup_heap`: no full-heap GC pauses while serving; the
    count is in ``genartifact_gc_frozen_objects``), and unfreeze it after the engine's shutdown."""
    state: dict[str, Server] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await engine_factory()
        srv = state["s"] = Server(engine, cfg, model_name, drain_s)
        frozen = 0
        if freeze_heap:
            frozen = freeze_startup_heap()
            log.info("serve_heap_frozen", objects=frozen)
        srv.metrics.frozen.set(frozen)
        log.info("serve_ready", model=model_name)
        try:
            yield
        finally:
            abandoned = await srv.drain()
            log.info("serve_shutdown", abandoned_deliveries=abandoned,
                     journal=str(cfg.journal_path) if cfg.journal_path else None)
            engine.shutdown()
            if frozen:  # as vLLM's EngineCore.shutdown: what start-up made is collectable again
                gc.unfreeze()

    app = FastAPI(title="genartifact", lifespan=lifespan)

    async def body_of(request: Request) -> dict[str, Any]:
        from starlette.requests import ClientDisconnect

        raw = bytearray()
        try:
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > MAX_BODY_BYTES:
                    raise BodyTooLarge(f"request body is larger than {MAX_BODY_BYTES} bytes")
        except ClientDisconnect:  # hung up mid-body: nothing to answer (was an ASGI traceback per request)
            raise _ClientGone() from None
        try:
            body = json.loads(bytes(raw), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except (ValueError, RecursionError):
            raise RequestSpecError("request body is not valid JSON (or nested too deeply)") from None
        if not isinstance(body, dict):
            raise RequestSpecError("request body must be a JSON object")
        return body

    def reject(srv: Server, e: Exception) -> JSONResponse:
        reason = type(e).__name__
        srv.metrics.requests.labels("rejected", reason).inc()
        msg = str(e)
        if isinstance(e, PluginFault):  # a plugin bug, not the client's: 500, details only in the server log
            return _error(500, "generation artifact failed: a plugin raised an internal error (see the server log)",
                          None, "internal_error")
        return _error(413 if isinstance(e, BodyTooLarge) else 400, msg, _field(msg))

    @app.get("/health")
    async def health() -> Any:
        llm = state["s"].engine.llm
        if llm is None or getattr(llm, "errored", False):
            return JSONResponse(status_code=503, content={"status": "engine_dead"})
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "genartifact",
                                           "root": model_name, "parent": None,
                                           "max_model_len": state["s"].max_model_len()}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        srv = state["s"]
        srv._sample_slots()
        return PlainTextResponse(generate_latest(srv.metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    async def handle(request: Request, kind: str) -> Any:
        srv = state["s"]
        try:
            body = await body_of(request)
            _check_keys(body, ENDPOINT_KEYS[kind], f"the {kind} request")
            stream = body.get("stream")
            stream = False if stream is None else stream
            if not isinstance(stream, bool):
                raise RequestSpecError(f"stream={stream!r} invalid; allowed: true or false")
            if kind == "completions":
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    srv.tokenize_check(prompt, "prompt")
                    ids = (await asyncio.to_thread(srv.engine.tokenizer, prompt))["input_ids"]
                elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                                 and t >= 0 for t in prompt):
                    ids = list(prompt)
                else:
                    raise RequestSpecError("prompt must be a string or a list of token ids (one prompt per request)")
                sampling, n, user_lp = srv.sampling(body, kind)
            elif kind == "chat":
                msgs = body.get("messages")
                if not isinstance(msgs, list) or not msgs or not all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in msgs):
                    raise RequestSpecError("messages must be a non-empty list of {role, content} strings")
                for m in msgs:
                    srv.tokenize_check(m["content"], "messages content")
                ids = await asyncio.to_thread(
                    srv.engine.tokenizer.apply_chat_template,
                    [{"role": m["role"], "content": m["content"]} for m in msgs], chat_template=srv.chat_template,
                    add_generation_prompt=True, tokenize=True, return_dict=False)
                if isinstance(ids, dict):
                    ids = ids["input_ids"]
                if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
                    body["max_tokens"] = body["max_completion_tokens"]
                sampling, n, user_lp = srv.sampling(body, kind)
            else:  # generate: token ids in/out
                ids = body.get("token_ids")
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                        for t in ids):
                    raise RequestSpecError("token_ids must be a list of non-negative integers")
                sp = body.get("sampling_params", {})
                if not isinstance(sp, dict):
                    raise RequestSpecError("sampling_params must be an object")
                _check_keys(sp, SAMPLING_KEYS, "sampling_params")
                sampling, n, user_lp = srv.sampling(sp, kind)
                sampling["detokenize"] = False  # token ids out: no text to build
                if "routed_experts_prompt_start" in sp and "routed_experts_prompt_start" not in body:
                    body["routed_experts_prompt_start"] = sp["routed_experts_prompt_start"]
            opts = body.get("stream_options")
            if opts is not None:
                if not stream:  # vLLM answers 400 here too
                    raise RequestSpecError("stream_options can only be defined when stream=true")
                if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"} or not all(
                        isinstance(v, bool) or v is None for v in opts.values()):
                    raise RequestSpecError("stream_options invalid; allowed: an object with booleans include_usage "
                                           "and continuous_usage_stats")
            preps = srv.prepare_choices(ids, sampling, body, n)
        except _ClientGone:
            srv.metrics.requests.labels("rejected", "client_disconnected").inc()
            return Response(status_code=499)  # (nobody reads it: the client is gone)
        except GenartifactError as e:
            return reject(srv, e)
        srv.metrics.requests.labels("admitted", "").inc()
        rid = f"{'cmpl' if kind != 'chat' else 'chatcmpl'}-{uuid.uuid4().hex}"
        if stream and kind != "generate":
            return StreamingResponse(sse(srv, preps, kind, rid, len(ids), user_lp, opts or {}),
                                     media_type="text/event-stream")
        return await until_disconnect(request, respond(srv, preps, kind, rid, len(ids), user_lp))

    async def until_disconnect(request: Request, work: Any) -> Any:
        """Run a non-streaming request while watching its connection: a client that hangs up aborts it with
        the streaming rules (still generating: aborted in vLLM, captures released, nothing stored; upload
        already started: finishes in the background, journaled). Returns the response, or None (nobody to
        send it to)."""
        task = asyncio.ensure_future(work)

        async def hangup() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(hangup())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        state["s"].metrics.requests.labels("client_disconnected", "").inc()
        return None

    def choice_body(srv: Server, kind: str, i: int, st: _Choice, user_lp: int | None, text: str, ids: list[int],
                    steps: list[Any], finish: str | None, stop_reason: Any, stream: bool) -> dict[str, Any]:
        """One choice (or streamed choice delta) in vLLM's OpenAI shape."""
        lp: Any = None
        if user_lp is not None and kind == "completions":
            lp = srv.completion_logprobs(ids, steps, user_lp, st.offset)
            if lp["tokens"]:
                st.offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        elif user_lp is not None:
            lp = {"content": srv.chat_logprobs(ids, steps, user_lp)}
        if kind == "chat":
            if stream:
                delta: dict[str, Any] = {"role": "assistant", "content": text} if st.first else {}
                if text and not st.first:
                    delta["content"] = text
                st.first = False
                return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}
            return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                    "finish_reason": finish, "stop_reason": stop_reason}
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}

    async def respond(srv: Server, preps: list[Any], kind: str, rid: str, n_prompt: int, user_lp: int | None) -> Any:
        skip = preps[0].sampling.get("skip_special_tokens", True)

        async def one(prep: Any) -> tuple[RequestResult, str, list[Any]]:
            result, text, steps = None, "", []
            async for ev in srv.events(prep, stream=False):
                if isinstance(ev, RequestResult):
                    result = ev
                else:
                    delta, _, c = ev
                    text += c.text or ""
                    if c.logprobs is not None:
                        steps.extend(c.logprobs[j] for j in range(len(delta.new_token_ids)))
                    elif user_lp is not None:
                        steps.extend([None] * len(delta.new_token_ids))
            assert result is not None
            if not srv.detok:
                text = srv.text(result.completion_token_ids, skip)
            return result, text, steps

        done = await asyncio.gather(*(one(p) for p in preps))
        n_completion = sum(len(r.completion_token_ids) for r, _, _ in done)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
        out: dict[str, Any]
        if kind == "generate":
            result, _, steps = done[0]
            ids = result.completion_token_ids
            lps = [_json_float(step[t].logprob) if step is not None and t in step else None
                   for t, step in zip(ids, steps, strict=True)]
            out = {"token_ids": ids, "logprobs": lps, "finish_reason": result.finish_reason,
                   "prompt_token_count": n_prompt}
            if result.receipt is not None:
                out[EXT] = result.receipt
            return JSONResponse(out)
        choices = []
        for i, (result, text, steps) in enumerate(done):
            ch = choice_body(srv, kind, i, _Choice(), user_lp, text, result.completion_token_ids, steps,
                             result.finish_reason, result.stop_reason, stream=False)
            if result.receipt is not None:
                ch[EXT] = result.receipt  # each choice its own artifact and receipt
            choices.append(ch)
        out = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
               "created": int(time.time()), "model": srv.model_name, "choices": choices, "usage": usage}
        if len(done) == 1 and done[0][0].receipt is not None:
            out[EXT] = done[0][0].receipt  # n=1: also at the top level
        return JSONResponse(out)

    async def sse(srv: Server, preps: list[Any], kind: str, rid: str, n_prompt: int, user_lp: int | None,
                  opts: Mapping[str, Any]) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        skip = preps[0].sampling.get("skip_special_tokens", True)
        states = [_Choice() for _ in preps]

        def emit(i: int, choice: dict[str, Any], extra: Mapping[str, Any] | None = None) -> bytes:
            out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": srv.model_name,
                                   "choices": [choice]}
            if opts.get("continuous_usage_stats"):
                out["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": len(states[i].ids),
                                "total_tokens": n_prompt + len(states[i].ids)}
            out.update(extra or {})
            return f"data: {json.dumps(out)}\n\n".encode()

        async for i, ev in _merge([srv.events(p, stream=True) for p in preps]):
            st = states[i]
            if isinstance(ev, RequestResult):
                last = choice_body(srv, kind, i, st, None, "", [], [], ev.finish_reason, ev.stop_reason, stream=True)
                extra = None
                if ev.receipt is not None:
                    last[EXT] = ev.receipt
                    extra = {EXT: ev.receipt}
                yield emit(i, last, extra)
                continue
            delta, _, c = ev
            new_ids = list(delta.new_token_ids)
            st.ids.extend(new_ids)
            if srv.detok:
                new = c.text or ""
            else:  # no detokenizer in the engine: decode the whole completion, send the new suffix
                text = srv.text(st.ids, skip)
                if text.endswith("\ufffd") and not delta.finished:
                    text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for the next token
                new = text[len(st.sent):] if text.startswith(st.sent) else ""
                st.sent = text if text.startswith(st.sent) else st.sent
            steps: list[Any] = []
            if user_lp is not None:
                steps = ([c.logprobs[j] for j in range(len(new_ids))] if c.logprobs is not None
                         else [None] * len(new_ids))
            if new or new_ids or st.first:
                yield emit(i, choice_body(srv, kind, i, st, user_lp, new, new_ids, steps, None, None, stream=True))
        if opts.get("include_usage"):  # vLLM: one final chunk with empty choices and the whole request's usage
            n_completion = sum(len(st.ids) for st in states)
            yield (f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': srv.model_name, 'choices': [], 'usage': {'prompt_tokens': n_prompt, 'completion_tokens': n_completion, 'total_tokens': n_prompt + n_completion}})}\n\n").encode()
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, "chat")

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        return await handle(request, "generate")

    return app


def _choice_spec(artifact: Any, i: int, n: int) -> Any:
    """Choice ``i``'s artifact request spec (see :meth:`Server.prepare_choices`); malformed specs are returned
    unchanged for the spec parser to refuse with its own message."""
    if not isinstance(artifact, dict) or not isinstance(artifact.get("delivery"), dict):
        return artifact
    delivery = artifact["delivery"]
    target = delivery.get("target")
    if isinstance(target, list):
        if len(target) != n:
            raise RequestSpecError(f"generation_artifact.delivery.target has {len(target)} targets; n={n} needs "
                                   "exactly one per choice")
        target = target[i]
    elif n > 1:
        key = target.get("object_key") if isinstance(target, dict) else None
        if not isinstance(key, str) or "{choice}" not in key:
            raise RequestSpecError(f"n={n} with generation artifacts needs one target per choice: put {{choice}} in "
                                   "generation_artifact.delivery.target.object_key, or give delivery.target as a "
                                   f"list of {n} targets")
        target = {**target, "object_key": key.replace("{choice}", str(i))}
    else:
        return artifact
    return {**artifact, "delivery": {**delivery, "target": target}}


class _Choice:
    """Streaming state of one choice: token ids so far, text sent, text offset (completions logprobs)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.sent = ""
        self.offset = 0
        self.first = True


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


async def _merge(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several event streams as ``(stream index, event)``, in arrival order. An error in one stream
    is raised here; closing the merged stream (client gone) cancels every stream, which aborts their requests."""
    if len(gens) == 1:
        async for ev in gens[0]:
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for ev in gen:
                queue.put_nowait((i, ev))
            queue.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, _Failed(e)))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, ev = await queue.get()
            if ev is done:
                left -= 1
            elif isinstance(ev, _Failed):
                raise ev.error
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _json_float(x: float) -> float | None | str:
    if math.isnan(x):
        return None
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return x


def run_serve_cli(args: Any) -> int:
    """Entry point of ``genartifact serve``."""
    import uvicorn

    cfg = config_mod.load(args.config)
    host = cfg.host()
    from genartifact.engine.engine_args import command_engine_kwargs
    from genartifact.engine.job import check_target_tables

    check_target_tables(cfg, host)
    pipeline_concurrency(), small_pipeline_concurrency()  # environment limits fail now, not at the first request
    kwargs = command_engine_kwargs(cfg, args)  # vLLM's engine arguments: [engine] table, then the command line
    kwargs.setdefault("skip_tokenizer_init", False)  # as vllm serve: the engine detokenizes (stop strings, text)
    names = kwargs.get("served_model_name") or [args.model]  # as vLLM: the first name is the one responses carry
    names = [names] if isinstance(names, str) else list(names)

    import signal

    stopped: dict[str, int] = {}

    class _StartInterrupted(BaseException):
        pass

    def on_start_signal(signum: int, _frame: Any) -> None:
        stopped["signal"] = signum
        raise _StartInterrupted(signum)

    async def factory() -> VllmEngine:
        # engine start blocks the event loop for tens of seconds (minutes on real checkpoints), so uvicorn's own
        # handlers could only act after it; a plain handler interrupts the start at once
        old = {sig: signal.signal(sig, on_start_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return await VllmEngine(host, args.model, **kwargs).start()
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    app = create_app(factory, cfg, names[0], drain_s=args.drain_s, freeze_heap=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=int(args.drain_s))
    except (_StartInterrupted, SystemExit):  # uvicorn exits 3 when the lifespan start-up fails
        if "signal" not in stopped:
            raise
    if "signal" in stopped:
        from genartifact.engine.vllm_adapter import kill_engine_processes

        kill_engine_processes()
        print(f"error: stopped by {signal.Signals(stopped['signal']).name} during engine start-up", file=sys.stderr)
        return 128 + stopped["signal"]
    return 0
