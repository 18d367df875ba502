"""Worker-side route capture for runners without vLLM's native routed-experts return (CPU, V1 runner).

A :class:`~genartifact.engine.worker_ext.WorkerCapture` run by genartifact's worker runtime on the capturing
rank (TP rank 0) of each engine. It binds every MoE router's capture callback (``BaseRouter.set_capture_fn``:
the hook vLLM's own ``bind_routed_experts_capturer`` uses). For steps with a flagged request (the runtime's
step hook; flag = ``SamplingParams.extra_args["genartifact_capture_id"]``) each router call only keeps the layer's
``topk_ids`` by reference (one list append inside vLLM's forward: nothing there can fail, so nothing is guarded).
At the step's end — deferred by the runtime until the step's output has gone back to the engine, so off the
engine's critical path — it reads the batch layout (request order ``input_batch.req_ids``, start position
``input_batch.num_computed_tokens_cpu`` and token count ``scheduler_output.num_scheduled_tokens``: the runner
applies a step's state updates before its forward and changes them again only at the next step's entry, which
settles this end first), stacks the layers once and scatters the rows to the flagged requests by absolute
position (:class:`~genartifact_route_capture.recorder.RouteRecorder`). A fault there fails the step's flagged
requests of this content (the runtime's ``end_step`` isolation), never the forward.
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
        #: ``(layer id, topk_ids)`` of the step's router calls, in call order, kept by reference for ``end_step``
        self._kept: list[tuple[int, Any]] = []
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
        self.step, self._kept = step, []

    def end_step(self, step: WorkerStep) -> None:
        """Record the step's kept router rows (see the module): the batch layout, then each layer's rows, then the
        scatter. Runs for a failed step too (what its routers produced is recorded, the rest stays unfilled)."""
        kept, self._kept, self.step = self._kept, [], None
        if not kept:  # no router ran (a step that failed before its forward)
            return
        rec = self.recorder
        rec.begin_step(self._segments(step))
        if not rec.recording:  # no flagged request scheduled in this step
            return
        for layer_id, rows in kept:
            rec.on_layer(layer_id, rows)
        rec.end_step()

    def _segments(self, step: WorkerStep) -> list[tuple[str | None, int, int]]:
        """The step's batch as ``(capture id | None, start position, tokens)`` per request in batch order."""
        ib = self.worker.model_runner.input_batch
        sched = step.scheduler_output.num_scheduled_tokens
        k = ib.num_reqs
        computed = ib.num_computed_tokens_cpu[:k].tolist()  # one conversion, not a numpy scalar per request
        flagged = step.flagged.get(self.name, {})
        return [(flagged.get(rid), int(computed[i]), int(sched.get(rid, 0))) for i, rid in enumerate(ib.req_ids[:k])]

    def capture(self, layer_id: int, rows: Any) -> None:
        """Router callback: ``rows`` ``[tokens_in_step, top_k]`` (a torch tensor) of MoE layer ``layer_id``, kept by
        reference until :meth:`end_step` (the router does not write into it after the call: see the recorder)."""
        step = self.step
        # no flagged request this step, or a profile/dummy run outside execute_model (also between a step's end and
        # its deferred end_step: step.closed)
        if step is None or step.closed:
            return
        self._kept.append((layer_id, rows))

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
