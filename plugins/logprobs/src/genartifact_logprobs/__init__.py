"""``selected_logprobs``: the log-probability of each sampled completion token.

Per completion token, the logprob of the token actually sampled, looked up *by token id* in vLLM's
per-position ``{token_id: Logprob}`` mapping (never by position in the dict), stored as ``float32
[completion_tokens]`` aligned 1:1 with the completion tokens. When the user did not ask for logprobs the
engine is asked for ``logprobs=0`` (the sampled token only, vLLM ``SamplingParams.logprobs``) in vLLM's
flat container (``flat_logprobs=True``). Values are
as produced under the engine's ``logprobs_mode`` (recorded in the manifest header).
"""

from __future__ import annotations

import array
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pluggy
from genartifact.errors import AdmissionError, CaptureError
from genartifact.format import TensorPart
from genartifact.types import AdmissionContext, Delta, FinalContext, ModelInfo

hookimpl = pluggy.HookimplMarker("genartifact")
NAME = "selected_logprobs"
__version__ = "0.1.0"


class SelectedLogprobs:
    """Per-request producer; retains ``float32`` per completion token (4 bytes each)."""

    name = NAME

    def __init__(self) -> None:
        self._values = array.array("f")
        self._max_tokens = 0

    def admit(self, ctx: AdmissionContext) -> int:
        lp = ctx.sampling.get("logprobs")
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
            raise AdmissionError(f"logprobs must be None or an integer >= 0 for selected_logprobs; got {lp!r}")
        self._max_tokens = ctx.max_tokens
        return 4 * ctx.max_tokens + 128

    def sampling_overrides(self, params: dict[str, Any]) -> None:
        if params.get("logprobs") is None:
            # only the sampled token; vLLM's flat container avoids per-token objects (FlatLogprobs)
            params["logprobs"] = 0
            params.setdefault("flat_logprobs", True)

    def on_delta(self, delta: Delta) -> None:
        if not delta.new_token_ids:
            return
        lps = delta.new_logprobs
        if lps is None or len(lps) != len(delta.new_token_ids):
            got = None if lps is None else len(lps)
            raise CaptureError(f"selected_logprobs: engine sent {got} logprob entries for {len(delta.new_token_ids)} tokens")
        if len(self._values) + len(lps) > self._max_tokens:
            raise CaptureError(f"selected_logprobs: more than the admitted {self._max_tokens} tokens")
        for tok, pos in zip(delta.new_token_ids, lps, strict=True):
            entry = pos.get(tok) if isinstance(pos, Mapping) else None
            if entry is None:
                raise CaptureError(f"selected_logprobs: sampled token {tok} missing from the engine's logprobs")
            v = float(getattr(entry, "logprob", entry))
            if math.isnan(v) or v == math.inf:
                raise CaptureError(f"selected_logprobs: engine logprob {v} for token {tok}; allowed finite or -inf")
            self._values.append(v)

    async def collect(self, final: FinalContext) -> None:
        return None

    def finalize(self, final: FinalContext) -> tuple[dict[str, Any], list[TensorPart]]:
        if len(self._values) != final.completion_token_count:
            raise CaptureError(
                f"selected_logprobs: {len(self._values)} values for {final.completion_token_count} completion tokens"
            )
        arr = np.frombuffer(self._values, dtype=np.float32).copy() if self._values else np.zeros(0, np.float32)
        return {"token_start": final.prompt_token_count}, [TensorPart(f"{NAME}.logprobs", arr)]

    def retained_bytes(self) -> int:
        return 4 * len(self._values)

    def release(self) -> None:
        self._values = array.array("f")


@hookimpl
def genartifact_content_producer(name: str, model: ModelInfo) -> SelectedLogprobs | None:
    return SelectedLogprobs() if name == NAME else None
