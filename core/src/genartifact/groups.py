"""GRPO groups: ``n`` samples of one prompt with the prompt's route rows stored once.

Design (``docs/format.md``, "Groups"; an addition to ``generation_artifact_v1`` that needs no new reader: every
object below is a valid v1 artifact on its own):

* **prompt part** — one object per group: ``token_ids`` = the prompt (P tokens, C = 0), ``moe_routes`` rows (and
  ``moe_route_weights`` rows when the samples have them: aligned 1:1, deduplicated with the ids) for positions ``s .. P-2`` (``s`` = the group's ``routed_experts_prompt_start``), ``header.group =
  {"id", "role": "prompt_part", "size": n}``. Its rows are *first wins*: taken from sample 0.
* **sample part** — one object per sample (each still gets its own receipt): the full token ids (prompt +
  completion), every other content unchanged, ``moe_routes`` from ``token_start = t_k`` where ``t_k = P - 1``
  (the last prompt token's row onward — prefill computes it, and it is the first row a completion depends on)
  unless the sample's own prompt rows differ from the prompt part: then ``t_k`` = the first differing position,
  so the differing rows are kept with that sample, never dropped. ``header.group = {"id", "role": "sample",
  "index", "size", "prompt_row_mismatches", "prompt_part": {"sha256", "byte_count", "object_id"?, "token_start":
  s, "rows"}}``.

A reader joins them (:func:`join`): prompt-part rows for positions ``s .. t_k - 1`` then the sample's rows — exactly
the rows a non-deduplicated artifact of that sample holds. Nothing here imports vllm or torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from genartifact import format as fmt
from genartifact.errors import GenartifactError
from genartifact.loaders import (
    ArtifactRef,
    BatchResult,
    LayoutError,
    LoadError,
    ReadableTarget,
    Routes,
    _decoded_limit,
    _open,
    aload_batch,
    ref_of,
    verify_bytes,
)

ROUTES = "moe_routes.expert_ids"
WEIGHTS = "moe_route_weights.weights"  # aligned 1:1 with ROUTES rows: deduplicated with them (same token_start)


class GroupError(GenartifactError, ValueError):
    """Samples that do not form a group (different prompts, routers or route starts), or a sample and prompt part
    that do not belong together (digest, tokens, routers)."""


@dataclass(frozen=True)
class SamplePart:
    """One sample's deduplicated input and how many of its prompt rows differed from the prompt part (rows)."""

    input: fmt.ArtifactInput
    prompt_row_mismatches: int
    token_start: int


def _routes_of(inp: fmt.ArtifactInput) -> tuple[np.ndarray, Mapping[str, Any]]:
    if "moe_routes" not in inp.sections:
        raise GroupError("group dedup needs the moe_routes content in every sample")
    for t in inp.tensors:
        if t.name == ROUTES:
            return np.asarray(t.array), inp.sections["moe_routes"]
    raise GroupError(f"sample has no {ROUTES} tensor")


def _weights_of(inp: fmt.ArtifactInput) -> np.ndarray | None:
    """The stored ``moe_route_weights`` tensor ``[routers, rows, top_k]`` (f32, or bf16 bits), or None."""
    if "moe_route_weights" not in inp.sections:
        return None
    for t in inp.tensors:
        if t.name == WEIGHTS:
            return np.asarray(t.array)
    raise GroupError(f"sample has the moe_route_weights content but no {WEIGHTS} tensor")


def _check_group(samples: Sequence[fmt.ArtifactInput]) -> tuple[np.ndarray, int, int, Mapping[str, Any]]:
    if not samples:
        raise GroupError("a group needs at least one sample")
    p = samples[0].prompt_token_count
    prompt = np.asarray(samples[0].token_ids)[:p]
    _, sec0 = _routes_of(samples[0])
    s = int(sec0["token_start"])
    if p < 1 or s > p - 1:
        raise GroupError(f"prompt of {p} tokens with routes from {s}: nothing to share (needs start <= P - 1)")
    for k, x in enumerate(samples):
        ids, sec = _routes_of(x)
        if x.prompt_token_count != p or not np.array_equal(np.asarray(x.token_ids)[:p], prompt):
            raise GroupError(f"sample {k}: prompt token ids differ from sample 0's")
        if int(sec["token_start"]) != s:
            raise GroupError(f"sample {k}: moe_routes token_start {sec['token_start']} != sample 0's {s}")
        if (list(sec["router_ids"]), list(sec["expert_counts"]), int(sec["top_k"])) != \
                (list(sec0["router_ids"]), list(sec0["expert_counts"]), int(sec0["top_k"])):
            raise GroupError(f"sample {k}: routers/expert counts/top_k differ from sample 0's")
        if ids.shape[1] < p - 1 - s:
            raise GroupError(f"sample {k}: {ids.shape[1]} route rows, fewer than the {p - 1 - s} prompt rows")
        w, w0 = _weights_of(x), _weights_of(samples[0])
        if (w is None) != (w0 is None) or (w is not None and (w.shape[0] != w0.shape[0] or w.dtype != w0.dtype
                                                               or x.sections["moe_route_weights"].get("dtype")
                                                               != samples[0].sections["moe_route_weights"].get("dtype"))):
            raise GroupError(f"sample {k}: moe_route_weights presence/dtype/routers differ from sample 0's")
        if w is not None and (int(x.sections["moe_route_weights"]["token_start"]) != s or w.shape[1] != ids.shape[1]):
            raise GroupError(f"sample {k}: moe_route_weights rows are not aligned with moe_routes rows")
    return prompt, p, s, sec0


def prompt_part(samples: Sequence[fmt.ArtifactInput], group_id: str, size: int | None = None) -> fmt.ArtifactInput:
    """The group's prompt-part input (first wins: sample 0's rows for positions ``s .. P-2``).

    ``samples``: full (non-deduplicated) inputs of the group's samples, ``moe_routes.expert_ids`` stored
    router-major ``[routers, rows, top_k]`` from a common ``token_start``. ``size``: the group's ``n`` (default
    ``len(samples)``; larger when some samples failed or are re-run by ``--resume``). Raises :class:`GroupError`.
    """
    prompt, p, s, sec0 = _check_group(samples)
    ids, _ = _routes_of(samples[0])
    sections: dict[str, Any] = {"moe_routes": {**sec0, "token_start": s}}
    tensors = [fmt.TensorPart(ROUTES, np.ascontiguousarray(ids[:, : p - 1 - s]))]
    w = _weights_of(samples[0])
    if w is not None:  # the weights' prompt rows go with the routes' (same positions, same first-wins sample)
        sections["moe_route_weights"] = {**samples[0].sections["moe_route_weights"], "token_start": s}
        tensors.append(fmt.TensorPart(WEIGHTS, np.ascontiguousarray(w[:, : p - 1 - s])))
    return fmt.ArtifactInput(
        token_ids=prompt.astype(np.uint32), prompt_token_count=p, contents=sorted(sections),
        sections=sections, tensors=tensors,
        header={**dict(samples[0].header), "group": {"id": group_id, "role": "prompt_part",
                                                    "size": len(samples) if size is None else size}})


def sample_parts(samples: Sequence[fmt.ArtifactInput], group_id: str,
                 prompt_receipt: Mapping[str, Any], indices: Sequence[int] | None = None,
                 size: int | None = None) -> list[SamplePart]:
    """Each sample's deduplicated input, referencing the stored prompt part by ``prompt_receipt`` (its
    ``sha256`` and ``byte_count``; ``object_id`` too when it has one). ``indices``: each sample's index in the
    group (default ``0..len-1``), ``size``: the group's ``n`` (default ``len(samples)``).

    Sample *k*'s prompt rows are compared with the prompt part (sample 0's): equal -> it stores rows from
    ``P - 1``; otherwise from its first differing position (all differing rows stay with the sample) and
    ``prompt_row_mismatches`` counts the differing rows. Raises :class:`GroupError`.
    """
    prompt, p, s, _ = _check_group(samples)
    shared = _routes_of(samples[0])[0][:, : p - 1 - s]
    w0 = _weights_of(samples[0])
    wshared = None if w0 is None else w0[:, : p - 1 - s]
    sha, bc = prompt_receipt.get("sha256"), prompt_receipt.get("byte_count")
    if not isinstance(sha, str) or len(sha) != 64 or isinstance(bc, bool) or not isinstance(bc, int):
        raise GroupError("prompt_receipt needs the prompt part's sha256 (64 hex) and byte_count")
    ref: dict[str, Any] = {"sha256": sha, "byte_count": bc, "token_start": s, "rows": p - 1 - s}
    if isinstance(prompt_receipt.get("object_id"), str):
        ref["object_id"] = prompt_receipt["object_id"]
    indices = list(range(len(samples))) if indices is None else list(indices)
    if len(indices) != len(samples) or len(set(indices)) != len(indices):
        raise GroupError(f"indices {indices} do not name each of the {len(samples)} samples once")
    size = len(samples) if size is None else size
    out = []
    for k, x in zip(indices, samples, strict=True):
        ids, sec = _routes_of(x)
        w = _weights_of(x)
        differs = (ids[:, : p - 1 - s] != shared).any(axis=(0, 2))
        if w is not None:  # a row differs when its expert ids or its weights (bit for bit) differ
            differs |= (w[:, : p - 1 - s] != wshared).any(axis=(0, 2))
        diff = np.nonzero(differs)[0]
        t = s + int(diff[0]) if diff.size else p - 1
        tensors = [fmt.TensorPart(tp.name, np.ascontiguousarray(np.asarray(tp.array)[:, t - s :]))
                   if tp.name in (ROUTES, WEIGHTS) else tp for tp in x.tensors]
        header = {**dict(x.header), "group": {"id": group_id, "role": "sample", "index": k, "size": size,
                                              "prompt_row_mismatches": int(diff.size), "prompt_part": ref}}
        rsec = {**sec, "token_start": t}
        if "requested_token_start" in rsec:  # the request's start (s) lives in header.group.prompt_part.token_start;
            # this object's own rows start at t, and a reader requires requested >= effective
            rsec["requested_token_start"] = max(int(rsec["requested_token_start"]), t)
        sections = {**x.sections, "moe_routes": rsec}
        if w is not None:
            sections["moe_route_weights"] = {**x.sections["moe_route_weights"], "token_start": t}
        out.append(SamplePart(replace(x, sections=sections, tensors=tensors, header=header), int(diff.size), t))
    return out


def join(prompt: fmt.Artifact, sample: fmt.Artifact) -> Routes:
    """The full routes of a sample part (positions ``s .. T-2``), equal to a non-deduplicated artifact's rows.

    Checks: the sample's ``header.group.prompt_part.sha256``/``byte_count`` match ``prompt``, the prompt token ids
    are the sample's first P tokens, routers agree, and the row counts add up. Raises :class:`GroupError`.
    """
    g = sample.manifest["header"].get("group")
    if not isinstance(g, dict) or g.get("role") != "sample" or not isinstance(g.get("prompt_part"), dict):
        raise GroupError("artifact is not a group sample part (header.group.role != 'sample')")
    ref = g["prompt_part"]
    if prompt.sha256 != ref.get("sha256") or prompt.byte_count != ref.get("byte_count"):
        raise GroupError("prompt part digest/byte count differ from the sample's reference")
    pr, sr = Routes.of(prompt), Routes.of(sample)
    p = prompt.prompt_token_count
    if sample.prompt_token_count != p or not np.array_equal(sample.token_ids[:p], prompt.token_ids):
        raise GroupError("the sample's prompt token ids differ from the prompt part's")
    if (pr.router_ids, pr.expert_counts, pr.top_k) != (sr.router_ids, sr.expert_counts, sr.top_k):
        raise GroupError("routers/expert counts/top_k of sample and prompt part differ")
    s, t = pr.token_start, sr.token_start
    if not s <= t <= p - 1 or pr.rows.shape[0] != p - 1 - s:
        raise GroupError(f"sample token_start {t} outside the prompt part's positions {s}..{p - 1}")
    rows = np.concatenate([pr.rows[: t - s], sr.rows], axis=0)
    expect = max(0, sample.token_ids.shape[0] - 1 - s)
    if rows.shape[0] != expect:
        raise GroupError(f"joined rows {rows.shape[0]} != T - 1 - start = {expect}")
    if (pr.weights is None) != (sr.weights is None):
        raise GroupError("moe_route_weights in only one of sample and prompt part")
    weights = None if sr.weights is None else np.concatenate([pr.weights[: t - s], sr.weights], axis=0)
    return Routes(sample.token_ids, p, s, rows, sr.router_ids, sr.expert_counts, weights)


def _prompt_ref(ref: Any) -> ArtifactRef:
    """The prompt part to fetch, from a sample's ``header.group.prompt_part`` (free-form header JSON, so checked
    like a receipt: ``object_id`` non-empty string, ``byte_count`` integer >= 0, ``sha256`` 64 lowercase hex).
    Raises :class:`LoadError` (check ``receipt``) naming the bad field."""
    if not isinstance(ref, Mapping):
        raise LoadError(f"header.group.prompt_part is {type(ref).__name__}, not an object with object_id, byte_count "
                        f"and sha256", check="receipt")
    if not isinstance(ref.get("object_id"), str) or not ref["object_id"]:
        raise LoadError("header.group.prompt_part has no object_id to fetch", check="receipt")
    try:
        return ref_of({**ref, "state": "ready"})
    except LoadError as e:
        raise LoadError(f"header.group.prompt_part: {e.message}", check="receipt", object_id=e.object_id) from None


async def aload_group(items: Iterable[Mapping[str, Any] | str | ArtifactRef], target: ReadableTarget,
                      **kwargs: Any) -> BatchResult:
    """Load sample parts (receipts or ids) and return their joined :class:`~genartifact.loaders.Routes`, each
    distinct prompt part fetched once (by the ``object_id`` in the sample's reference, verified against its
    ``sha256`` and ``byte_count``). Artifacts without a group header, or group samples stored whole (no
    ``header.group.prompt_part``), are returned as ``Routes.of(art)``.
    Per-item failures land in ``BatchResult.errors`` (check ``layout`` for join failures, ``receipt`` for a
    malformed ``header.group.prompt_part`` reference; the prompt part read is bounded by that reference's
    ``byte_count`` + 1 and the decode limit, like any item). ``kwargs`` go to
    :func:`~genartifact.loaders.aload_batch` (bounds, progress)."""
    items = list(items)
    max_decoded_bytes = kwargs.get("max_decoded_bytes")
    res = await aload_batch(items, target, layout="artifact", **kwargs)
    cache: dict[str, Any] = {}
    out: list[Any] = [None] * len(res.items)
    errors = list(res.errors)
    for i, art in enumerate(res.items):
        if art is None:
            continue
        g = art.manifest["header"].get("group")
        try:
            if not isinstance(g, dict) or g.get("role") != "sample" or "prompt_part" not in g:
                out[i] = Routes.of(art)  # not deduplicated (no group, or a group sample stored whole)
                continue
            r = _prompt_ref(g.get("prompt_part"))
            if r.object_id not in cache:
                try:  # read bounded like any batch item: the reference's byte_count + 1, capped by the decode limit
                    data = await _open(target, r, _decoded_limit(max_decoded_bytes))
                    cache[r.object_id] = verify_bytes(r, data, max_decoded_bytes=max_decoded_bytes)
                except LoadError as e:
                    cache[r.object_id] = e
            part = cache[r.object_id]
            if isinstance(part, LoadError):
                raise part
            out[i] = join(part, art)
        except LoadError as e:
            errors.append(LoadError(f"prompt part: {e.message}", check=e.check, index=i, object_id=e.object_id))
        except (GroupError, LayoutError) as e:
            errors.append(LoadError(str(e), check="layout", index=i, object_id=ref_of(items[i]).object_id))
    errors.sort(key=lambda e: e.index if e.index is not None else -1)
    return BatchResult(out, errors, res.bytes_fetched, res.peak_bytes_in_flight)


@dataclass
class GroupSlot:
    """What :meth:`GroupCollector.submit` hands back to one sample: the input to store (its sample part, or the
    full input when the group could not share a prompt part) and the receipt's ``group`` field."""

    input: fmt.ArtifactInput
    receipt_group: dict[str, Any]


class GroupCollector:
    """Gathers the full inputs of one group's samples as they finish generating, stores the prompt part once,
    then hands each sample its sample part (``generate`` with ``"n" > 1``; one collector per group attempt).

    ``indices``: the sample indices this attempt runs (all of ``0..size-1``, or the missing ones on
    ``--resume``). ``store_prompt(input, leader)`` is awaited once, with the prompt-part input and the
    lowest submitted sample index (whose request stores it), and returns that object's receipt (``state``,
    ``object_id``, ``sha256``, ``byte_count`` or ``error_code``).

    Every sample either submits its input (:meth:`submit`) or is withdrawn (:meth:`withdraw`: failed capture, aborted,
    cancelled): once none is pending, the prompt part is built from the submitted samples (first wins: the
    lowest index) and stored. If it cannot be built (no ``moe_routes``, routes start after the prompt) or
    stored (any failure code), every submitted sample is stored whole and its receipt's ``group`` says why
    (``not_shared``) — no sample ever references a prompt part that is not stored.
    """

    def __init__(self, group_id: str, size: int, indices: Sequence[int], store_prompt: Any) -> None:
        self.group_id, self.size = group_id, size
        self._pending = set(indices)
        self._inputs: dict[int, fmt.ArtifactInput] = {}
        self._slots: dict[int, GroupSlot] = {}
        self._store_prompt = store_prompt
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.prompt_receipt: dict[str, Any] | None = None

    def withdraw(self, index: int) -> None:
        """Sample ``index`` will not submit (failed or cancelled); idempotent, a no-op after it submitted."""
        if index in self._pending:
            self._pending.discard(index)
            self._maybe_build()

    async def submit(self, index: int, inp: fmt.ArtifactInput) -> GroupSlot:
        """Hand in sample ``index``'s full input; returns, once the prompt part is settled, what to store."""
        if index not in self._pending:
            raise GroupError(f"sample {index} is not pending in group {self.group_id}")
        self._inputs[index] = inp
        self._pending.discard(index)
        self._maybe_build()
        await self._done.wait()
        return self._slots[index]

    def _maybe_build(self) -> None:
        if not self._pending and self._task is None:
            if not self._inputs:
                self._done.set()
                return
            self._task = asyncio.ensure_future(self._build())
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _whole(self, reason: str) -> None:
        for k, x in self._inputs.items():
            g = {"id": self.group_id, "index": k, "size": self.size, "not_shared": reason}
            hdr = {**dict(x.header), "group": {"id": self.group_id, "role": "sample", "index": k, "size": self.size}}
            self._slots[k] = GroupSlot(replace(x, header=hdr), g)

    async def _build(self) -> None:
        try:
            ks = sorted(self._inputs)
            samples = [self._inputs[k] for k in ks]
            try:
                part = prompt_part(samples, self.group_id, self.size)
            except GroupError as e:
                self._whole("not_shareable: " + str(e)[:200])
                return
            try:
                rec = dict(await self._store_prompt(part, ks[0]))
            except Exception as e:  # noqa: BLE001 - a store bug must not lose the samples: they go whole
                rec = {"state": "failed", "error_code": "internal_error", "error": type(e).__name__}
            self.prompt_receipt = rec
            if rec.get("state") != "ready":
                self._whole(f"prompt_part_{rec.get('error_code', 'failed')}")
                return
            ref = {"object_id": rec["object_id"], "sha256": rec["sha256"], "byte_count": rec["byte_count"]}
            for k, sp in zip(ks, sample_parts(samples, self.group_id, ref, ks, self.size), strict=True):
                self._slots[k] = GroupSlot(sp.input, {"id": self.group_id, "index": k, "size": self.size,
                                                      "prompt_part": ref, "prompt_row_mismatches":
                                                      sp.prompt_row_mismatches, "route_token_start": sp.token_start})
        except Exception as e:  # noqa: BLE001 - never leave a sample without its slot
            log_error = type(e).__name__
            self._slots.clear()
            self._whole(f"internal_error: {log_error}")
        finally:
            self._done.set()


def load_group(items: Iterable[Mapping[str, Any] | str | ArtifactRef], target: ReadableTarget,
               **kwargs: Any) -> BatchResult:
    """Synchronous :func:`aload_group`."""
    return asyncio.run(aload_group(items, target, **kwargs))


__all__ = ["GroupCollector", "GroupError", "GroupSlot", "SamplePart", "aload_group", "join", "load_group", "prompt_part", "sample_parts"]
