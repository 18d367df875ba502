"""``token_timestamps``: when each completion token arrived at the serving process.

Tensor ``token_timestamps.arrival_ns``: ``int64 [completion_tokens]``, nanoseconds on the serving process's
monotonic clock (``time.monotonic_ns()``) after the request was admitted (so element 0 includes queueing and
prefill: the time to first token). Tokens that arrived in one engine output share its timestamp. The producer
sets ``per_step_deltas = True``, so the batch job streams this request one delta per engine step instead of
returning the final output only.
"""

from __future__ import annotations

import array
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pluggy
from genartifact.errors import ArtifactFormatError, CaptureError, ConfigError
from genartifact.format import TensorPart
from genartifact.types import AdmissionContext, Delta, FinalContext, ModelInfo

hookimpl = pluggy.HookimplMarker("genartifact")
NAME = "token_timestamps"
TENSOR = f"{NAME}.arrival_ns"
#: headroom for the manifest section (its canonical JSON is about 40 bytes), counted against admit() like tensors
SECTION_BYTES = 128


class TokenTimestamps:
    """Per-request producer: retains 8 bytes per completion token (int64)."""

    name = NAME
    per_step_deltas = True

    def __init__(self) -> None:
        self._t0 = 0
        self._max = 0
        self._ns = array.array("q")

    def admit(self, ctx: AdmissionContext) -> int:
        """Worst case: 8 bytes per completion token plus the manifest section's JSON (docs/plugins.md)."""
        self._t0 = time.monotonic_ns()
        self._max = ctx.max_tokens
        return 8 * ctx.max_tokens + SECTION_BYTES  # int64 per token + the manifest section (one admitted sum)

    def sampling_overrides(self, params: dict[str, Any]) -> None:
        """Timestamps need no change to sampling."""

    def on_delta(self, delta: Delta) -> None:
        if not delta.new_token_ids:
            return
        if delta.arrival_ns <= 0:
            raise CaptureError("token_timestamps: the engine adapter gave no arrival_ns")
        if len(self._ns) + len(delta.new_token_ids) > self._max:
            raise CaptureError(f"token_timestamps: more than the admitted {self._max} tokens")
        self._ns.extend([max(0, delta.arrival_ns - self._t0)] * len(delta.new_token_ids))

    async def collect(self, final: FinalContext) -> None:
        """Nothing is held engine-side."""

    def finalize(self, final: FinalContext) -> tuple[dict[str, Any], list[TensorPart]]:
        if len(self._ns) != final.completion_token_count:
            raise CaptureError(f"token_timestamps: {len(self._ns)} timestamps for "
                               f"{final.completion_token_count} completion tokens")
        arr = np.frombuffer(self._ns, dtype="<i8").copy() if self._ns else np.zeros(0, "<i8")
        return {"clock": "monotonic_ns", "origin": "admission"}, [TensorPart(TENSOR, arr)]

    def retained_bytes(self) -> int:
        return 8 * len(self._ns)

    def release(self) -> None:
        self._ns = array.array("q")


class Reader:
    """Strict checks (section ``{"clock": "monotonic_ns", "origin": "admission"}``; tensor int64 [C],
    non-negative, non-decreasing), typed view and ``inspect`` summary. No engine imports."""

    def validate(self, manifest: Mapping[str, Any], section: Mapping[str, Any],
                 tensors: Mapping[str, np.ndarray]) -> None:
        c = manifest["completion_token_count"]
        if dict(section) != {"clock": "monotonic_ns", "origin": "admission"}:
            raise ArtifactFormatError("token_timestamps section must be {'clock': 'monotonic_ns', 'origin': 'admission'}")
        if set(tensors) != {TENSOR}:
            raise ArtifactFormatError(f"token_timestamps needs exactly the tensor {TENSOR!r}; got {sorted(tensors)}")
        ns = tensors[TENSOR]
        if ns.dtype != np.dtype("<i8") or ns.shape != (c,):
            raise ArtifactFormatError(f"{TENSOR} must be i64 [{c}] (one per completion token)")
        if ns.size and (int(ns.min()) < 0 or bool(np.any(np.diff(ns) < 0))):
            raise ArtifactFormatError(f"{TENSOR} must be non-negative and non-decreasing")

    def view(self, manifest: Mapping[str, Any], section: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        """``int64 [C]``: ns after admission at which each completion token arrived."""
        return tensors[TENSOR]

    def summary(self, manifest: Mapping[str, Any], section: Mapping[str, Any],
                tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
        ns = tensors[TENSOR]
        gaps = np.diff(ns)
        return {"count": int(ns.size), "first_token_ms": float(ns[0]) / 1e6 if ns.size else None,
                "last_token_ms": float(ns[-1]) / 1e6 if ns.size else None,
                "mean_inter_token_ms": float(gaps.mean()) / 1e6 if gaps.size else None}

    def summary_text(self, s: Mapping[str, Any]) -> str:
        return (f"{s['count']} tokens, first at {s['first_token_ms']} ms, last at {s['last_token_ms']} ms, "
                f"mean gap {s['mean_inter_token_ms']} ms")


READER = Reader()


@hookimpl
def genartifact_content_producer(name: str, model: ModelInfo, settings: Mapping[str, Any]) -> TokenTimestamps | None:
    if name != NAME:
        return None
    extra = set(settings) - {"base_dir"}
    if extra:
        raise ConfigError(f"[contents.{NAME}]: unknown key(s) {sorted(extra)}; this content takes no settings")
    return TokenTimestamps()


@hookimpl
def genartifact_content_reader(name: str) -> Reader | None:
    return READER if name == NAME else None
