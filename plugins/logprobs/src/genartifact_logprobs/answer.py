"""The worker's fetch answer of ``selected_logprobs``, one format for the out-of-band handover and the RPC fetch.

``{"positions": bytes, "token_ids": bytes, "logprobs": bytes}``: one entry per real sample, by ascending absolute
position (the request's token count after the step that sampled it), as little-endian ``uint32``, ``uint32`` and
``float32`` arrays of the same length. Binary rather than lists: a 32k-token request's answer is three 128 KiB
values, handed over and checked without a Python object per token (docs/benchmarks.md, issue 13 fourteenth pass).
Or ``{"error": text}``: the worker could not store one of the request's samples (engine data out of bounds).
Numpy only: the worker (:mod:`.worker`) builds it, the driver's producer reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from genartifact.errors import CaptureError

_FIELDS = (("positions", "<u4"), ("token_ids", "<u4"), ("logprobs", "<f4"))


def worker_answer(positions: Sequence[int], token_ids: Sequence[int], logprobs: Sequence[float]) -> dict[str, bytes]:
    """The answer for samples at ``positions`` (ints, ascending) of ``token_ids`` (ints) with ``logprobs`` (floats,
    stored as ``float32``: what vLLM's sampler computed). Raises ``ValueError`` when the lengths differ."""
    if not len(positions) == len(token_ids) == len(logprobs):
        raise ValueError(f"{len(positions)} positions, {len(token_ids)} token ids, {len(logprobs)} logprobs")
    return {name: np.asarray(v, dtype=dt).tobytes() for (name, dt), v in zip(_FIELDS, (positions, token_ids, logprobs),
                                                                           strict=True)}


def read_worker_answer(answer: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(positions uint32 [n], token_ids uint32 [n], logprobs float32 [n])``, read-only views of ``answer``'s
    buffers (no copy). Raises :class:`CaptureError` for an answer that is not of this format (a field missing,
    not bytes-like, not a whole number of items, or lengths that differ), and, naming it, for the worker's
    ``{"error": text}`` (a sample it could not store: engine data out of bounds)."""
    if isinstance(answer, Mapping) and "error" in answer:
        raise CaptureError(f"selected_logprobs: the worker refused this request's samples: {str(answer['error'])[:400]}")
    try:
        arrs = tuple(np.frombuffer(answer[name], dtype=dt) for name, dt in _FIELDS)
    except (KeyError, TypeError, ValueError) as e:
        raise CaptureError(f"selected_logprobs: the worker's answer is not this plugin's format "
                           f"({type(e).__name__}: {e}); driver and workers must run the same genartifact-logprobs") from None
    sizes = [a.size for a in arrs]
    if len(set(sizes)) != 1:
        raise CaptureError(f"selected_logprobs: the worker's answer holds {sizes} positions, token ids, logprobs")
    return arrs  # type: ignore[return-value]
