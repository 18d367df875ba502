"""A stand-in for an RL framework's own vLLM worker extension (verl's / OpenRLHF's ``worker_extension_cls``):
its own RPC methods, used side by side with genartifact's worker capture in ``test_engine_coexist.py``."""

from __future__ import annotations

from typing import Any


class FrameworkWorkerExtension:
    """Mixed into the vLLM worker class by vLLM (``self`` is the worker)."""

    def framework_ping(self, token: Any) -> dict[str, Any]:
        """Echo ``token`` with facts only a worker has (its rank, whether genartifact's RPC is attached)."""
        return {"echo": token, "rank": int(getattr(self, "rank", -1)),
                "genartifact_rpc": hasattr(self, "genartifact_call")}

    def framework_weight_sum(self) -> float:
        """Sum of the first parameter tensor (what a weight-sync check would read)."""
        p = next(iter(self.model_runner.model.parameters()))
        return float(p.detach().float().sum())
