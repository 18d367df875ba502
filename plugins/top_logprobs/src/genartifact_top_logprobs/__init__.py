"""``top_logprobs``: for every sampled position the top-k token ids and their logprobs (on-policy distillation).

Source: vLLM's own ``logprobs=k`` output (``SamplingParams.logprobs``), read on the driver from each output
delta, so the stored values are exactly what the engine reports. ``k`` is the request's ``logprobs`` sampling
parameter, 1..20 (vLLM's default ``max_logprobs``); a request with this content and no ``logprobs`` is refused
at admission. Per position vLLM returns the sampled token plus the k most likely tokens (``k + 1`` entries when
the sampled token is outside the top k, ``k`` when it is one of them); the plugin keeps the top k, ordered by
descending logprob (vLLM's rank order; exact ties keep vLLM's order). Values are under the engine's
``logprobs_mode`` (manifest header), aligned 1:1 with ``selected_logprobs`` and the completion tokens.

Tensors: ``top_logprobs.token_ids`` ``u32 [C, k]`` and ``top_logprobs.logprobs`` ``f32 [C, k]`` (row *i* =
completion position *i*, columns by rank). Section: ``{"token_start": P, "k": k}``.
"""

from __future__ import annotations

import array
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pluggy
from genartifact.errors import AdmissionError, ArtifactFormatError, CaptureError
from genartifact.format import TensorPart
from genartifact.types import AdmissionContext, Delta, FinalContext, ModelInfo

hookimpl = pluggy.HookimplMarker("genartifact")
NAME = "top_logprobs"
MAX_K = 20
__version__ = "0.1.0"


class TopLogprobs:
    """Per-request producer; retains ``8 x k`` bytes per completion token (u32 id + f32 logprob per rank)."""

    name = NAME

    def __init__(self, model: ModelInfo | None = None) -> None:
        self.k = 0
        self._max_tokens = 0
        self._ids = array.array("I")
        self._lps = array.array("f")

    def admit(self, ctx: AdmissionContext) -> int:
        k = ctx.sampling.get("logprobs")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise AdmissionError(f"top_logprobs needs sampling logprobs=k with k in 1..{MAX_K}; got {k!r}")
        self.k, self._max_tokens = k, ctx.max_tokens
        return 8 * k * ctx.max_tokens + 128

    def sampling_overrides(self, params: dict[str, Any]) -> None:
        params["logprobs"] = max(int(params.get("logprobs") or 0), self.k)

    def on_delta(self, delta: Delta) -> None:
        if not delta.new_token_ids:
            return
        lps = delta.new_logprobs
        if lps is None or len(lps) != len(delta.new_token_ids):
            got = None if lps is None else len(lps)
            raise CaptureError(f"top_logprobs: engine sent {got} logprob entries for {len(delta.new_token_ids)} tokens")
        if len(self._lps) // self.k + len(lps) > self._max_tokens:
            raise CaptureError(f"top_logprobs: more than the admitted {self._max_tokens} tokens")
        for tok, pos in zip(delta.new_token_ids, lps, strict=True):
            if not isinstance(pos, Mapping):
                raise CaptureError("top_logprobs: engine logprobs entry is not a token id -> logprob mapping")
            items = [(int(t), float(getattr(v, "logprob", v))) for t, v in pos.items()]
            if len(items) == self.k + 1:  # the sampled token is outside the top k: drop it
                items = [it for it in items if it[0] != tok]
            if len(items) != self.k:
                raise CaptureError(f"top_logprobs: {len(pos)} entries for sampled token {tok}; expected k={self.k} "
                                   f"or k+1")
            items.sort(key=lambda it: -it[1])  # stable: exact ties keep the engine's order
            for t, v in items:
                if math.isnan(v) or v == math.inf:
                    raise CaptureError(f"top_logprobs: engine logprob {v} for token {t}; allowed finite or -inf")
                if not 0 <= t <= 0xFFFFFFFF:
                    raise CaptureError(f"top_logprobs: token id {t} out of range 0..2**32-1")
                self._ids.append(t)
                self._lps.append(v)

    async def collect(self, final: FinalContext) -> None:
        return None

    def finalize(self, final: FinalContext) -> tuple[dict[str, Any], list[TensorPart]]:
        c, k = final.completion_token_count, self.k
        if len(self._lps) != c * k:
            raise CaptureError(f"top_logprobs: {len(self._lps) // max(k, 1)} rows for {c} completion tokens")
        ids = np.frombuffer(self._ids, np.uint32).reshape(c, k).copy() if c else np.zeros((0, k), np.uint32)
        lps = np.frombuffer(self._lps, np.float32).reshape(c, k).copy() if c else np.zeros((0, k), np.float32)
        return ({"token_start": final.prompt_token_count, "k": k},
                [TensorPart(f"{NAME}.logprobs", lps), TensorPart(f"{NAME}.token_ids", ids)])

    def retained_bytes(self) -> int:
        return 4 * (len(self._ids) + len(self._lps))

    def release(self) -> None:
        self._ids, self._lps = array.array("I"), array.array("f")


def validate(manifest: Mapping[str, Any], section: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
    """Strict check of a stored ``top_logprobs`` content (reader side). Raises :class:`ArtifactFormatError`:
    section keys/values, tensor dtypes and shapes ``[C, k]``, NaN/+inf logprobs, rows not in descending order."""
    p, c = manifest["prompt_token_count"], manifest["completion_token_count"]
    if set(section) != {"token_start", "k"} or section["token_start"] != p:
        raise ArtifactFormatError(f"top_logprobs section must be {{'token_start': {p}, 'k': 1..{MAX_K}}}")
    k = section["k"]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ArtifactFormatError(f"top_logprobs k {k!r}; allowed 1..{MAX_K}")
    ids, lps = tensors.get(f"{NAME}.token_ids"), tensors.get(f"{NAME}.logprobs")
    if set(tensors) != {f"{NAME}.token_ids", f"{NAME}.logprobs"} or ids is None or lps is None:
        raise ArtifactFormatError(f"top_logprobs tensors must be exactly {NAME}.token_ids and {NAME}.logprobs")
    if ids.dtype != np.uint32 or lps.dtype != np.float32 or ids.shape != (c, k) or lps.shape != (c, k):
        raise ArtifactFormatError(f"top_logprobs tensors must be u32/f32 [{c}, {k}]")
    bad = np.isnan(lps) | (lps == np.inf)
    if bad.any():
        raise ArtifactFormatError("top_logprobs holds NaN or +inf; only finite values and -inf are allowed")
    if k > 1 and (np.diff(lps, axis=1) > 0).any():
        raise ArtifactFormatError("top_logprobs rows must be in descending logprob order (rank order)")


def view(manifest: Mapping[str, Any], section: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(token_ids u32 [C, k], logprobs f32 [C, k])``."""
    return tensors[f"{NAME}.token_ids"], tensors[f"{NAME}.logprobs"]


def summary(manifest: Mapping[str, Any], section: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """``inspect`` summary: k and rows."""
    return {"k": section["k"], "rows": int(tensors[f"{NAME}.logprobs"].shape[0])}


class Reader:
    """The content reader (``genartifact_content_reader``): :func:`validate`, :func:`view`, :func:`summary`."""

    name = NAME
    validate = staticmethod(validate)
    view = staticmethod(view)
    summary = staticmethod(summary)


@hookimpl
def genartifact_content_producer(name: str, model: ModelInfo) -> TopLogprobs | None:
    return TopLogprobs(model) if name == NAME else None


@hookimpl
def genartifact_content_reader(name: str) -> Reader | None:
    return Reader() if name == NAME else None
