"""Worker side of ``moe_route_weights`` (imported only inside vLLM workers, from the worker-capture hook).

vLLM's router capture callback (``BaseRouter.capture_fn``) sees only the expert ids, so the weights are taken
by wrapping the router's weight computation: every MoE layer's router (``MoERunner.router``, a
``vllm.model_executor.layers.fused_moe.router.base_router.BaseRouter``) computes
``(topk_weights, topk_ids) = self._compute_routing(hidden_states, router_logits, indices_type)`` inside
``BaseRouter._select_experts`` (vLLM 0.32: ``router/base_router.py``), immediately before it hands
``topk_ids`` to ``capture_fn`` (what ``moe_routes`` records). The wrapper is an instance attribute that
shadows that method on each router: it calls the original and records ``topk_weights`` ``[tokens_in_step,
top_k]`` (fp32) — the same call, the same row and column order as the ids, so row *i*, column *j* is the
weight of expert ``moe_routes[i, router, j]``. On CPU the router is ``router/cpu_router.py:CPURouter``.

Rows are attributed by absolute position with moe_routes' own recorder
(:class:`genartifact_route_capture.recorder.RouteRecorder`, here with a float32 buffer), so chunked
prefill, mixed batches, preemption + recompute (a recomputed position overwrites its row) and
``routed_experts_prompt_start`` behave exactly as for ``moe_routes``; a position never computed (prefix
caching) is reported missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
from genartifact.engine.worker_ext import WorkerCapture, WorkerStep
from genartifact_route_capture.layout import resolve_layout
from genartifact_route_capture.recorder import RouteRecorder

NAME = "moe_route_weights"
CAPTURE_KEY = "genartifact_route_weights_capture_id"
log = structlog.get_logger("genartifact.route_weights.worker")


class RouteWeightsCapture(WorkerCapture):
    """Router weights of flagged requests, recorded on one worker as fp32 ``[routers, positions, top_k]``.
    ``pop(cid, [start, end])`` returns positions ``start .. end-1`` plus the routers' scaling factors."""

    name = NAME
    capture_key = CAPTURE_KEY

    def __init__(self, worker: Any) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.worker = worker
        mr = worker.model_runner
        model = mr.get_model() if hasattr(mr, "get_model") else mr.model
        vcfg = worker.vllm_config
        lay = resolve_layout(vcfg.model_config.hf_text_config.to_dict())
        runners = sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: int(m.layer_id))
        found = [int(m.layer_id) for m in runners]
        if found != list(lay.router_ids):
            raise RuntimeError(f"MoE runners at layers {found} disagree with the config's router layout "
                               f"{list(lay.router_ids)} (pipeline parallelism is not supported by worker capture)")
        self.recorder = RouteRecorder(router_ids=lay.router_ids, top_k=lay.top_k, dtype=np.dtype("<f4"),
                                      max_positions=int(vcfg.model_config.max_model_len))
        # the factor each router multiplies into its weights, and the one the runner applies to the MoE output
        # instead (vLLM's DeepSeek-V2/V3 pass apply_routed_scale_to_output=True off ROCm-aiter: router 1.0)
        self.router_scale = [float(getattr(m.router, "routed_scaling_factor", 1.0) or 1.0) for m in runners]
        self.output_scale = [float(getattr(m, "routed_scaling_factor", 1.0) or 1.0) for m in runners]
        self.step: WorkerStep | None = None
        self.step_ready = False
        for m in runners:
            self._wrap(m.router, int(m.layer_id))
        log.info("route_weights_capture_installed", routers=len(found), router=type(runners[0].router).__name__)

    def _wrap(self, router: Any, layer_id: int) -> None:
        orig = router._compute_routing  # bound method of the router's class

        def _compute_routing(*a: Any, **kw: Any) -> Any:
            topk_weights, topk_ids = orig(*a, **kw)
            self.capture(layer_id, topk_weights)
            return topk_weights, topk_ids

        router._compute_routing = _compute_routing

    # step hook (the same shape as moe_routes' RouteCapture)
    def begin_step(self, step: WorkerStep) -> None:
        self.step, self.step_ready = step, False

    def end_step(self, step: WorkerStep) -> None:
        if self.step_ready:
            self.recorder.end_step()
        self.step, self.step_ready = None, False

    def _begin(self) -> None:
        mr, so = self.worker.model_runner, self.step.scheduler_output  # type: ignore[union-attr]
        ib = mr.input_batch
        sched = so.num_scheduled_tokens
        computed = ib.num_computed_tokens_cpu
        flagged = self.step.flagged.get(NAME, {})  # type: ignore[union-attr]
        segs = [(flagged.get(rid), int(computed[i]), int(sched.get(rid, 0)))
                for i, rid in enumerate(ib.req_ids[: ib.num_reqs])]
        self.recorder.begin_step(segs)
        self.step_ready = True

    def capture(self, layer_id: int, topk_weights: Any) -> None:
        """Router weights ``[tokens_in_step, top_k]`` (any float dtype; stored fp32) of MoE layer ``layer_id``."""
        if self.step is None:  # no flagged request this step, or profile/dummy runs outside execute_model
            return
        if not self.step_ready:
            self._begin()
        if self.recorder._step is None:
            return
        self.recorder.on_layer(layer_id, topk_weights.detach())

    # capture-id verbs
    def pop(self, capture_id: str, args: Sequence[Any]) -> Any | None:
        start, end = args
        out = self.recorder.fetch(capture_id, int(start), int(end))
        if out is not None:
            out["router_scale"], out["output_scale"] = self.router_scale, self.output_scale
        return out

    def handover(self, capture_id: str, extra_args: Any) -> Any | None:
        """Weights of a finished request for out-of-band handover: positions ``start .. forwarded-1`` (``start``
        from ``extra_args["genartifact_routes_start"]``, default 0), with the scales, as :meth:`pop` gives."""
        r = self.recorder.reqs.get(capture_id)
        if r is None:
            return None
        start = int((extra_args or {}).get("genartifact_routes_start", 0) or 0)
        return self.pop(capture_id, [start, max(start, r.max_pos)])

    def drop(self, capture_id: str) -> bool:
        return self.recorder.discard(capture_id)

    def stats(self) -> dict[str, Any]:
        rec = self.recorder
        return {"requests": len(rec.reqs), "retained_bytes": rec.retained_bytes(), "steps": rec.steps,
                "recomputed_positions": rec.recomputed_positions}
