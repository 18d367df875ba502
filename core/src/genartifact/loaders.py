"""Trainer-side loaders: receipts -> verified artifacts -> route tensors in the layouts RL frameworks use.

Light: imports only numpy and the format reader; torch is imported lazily (``backend="torch"``), a progress
bar (tqdm) only when asked for.

Pipeline per item: fetch the stored bytes through the storage target's read-back
(``await target.open(object_id, max_bytes)``), check the byte count and SHA-256 against the receipt, decode
strictly (:func:`genartifact.format.decode`), then shape the routes to a named layout:

=========  ==========================================  =========  ============================================
layout     shape                                       dtype      convention source
=========  ==========================================  =========  ============================================
``verl``   ``[1, total_len, L, top_k]``, left-padded   int16      verl router replay (``routed_experts`` from
                                                                  vLLM ``AsyncLLM``), rows from
                                                                  ``padded_prompt_len - len(prompt)``
``slime``  ``[T - 1 - start, L, top_k]``               int32      slime/Miles (SGLang ``meta_info.routed_experts``)
``nemo_rl````[length, L, top_k]``, ``-1`` = not captured  int32      NeMo-RL (missing rows -> live router)
``raw``    bytes of ``[rows, L, top_k]`` + shape+dtype uint8/16   prime-rl ``RoutedExperts(data, shape, dtype)``
``packed`` ``[sum T_i, L, top_k]`` + ``cu_seqlens``    int32      packed / remove-padding batches (newer verl,
                                                                  SkyRL; flash-attn varlen ``cu_seqlens``)
=========  ==========================================  =========  ============================================

``T = P + C`` (prompt + completion tokens), ``start`` = the artifact's ``moe_routes.token_start``. Row *i* of a
stored artifact is the routing of absolute position ``start + i`` (vLLM's ``routed_experts`` contract; the last
sampled token is never fed, so there are ``T - 1 - start`` rows). ``L`` is the number of MoE routers stored
(dense layers are absent) unless ``num_layers`` is given: then the layer axis is every decoder layer
``0..num_layers-1`` as in vLLM's native tensor, routes placed at their ``router_ids`` and dense layers filled
with the layout's fill value (0 for verl/slime/raw as vLLM reports them, -1 for nemo_rl and packed).

Router weights (the ``moe_route_weights`` content): ``verl``, ``raw`` and ``packed`` take ``weights=True`` and
then also return the combine weights of the same experts, float32, in exactly the routes' shape and alignment
(row *i*, column *j* = the weight of expert ``routes[..., i, layer, j]``; 0.0 wherever the routes hold a fill
value); :func:`route_weights` gives them in the ``slime``/``raw`` row alignment. The values are the combine
weights applied to the expert outputs: the stored router weights times the section's ``output_scale`` (1.0
except where vLLM applies ``routed_scaling_factor`` to the MoE output, DeepSeek-V2/V3), which is what
HF transformers' routers return and what a trainer replaying weights into its router needs.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from genartifact import format as fmt
from genartifact.errors import ArtifactFormatError, GenartifactError

LAYOUTS = ("verl", "slime", "nemo_rl", "raw", "packed", "artifact")
#: Largest ``num_layers`` a layout accepts (decoder layers; vLLM's largest models have a few hundred): a typo'd
#: huge value is a LayoutError, not a multi-terabyte allocation.
MAX_LAYERS = 65536
CHECKS = ("receipt", "fetch", "byte_count", "sha256", "decode", "layout")


class LayoutError(GenartifactError, ValueError):
    """An artifact cannot be shaped to the requested layout (argument out of range, routes missing)."""


class LoadError(GenartifactError):
    """Loading one item failed. ``index``: position in the batch; ``object_id``: the receipt's object id (or
    None when the receipt itself is invalid); ``check``: which step failed, one of :data:`CHECKS`."""

    def __init__(self, message: str, *, check: str, index: int | None = None, object_id: str | None = None) -> None:
        self.message, self.check, self.index, self.object_id = message, check, index, object_id
        where = f"item {index}" if index is not None else "item"
        if object_id is not None:
            where += f" ({object_id})"
        super().__init__(f"{where}: {check}: {message}")


class ReadableTarget(Protocol):
    """The read-back side of a storage target (``StorageTarget.open``)."""

    async def open(self, object_id: str, max_bytes: int) -> bytes:
        """Return the stored bytes of ``object_id``; raise when missing or larger than ``max_bytes``."""
        ...


# ------------------------------------------------------------------------------------------- references


@dataclass(frozen=True)
class ArtifactRef:
    """What is known about an object before fetching it: ``object_id`` and, from a receipt, its
    ``byte_count`` (bytes) and ``sha256`` (hex). A bare object id has neither: only the strict decode checks it."""

    object_id: str
    byte_count: int | None = None
    sha256: str | None = None


def ref_of(item: Mapping[str, Any] | str | ArtifactRef) -> ArtifactRef:
    """An :class:`ArtifactRef` from a receipt dict (``state`` must be ``"ready"``), an object id string or a ref.

    Raises :class:`LoadError` (check ``"receipt"``) for a failed/rejected receipt or missing/mistyped fields.
    """
    if isinstance(item, ArtifactRef):
        return item
    if isinstance(item, str):
        if not item:
            raise LoadError("object id must be a non-empty string", check="receipt")
        return ArtifactRef(item)
    if not isinstance(item, Mapping):
        raise LoadError(f"expected a receipt dict or an object id string, got {type(item).__name__}", check="receipt")
    oid = item.get("object_id")
    if item.get("state") != "ready":
        raise LoadError(f"receipt state is {repr(item.get('state'))[:40]} "
                        f"({str(item.get('error_code', 'no error_code'))[:80]}); "
                        f"only 'ready' receipts have an object", check="receipt",
                        object_id=oid if isinstance(oid, str) else None)
    bc, sha = item.get("byte_count"), item.get("sha256")
    if not isinstance(oid, str) or not oid:
        raise LoadError("receipt object_id must be a non-empty string", check="receipt")
    if isinstance(bc, bool) or not isinstance(bc, int) or bc < 0:
        raise LoadError(f"receipt byte_count {bc!r} must be a non-negative integer", check="receipt", object_id=oid)
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise LoadError("receipt sha256 must be 64 lowercase hex digits", check="receipt", object_id=oid)
    return ArtifactRef(oid, bc, sha)


def verify_bytes(ref: ArtifactRef, data: bytes, *, max_decoded_bytes: int | None = None) -> fmt.Artifact:
    """Check ``data`` against ``ref`` and decode it strictly.

    Order: byte count, then the strict decode (which hashes the exact bytes once), then SHA-256 equality. A
    corrupted object that also fails to decode is reported as a ``sha256`` mismatch when its digest differs
    (the storage, not the writer, is at fault). Raises :class:`LoadError` with check ``byte_count``, ``sha256``
    or ``decode``.
    """
    if ref.byte_count is not None and len(data) != ref.byte_count:
        raise LoadError(f"read {len(data)} bytes, receipt says {ref.byte_count}", check="byte_count",
                        object_id=ref.object_id)
    try:
        art = fmt.decode(data, max_decoded_bytes=max_decoded_bytes)
    except ArtifactFormatError as e:
        if ref.sha256 is not None and hashlib.sha256(data).hexdigest() != ref.sha256:
            raise LoadError("SHA-256 of the stored bytes differs from the receipt", check="sha256",
                            object_id=ref.object_id) from None
        raise LoadError(str(e), check="decode", object_id=ref.object_id) from None
    if ref.sha256 is not None and art.sha256 != ref.sha256:
        raise LoadError("SHA-256 of the stored bytes differs from the receipt", check="sha256", object_id=ref.object_id)
    return art


async def fetch(target: ReadableTarget, item: Mapping[str, Any] | str | ArtifactRef, *,
                max_decoded_bytes: int | None = None) -> fmt.Artifact:
    """Fetch one object through ``target.open`` and return the verified, decoded :class:`~genartifact.format.Artifact`.

    ``max_bytes`` passed to the target is the receipt's ``byte_count`` (+1, so an object that grew is detected
    as a byte-count mismatch), or the largest valid object for the decoded limit when only an id is known.
    Raises :class:`LoadError` (checks ``receipt``, ``fetch``, ``byte_count``, ``sha256``, ``decode``).
    """
    ref = ref_of(item)
    data = await _open(target, ref, _decoded_limit(max_decoded_bytes))
    return verify_bytes(ref, data, max_decoded_bytes=max_decoded_bytes)


def fetch_sync(target: ReadableTarget, item: Mapping[str, Any] | str | ArtifactRef, *,
               max_decoded_bytes: int | None = None) -> fmt.Artifact:
    """Synchronous :func:`fetch` (runs its own event loop; from async code await :func:`fetch`)."""
    _no_running_loop("fetch_sync", "fetch")
    return asyncio.run(fetch(target, item, max_decoded_bytes=max_decoded_bytes))


def _no_running_loop(name: str, alternative: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{name} called inside a running event loop; use 'await {alternative}(...)'")


def _decoded_limit(max_decoded_bytes: int | None) -> int:
    if max_decoded_bytes is not None and (isinstance(max_decoded_bytes, bool) or not isinstance(max_decoded_bytes, int)
                                          or max_decoded_bytes < 1):
        raise ValueError(f"max_decoded_bytes={max_decoded_bytes!r}; allowed: None (the configured limit) or an "
                         f"integer number of bytes >= 1")
    if max_decoded_bytes is None:
        from genartifact.limits import max_decoded_bytes as env_limit

        max_decoded_bytes = env_limit()
    return min(max_decoded_bytes, fmt.MAX_DECODED_BYTES)


def _max_read(ref: ArtifactRef, decoded_limit: int) -> int:
    bound = fmt.encoded_size_bound(decoded_limit)
    return bound if ref.byte_count is None else min(ref.byte_count + 1, bound + 1)


async def _open(target: ReadableTarget, ref: ArtifactRef, decoded_limit: int) -> bytes:
    try:
        data = await target.open(ref.object_id, _max_read(ref, decoded_limit))
    except GenartifactError as e:
        # ObjectTooLargeError (the target's read-back): the stored object is longer than the receipt says
        check = "byte_count" if type(e).__name__ == "ObjectTooLargeError" and ref.byte_count is not None else "fetch"
        raise LoadError(str(e), check=check, object_id=ref.object_id) from None
    except Exception as e:  # noqa: BLE001 - per-item isolation; the type only, provider text may hold secrets
        raise LoadError(f"read failed ({type(e).__name__})", check="fetch", object_id=ref.object_id) from None
    if not isinstance(data, bytes | bytearray | memoryview):
        raise LoadError(f"target returned {type(data).__name__}, not bytes", check="fetch", object_id=ref.object_id)
    return bytes(data) if not isinstance(data, bytes) else data


# ---------------------------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class Routes:
    """Routes of one sequence, independent of the storage layout.

    ``token_ids``: ``uint32 [T]`` (prompt then completion; for a stitched multi-turn sequence all turns).
    ``prompt_token_count``: P (tokens; for a stitched sequence the first turn's prompt). ``token_start``: the
    absolute position of row 0. ``rows``: ``uint8|uint16 [T - 1 - token_start, R, top_k]`` (token-major view),
    row *i* = experts chosen for the token at position ``token_start + i``, vLLM's top-k order.
    ``router_ids``: decoder-layer index of each of the R routers (ascending); ``expert_counts``: experts per
    router. ``weights``: ``float32 [T - 1 - token_start, R, top_k]`` combine weights aligned with ``rows``
    (router weights x ``output_scale``), or None when the artifact has no ``moe_route_weights``.
    """

    token_ids: np.ndarray
    prompt_token_count: int
    token_start: int
    rows: np.ndarray
    router_ids: tuple[int, ...]
    expert_counts: tuple[int, ...]
    weights: np.ndarray | None = None

    @property
    def top_k(self) -> int:
        return int(self.rows.shape[2])

    @classmethod
    def of(cls, art: fmt.Artifact | Routes) -> Routes:
        """Routes of a decoded artifact. Raises :class:`LayoutError` if it has no ``moe_routes``."""
        if isinstance(art, Routes):
            return art
        if not isinstance(art, fmt.Artifact):
            raise LayoutError(f"expected a decoded Artifact or Routes, got {type(art).__name__}")
        if "moe_routes" not in art.manifest["sections"]:
            raise LayoutError(f"artifact has no moe_routes content (contents: {art.contents})")
        s = art.manifest["sections"]["moe_routes"]
        rows = art.routes()
        return cls(art.token_ids, art.prompt_token_count, int(s["token_start"]), rows,
                   tuple(s["router_ids"]), tuple(s["expert_counts"]), _weights_of(art, s, rows.shape))

    def need_weights(self) -> np.ndarray:
        """``weights``; raises :class:`LayoutError` when the artifact has no ``moe_route_weights``."""
        if self.weights is None:
            raise LayoutError("weights=True but the artifact has no moe_route_weights content")
        return self.weights

    def weight_axis(self, num_layers: int | None) -> np.ndarray:
        """``weights`` as ``float32 [rows, L, top_k]``, dense layers (``num_layers`` given) 0.0."""
        w = self.need_weights()
        if num_layers is None:
            return w
        out = np.zeros((w.shape[0], self.check_num_layers(num_layers), w.shape[2]), np.float32)
        out[:, list(self.router_ids), :] = w
        return out

    def check_num_layers(self, num_layers: Any) -> int:
        """``num_layers`` as an int; raises :class:`LayoutError` unless last router id < it <= :data:`MAX_LAYERS`."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int | np.integer) \
                or not max(self.router_ids) < num_layers <= MAX_LAYERS:
            raise LayoutError(f"num_layers={num_layers!r} must be an integer > the last router id "
                              f"{max(self.router_ids)} and <= {MAX_LAYERS}")
        return int(num_layers)

    def layer_axis(self, num_layers: int | None, fill: int, dtype: Any) -> np.ndarray:
        """``rows`` as ``dtype [rows, L, top_k]``: L = R (``num_layers`` None) or every decoder layer with
        non-MoE layers set to ``fill``. Raises :class:`LayoutError` when ``num_layers`` <= the last router id."""
        n, _, k = self.rows.shape
        if num_layers is None:
            return self.rows.astype(dtype)
        num_layers = self.check_num_layers(num_layers)
        out = np.full((n, num_layers, k), fill, dtype)
        out[:, list(self.router_ids), :] = self.rows
        return out


def _weights_of(art: fmt.Artifact, routes: Mapping[str, Any], shape: tuple[int, ...]) -> np.ndarray | None:
    """The artifact's combine weights ``float32 [rows, R, top_k]`` (router weights x output_scale) or None."""
    sec = art.manifest["sections"].get("moe_route_weights")
    if sec is None:
        return None
    for key in ("token_start", "router_ids", "top_k"):  # the reader checks this on decode; Routes may be built
        if sec.get(key) != routes.get(key):              # from a hand-made artifact, so say it precisely here
            raise LayoutError(f"moe_route_weights {key} {sec.get(key)!r} != moe_routes {key} {routes.get(key)!r}")
    w = np.asarray(art.content("moe_route_weights"), np.float32)
    if w.shape != tuple(shape):
        raise LayoutError(f"moe_route_weights shape {w.shape} != moe_routes rows {tuple(shape)}")
    return (w * np.asarray(sec["output_scale"], np.float32)[None, :, None]).astype(np.float32)


def route_weights(art: fmt.Artifact | Routes, *, num_layers: int | None = None, backend: str = "numpy") -> Any:
    """Combine weights ``float32 [T - 1 - token_start, L, top_k]``, row *i* = position ``token_start + i``,
    aligned element by element with :func:`slime` / :func:`raw` routes (dense layers, with ``num_layers``,
    0.0). Values: the router's top-k weights x ``output_scale`` (module doc). Raises :class:`LayoutError` when
    the artifact has no ``moe_route_weights`` (or no ``moe_routes``)."""
    return _backend(Routes.of(art).weight_axis(num_layers), backend)


def _check_int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo or (hi is not None and v > hi):
        raise LayoutError(f"{name}={v!r} out of range; allowed: integer {lo}..{hi if hi is not None else 'inf'}")
    return int(v)


def _backend(a: np.ndarray, backend: str) -> Any:
    if backend == "numpy":
        return a
    if backend == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(a))
    raise LayoutError(f"backend={backend!r}; allowed: 'numpy', 'torch'")


def verl(art: fmt.Artifact | Routes, *, padded_prompt_len: int, total_len: int, num_layers: int | None = None,
         backend: str = "numpy", weights: bool = False) -> Any:
    """verl router-replay layout: ``int16 [1, total_len, L, top_k]``.

    Convention (verl's ``routed_experts`` handling of vLLM ``AsyncLLM`` output): the prompt is left-padded to
    ``padded_prompt_len`` and the response right-padded, so token *j* of the sequence sits at index
    ``padded_prompt_len - P + j``; the stored row of position *j* is placed there, every other index (left
    padding, positions before ``token_start``, the last sampled token, right padding) is zero. Dense layers
    (``num_layers`` given) are zero, as vLLM reports them.

    With ``weights=True`` returns ``(routes, weights)``: ``weights`` ``float32 [1, total_len, L, top_k]``
    placed exactly like the routes (0.0 elsewhere).

    Raises :class:`LayoutError` when ``padded_prompt_len < P``, ``total_len < padded_prompt_len + C``, an
    expert id does not fit int16 (more than 32768 experts), or ``weights=True`` without ``moe_route_weights``.
    """
    r = Routes.of(art)
    p, t = r.prompt_token_count, r.token_ids.shape[0]
    padded_prompt_len = _check_int("padded_prompt_len", padded_prompt_len, p)
    total_len = _check_int("total_len", total_len, padded_prompt_len + (t - p))
    if max(r.expert_counts) > 32768:
        raise LayoutError(f"expert count {max(r.expert_counts)} does not fit verl's int16 layout (max 32768)")
    rows = r.layer_axis(num_layers, 0, np.int16)
    out = np.zeros((1, total_len, rows.shape[1], r.top_k), np.int16)
    at = padded_prompt_len - p + r.token_start
    out[0, at : at + rows.shape[0]] = rows
    if not weights:
        return _backend(out, backend)
    wout = np.zeros(out.shape, np.float32)
    wout[0, at : at + rows.shape[0]] = r.weight_axis(num_layers)
    return _backend(out, backend), _backend(wout, backend)


def slime(art: fmt.Artifact | Routes, *, num_layers: int | None = None, backend: str = "numpy") -> Any:
    """slime / Miles layout: ``int32 [T - 1 - token_start, L, top_k]`` (``[len(tokens) - 1, L, top_k]`` for a
    full-sequence artifact), row *i* = position ``token_start + i``.

    Convention: SGLang's ``meta_info.routed_experts`` as slime decodes it (``torch.frombuffer`` -> int32,
    reshaped ``[len(tokens) - 1, num_layers, top_k]``); with ``routed_experts_start_len`` each turn contributes
    only its new rows, which slime appends (use :func:`stitch_turns` to join turns first). Dense layers
    (``num_layers`` given) are zero, as the engines report them.

    Raises :class:`LayoutError` when a stored MoE layer is all zero over a non-empty row range with
    ``top_k > 1`` (impossible for top-k of distinct experts; slime rejects such rows as dropped routes).
    """
    r = Routes.of(art)
    if r.rows.shape[0] and r.top_k > 1:
        zero = ~r.rows.reshape(r.rows.shape[0], len(r.router_ids), -1).any(axis=(0, 2))
        if zero.any():
            raise LayoutError(f"MoE layer {r.router_ids[int(np.argmax(zero))]} is all zero: routes were dropped")
    return _backend(r.layer_axis(num_layers, 0, np.int32), backend)


def nemo_rl(art: fmt.Artifact | Routes, *, length: int | None = None, num_layers: int | None = None,
            backend: str = "numpy") -> Any:
    """NeMo-RL layout: ``int32 [length, L, top_k]`` over absolute positions ``0..length-1`` (default
    ``length = T - 1``, vLLM's row count for a full sequence), ``-1`` for every row not captured (positions
    before ``token_start`` — e.g. skipped with ``routed_experts_prompt_start`` — and positions past the stored
    rows) and for dense layers. Convention: NeMo-RL falls back to the live router where the sentinel ``-1``
    appears.

    Raises :class:`LayoutError` when ``length < T - 1``.
    """
    r = Routes.of(art)
    t = r.token_ids.shape[0]
    length = _check_int("length", max(t - 1, 0) if length is None else length, max(t - 1, 0))
    rows = r.layer_axis(num_layers, -1, np.int32)
    out = np.full((length, rows.shape[1], r.top_k), -1, np.int32)
    out[r.token_start : r.token_start + rows.shape[0]] = rows
    return _backend(out, backend)


@dataclass(frozen=True)
class RawRoutes:
    """prime-rl's ``RoutedExperts(data, shape, dtype)``: ``data`` = C-order bytes of a token-major
    ``[rows, L, top_k]`` tensor of ``dtype`` (``"uint8"`` when every router has <= 256 experts, else
    ``"uint16"``, little-endian); ``token_start``: absolute position of row 0."""

    data: bytes
    shape: tuple[int, int, int]
    dtype: str
    token_start: int
    #: with ``raw(..., weights=True)``: C-order bytes of the combine weights, ``float32`` little-endian, same shape
    weights_data: bytes | None = None

    def array(self) -> np.ndarray:
        """The tensor back from the bytes (read-only view)."""
        return np.frombuffer(self.data, np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)

    def weights(self) -> np.ndarray:
        """The combine weights back from ``weights_data``: ``float32 [rows, L, top_k]`` (read-only view).
        Raises :class:`LayoutError` when they were not asked for."""
        if self.weights_data is None:
            raise LayoutError("no weights: call raw(..., weights=True) on an artifact with moe_route_weights")
        return np.frombuffer(self.weights_data, np.dtype("<f4")).reshape(self.shape)


def raw(art: fmt.Artifact | Routes, *, num_layers: int | None = None, weights: bool = False) -> RawRoutes:
    """prime-rl layout: raw bytes + shape + dtype of ``uint8|uint16 [T - 1 - token_start, L, top_k]``
    (token-major; the stored router-major tensor is transposed once). Dense layers (``num_layers`` given) are
    zero. Convention: prime-rl's ``RoutedExperts(data, shape, dtype)`` from vllm-router (uint8 for <= 256
    experts). ``weights=True`` adds ``weights_data`` (float32 bytes, same shape; dense layers 0.0)."""
    r = Routes.of(art)
    dt = np.dtype("<u1") if max(r.expert_counts) <= 256 else np.dtype("<u2")
    a = np.ascontiguousarray(r.layer_axis(num_layers, 0, dt))
    wd = np.ascontiguousarray(r.weight_axis(num_layers), np.dtype("<f4")).tobytes() if weights else None
    return RawRoutes(a.tobytes(), tuple(a.shape), dt.name, r.token_start, wd)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Packed:
    """A packed (remove-padding) batch: ``token_ids`` ``int32 [N]``, ``routes`` ``int32 [N, L, top_k]``,
    ``cu_seqlens`` ``int32 [B + 1]`` (sequence *b* occupies ``[cu_seqlens[b], cu_seqlens[b+1])``),
    ``prompt_token_counts`` ``int32 [B]``; ``N = sum of T_b``; ``weights`` (``packed(..., weights=True)``)
    ``float32 [N, L, top_k]`` aligned with ``routes`` (0.0 where routes hold the fill value), else None."""

    token_ids: np.ndarray
    routes: np.ndarray
    cu_seqlens: np.ndarray
    prompt_token_counts: np.ndarray
    weights: Any = None


def packed(arts: Sequence[fmt.Artifact | Routes], *, num_layers: int | None = None, fill: int = -1,
           backend: str = "numpy", weights: bool = False) -> Packed:
    """Packed layout: every sequence's ``T_b`` tokens back to back, one route row per token so the rows line up
    with the packed ``input_ids`` fed in teacher forcing; ``cu_seqlens`` (int32 ``[B + 1]``, the flash-attn
    varlen convention used by newer verl / SkyRL remove-padding batches) delimits sequences. Rows not captured
    (before ``token_start``, and each sequence's last token, which was never fed) and dense layers hold
    ``fill`` (default -1: "use the live router"). All sequences must have the same routers and top_k.

    ``weights=True`` adds :attr:`Packed.weights` (every item must have ``moe_route_weights``).

    Raises :class:`LayoutError` for an empty batch, mismatched router layouts, ``fill`` outside int32,
    ``num_layers`` out of range (:meth:`Routes.check_num_layers`), or ``weights=True`` and an item without
    ``moe_route_weights`` (naming the item).
    """
    rs = [Routes.of(a) for a in arts]
    if not rs:
        raise LayoutError("packed needs at least one artifact")
    fill = _check_int("fill", fill, -(2**31), 2**31 - 1)
    key = (rs[0].router_ids, rs[0].top_k)
    for i, r in enumerate(rs):
        if (r.router_ids, r.top_k) != key:
            raise LayoutError(f"item {i}: routers/top_k {r.router_ids}/{r.top_k} differ from item 0's {key[0]}/{key[1]}")
    lens = np.array([r.token_ids.shape[0] for r in rs], np.int64)
    cu = np.zeros(len(rs) + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    if cu[-1] > np.iinfo(np.int32).max:
        raise LayoutError(f"packed batch has {int(cu[-1])} tokens; int32 cu_seqlens allow {np.iinfo(np.int32).max}")
    width = len(rs[0].router_ids) if num_layers is None else rs[0].check_num_layers(num_layers)
    if weights:
        for i, r in enumerate(rs):
            if r.weights is None:
                raise LayoutError(f"item {i}: weights=True but it has no moe_route_weights content")
    routes = np.full((int(cu[-1]), width, rs[0].top_k), fill, np.int32)
    wts = np.zeros(routes.shape, np.float32) if weights else None
    tok = np.empty(int(cu[-1]), np.int32)
    for r, o in zip(rs, cu[:-1], strict=True):
        o = int(o)
        tok[o : o + r.token_ids.shape[0]] = r.token_ids.astype(np.int64)
        rows = r.layer_axis(num_layers, fill, np.int32)
        routes[o + r.token_start : o + r.token_start + rows.shape[0]] = rows
        if wts is not None:
            wts[o + r.token_start : o + r.token_start + rows.shape[0]] = r.weight_axis(num_layers)
    pc = np.array([r.prompt_token_count for r in rs], np.int32)
    return Packed(_backend(tok, backend), _backend(routes, backend), _backend(cu.astype(np.int32), backend),
                  _backend(pc, backend), None if wts is None else _backend(wts, backend))


def top_logprobs(art: fmt.Artifact, *, backend: str = "numpy") -> tuple[Any, Any]:
    """The ``top_logprobs`` content: ``(token_ids uint32 [C, k], logprobs float32 [C, k])``, row *i* = completion
    position *i*, columns in rank order (descending logprob), aligned with ``selected_logprobs``. With
    ``backend="torch"`` token ids come back as int64 (torch has no uint32 arithmetic). Raises
    :class:`LayoutError` when the artifact has no ``top_logprobs`` content."""
    if "top_logprobs" not in art.manifest["sections"]:
        raise LayoutError(f"artifact has no top_logprobs content (contents: {art.contents})")
    ids, lps = art.tensors["top_logprobs.token_ids"], art.tensors["top_logprobs.logprobs"]
    if backend == "torch":
        return _backend(ids.astype(np.int64), backend), _backend(np.array(lps), backend)
    return _backend(ids, backend), _backend(lps, backend)


# -------------------------------------------------------------------------------------- multi-turn


def stitch_turns(turns: Sequence[fmt.Artifact | Routes]) -> Routes:
    """Join per-turn artifacts into the routes of the full sequence.

    Turn *k* (k >= 1) must have been requested with ``routed_experts_prompt_start = len(turn k-1 tokens) - 1``
    (the previous turn's last sampled token was never fed, so the next turn's prefill produces its row), and its
    token ids must extend the previous turn's. The result covers positions ``turns[0].token_start ..
    T_last - 2``; its ``prompt_token_count`` is the first turn's prompt; its ``weights`` are
    joined too when every turn has ``moe_route_weights`` (else None).

    Raises :class:`LayoutError` naming the turn when the token ids do not extend, the start is not
    ``len(previous) - 1``, routers/top_k differ, or the row counts do not add up to ``T_last - 1 - start_0``.
    """
    rs = [Routes.of(t) for t in turns]
    if not rs:
        raise LayoutError("stitch_turns needs at least one turn")
    for k in range(1, len(rs)):
        prev, cur = rs[k - 1], rs[k]
        n = prev.token_ids.shape[0]
        if cur.token_ids.shape[0] < n or not np.array_equal(cur.token_ids[:n], prev.token_ids):
            raise LayoutError(f"turn {k}: token ids do not extend turn {k - 1}'s {n} tokens")
        if cur.token_start != n - 1:
            raise LayoutError(f"turn {k}: token_start {cur.token_start} != len(turn {k - 1} tokens) - 1 = {n - 1}")
        if (cur.router_ids, cur.expert_counts, cur.top_k) != (prev.router_ids, prev.expert_counts, prev.top_k):
            raise LayoutError(f"turn {k}: routers/expert counts/top_k differ from turn {k - 1}")
    rows = np.concatenate([r.rows for r in rs], axis=0) if len(rs) > 1 else rs[0].rows
    have = [r.weights is not None for r in rs]
    wts = (np.concatenate([r.weights for r in rs], axis=0) if len(rs) > 1 else rs[0].weights) if all(have) else None
    last, first = rs[-1], rs[0]
    expect = max(0, last.token_ids.shape[0] - 1 - first.token_start)
    if rows.shape[0] != expect:
        raise LayoutError(f"stitched rows {rows.shape[0]} != T_last - 1 - start_0 = {expect}")
    return Routes(last.token_ids, first.prompt_token_count, first.token_start, rows, first.router_ids,
                  first.expert_counts, wts)


# -------------------------------------------------------------------------------------- batches


@dataclass
class BatchResult:
    """Outcome of :func:`load_batch`: ``items[i]`` is the layout output of input *i* (None when it failed);
    ``errors`` lists one :class:`LoadError` per failed input (``index``, ``object_id``, ``check``), in input
    order. ``bytes_fetched``: total stored bytes read; ``peak_bytes_in_flight``: the largest number of fetched,
    not yet decoded bytes held at once (never above the bound)."""

    items: list[Any]
    errors: list[LoadError] = field(default_factory=list)
    bytes_fetched: int = 0
    peak_bytes_in_flight: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_errors(self) -> None:
        """Raise the first error (with a count of the others) when any item failed."""
        if self.errors:
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            e = self.errors[0]
            raise LoadError(f"{e.message}{more}", check=e.check, index=e.index, object_id=e.object_id)


class _ByteBudget:
    """A counting semaphore over bytes: ``acquire(n)`` waits until ``n`` more bytes fit under ``limit``; a
    request larger than the whole limit is admitted alone (it waits for an empty budget)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak = limit, 0, 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


def _layout_fn(layout: str | Callable[[fmt.Artifact], Any], kwargs: Mapping[str, Any]) -> Callable[[fmt.Artifact], Any]:
    if callable(layout):
        return layout
    fns: dict[str, Callable[..., Any]] = {"verl": verl, "slime": slime, "nemo_rl": nemo_rl, "raw": raw,
                                          "artifact": lambda a: a}
    if layout == "packed":
        raise LayoutError("layout 'packed' spans the whole batch: load with layout='artifact' then call packed(items)")
    if layout not in fns:
        raise LayoutError(f"layout={layout!r}; allowed: {list(LAYOUTS)}")
    fn = fns[layout]
    try:  # a missing or misspelt layout argument is the caller's error, found before any item is fetched
        inspect.signature(fn).bind(None, **kwargs)
    except TypeError as e:
        allowed = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
        raise LayoutError(f"layout {layout!r}: {e}; its keyword arguments: {allowed}") from None
    return (lambda a: fn(a, **kwargs)) if kwargs else fn


async def aload_batch(items: Iterable[Mapping[str, Any] | str | ArtifactRef], target: ReadableTarget, *,
                      layout: str | Callable[[fmt.Artifact], Any] = "artifact",
                      max_concurrency: int = 16, max_bytes_in_flight: int = 256 << 20, max_decodes: int = 2,
                      max_decoded_bytes: int | None = None, progress: bool | None = None,
                      **layout_kwargs: Any) -> BatchResult:
    """Fetch, verify, decode and lay out many artifacts (a GRPO group, a micro-batch), in input order.

    Bounds: at most ``max_concurrency`` reads outstanding, and fetched-but-not-yet-decoded bytes at most
    ``max_bytes_in_flight`` (bytes; reserved before each read from the receipt's ``byte_count``, or the
    largest valid object for a bare id; an object larger than the whole bound is read alone). Decoding runs in
    worker threads (at most ``max_decodes`` at once) while other reads proceed; its transient memory is one
    decoded body (<= the decoded limit) per concurrent decode. Peak memory is therefore about
    ``max_bytes_in_flight + max_decodes x decoded body size`` plus the results (the layout outputs), which are
    what the caller keeps (measured: ``benchmarks/bench_load.py``).

    ``layout``: one of ``"verl"``, ``"slime"``, ``"nemo_rl"``, ``"raw"``, ``"artifact"`` (the decoded
    :class:`~genartifact.format.Artifact`) or a callable; ``layout_kwargs`` go to the layout function (e.g.
    ``padded_prompt_len``, ``total_len`` for verl). ``progress``: show a tqdm bar (default: when more than 64
    items). A failing item never stops the others: it is recorded in ``BatchResult.errors``.

    Raises :class:`LayoutError` for an unknown layout or layout keyword arguments it does not take (before any
    fetch), and ``ValueError`` for bounds that are not integers >= 1 (``max_decoded_bytes``: None or >= 1). A
    callable ``layout`` that raises fails only that item (check ``layout``).
    """
    refs_in = list(items)
    fn = _layout_fn(layout, layout_kwargs)
    for name, v in (("max_concurrency", max_concurrency), ("max_bytes_in_flight", max_bytes_in_flight),
                    ("max_decodes", max_decodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}; allowed: an integer >= 1")
    limit = _decoded_limit(max_decoded_bytes)
    budget, sem = _ByteBudget(max_bytes_in_flight), asyncio.Semaphore(max_concurrency)
    decoders = asyncio.Semaphore(max_decodes)
    out: list[Any] = [None] * len(refs_in)
    errors: dict[int, LoadError] = {}
    fetched = 0
    bar = None
    if progress or (progress is None and len(refs_in) > 64):
        from tqdm.auto import tqdm

        bar = tqdm(total=len(refs_in), unit="artifact", desc="genartifact load")

    async def one(i: int, item: Any) -> None:
        nonlocal fetched
        try:
            ref = ref_of(item)
            need = _max_read(ref, limit) if ref.byte_count is None else ref.byte_count
            await budget.acquire(need)
            try:
                async with sem:
                    data = await _open(target, ref, limit)
                fetched += len(data)
                async with decoders:
                    out[i] = await asyncio.to_thread(_decode_and_layout, ref, data, fn, max_decoded_bytes)
                del data
            finally:
                await budget.release(need)
        except LoadError as e:
            errors[i] = LoadError(e.message, check=e.check, index=i, object_id=e.object_id)
        finally:
            if bar is not None:
                bar.update(1)

    try:
        await asyncio.gather(*(one(i, it) for i, it in enumerate(refs_in)))
    finally:
        if bar is not None:
            bar.close()
    return BatchResult(out, [errors[i] for i in sorted(errors)], fetched, budget.peak)


def _decode_and_layout(ref: ArtifactRef, data: bytes, fn: Callable[[fmt.Artifact], Any],
                       max_decoded_bytes: int | None) -> Any:
    art = verify_bytes(ref, data, max_decoded_bytes=max_decoded_bytes)
    try:
        return fn(art)
    except GenartifactError as e:
        raise LoadError(str(e), check="layout", object_id=ref.object_id) from None
    except Exception as e:  # noqa: BLE001 - a caller's layout callable failing on one item fails only that item
        raise LoadError(f"layout function raised {type(e).__name__}: {str(e)[:200]}", check="layout",
                        object_id=ref.object_id) from None


def load_batch(items: Iterable[Mapping[str, Any] | str | ArtifactRef], target: ReadableTarget, **kwargs: Any) -> BatchResult:
    """Synchronous :func:`aload_batch` (runs its own event loop; from async code await ``aload_batch``)."""
    _no_running_loop("load_batch", "aload_batch")
    return asyncio.run(aload_batch(items, target, **kwargs))


def open_target(kind: str = "managed_fsspec", config: str | None = None) -> Any:
    """The storage target ``kind`` configured as the server would (plugin enabled, settings from the config
    file ``config`` or ``GENARTIFACT_CONFIG``/default); its ``open`` is the read-back used by the loaders.
    Raises :class:`~genartifact.errors.PluginError`/``ConfigError`` as the host does."""
    from genartifact import config as config_mod
    from genartifact.host import PluginHost

    cfg = config_mod.load(config)
    host = PluginHost({"targets": [kind]})
    return host.hooks.storage_target(kind, cfg.target_settings().get(kind, {}))


__all__ = ["CHECKS", "LAYOUTS", "MAX_LAYERS", "ArtifactRef", "BatchResult", "LayoutError", "LoadError", "Packed", "RawRoutes",
           "ReadableTarget", "Routes", "aload_batch", "fetch", "fetch_sync", "load_batch", "nemo_rl", "open_target", "packed",
           "raw", "ref_of", "slime", "stitch_turns", "top_logprobs", "verify_bytes", "verl"]
