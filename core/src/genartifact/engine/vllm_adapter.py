"""vLLM adapter: start an ``AsyncLLM`` with the genartifact worker extension, convert vLLM outputs to
engine-neutral :class:`~genartifact.types.Delta` objects, and run one request with its artifact session.

vllm and torch are imported inside the functions that need them; still, import this module lazily (only
engine commands and engine tests do).
The ``AsyncLLM`` must be created from a ``if __name__ == "__main__":`` guarded entry point (vLLM spawns
its engine-core and worker processes).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from genartifact.engine.worker_ext import ENV_CONTENTS, ENV_PROBES, QUALNAME
from genartifact.errors import RequestSpecError
from genartifact.host import PluginHost
from genartifact.session import ArtifactSession
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

    :param host: the plugin host (enabled content plugins adjust engine options and run in workers).
    :param model: local model directory.
    :param engine_kwargs: extra ``AsyncEngineArgs`` fields (e.g. ``max_num_batched_tokens``).
    """

    def __init__(self, host: PluginHost, model: str | os.PathLike[str], **engine_kwargs: Any) -> None:
        self.host = host
        self.model_dir = str(Path(model).resolve())
        self.engine_kwargs = engine_kwargs
        self.llm: Any = None
        self.model_info: ModelInfo | None = None
        self.tokenizer: Any = None
        self._pending: dict[str, list[tuple[tuple[Any, ...], asyncio.Future[list[Any]]]]] = {}

    async def start(self) -> VllmEngine:
        """Start the engine (about 20 s on CPU) and initialise the worker extension."""
        for k, v in CPU_ENV.items():
            os.environ.setdefault(k, v)
        os.environ[ENV_CONTENTS] = json.dumps([p.name for p in self.host.enabled["contents"]])
        os.environ[ENV_PROBES] = json.dumps([p.name for p in self.host.enabled["probes"]])
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        opts = cpu_mla_fallback(engine_options(self.host, self.model_dir, self.engine_kwargs))
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**opts))
        vcfg = self.llm.vllm_config
        mc = vcfg.model_config
        hf = mc.hf_text_config.to_dict()
        import vllm

        self.model_info = ModelInfo(
            name=Path(self.model_dir).name,
            hf_config=hf,
            engine_name="vllm",
            engine_version=vllm.__version__,
            engine_options={
                "enable_prefix_caching": bool(vcfg.cache_config.enable_prefix_caching),
                "worker_extension": vcfg.parallel_config.worker_extension_cls == QUALNAME,
                "native_routed_experts": bool(_native_routes_enabled(vcfg)),
                "logprobs_mode": str(getattr(mc, "logprobs_mode", "raw_logprobs")),
                "max_model_len": int(mc.max_model_len),
                "device": str(vcfg.device_config.device_type),
                "chunked_prefill": bool(vcfg.scheduler_config.enable_chunked_prefill),
                "seed": mc.seed,
            },
            config_sha256=hashlib.sha256(json.dumps(hf, sort_keys=True, default=str).encode()).hexdigest(),
        )
        self.tokenizer = _load_tokenizer(self.model_dir)
        if self.model_info.engine_options["worker_extension"]:
            await self.worker_call("init")
        log.info("engine_started", model=self.model_info.name, vllm=vllm.__version__, **self.model_info.engine_options)
        return self

    async def worker_call(self, method: str, *args: Any) -> list[Any]:
        """Run the genartifact worker hook ``method`` on every worker; one result per worker.

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
                per_worker = await self.llm.collective_rpc("genartifact_call", args=(method, *batch[0][0]))
                results = [per_worker]
            else:
                per_worker = await self.llm.collective_rpc("genartifact_call",
                                                           args=("batch", method, [list(a) for a, _ in batch]))
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
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    async def stream(self, prompt_token_ids: list[int], sampling: Mapping[str, Any],
                     request_id: str | None = None, final_only: bool = False) -> AsyncIterator[tuple[Delta, Any]]:
        """Generate and yield ``(Delta, vllm CompletionOutput)``: one per engine step with
        ``RequestOutputKind.DELTA``, or a single delta holding everything with ``final_only=True``
        (``FINAL_ONLY``: no per-token output processing, for callers that do not stream)."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sampling = dict(sampling)
        if self.engine_kwargs.get("skip_tokenizer_init", True) and not sampling.get("ignore_eos"):
            # the engine has no tokenizer: stop at EOS explicitly (vLLM would take it from the tokenizer)
            eos = self.tokenizer.eos_token_id
            if eos is not None:
                sampling["stop_token_ids"] = sorted({*sampling.get("stop_token_ids", []), int(eos)})
            sampling.setdefault("detokenize", False)
        kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
        params = SamplingParams(**sampling, output_kind=kind)
        rid = request_id or uuid.uuid4().hex
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_token_ids)), params, rid):
            c = out.outputs[0]
            ids = list(c.token_ids)
            yield Delta(
                prompt_token_ids=out.prompt_token_ids or prompt_token_ids,
                new_token_ids=ids,
                new_logprobs=_sample_logprobs(c.logprobs, len(ids)),
                routed_experts=getattr(c, "routed_experts", None),
                finished=bool(out.finished),
            ), c

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
        elif n != 1:
            raise RequestSpecError(f"n={n!r} unsupported; allowed: 1")
        return Prepared(list(prompt_token_ids), sampling, session)

    async def execute(self, prep: Prepared, stream: bool = True,
                      request_id: str | None = None) -> AsyncIterator[tuple[Delta, str | None] | RequestResult]:
        """Run a prepared request: yields ``(Delta, finish_reason)`` per engine output, then one
        :class:`RequestResult` (with the receipt). Closing the generator early (client gone) aborts the request
        in vLLM and releases every capture (worker rows included); an upload already started finishes in the
        background (journaled)."""
        session, completion, finish = prep.session, [], None
        try:
            async for delta, c in self.stream(prep.prompt_token_ids, prep.sampling, request_id, final_only=not stream):
                completion.extend(delta.new_token_ids)
                if session is not None:
                    session.record_or_fail(delta)
                finish = c.finish_reason or finish
                yield delta, finish
            receipt, peak, budget = None, 0, 0
            if session is not None:
                receipt = await session.finalize(self)
                peak, budget = session.peak_retained, session.budget
            yield RequestResult(prep.prompt_token_ids, completion, None, receipt, finish, peak, budget)
        finally:
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


def engine_options(host: PluginHost, model_dir: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``AsyncEngineArgs`` kwargs: defaults, then ``overrides``, then the genartifact worker extension (unless
    the user set their own ``worker_extension_cls``: vLLM allows one, so a warning names it and the worker
    route path is off), then each enabled content plugin's ``genartifact_engine_options`` in config order."""
    opts: dict[str, Any] = {"model": model_dir, **DEFAULT_ENGINE_OPTIONS, **overrides}
    user_ext = opts.get("worker_extension_cls")
    if user_ext and user_ext != QUALNAME:
        log.warning("worker_extension_in_use", cls=user_ext,
                    detail="vLLM allows one worker extension; genartifact worker capture is disabled, "
                           "moe_routes needs enable_return_routed_experts")
    else:
        opts["worker_extension_cls"] = QUALNAME
    host.hooks.engine_options(options=opts)
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
