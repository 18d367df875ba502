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
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from genartifact import config as config_mod
from genartifact.engine.tiny_model import CHAT_TEMPLATE
from genartifact.engine.vllm_adapter import RequestResult, VllmEngine
from genartifact.errors import GenartifactError, PluginFault, RequestSpecError
from genartifact.limits import pipeline_concurrency

log = structlog.get_logger("genartifact.serve")
EXT = "generation_artifact"
MAX_LOGPROBS = 20
MAX_BODY_BYTES = 8 << 20  # 8 MiB: far above any prompt a max_model_len engine accepts
CHARS_PER_TOKEN_CAP = 32  # a prompt string longer than max_model_len x this cannot fit: refuse before tokenizing
COMMON_KEYS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream", "ignore_eos",
               EXT, "routed_experts_prompt_start", "user", "stream_options"}
ENDPOINT_KEYS = {"completions": COMMON_KEYS | {"prompt", "logprobs"},
                 "chat": COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"},
                 "generate": {"token_ids", "sampling_params", EXT, "routed_experts_prompt_start"}}
SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "n", "ignore_eos", "logprobs",
                 "routed_experts_prompt_start"}
PARAMS = sorted({*COMMON_KEYS, "prompt", "messages", "token_ids", "sampling_params", "top_logprobs",
                 "max_completion_tokens"} - {"n"}, key=len, reverse=True)


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
                                  registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.slots = Gauge("genartifact_pipeline_slots_in_use", "Encode+deliver slots in use", registry=r)
        self.slots_peak = Gauge("genartifact_pipeline_slots_in_use_peak", "Peak encode+deliver slots in use",
                                registry=r)
        self.inflight = Gauge("genartifact_inflight_requests", "Requests being served", registry=r)


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
        self.capacity = pipeline_concurrency()
        tok = engine.tokenizer
        self.chat_template = getattr(tok, "chat_template", None) or CHAT_TEMPLATE

    # ---------------------------------------------------------------- request parsing
    def sampling(self, body: Mapping[str, Any], logprobs_default: int | None = None,
                 chat: bool = False) -> dict[str, Any]:
        max_len = int(self.engine.model_info.engine_options.get("max_model_len", 2048))  # type: ignore[union-attr]
        s: dict[str, Any] = {
            "max_tokens": _num(body, "max_tokens", 16, 1, max_len, integer=True),
            "temperature": _num(body, "temperature", 1.0, 0.0, 100.0),
            "top_p": _num(body, "top_p", 1.0, 1e-9, 1.0),
        }
        if body.get("top_k") is not None:
            s["top_k"] = _num(body, "top_k", -1, -1, 1 << 20, integer=True)
        if body.get("seed") is not None:
            s["seed"] = _num(body, "seed", 0, 0, 2**63 - 1, integer=True)
        lp = body.get("logprobs", logprobs_default)
        # the OpenAI fields (completions ``logprobs: k``; chat ``logprobs: true`` + ``top_logprobs: k``) are
        # served into a ``top_logprobs`` artifact when the request asks for that content (values in the artifact,
        # not in the response body); otherwise they are refused as before
        ext = body.get(EXT)
        into_artifact = isinstance(ext, Mapping) and isinstance(ext.get("contents"), list) \
            and "top_logprobs" in ext["contents"]
        if chat and (lp not in (None, False) or body.get("top_logprobs") is not None):
            if not into_artifact:
                raise RequestSpecError("logprobs on /v1/chat/completions is not supported yet; use /generate for "
                                       "per-token logprobs (or selected_logprobs/top_logprobs artifacts)")
            if lp is not True:
                raise RequestSpecError(f"logprobs={lp!r} invalid with top_logprobs; allowed: true")
            lp = _num(body, "top_logprobs", None, 1, MAX_LOGPROBS, integer=True) \
                if body.get("top_logprobs") is not None else None
            if lp is None:
                raise RequestSpecError(f"top_logprobs must be an integer 1..{MAX_LOGPROBS} for a top_logprobs artifact")
        if not chat and logprobs_default is None and lp is not None and not into_artifact:
            raise RequestSpecError("logprobs on /v1/completions is not supported yet; use /generate for per-token "
                                   "logprobs (or selected_logprobs/top_logprobs artifacts)")
        if lp is not None and lp is not False:
            s["logprobs"] = _num({"logprobs": lp}, "logprobs", 0, 0, MAX_LOGPROBS, integer=True)
        if body.get("ignore_eos") is not None:  # vLLM's extension parameter of the same name
            if not isinstance(body["ignore_eos"], bool):
                raise RequestSpecError(f"ignore_eos={body['ignore_eos']!r} invalid; allowed: true or false")
            s["ignore_eos"] = body["ignore_eos"]
        n = body.get("n", 1)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n != 1):
            raise RequestSpecError(f"n={n!r} unsupported; allowed: 1 (one choice per request)")
        return s

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

    def _sample_slots(self) -> None:
        sem = self.engine.host.pipeline()
        used = self.capacity - sem._value
        self.metrics.slots.set(used)
        if used > self.metrics.slots_peak._value.get():
            self.metrics.slots_peak.set(used)

    def _count_receipt(self, receipt: Mapping[str, Any] | None) -> None:
        if receipt is None:
            return
        self.metrics.artifacts.labels(receipt["state"], receipt.get("error_code", "")).inc()
        if receipt["state"] == "ready":
            self.metrics.bytes.inc(receipt["byte_count"])

    def text(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    async def drain(self) -> int:
        """Wait up to ``drain_s`` for started deliveries; returns how many were still running (abandoned)."""
        sem = self.engine.host.pipeline()
        deadline = time.monotonic() + self.drain_s
        while sem._value < self.capacity and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.capacity - sem._value


def create_app(engine_factory: Any, cfg: config_mod.Config, model_name: str, drain_s: float = 30.0) -> FastAPI:
    """The ASGI app. ``engine_factory()`` returns a started :class:`VllmEngine` (awaitable)."""
    state: dict[str, Server] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await engine_factory()
        state["s"] = Server(engine, cfg, model_name, drain_s)
        log.info("serve_ready", model=model_name)
        try:
            yield
        finally:
            abandoned = await state["s"].drain()
            log.info("serve_shutdown", abandoned_deliveries=abandoned,
                     journal=str(cfg.journal_path) if cfg.journal_path else None)
            engine.shutdown()

    app = FastAPI(title="genartifact", lifespan=lifespan)

    async def body_of(request: Request) -> dict[str, Any]:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise BodyTooLarge(f"request body is larger than {MAX_BODY_BYTES} bytes")
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
                sampling = srv.sampling(body)
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
                sampling = srv.sampling(body, chat=True)
            else:  # generate: token ids in/out
                ids = body.get("token_ids")
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                        for t in ids):
                    raise RequestSpecError("token_ids must be a list of non-negative integers")
                sp = body.get("sampling_params", {})
                if not isinstance(sp, dict):
                    raise RequestSpecError("sampling_params must be an object")
                _check_keys(sp, SAMPLING_KEYS, "sampling_params")
                sampling = srv.sampling(sp, logprobs_default=0)
                if "routed_experts_prompt_start" in sp and "routed_experts_prompt_start" not in body:
                    body["routed_experts_prompt_start"] = sp["routed_experts_prompt_start"]
            prep = srv.prepare(ids, sampling, body)
        except GenartifactError as e:
            return reject(srv, e)
        srv.metrics.requests.labels("admitted", "").inc()
        rid = f"{'cmpl' if kind != 'chat' else 'chatcmpl'}-{uuid.uuid4().hex}"
        if stream and kind != "generate":
            return StreamingResponse(sse(srv, prep, kind, rid), media_type="text/event-stream")
        return await until_disconnect(request, respond(srv, prep, kind, rid, len(ids)))

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

    async def respond(srv: Server, prep: Any, kind: str, rid: str, n_prompt: int) -> Any:
        result: RequestResult | None = None
        lps: list[float] = []
        async for ev in srv.events(prep, stream=False):
            if isinstance(ev, RequestResult):
                result = ev
            elif ev[0].new_logprobs is not None:
                lps.extend(d.get(t, float("nan")) for t, d in zip(ev[0].new_token_ids, ev[0].new_logprobs, strict=True))
        assert result is not None
        ids = result.completion_token_ids
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)}
        out: dict[str, Any]
        if kind == "generate":
            out = {"token_ids": ids, "logprobs": [_json_float(x) for x in lps], "finish_reason": result.finish_reason,
                   "prompt_token_count": n_prompt}
        elif kind == "chat":
            out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": srv.model_name,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": srv.text(ids)},
                                "finish_reason": result.finish_reason, "logprobs": None}], "usage": usage}
        else:
            out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": srv.model_name,
                   "choices": [{"index": 0, "text": srv.text(ids), "finish_reason": result.finish_reason,
                                "logprobs": None}], "usage": usage}
        if result.receipt is not None:
            out[EXT] = result.receipt
        return JSONResponse(out)

    async def sse(srv: Server, prep: Any, kind: str, rid: str) -> AsyncIterator[bytes]:
        created, ids, sent = int(time.time()), [], ""
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": obj, "created": created, "model": srv.model_name, "choices": [choice]}

        first = True
        async for ev in srv.events(prep, stream=True):
            if isinstance(ev, RequestResult):
                last = chunk(None, ev.finish_reason)
                if ev.receipt is not None:
                    last[EXT] = ev.receipt
                yield f"data: {json.dumps(last)}\n\n".encode()
                break
            ids.extend(ev[0].new_token_ids)
            text = srv.text(ids)
            if text.endswith("\ufffd") and not ev[0].finished:
                text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for the next token
            new = text[len(sent):] if text.startswith(sent) else ""
            sent = text if text.startswith(sent) else sent
            if new or first:
                yield f"data: {json.dumps(chunk(new, None, first))}\n\n".encode()
                first = False
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
    pipeline_concurrency()
    kwargs = command_engine_kwargs(cfg, args)  # vLLM's engine arguments: [engine] table, then the command line
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

    app = create_app(factory, cfg, names[0], drain_s=args.drain_s)
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
