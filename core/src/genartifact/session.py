"""One request's artifact lifecycle: admit -> capture deltas -> finalize (encode + deliver) -> release.

Admission runs before inference and takes no pipeline slot. Finalize encodes off the event loop and
delivers under the host's per-event-loop pipeline semaphore. Cancellation (see :meth:`ArtifactSession.finalize`):
cancelled before its slot is taken, the operation never starts; cancelled after, it finishes in the
background and keeps its slot until done.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import structlog

from genartifact import format as fmt
from genartifact.errors import (
    AdmissionError,
    ArtifactFormatError,
    CaptureError,
    DeliveryError,
    GenartifactError,
    PluginFault,
    TargetError,
)
from genartifact.host import PluginHost, redact
from genartifact.journal import DeliveryJournal
from genartifact.limits import SMALL_ARTIFACT_BYTES, max_decoded_bytes
from genartifact.spec import ArtifactRequest
from genartifact.types import AdmissionContext, ContentProducer, Delta, FinalContext, ModelInfo, ValidatedTarget

log = structlog.get_logger("genartifact.session")

#: Stable receipt error codes (docs/receipts.md).
ERROR_MESSAGES = {
    "capture_invalid": "captured engine data was missing or out of the admitted bounds (the log line "
                       "artifact_capture_invalid has the cause)",
    "encode_failed": "generation artifact encoding failed",
    "target_invalid": "generation artifact target became invalid",
    "too_large": "generation artifact exceeds the target byte limit",
    "delivery_failed": "generation artifact delivery failed",
    "object_exists": "generation artifact object already exists",
    "timeout": "generation artifact delivery timed out",
    "expired": "generation artifact grant expired",
    "signature_mismatch": "generation artifact upload was refused: the request does not match the URL's signature",
    "forbidden": "generation artifact upload was refused by the store (403)",
    "redirect_refused": "generation artifact upload was redirected; redirects are not followed",
    "internal_error": "generation artifact failed",
    "generation_aborted": "generation did not finish: the engine aborted the request (vLLM finish_reason 'abort'); "
                          "nothing was stored",
    "engine_failed": "generation did not finish: the engine ended the request with an error (vLLM finish_reason "
                     "'error'); nothing was stored",
}

#: vLLM finish reasons (``vllm.v1.engine.FinishReason``) of a generation that did not run to its end, and the
#: receipt's error code for each: its artifact would look complete while its completion was cut short
UNFINISHED = {"abort": "generation_aborted", "error": "engine_failed"}

MANIFEST_BASE_BYTES = 8192
MANIFEST_BYTES_PER_ROUTER = 24
TOKEN_BYTES = 4  # token ids are stored as uint32


def check_routes_start(routes_start: Any, prompt_token_count: int) -> None:
    """vLLM's rule for ``routed_experts_prompt_start`` (``v1/engine/input_processor.py``): an integer
    ``0 <= start <= prompt length`` (tokens), else the request is refused, never silently clamped or ignored.
    Raises :class:`~genartifact.errors.AdmissionError` naming the field and the allowed values."""
    allowed = f"allowed: an integer 0..{prompt_token_count} (the prompt length, inclusive, as vLLM requires)"
    if isinstance(routes_start, bool) or not isinstance(routes_start, int) or routes_start < 0:
        raise AdmissionError(f"routed_experts_prompt_start must be a non-negative integer; got "
                             f"{str(routes_start)[:40]}; {allowed}")
    if routes_start > prompt_token_count:
        raise AdmissionError(f"routed_experts_prompt_start={str(routes_start)[:40]} is beyond the prompt; {allowed}")


def failed_receipt(req: ArtifactRequest, code: str) -> dict[str, Any]:
    """Receipt for a failed artifact: stable code and generic message, no provider detail. ``target`` is the
    request's target kind (docs/receipts.md)."""
    return {
        "format": req.format,
        "contents": sorted(req.contents),
        "state": "failed",
        "target": req.target_kind,
        "error_code": code,
        "error": ERROR_MESSAGES.get(code, ERROR_MESSAGES["internal_error"]),
    }


def fault_receipt(req: ArtifactRequest | None, fault: PluginFault) -> dict[str, Any]:
    """The ``failed`` / ``internal_error`` receipt of a request whose plugin broke its contract (the fault was
    logged, naming the plugin, when it was raised). Without a parsed request, a minimal receipt."""
    if req is not None:
        return failed_receipt(req, "internal_error")
    return {"state": "failed", "error_code": "internal_error", "error": ERROR_MESSAGES["internal_error"]}


class ArtifactSession:
    """Artifact state of a single-choice request.

    :param host: the plugin host (provides content producers, targets and the pipeline semaphore).
    :param request: a validated :class:`~genartifact.spec.ArtifactRequest`.
    :param model: engine/model facts.
    :param target: a storage target instance for ``request.target_kind`` (from :meth:`for_request`).

    ``recover_existing`` (set by ``generate --resume``; default False): when the create-only delivery answers
    ``object_exists``, the stored object is read back through the target (at most this run's encoded byte count,
    which admission bounded by the target's ``max_bytes``) and, if its byte count and SHA-256 equal the bytes this
    run just encoded (a deterministic rerun: seeded or temperature 0), the receipt is ``ready`` with
    ``"recovered": "rerun_match"``. Anything else (different bytes, larger, unreadable, a target without
    read-back such as presigned grants) stays ``object_exists``; outside a resume a duplicate always fails so.
    """

    recover_existing: bool = False

    def __init__(self, host: PluginHost, request: ArtifactRequest, model: ModelInfo, target: Any,
                 producers: list[ContentProducer], journal: DeliveryJournal | None = None) -> None:
        self.host = host
        self.journal = journal
        self.request = request
        self.model = model
        self._target = target
        self._producers = producers
        self._validated: ValidatedTarget | None = None
        self._prompt: list[int] | None = None
        self._completion = array.array("I")
        self.prompt_token_count = 0
        self.max_tokens = 0
        self.budget = 0
        self.encoded_bound = 0
        self._header: dict[str, Any] = {}
        self._finished = False
        self._finish_reason: str | None = None
        self.peak_retained = 0
        self.failed_code: str | None = None
        # the producers' optional flags, read once at admission (per_step_deltas, consumes_deltas)
        self._delta_producers: list[Any] = []
        self._per_step: bool | None = None
        # GRPO groups (generate "n" > 1): the group's collector and this sample's index; see groups.GroupCollector
        self.group: Any = None
        self.group_index: int | None = None

    @classmethod
    def for_request(cls, host: PluginHost, request: ArtifactRequest, model: ModelInfo,
                    target_settings: Mapping[str, Mapping[str, Any]],
                    journal: DeliveryJournal | None = None,
                    content_settings: Mapping[str, Mapping[str, Any]] | None = None) -> ArtifactSession:
        """Resolve content producers and the target from enabled plugins (each wrapped by the host's fault
        isolation). With a ``journal``, every upload is recorded (intent before, outcome after) for
        ``genartifact reconcile``. ``content_settings``: content name -> its ``[contents.<name>]`` table.

        :raises UnknownPluginError: a content name or target kind has no enabled plugin (fail fast).
        :raises PluginFault: a plugin factory raised or returned a wrong object (-> ``internal_error``).
        """
        names = [host.require("contents", c, "generation_artifact.contents").name for c in request.contents]
        kind = host.require("targets", request.target_kind, "generation_artifact.delivery.target.kind").name
        producers = []
        csettings = content_settings if content_settings is not None else getattr(host, "content_settings", {})
        for c in names:
            p = host.hooks.content_producer(name=c, model=model, settings=csettings.get(c, {}))
            if p is None:
                raise AdmissionError(f"content '{c}': its plugin returned no producer for model {model.name!r}")
            producers.append(p)
        target = host.hooks.storage_target(kind=kind, settings=target_settings.get(kind, {}))
        if target is None:
            raise AdmissionError(f"target kind '{kind}': its plugin returned no target")
        return cls(host, request, model, target, producers, journal)

    # ------------------------------------------------------------------ admission
    def admit(self, prompt_token_count: int, max_tokens: int, *, routes_start: int = 0,
              sampling: Mapping[str, Any] | None = None) -> None:
        """Admit the request before inference.

        Worst-case decoded bytes = manifest bound + uint32 tokens ``(P + max_tokens)`` + each content's
        worst case + 64-byte alignment per tensor; the encoded bound adds zstd's compress bound.
        :raises AdmissionError: above ``GENARTIFACT_MAX_DECODED_BYTES`` (default 64 MiB) or the target's
            ``max_bytes``; or a producer cannot be served by this engine.
        :raises TargetError: the target spec is invalid (validation has no side effects).
        """
        for name, v in (("prompt_token_count", prompt_token_count), ("max_tokens", max_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "max_tokens" else 0):
                raise AdmissionError(f"{name} must be an integer >= {1 if name == 'max_tokens' else 0}; got {v!r}")
        check_routes_start(routes_start, prompt_token_count)
        self._check_worker_captures()
        sampling = dict(sampling or {})
        for k, v in sampling.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise AdmissionError(f"sampling {k}={v!r} is not a finite number; allowed: finite numbers "
                                     f"(the artifact header records it as JSON)")
        ctx = AdmissionContext(prompt_token_count, max_tokens, routes_start, self.model, sampling)
        validated = self._target.validate(self.request.target)
        self._header = self._make_header(sampling)
        content_bytes = sum(p.admit(ctx) for p in self._producers)
        tensors = 1 + 2 * len(self._producers)
        decoded = (MANIFEST_BASE_BYTES + _header_bytes(self._header) + fmt.ALIGN * tensors
                   + TOKEN_BYTES * (prompt_token_count + max_tokens) + content_bytes)
        limit = max_decoded_bytes()
        if decoded > limit:
            raise AdmissionError(
                f"worst-case decoded artifact is {decoded} bytes (prompt {prompt_token_count} + max_tokens "
                f"{max_tokens} tokens, contents {list(self.request.contents)}); limit {limit} bytes "
                f"(GENARTIFACT_MAX_DECODED_BYTES); lower max_tokens or request fewer contents"
            )
        bound = fmt.encoded_size_bound(decoded)
        if bound > validated.max_bytes:
            raise AdmissionError(
                f"worst-case encoded artifact is {bound} bytes; target max_bytes is {validated.max_bytes}; "
                f"lower max_tokens or raise the target's max_bytes"
            )
        # the producers' optional flags, read once, after every admit returned (a producer may set them there; a
        # faulty one is a plugin fault at admission): producers fed per delta (the others declared
        # consumes_deltas = False: their data comes from collect), and whether any needs per-step deltas
        self._delta_producers = [p for p in self._producers if p.consumes_deltas]
        self._per_step = any([p.per_step_deltas for p in self._producers])  # every flag checked
        self._validated = validated
        self.prompt_token_count, self.max_tokens = prompt_token_count, max_tokens
        self.budget, self.encoded_bound = decoded, bound
        self.routes_start = ctx.routes_start

    def _check_worker_captures(self) -> None:
        """:raises PluginFault: a requested content's worker capture could not be installed when the engine started
        (``engine_options["worker_capture_faults"]``: its plugin's ``genartifact_worker_capture`` raised or returned a
        wrong object): this request fails (``internal_error``) before inference, requests without it run."""
        faults = self.model.engine_options.get("worker_capture_faults") or {}
        for p in self._producers:
            msg = faults.get(p.name)
            if msg:
                label = p.info.label() if p.info else p.name
                log.error("plugin_fault", plugin=p.name, dist=p.info.dist if p.info else None,
                          method="genartifact_worker_capture", error_type="worker_capture_unavailable")
                raise PluginFault(f"content '{p.name}': its worker capture could not be installed when the engine "
                                  f"started ({redact(msg, 600)}); its requests fail until the plugin is fixed and the "
                                  f"engine restarted", plugin=label, method="genartifact_worker_capture",
                                  error_type="worker_capture_unavailable")

    def _make_header(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        opts = self.model.engine_options
        return {
            "engine": {"name": self.model.engine_name, "version": self.model.engine_version},
            "model": {"name": self.model.name, "config_sha256": self.model.config_sha256},
            "sampling": {
                "temperature": sampling.get("temperature"),
                "top_p": sampling.get("top_p"),
                "top_k": sampling.get("top_k"),
                "seed": sampling.get("seed"),
                "logprobs_mode": opts.get("logprobs_mode"),
                "engine_seed": opts.get("seed"),
            },
        }

    def sampling_overrides(self, params: dict[str, Any]) -> dict[str, Any]:
        """Let each producer adjust the engine sampling kwargs (in place); returns ``params``."""
        self._require_admitted()
        for p in self._producers:
            p.sampling_overrides(params)
        return params

    def _require_admitted(self) -> None:
        if self._validated is None:
            raise CaptureError("session not admitted (call admit() before inference)")

    # ------------------------------------------------------------------ capture
    def record(self, delta: Delta) -> None:
        """Capture one engine delta, revalidating admitted bounds.

        :raises CaptureError: prompt length changed, completion beyond ``max_tokens``, a producer's data
            out of bounds, or retained bytes above the admitted budget.
        """
        self._require_admitted()
        if self._finished:
            raise CaptureError("delta received after the final delta")
        n_prompt = len(delta.prompt_token_ids)  # no per-delta copy: O(1) check after the first delta
        prompt = self._prompt
        if prompt is None:
            if n_prompt != self.prompt_token_count:
                raise CaptureError(f"engine prompt has {n_prompt} tokens; admitted {self.prompt_token_count}")
            self._prompt = list(delta.prompt_token_ids)
        elif n_prompt != len(prompt):
            raise CaptureError(f"prompt length changed from {len(prompt)} to {n_prompt} tokens")
        completion, new = self._completion, delta.new_token_ids
        if len(completion) + len(new) > self.max_tokens:
            raise CaptureError(
                f"completion reached {len(completion) + len(new)} tokens; admitted max_tokens {self.max_tokens}"
            )
        try:
            completion.extend(new)
        except OverflowError:
            raise CaptureError("token id out of range 0..2**32-1") from None
        # only the producers fed per delta (the others retain nothing between collects), then the budget
        if self._delta_producers:
            retained = TOKEN_BYTES * (n_prompt + len(completion))
            for p in self._delta_producers:
                p.on_delta(delta)
                retained += p.retained_bytes()
            if retained > self.peak_retained:
                self.peak_retained = retained
            if retained > self.budget:
                raise CaptureError(f"retained {retained} bytes exceed the admitted budget of {self.budget} bytes")
        self._finished = delta.finished
        self._finish_reason = delta.finish_reason

    def record_or_fail(self, delta: Delta) -> None:
        """Like :meth:`record`, but a :class:`CaptureError` marks the artifact failed (``capture_invalid``)
        and drops retained data instead of raising, so generation continues. Later deltas are ignored."""
        if self.failed_code is not None:
            return
        try:
            self.record(delta)
        except CaptureError as e:
            log.warning("artifact_capture_invalid", error=redact(str(e)), contents=sorted(self.request.contents))
            self.failed_code = "capture_invalid"
            for p in self._producers:
                p.release()
        except PluginFault:  # logged with the plugin's name when raised; generation goes on
            self.failed_code = "internal_error"
            for p in self._producers:
                p.release()

    def _check_budget(self) -> None:
        retained = self.retained_bytes()
        self.peak_retained = max(self.peak_retained, retained)
        if retained > self.budget:
            raise CaptureError(f"retained {retained} bytes exceed the admitted budget of {self.budget} bytes")

    def retained_bytes(self) -> int:
        """Bytes retained now: token ids plus every producer's retained bytes."""
        tokens = TOKEN_BYTES * (len(self._prompt or ()) + len(self._completion))
        return tokens + sum(p.retained_bytes() for p in self._producers)

    @property
    def per_step_deltas(self) -> bool:
        """True if any requested content needs one delta per engine step (its producer's ``per_step_deltas``, read
        once at admission); the job then streams this request instead of asking the engine for the final output
        only. :raises PluginFault: before admission only, a producer's flag raises or is not a bool."""
        if self._per_step is None:  # not admitted yet
            return any([p.per_step_deltas for p in self._producers])
        return self._per_step

    @property
    def consumes_deltas(self) -> bool:
        """False once admitted when no requested content takes anything from deltas (every producer declared
        ``consumes_deltas = False``): the engine adapter then records the whole completion as one delta when the
        stream ends (:meth:`record_or_fail` once, the same checks of prompt length and ``max_tokens``) instead of
        once per engine step. True before admission."""
        return self._per_step is None or bool(self._delta_producers)

    @property
    def completion_token_ids(self) -> list[int]:
        return list(self._completion)

    # ------------------------------------------------------------------ finalize
    async def finalize(self, engine: Any = None) -> dict[str, Any]:
        """Collect, encode off the event loop, deliver, and return the receipt.

        Never raises for artifact failures: returns a failed receipt (``state: failed``, stable
        ``error_code``). Raises ``asyncio.CancelledError`` if cancelled; if the encode/deliver operation had
        already started it keeps running in the background (holding its pipeline slot) until done.
        """
        self._require_admitted()
        if self.failed_code is not None:
            return failed_receipt(self.request, self.failed_code)
        unfinished = UNFINISHED.get(str(self._finish_reason))
        if unfinished is not None:  # cut short (an abort by the engine's owner, the engine shutting down): no object
            log.warning("artifact_generation_unfinished", finish_reason=self._finish_reason,
                        completion_tokens=len(self._completion), contents=sorted(self.request.contents))
            return failed_receipt(self.request, unfinished)
        # a copy: the session's own token buffer (what is stored) must not be writable by a plugin's collect
        final = FinalContext(self.prompt_token_count, len(self._completion), engine, tuple(self._completion))
        try:
            for p in self._producers:
                await p.collect(final)
            self._check_budget()
            inp = self._build_input(final)
        except CaptureError as e:
            log.warning("artifact_capture_invalid", error=redact(str(e)), contents=sorted(self.request.contents))
            return failed_receipt(self.request, "capture_invalid")
        except PluginFault:  # already logged, naming the plugin
            return failed_receipt(self.request, "internal_error")
        except Exception as e:  # noqa: BLE001 - a plugin bug must not fail generation
            log.error("artifact_collect_failed", error_type=type(e).__name__, error=redact(str(e)))
            return failed_receipt(self.request, "internal_error")
        group_field = None
        if self.group is not None:  # a group sample: wait until the prompt part is settled (holding no slot)
            slot = await self.group.submit(self.group_index, inp)
            inp, group_field = slot.input, slot.receipt_group
        sem = self._pipeline()
        await sem.acquire()  # cancelled here -> the operation never starts
        task = asyncio.ensure_future(self._encode_and_deliver(inp, sem, self._validated, self.budget))
        task.add_done_callback(_consume)
        receipt = await asyncio.shield(task)
        return receipt if group_field is None else {**receipt, "group": group_field}

    async def deliver_extra(self, inp: fmt.ArtifactInput, target_spec: Mapping[str, Any]) -> dict[str, Any]:
        """Encode and store one more object of this request (a group's prompt part) at ``target_spec`` (same
        target kind, validated here), journaled and bounded like the request's own artifact (its admitted
        decoded budget and the target's ``max_bytes``). Returns its receipt; never raises for delivery failures
        (a ``failed`` receipt with the stable code, ``target_invalid`` for a spec the target refuses)."""
        self._require_admitted()
        try:
            validated = self._target.validate(target_spec)
        except TargetError:
            return failed_receipt(self.request, "target_invalid")
        sem = self._pipeline()
        await sem.acquire()
        task = asyncio.ensure_future(self._encode_and_deliver(inp, sem, validated, self.budget))
        task.add_done_callback(_consume)
        return await asyncio.shield(task)

    def _pipeline(self) -> asyncio.Semaphore:
        """This request's pipeline lane (:meth:`PluginHost.pipeline`): small when its admitted worst-case encoded
        size is at most :data:`~genartifact.limits.SMALL_ARTIFACT_BYTES`."""
        return self.host.pipeline(small=self.encoded_bound <= SMALL_ARTIFACT_BYTES)

    def _build_input(self, final: FinalContext) -> fmt.ArtifactInput:
        sections, tensors = {}, []
        for p in self._producers:
            section, parts = p.finalize(final)
            sections[p.name] = section
            tensors.extend(parts)
        tokens = array.array("I", self._prompt or [])
        tokens.extend(self._completion)
        self._readers = {p.name: r for p in self._producers if (r := self.host.reader(p.name)) is not None}
        return fmt.ArtifactInput(
            token_ids=np.frombuffer(tokens, dtype="<u4") if tokens else np.zeros(0, "<u4"),
            prompt_token_count=self.prompt_token_count,
            contents=list(self.request.contents),
            sections=sections,
            tensors=tensors,
            header=self._header,
        )

    async def _encode_and_deliver(self, inp: fmt.ArtifactInput, sem: asyncio.Semaphore,
                                  validated: ValidatedTarget | None, budget: int) -> dict[str, Any]:
        """Encode and deliver under the pipeline slot ``sem`` (released here on every path). ``validated`` and
        ``budget`` are the admission's, taken when the slot was: an operation that keeps running after its caller
        was cancelled (and the session released) still checks and stores against them."""
        did = None  # journal delivery id: every intent gets an outcome, whatever happens after it
        try:
            if validated is None:  # released before its operation started: internal_error below, slot released
                raise RuntimeError("session released before its operation started")
            try:
                readers = getattr(self, "_readers", None)
                if _encodes_inline(inp, budget):  # a thread hop costs more than encoding it here
                    enc = fmt.encode(inp, readers=readers)
                else:
                    enc = await asyncio.to_thread(fmt.encode, inp, readers=readers)
            except ArtifactFormatError as e:
                log.warning("artifact_encode_failed", error=redact(str(e)))
                return failed_receipt(self.request, "encode_failed")
            if enc.decoded_bytes > budget:
                log.error("artifact_over_budget", decoded=enc.decoded_bytes, budget=budget)
                return failed_receipt(self.request, "capture_invalid")
            if enc.byte_count > validated.max_bytes:
                return failed_receipt(self.request, "too_large")
            if self.journal is not None:
                describe = getattr(self._target, "describe", None)
                ref = describe(validated) if describe is not None else {}
                try:
                    did = await asyncio.to_thread(self.journal.intent, kind=self.request.target_kind,
                                                  object_id=validated.object_id, ref=ref, sha256=enc.sha256,
                                                  byte_count=enc.byte_count)
                except OSError as e:  # (ENOSPC...) no durable intent, so no upload: nothing was stored
                    log.error("journal_intent_not_written", errno=e.errno, target_kind=self.request.target_kind)
                    return failed_receipt(self.request, "delivery_failed")
            try:
                object_id = await self._target.deliver(validated, enc.data, enc.sha256)
            except (DeliveryError, TargetError) as e:
                code = "target_invalid" if isinstance(e, TargetError) else e.code
                code = code if code in ERROR_MESSAGES else "delivery_failed"
                if code == "object_exists" and self.recover_existing and await self._stored_matches(enc, validated):
                    await self._journal_outcome(did, "ready")
                    did = None
                    log.info("artifact_recovered", object_id=validated.object_id, sha256=enc.sha256)
                    return {**self._ready_receipt(enc, validated), "recovered": "rerun_match"}
                log.warning("artifact_delivery_failed", error_code=code, target_kind=self.request.target_kind)
                await self._journal_outcome(did, "failed", code)
                did = None
                return failed_receipt(self.request, code)
            except PluginFault:  # a target bug (e.g. a wrong return value): the object may exist; journal says so
                await self._journal_outcome(did, "failed", "internal_error")
                did = None
                return failed_receipt(self.request, "internal_error")
            except BaseException:
                # cancelled or crashed mid-upload: the object may or may not have landed (reconcile judges it)
                await asyncio.shield(self._journal_outcome(did, "interrupted"))
                did = None
                raise
            await self._journal_outcome(did, "ready")
            did = None
            object_id = validated.object_id  # the receipt carries the validated id (GuardedTarget checks)
            # debug, not info: the receipt already says it, and one console line per artifact costs more driver
            # time than encoding a small artifact (docs/benchmarks.md, issue 13); `--log-level debug` shows it
            log.debug("artifact_ready", object_id=object_id, byte_count=enc.byte_count, sha256=enc.sha256)
            return self._ready_receipt(enc, validated)
        except PluginFault:  # logged with the plugin's name when raised
            await self._journal_outcome(did, "failed", "internal_error")
            return failed_receipt(self.request, "internal_error")
        except Exception as e:  # noqa: BLE001 - never leak provider detail into the receipt
            log.error("artifact_failed", error_type=type(e).__name__)
            await self._journal_outcome(did, "failed", "internal_error")
            return failed_receipt(self.request, "internal_error")
        finally:
            sem.release()

    def _ready_receipt(self, enc: fmt.EncodedArtifact, validated: ValidatedTarget) -> dict[str, Any]:
        return {
            "format": self.request.format,
            "contents": sorted(self.request.contents),
            "state": "ready",
            "target": self.request.target_kind,
            "byte_count": enc.byte_count,
            "sha256": enc.sha256,
            "object_id": validated.object_id,
        }

    async def _stored_matches(self, enc: fmt.EncodedArtifact, validated: ValidatedTarget) -> bool:
        """Whether the object already stored at ``validated``'s id is byte-for-byte this run's encoding: read back
        through the target, at most ``enc.byte_count`` bytes (a larger object is refused by the target before
        its body is read), then byte count and SHA-256 compared. False when it cannot be read back."""
        try:
            data = await self._target.open(validated.object_id, enc.byte_count)
        except (GenartifactError, OSError) as e:
            log.warning("artifact_recover_unreadable", error_type=type(e).__name__)
            return False
        if len(data) != enc.byte_count:
            return False
        return await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest()) == enc.sha256

    async def _journal_outcome(self, did: str | None, state: str, code: str | None = None) -> None:
        """Journal an outcome; a journal that cannot be written (ENOSPC...) never changes the receipt: the
        object's fate is already decided, and reconcile will see the intent without this outcome."""
        if did is None or self.journal is None:
            return
        try:
            await asyncio.to_thread(self.journal.outcome, did, state, code)
        except OSError as e:
            log.error("journal_outcome_not_written", state=state, errno=e.errno)

    async def aclose(self, engine: Any = None) -> None:
        """Release engine-side state (producers' optional ``discard(engine)``), then :meth:`release`."""
        if self.group is not None:  # never submitted (failed, aborted, cancelled): the others must not wait
            self.group.withdraw(self.group_index)
        try:
            for p in self._producers:
                discard = getattr(p, "discard", None)
                if discard is not None:
                    try:
                        await discard(engine)
                    except Exception as e:  # noqa: BLE001 - cleanup must not mask the request outcome
                        log.warning("artifact_discard_failed", content=p.name, error_type=type(e).__name__)
        finally:
            self.release()

    def release(self) -> None:
        """Clear tokens, producer state, counters and admission state. Idempotent."""
        for p in self._producers:
            p.release()
        self._prompt = None
        self._completion = array.array("I")
        self._validated = None
        self.prompt_token_count = self.max_tokens = self.budget = self.encoded_bound = 0
        self._finished = False
        self._finish_reason = None
        self.failed_code = None


#: Artifacts whose token ids + tensors total at most this many bytes are encoded on the event loop: encoding one
#: (≈ 0.1 ms, the manifest and zstd's fixed cost) is cheaper than the hop to a thread and back (≈ 0.1 ms of wall
#: time plus the GIL hand-offs, which delay the engine's output processing on this same loop). Larger ones are
#: encoded in a thread, so the loop never blocks for more than about a quarter of a millisecond.
INLINE_ENCODE_BYTES = 64 * 1024


def _encodes_inline(inp: fmt.ArtifactInput, budget: int) -> bool:
    """Whether ``inp`` is small enough to encode on the event loop (:data:`INLINE_ENCODE_BYTES`). Decided by the
    admitted worst case ``budget`` (decoded bytes) when it is at most that and the token ids and tensors are
    exact numpy arrays (whose ``nbytes`` the producers' guard checked against the admission): nothing to walk.
    Otherwise by :func:`_input_nbytes`, which stops counting at the limit."""
    if budget <= INLINE_ENCODE_BYTES and type(inp.token_ids) is np.ndarray and all(
            type(getattr(t, "array", None)) is np.ndarray for t in inp.tensors):
        return True
    return _input_nbytes(inp) <= INLINE_ENCODE_BYTES


def _input_nbytes(inp: fmt.ArtifactInput, limit: int = INLINE_ENCODE_BYTES) -> int:
    """Roughly the bytes ``inp`` encodes (token ids + tensors + the manifest's sections and header), or any number
    above ``limit`` as soon as it is known to exceed it: the inline-encode decision. Counting stops there, so the
    cost is bounded whatever the input (a 60 MB section is not walked, let alone serialized, on the event loop).
    Anything whose size is not plain (a non-array token list or tensor) counts as over the limit: the thread
    encodes it."""
    tok = inp.token_ids
    n = tok.nbytes if type(tok) is np.ndarray else (4 * len(tok) if type(tok) in (list, tuple) else limit + 1)
    for t in inp.tensors:
        a = getattr(t, "array", None)
        if type(a) is not np.ndarray:  # exact ndarray: a subclass may report any nbytes
            return limit + 1
        n += a.nbytes
        if n > limit:
            return n
    return _json_size_upto(inp.sections, _json_size_upto(inp.header, n, limit), limit)


def _json_size_upto(obj: Any, n: int, limit: int) -> int:
    """``n`` plus about the canonical-JSON bytes of ``obj`` (characters of strings and keys, a fixed 24 per number
    or other scalar, a few per container item: a measure of the serializing work, not the exact size), stopping
    as soon as it is above ``limit`` (at most about ``limit / 2`` values visited). Never recurses (a stack walks
    deep nesting), and a self-referencing container still ends (every value visited adds at least 2)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        t = type(o)  # exact built-in types first: the ABC checks below cost more than the walk itself
        if t is str or isinstance(o, str):
            n += len(o) + 2
        elif t is dict or isinstance(o, Mapping):
            n += 2 + 4 * len(o)
            if n > limit:
                return n
            for k, v in o.items():
                n += len(k) if type(k) is str or isinstance(k, str) else 24
                stack.append(v)
        elif t is list or t is tuple or isinstance(o, (list, tuple)):
            n += 2 + len(o)
            if n > limit:
                return n
            stack.extend(o)
        else:  # numbers, bools, None, or values the encoder will refuse (or convert): sized like a number
            n += 24
        if n > limit:
            return n
    return n



def _header_bytes(header: Mapping[str, Any]) -> int:
    """``len(canonical_json(header))``: serialized every time. A cache of the last header keyed by a typed snapshot
    (``alike_key``, 2026-12-03) cost more than the serializing it saved (14.6 against 13.5 µs per admission on the
    AVX2 box of 2026-12-04, ``docs/benchmarks.md``) and was removed."""
    return len(fmt.canonical_json(header))


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
