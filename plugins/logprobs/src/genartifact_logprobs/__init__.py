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
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import pluggy
from genartifact.engine.worker_ext import discard_capture, fetch_capture
from genartifact.errors import AdmissionError, ArtifactFormatError, CaptureError
from genartifact.format import TensorPart
from genartifact.types import AdmissionContext, Delta, FinalContext, ModelInfo

from genartifact_logprobs.answer import read_worker_answer

hookimpl = pluggy.HookimplMarker("genartifact")
NAME = "selected_logprobs"
__version__ = "0.1.0"


class SelectedLogprobs:
    """Per-request producer; retains ``float32`` per completion token (4 bytes each).

    Two sources: ``worker`` (default when the genartifact worker extension runs and ``logprobs_mode`` is
    ``raw_logprobs``: the sampled token's logprob is taken inside the worker, see :mod:`.worker`) and ``engine``
    (vLLM's reported logprobs, ``logprobs=0``). ``GENARTIFACT_LOGPROBS_SOURCE=engine`` forces the latter."""

    name = NAME

    def __init__(self, model: ModelInfo | None = None) -> None:
        self._values = array.array("f")
        self._max_tokens = 0
        self._seen = 0
        opts = model.engine_options if model is not None else {}
        self.worker_source = (NAME in (opts.get("worker_captures") or ()) and opts.get("logprobs_mode") == "raw_logprobs"
                              and os.environ.get("GENARTIFACT_LOGPROBS_SOURCE", "worker") != "engine")
        self.capture_id: str | None = None
        self._fetched = False
        # worker source: the values come from collect; max_tokens per delta is the session's own check
        self.consumes_deltas = not self.worker_source

    def admit(self, ctx: AdmissionContext) -> int:
        lp = ctx.sampling.get("logprobs")
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
            raise AdmissionError(f"logprobs must be None or an integer >= 0 for selected_logprobs; got {lp!r}")
        self._max_tokens = ctx.max_tokens
        return 4 * ctx.max_tokens + 128

    def sampling_overrides(self, params: dict[str, Any]) -> None:
        if self.worker_source:
            self.capture_id = os.urandom(16).hex()  # 128 random bits, like uuid4
            params["extra_args"] = {**(params.get("extra_args") or {}), "genartifact_logprobs_id": self.capture_id}
            return
        if params.get("logprobs") is None:
            # only the sampled token; vLLM's flat container avoids per-token objects (FlatLogprobs)
            params["logprobs"] = 0
            params.setdefault("flat_logprobs", True)

    def on_delta(self, delta: Delta) -> None:
        if not delta.new_token_ids:
            return
        if self.worker_source:  # values come from the worker at collect time
            self._seen += len(delta.new_token_ids)
            if self._seen > self._max_tokens:
                raise CaptureError(f"selected_logprobs: more than the admitted {self._max_tokens} tokens")
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
        if not self.worker_source or self.capture_id is None:
            return
        if final.engine is None:
            raise CaptureError("selected_logprobs: worker source needs the engine at collect time")
        self._fetched = True
        p, c = final.prompt_token_count, final.completion_token_count
        try:
            r = await fetch_capture(final.engine, NAME, self.capture_id)
        except CaptureError:
            if c == 0:  # no sample was ever taken, so no worker saw one
                return
            raise
        positions, token_ids, arr = read_worker_answer(r)
        if positions.size != c or not np.array_equal(positions, np.arange(p, p + c)):
            raise CaptureError(f"selected_logprobs: worker sent {positions.size} samples at positions "
                               f"{positions[:3].tolist()}...; expected {c} at {p}..{p + c - 1}")
        if token_ids.tolist() != list(final.completion_token_ids):
            raise CaptureError("selected_logprobs: worker-sampled token ids differ from the completion tokens")
        bad = np.flatnonzero(np.isnan(arr) | (arr == np.inf))  # one pass, not a Python check per value
        if bad.size:
            i = int(bad[0])
            raise CaptureError(f"selected_logprobs: logprob {float(arr[i])} for token {int(token_ids[i])}; "
                               "allowed finite or -inf")
        self._values = array.array("f", arr.astype("=f4", copy=False).tobytes())

    async def discard(self, engine: Any) -> None:
        """Drop worker-side samples not fetched (request failed or was cancelled)."""
        if self.worker_source and self.capture_id is not None and not self._fetched and engine is not None:
            self._fetched = True
            await discard_capture(engine, NAME, self.capture_id)

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


class SelectedLogprobsReader:
    """Strict decode-side checks, typed view and ``inspect`` summary of ``selected_logprobs``: section
    ``{"token_start": P}``; tensor ``selected_logprobs.logprobs`` ``f32 [C]``, finite or -inf (no NaN, no +inf)."""

    def validate(self, manifest: Mapping[str, Any], s: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        p, c = manifest["prompt_token_count"], manifest["completion_token_count"]
        extra = set(tensors) - {f"{NAME}.logprobs"}
        if extra:
            raise ArtifactFormatError(f"selected_logprobs has unknown tensor(s) {sorted(extra)}; "
                                      f"allowed: ['selected_logprobs.logprobs']")
        lp = tensors.get(f"{NAME}.logprobs")
        if lp is None or lp.dtype != np.float32 or lp.shape != (c,):
            raise ArtifactFormatError(f"selected_logprobs.logprobs must be f32 [{c}]")
        if s.get("token_start") != p or set(s) != {"token_start"}:
            raise ArtifactFormatError(f"selected_logprobs section must be {{'token_start': {p}}} (prompt_token_count)")
        # one reduction, no temporaries: max is NaN if any value is NaN (numpy propagates NaN) and +inf if any is
        # +inf; only then is the offending index looked up
        if lp.size and not lp.max() < np.inf:
            bad = np.nonzero(np.isnan(lp) | (lp > 0) & np.isinf(lp))[0]
            raise ArtifactFormatError(
                f"selected_logprobs[{int(bad[0])}] is {float(lp[bad[0]])}; only finite values and -inf are allowed")

    def view(self, manifest: Mapping[str, Any], s: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        """``float32 [completion_token_count]``: logprob of each sampled token."""
        return tensors[f"{NAME}.logprobs"]

    def summary(self, manifest: Mapping[str, Any], s: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
        lp = self.view(manifest, s, tensors)
        finite = lp[np.isfinite(lp)]
        return {"count": int(lp.size), "mean": float(finite.mean()) if finite.size else None,
                "neg_inf": int(np.isneginf(lp).sum())}

    def summary_text(self, summary: Mapping[str, Any]) -> str:
        return f"{summary['count']} values, mean {summary['mean']}"


READER = SelectedLogprobsReader()


@hookimpl
def genartifact_content_producer(name: str, model: ModelInfo) -> SelectedLogprobs | None:
    return SelectedLogprobs(model) if name == NAME else None


@hookimpl
def genartifact_content_reader(name: str) -> SelectedLogprobsReader | None:
    return READER if name == NAME else None


@hookimpl
def genartifact_worker_capture(worker: Any, settings: Mapping[str, Any]) -> Any:
    """The worker source's capture (see :mod:`.worker`), for ``logprobs_mode = raw_logprobs`` engines."""
    if str(getattr(worker.vllm_config.model_config, "logprobs_mode", "raw_logprobs")) != "raw_logprobs":
        return None
    from genartifact_logprobs.worker import LogprobCapture

    return LogprobCapture(worker)
