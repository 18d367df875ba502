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
from genartifact_route_capture.worker import RecordingCapture

NAME = "moe_route_weights"
CAPTURE_KEY = "genartifact_route_weights_capture_id"
log = structlog.get_logger("genartifact.route_weights.worker")


class RouteWeightsCapture(RecordingCapture):
    """Router weights of flagged requests, recorded on one worker as fp32 ``[routers, positions, top_k]`` by
    moe_routes' shared worker side (:class:`~genartifact_route_capture.worker.RecordingCapture`: step hook,
    row attribution, pop/handover/drop). ``pop(cid, [start, end])`` returns positions ``start .. end-1`` plus
    the routers' scaling factors."""

    name = NAME
    capture_key = CAPTURE_KEY

    def row_dtype(self, lay: Any) -> np.dtype[Any]:
        return np.dtype("<f4")

    def install(self, runners: Sequence[Any]) -> None:
        # the factor each router multiplies into its weights, and the one the runner applies to the MoE output
        self.router_scale = [float(getattr(m.router, "routed_scaling_factor", 1.0) or 1.0) for m in runners]
        self.output_scale = [float(getattr(m, "routed_scaling_factor", 1.0) or 1.0) for m in runners]
        for m in runners:
            self._wrap(m.router, int(m.layer_id))
        log.info("route_weights_capture_installed", routers=len(runners), router=type(runners[0].router).__name__)

    def _wrap(self, router: Any, layer_id: int) -> None:
        orig = router._compute_routing  # bound method of the router's class

        def _compute_routing(*a: Any, **kw: Any) -> Any:
            topk_weights, topk_ids = orig(*a, **kw)
            self.capture(layer_id, topk_weights)
            return topk_weights, topk_ids

        router._compute_routing = _compute_routing

    def answer(self, out: dict[str, Any]) -> dict[str, Any]:
        out["router_scale"], out["output_scale"] = self.router_scale, self.output_scale
        return out
