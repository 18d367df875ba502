"""Worker-side route capture for runners without vLLM's native routed-experts return (CPU, V1 runner).

A :class:`~genartifact.engine.worker_ext.WorkerCapture` run by genartifact's worker runtime on the capturing
rank (TP rank 0) of each engine. It binds every MoE router's capture callback (``BaseRouter.set_capture_fn``:
the hook vLLM's own ``bind_routed_experts_capturer`` uses). For steps with a flagged request (the runtime's
step hook; flag = ``SamplingParams.extra_args["genartifact_capture_id"]``) it learns the batch layout —
request order ``input_batch.req_ids``, start position ``input_batch.num_computed_tokens_cpu`` and token count
``scheduler_output.num_scheduled_tokens`` — lazily on the step's first router call, after the runner has applied
the step's state updates, keeps each layer's ``topk_ids`` by reference during the forward, and at the step's end stacks them once and
scatters the rows to the flagged requests by absolute position
(:class:`~genartifact_route_capture.recorder.RouteRecorder`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
from genartifact.engine.worker_ext import WorkerCapture, WorkerStep

from genartifact_route_capture.layout import resolve_layout
from genartifact_route_capture.recorder import RouteRecorder

NAME = "moe_routes"
CAPTURE_KEY = "genartifact_capture_id"
START_KEY = "genartifact_routes_start"  # extra_args: first position to hand over (the request's routes_start)
log = structlog.get_logger("genartifact.route_capture.worker")


class RecordingCapture(WorkerCapture):
    """Per-router rows of flagged requests, recorded on one worker by absolute position with a
    :class:`RouteRecorder` (``[routers, positions, top_k]`` of :meth:`row_dtype`). The shared worker side of the
    route contents (``moe_routes`` here, ``moe_route_weights`` in genartifact-route-weights): a subclass sets
    ``name``/``capture_key``, gives its buffer dtype and feeds :meth:`capture` from the routers in
    :meth:`install`. ``pop(cid, [start, end])`` returns the rows of positions ``start .. end-1`` (see
    :meth:`RouteRecorder.fetch`), passed through :meth:`answer`."""

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
        self.recorder = RouteRecorder(router_ids=lay.router_ids, top_k=lay.top_k, dtype=self.row_dtype(lay),
                                      max_positions=int(vcfg.model_config.max_model_len))
        self.step: WorkerStep | None = None
        self.step_ready = False
        self.install(runners)

    def row_dtype(self, lay: Any) -> np.dtype[Any]:
        """The recorder's buffer dtype for the router layout ``lay``."""
        raise NotImplementedError

    def install(self, runners: Sequence[Any]) -> None:
        """Make every MoE runner's router (in layer order) call :meth:`capture`."""
        raise NotImplementedError

    def answer(self, out: dict[str, Any]) -> dict[str, Any]:
        """A fetched answer as handed to the driver (a subclass may add fields)."""
        return out

    # step hook
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
        k = ib.num_reqs
        computed = ib.num_computed_tokens_cpu[:k].tolist()  # one conversion, not a numpy scalar per request
        flagged = self.step.flagged.get(self.name, {})  # type: ignore[union-attr]
        segs = [(flagged.get(rid), int(computed[i]), int(sched.get(rid, 0))) for i, rid in enumerate(ib.req_ids[:k])]
        self.recorder.begin_step(segs)
        self.step_ready = True

    def capture(self, layer_id: int, rows: Any) -> None:
        """Router callback: ``rows`` ``[tokens_in_step, top_k]`` (a torch tensor) of MoE layer ``layer_id``."""
        step = self.step
        # no flagged request this step, or a profile/dummy run outside execute_model (also between a step's end and
        # its deferred end_step: step.closed)
        if step is None or step.closed:
            return
        # inside vLLM's forward: a fault here fails this step's flagged requests of this content, never the forward
        step.guard(self.name, self._on_layer, layer_id, rows)

    def _on_layer(self, layer_id: int, rows: Any) -> None:
        if not self.step_ready:
            self._begin()
        if not self.recorder.recording:  # no flagged request scheduled in this step
            return
        self.recorder.on_layer(layer_id, rows)

    # capture-id verbs
    def pop(self, capture_id: str, args: Sequence[Any]) -> Any | None:
        start, end = args
        out = self.recorder.fetch(capture_id, int(start), int(end))
        return None if out is None else self.answer(out)

    def handover(self, capture_id: str, extra_args: Any) -> Any | None:
        """Rows of a finished request for out-of-band handover: positions ``start .. forwarded-1``, ``start``
        from ``extra_args["genartifact_routes_start"]`` (default 0), ``forwarded`` = positions the request fed
        through the model (prompt + completion - 1); as :meth:`pop` gives them."""
        r = self.recorder.reqs.get(capture_id)
        if r is None:
            return None
        start = int((extra_args or {}).get(START_KEY, 0) or 0)
        return self.pop(capture_id, [start, max(start, r.max_pos)])

    def drop(self, capture_id: str) -> bool:
        return self.recorder.discard(capture_id)

    def stats(self) -> dict[str, Any]:
        rec = self.recorder
        return {"requests": len(rec.reqs), "retained_bytes": rec.retained_bytes(), "steps": rec.steps,
                "recomputed_positions": rec.recomputed_positions}


class RouteCapture(RecordingCapture):
    """Routes (expert ids) of flagged requests, recorded on one worker: u8 or u16 by the layout's expert count."""

    name = NAME
    capture_key = CAPTURE_KEY

    def row_dtype(self, lay: Any) -> np.dtype[Any]:
        return np.dtype("<u1") if lay.itemsize == 1 else np.dtype("<u2")

    def install(self, runners: Sequence[Any]) -> None:
        for m in runners:
            m.router.set_capture_fn(functools.partial(self.capture, int(m.layer_id)))
        log.info("route_capture_installed", routers=len(runners), runner=type(self.worker.model_runner).__name__)
