"""Worker-side route capture for runners without vLLM's native routed-experts return (CPU, V1 runner).

Runs inside a vLLM worker process, installed by the genartifact worker extension. It binds every MoE
router's capture callback (``BaseRouter.set_capture_fn``: the hook vLLM's own
``bind_routed_experts_capturer`` uses) and wraps ``model_runner.execute_model`` to learn each step's
batch layout: request order ``input_batch.req_ids``, start position ``input_batch.num_computed_tokens_cpu``
and token count ``scheduler_output.num_scheduled_tokens`` — read lazily on the step's first capture call,
after the runner has applied the step's state updates. Only requests whose
``SamplingParams.extra_args`` carry ``genartifact_capture_id`` are recorded.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import structlog
from genartifact.engine.worker_ext import track_flagged

from genartifact_route_capture.layout import resolve_layout
from genartifact_route_capture.recorder import RouteRecorder

CAPTURE_KEY = "genartifact_capture_id"
log = structlog.get_logger("genartifact.route_capture.worker")


class _State:
    def __init__(self, worker: Any) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.worker = worker
        mr = worker.model_runner
        model = mr.get_model() if hasattr(mr, "get_model") else mr.model
        vcfg = worker.vllm_config
        hf = vcfg.model_config.hf_text_config.to_dict()
        lay = resolve_layout(hf)
        runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        found = sorted(int(m.layer_id) for m in runners)
        if found != list(lay.router_ids):
            raise RuntimeError(f"MoE runners at layers {found} disagree with the config's router layout {list(lay.router_ids)}")
        self.recorder = RouteRecorder(
            router_ids=lay.router_ids, top_k=lay.top_k,
            dtype=np.dtype("<u1") if lay.itemsize == 1 else np.dtype("<u2"),
            max_positions=int(vcfg.model_config.max_model_len),
        )
        self.sched: Any = None
        # engine request id -> capture id of live flagged requests (a step without one returns at once)
        self.flagged: dict[str, str] = {}
        self.step_ready = False
        for m in runners:
            m.router.set_capture_fn(functools.partial(self.capture, int(m.layer_id)))
        orig = mr.execute_model

        @functools.wraps(orig)
        def execute_model(scheduler_output: Any, *a: Any, **kw: Any) -> Any:
            track_flagged(scheduler_output, CAPTURE_KEY, self.flagged)
            self.sched, self.step_ready = (scheduler_output if self.flagged else None), False
            try:
                return orig(scheduler_output, *a, **kw)
            finally:
                if self.step_ready:
                    self.recorder.end_step()
                self.sched, self.step_ready = None, False

        mr.execute_model = execute_model
        log.info("route_capture_installed", routers=len(found), runner=type(mr).__name__)

    def _begin(self) -> None:
        mr, so = self.worker.model_runner, self.sched
        ib = mr.input_batch
        sched = so.num_scheduled_tokens
        computed = ib.num_computed_tokens_cpu
        flagged = self.flagged
        segs = [(flagged.get(rid), int(computed[i]), int(sched.get(rid, 0)))
                for i, rid in enumerate(ib.req_ids[: ib.num_reqs])]
        self.recorder.begin_step(segs)
        self.step_ready = True

    def capture(self, layer_id: int, topk_ids: Any) -> None:
        if self.sched is None:  # profile/dummy runs outside execute_model
            return
        if not self.step_ready:
            self._begin()
        if self.recorder._step is None:  # no flagged request in this step
            return
        self.recorder.on_layer(layer_id, topk_ids.detach())


def install(worker: Any) -> None:
    """Bind capture on ``worker`` (idempotent)."""
    if getattr(worker, "_genartifact_routes", None) is None:
        worker._genartifact_routes = _State(worker)


def call(worker: Any, verb: str, args: list[Any]) -> Any:
    """Worker RPC verbs: ``fetch(capture_id, start, end)`` -> rows dict (see ``RouteRecorder.fetch``) or
    ``{"unknown": True}``; ``discard(capture_id)`` -> bool; ``stats()`` -> dict."""
    install(worker)
    st: _State = worker._genartifact_routes
    if verb == "fetch":
        cid, start, end = args
        return st.recorder.fetch(str(cid), int(start), int(end)) or {"unknown": True}
    if verb == "discard":
        return st.recorder.discard(str(args[0]))
    if verb == "stats":
        rec = st.recorder
        return {"requests": len(rec.reqs), "retained_bytes": rec.retained_bytes(), "steps": rec.steps,
                "recomputed_positions": rec.recomputed_positions}
    raise ValueError(f"moe_routes worker verb {verb!r} unknown; allowed: ['discard', 'fetch', 'stats']")
