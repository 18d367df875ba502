"""Engine-neutral data passed through hooks. No engine imports: the adapter converts vLLM objects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from genartifact.errors import ArtifactFormatError
from genartifact.format import TensorPart, canonical_json


@dataclass(frozen=True)
class ModelInfo:
    """What admission and capture need to know about the serving engine and model.

    ``hf_config``: the model's ``config.json`` as a dict (text config merged, as vLLM's ``hf_text_config``).
    ``engine_options``: resolved engine settings that change what can be captured, e.g.
    ``{"enable_prefix_caching": False, "worker_capture": True, "worker_captures": ["moe_routes"], "native_routed_experts": False,
    "logprobs_mode": "raw_logprobs"}``.
    """

    name: str
    hf_config: Mapping[str, Any]
    engine_name: str = "vllm"
    engine_version: str = "unknown"
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    config_sha256: str = ""


@dataclass(frozen=True)
class AdmissionContext:
    """Worst-case shape of one request, known before inference (units: tokens)."""

    prompt_token_count: int
    max_tokens: int
    routes_start: int
    model: ModelInfo
    sampling: Mapping[str, Any]


@dataclass(frozen=True)
class Delta:
    """One engine output delta for a single-choice request (vLLM ``RequestOutputKind.DELTA``).

    ``prompt_token_ids`` is set on every delta by vLLM and must never change. ``new_token_ids`` are the
    completion tokens added by this delta. ``new_logprobs`` (optional) is aligned 1:1 with
    ``new_token_ids``: per token a mapping token id -> logprob (float, or an object with ``.logprob``),
    vLLM's ``SampleLogprobs`` shape. ``routed_experts`` is vLLM's native ``CompletionOutput.routed_experts``
    (``[rows, num_hidden_layers, top_k]``, any integer dtype) when the engine returns it, else None.
    ``finish_reason``: vLLM's ``CompletionOutput.finish_reason`` (``"stop"``, ``"length"``, ``"abort"``) on the
    final delta, else None. ``arrival_ns``: when the front end received this output, ``time.monotonic_ns()``
    (nanoseconds, monotonic clock of the serving process; 0 when unknown).

    Granularity: requests whose contents need per-step deltas (a producer with ``per_step_deltas = True``)
    get one delta per engine step; otherwise the batch job may deliver a single final delta holding every
    token (vLLM ``FINAL_ONLY``).
    """

    prompt_token_ids: Sequence[int]
    new_token_ids: Sequence[int]
    new_logprobs: Sequence[Mapping[int, Any]] | None = None
    routed_experts: np.ndarray | None = None
    finished: bool = False
    finish_reason: str | None = None
    arrival_ns: int = 0


@runtime_checkable
class EngineHandle(Protocol):
    """The live engine as seen by content plugins at collect time."""

    async def worker_call(self, method: str, *args: Any) -> list[Any]:
        """Run worker-side hook ``method`` on every worker (vLLM ``collective_rpc``); one result per worker."""
        ...


@dataclass
class FinalContext:
    """Token facts at finalize: ``prompt_token_count``, ``completion_token_count`` (tokens), the engine handle
    (None when finalizing without an engine, e.g. in unit tests) and the completion token ids (the alignment
    authority for engine-side captures; a tuple, the host's copy: what a plugin does to it changes nothing
    stored)."""

    prompt_token_count: int
    completion_token_count: int
    engine: EngineHandle | None = None
    completion_token_ids: Sequence[int] = ()


class ContentProducer(Protocol):
    """Per-request state of one content plugin. Created by ``genartifact_content_producer``.

    Lifecycle: ``admit`` -> ``sampling_overrides`` -> ``on_delta``* -> ``collect`` -> ``finalize``;
    ``discard(engine)`` (optional) and ``release`` always, also after errors.

    Required: every method below except ``discard``. Optional attributes: ``per_step_deltas = True`` when the
    content needs one delta per engine step (e.g. per-token timestamps); ``consumes_deltas = False`` (read at
    admission) when it takes nothing from deltas (its data comes from ``collect``): the host then skips its
    ``on_delta`` and per-delta ``retained_bytes`` calls (both flags read once, after ``admit``; each must be a
    bool, else a plugin fault); ``discard``. Exceptions: ``admit``
    and ``sampling_overrides`` may raise ``AdmissionError`` (request rejected before inference); ``on_delta``,
    ``collect`` and ``finalize`` may raise ``CaptureError`` (receipt ``capture_invalid``). Anything else, or a
    wrong return value, is a plugin fault: that request's receipt is ``failed`` / ``internal_error`` and the
    log names the plugin (docs/plugins.md).
    """

    name: str

    def admit(self, ctx: AdmissionContext) -> int:
        """Return the worst-case decoded bytes of this content's tensors (``sum(nbytes)``) plus its manifest
        section (canonical JSON bytes, :func:`content_section_bytes`). ``finalize`` is held to
        exactly this sum by the host (a breach is a plugin fault, ``internal_error``). Raise
        :class:`~genartifact.errors.AdmissionError` if the engine cannot produce it."""

    def sampling_overrides(self, params: dict[str, Any]) -> None:
        """Adjust engine sampling kwargs in place (e.g. ``logprobs=0``; ``extra_args``)."""

    def on_delta(self, delta: Delta) -> None:
        """Keep only what this content needs; raise ``CaptureError`` when bounds are violated."""

    async def collect(self, final: FinalContext) -> None:
        """After the request finished: fetch anything held engine-side (e.g. worker route rows)."""

    def finalize(self, final: FinalContext) -> tuple[dict[str, Any], list[TensorPart]]:
        """Return this content's manifest section and tensors; revalidates admitted bounds."""

    def retained_bytes(self) -> int:
        """Bytes currently retained by this producer (counted against the admitted budget)."""

    def release(self) -> None:
        """Drop all retained state. Idempotent."""

    async def discard(self, engine: EngineHandle | None) -> None:
        """Optional: drop engine-side state not fetched by ``collect`` (request failed or cancelled). Idempotent."""


class ContentReader(Protocol):
    """Decode-side knowledge of one content, from ``genartifact_content_reader``. Must import neither vLLM nor
    torch. Arguments: ``manifest`` (the whole validated envelope: ``prompt_token_count``,
    ``completion_token_count``, ...), ``section`` (this content's manifest section), ``tensors`` (this content's
    tensors by full name, read-only numpy views)."""

    def validate(self, manifest: Mapping[str, Any], section: Mapping[str, Any],
                 tensors: Mapping[str, np.ndarray]) -> None:
        """Strictly check section and tensors (keys, dtypes, shapes aligned with the token counts, value ranges);
        raise :class:`~genartifact.errors.ArtifactFormatError` naming the field. Runs on encode and decode."""

    def summary(self, manifest: Mapping[str, Any], section: Mapping[str, Any],
                tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """A small JSON-compatible summary (``inspect --json`` puts it under the content's name)."""

    def view(self, manifest: Mapping[str, Any], section: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Any:
        """Optional: the typed accessor returned by ``Artifact.content(name)``."""

    def summary_text(self, summary: Mapping[str, Any]) -> str:
        """Optional: one line for ``inspect``'s text output, from this reader's own :meth:`summary`."""


@dataclass(frozen=True)
class ValidatedTarget:
    """A target spec that passed side-effect-free validation. ``max_bytes``: the target's byte limit (bytes);
    ``object_id``: the opaque id that the receipt carries (the host checks that ``deliver`` returns exactly this
    id); ``detail``: target-private, never logged."""

    kind: str
    max_bytes: int
    object_id: str
    detail: Any = field(repr=False, compare=False, default=None)


class StorageTarget(Protocol):
    """A storage backend (one per target kind), created by ``genartifact_storage_target``.

    Required: ``validate``, ``deliver``. Optional: ``describe`` (journal reference), ``open``/``exists``/
    ``delete`` (read-back: ``inspect``, ``verify --receipts``, ``reconcile``). Exceptions: ``TargetError`` and
    ``DeliveryError`` (with a code from docs/receipts.md); anything else, or a wrong return value, is a plugin
    fault (receipt ``internal_error``)."""

    kind: str

    def validate(self, spec: Mapping[str, Any]) -> ValidatedTarget:
        """Validate a request's ``delivery.target`` without side effects; raise ``TargetError``."""

    def describe(self, target: ValidatedTarget) -> dict[str, Any]:
        """Optional: a non-secret reference for the delivery journal (never URLs, headers or credentials)."""

    async def deliver(self, target: ValidatedTarget, data: bytes, sha256: str) -> str:
        """Store exactly ``data`` create-only and all-or-nothing; return the object id.
        Raise ``DeliveryError`` (with a stable ``code``) on any failure, leaving nothing at the key."""

    async def open(self, object_id: str, max_bytes: int) -> bytes:
        """Read back the object a receipt names (``object_id`` as returned by :meth:`deliver`), reading at
        most ``max_bytes`` bytes. Raises :class:`~genartifact.errors.ObjectNotFoundError` when absent,
        :class:`~genartifact.errors.ObjectTooLargeError` when larger than ``max_bytes``,
        :class:`~genartifact.errors.TargetNotReadableError` when the kind cannot read (write-only grants) and
        :class:`~genartifact.errors.TargetError` for an id this target does not accept."""

    async def exists(self, object_id: str) -> bool:
        """Whether an object is stored under ``object_id``. Same errors as :meth:`open` (bar not-found)."""

    async def delete(self, object_id: str, sha256: str) -> bool:
        """Conditional delete: remove the object only if its bytes hash (SHA-256, lowercase hex) to ``sha256``,
        hashing while streaming and never reading more than the target's ``max_bytes`` (a larger object is not
        ours and is kept). Returns True if deleted, False if absent or different. Raises
        :class:`~genartifact.errors.TargetNotReadableError` when the kind cannot delete."""


def content_section_bytes(section: Any) -> int | None:
    """Bytes a content's manifest ``section`` adds to the decoded artifact (its canonical JSON, as the encoder
    writes it), or None when it is not JSON-compatible. This plus the content's tensor ``nbytes`` is what
    ``admit()`` bounds (the one over-admission rule, checked by the host's guarded producer at ``finalize``).
    Public for plugin authors (also importable as ``genartifact.host.content_section_bytes``)."""
    try:
        return len(canonical_json(section))
    except ArtifactFormatError:
        return None
