"""The single genartifact vLLM worker extension (``worker_extension_cls``).

vLLM allows one extension class per engine; it is mixed into the worker class, so ``self`` is the worker.
Each enabled content plugin adds worker-side behaviour through the ``genartifact_worker_init`` /
``genartifact_worker_call`` hooks. The enabled plugin list reaches the (spawned) worker processes through
the ``GENARTIFACT_WORKER_CONTENTS`` environment variable (JSON list), set by the engine adapter before the
engine starts. ``init_worker_extension`` is not called by the CPU worker in vLLM 0.32, so initialisation
is lazy: the adapter calls ``genartifact_call("init")`` once after engine start, before any request.
"""

from __future__ import annotations

import json
import os
from typing import Any

QUALNAME = "genartifact.engine.worker_ext.GenartifactWorkerExtension"
ENV_CONTENTS = "GENARTIFACT_WORKER_CONTENTS"
ENV_PROBES = "GENARTIFACT_WORKER_PROBES"


class GenartifactWorkerExtension:
    """Mixin for vLLM workers. Attribute names are prefixed to avoid clashing with worker attributes."""

    def genartifact_call(self, method: str, *args: Any) -> Any:
        """Dispatch worker RPC ``method`` to the enabled content plugins (``"init"`` initialises only)."""
        host = getattr(self, "_genartifact_host", None)
        if host is None:
            from genartifact.host import PluginHost

            host = PluginHost({"contents": json.loads(os.environ.get(ENV_CONTENTS, "[]")),
                               "probes": json.loads(os.environ.get(ENV_PROBES, "[]"))})
            host.hooks.worker_init(worker=self)
            self._genartifact_host = host
        if method == "init":
            return {"contents": [p.name for p in host.enabled["contents"]]}
        if method == "batch":  # ("batch", inner_method, [args, ...]) -> [result, ...]: one RPC for many calls
            inner, calls = args
            return [self.genartifact_call(inner, *a) for a in calls]
        result = host.hooks.worker_call(worker=self, method=method, args=list(args))
        if result is None:
            raise ValueError(f"no enabled worker plugin handles method {method!r}")
        return None if isinstance(result, dict) and result.get("unknown") else result


def track_flagged(scheduler_output: Any, key: str, flagged: dict[str, str]) -> None:
    """Keep ``flagged`` (engine request id -> capture id) current from one step's ``SchedulerOutput``: add new
    requests whose ``SamplingParams.extra_args`` carry ``key``, drop the step's ``finished_req_ids``. Worker-side
    captures use it so that a step without a flagged request costs one dict check."""
    for r in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
        extra = getattr(getattr(r, "sampling_params", None), "extra_args", None) or {}
        if key in extra:
            flagged[r.req_id] = str(extra[key])
    for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
        flagged.pop(rid, None)
