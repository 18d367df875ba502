"""Benchmark grid: prefill points (total new tokens × batch × KV-read tokens) and decode points (batch ×
context), bounded by the engine's limits; or an explicit points file. The grid digest (SHA-256 of the canonical
JSON of the ordered points) identifies a grid across ranks and runs."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from genartifact.errors import GenartifactError

PHASES = ("prefill", "decode")


class GridError(GenartifactError, ValueError):
    """An explicit point is malformed or infeasible for the engine's limits (names the point and the limit)."""


@dataclass(frozen=True, order=True)
class Point:
    """``prefill``: ``tokens`` = total new tokens in the pass, ``batch`` requests, ``kv`` = KV-read (cached prefix)
    tokens per request. ``decode``: ``batch`` requests at ``context`` tokens each (KV before the step = context − 1)."""

    phase: str
    batch: int
    tokens: int = 0
    kv: int = 0
    context: int = 0

    def key(self) -> str:
        """Stable point key, e.g. ``prefill:t256:b2:kv0`` or ``decode:b4:c128``."""
        if self.phase == "prefill":
            return f"prefill:t{self.tokens}:b{self.batch}:kv{self.kv}"
        return f"decode:b{self.batch}:c{self.context}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Limits:
    """Engine limits that bound the grid (tokens unless named otherwise)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    prefix_caching: bool

    def decode_admission_passes(self, p: Point) -> int:
        """Upper bound on the forward passes that admit a decode point's prompts: ``batch × (context − 1)``
        prompt tokens under a budget of ``max_num_batched_tokens`` per pass, of which requests already decoding
        take up to ``batch − 1`` (vLLM V1 schedules running requests first, then chunks waiting prompts into what
        is left); +1 for a request whose last chunk lands in a pass of its own."""
        budget = max(1, self.max_num_batched_tokens - (p.batch - 1))
        return math.ceil(p.batch * (p.context - 1) / budget) + 1

    def decode_max_tokens(self, p: Point, repeats: int) -> int:
        """Tokens each request of a decode point generates: enough that, after the slowest admission, the
        whole batch still decodes together for ``repeats`` passes (the first-admitted request decodes during the
        admission passes and finishes first)."""
        return self.decode_admission_passes(p) + repeats + 1

    def check(self, p: Point, repeats: int = 3) -> None:
        """Raise :class:`GridError` if ``p`` cannot be measured on this engine (``repeats`` measured passes per
        execution: a decode point's requests generate :meth:`decode_max_tokens` tokens, which must fit the model
        length and, for the whole batch, the KV cache)."""
        if p.phase not in PHASES:
            raise GridError(f"point {p.key()}: phase {p.phase!r}; allowed: {list(PHASES)}")
        if p.batch < 1 or p.batch > self.max_num_seqs:
            raise GridError(f"point {p.key()}: batch {p.batch} outside 1..max_num_seqs={self.max_num_seqs}")
        if p.phase == "prefill":
            per = p.tokens // p.batch
            if p.tokens < p.batch or p.tokens % p.batch:
                raise GridError(f"point {p.key()}: tokens {p.tokens} must be a positive multiple of batch {p.batch}")
            if p.tokens > self.max_num_batched_tokens:
                raise GridError(f"point {p.key()}: tokens {p.tokens} > max_num_batched_tokens={self.max_num_batched_tokens}")
            if p.kv and (not self.prefix_caching or p.kv % self.block_size):
                raise GridError(f"point {p.key()}: kv {p.kv} needs prefix caching and a multiple of block_size="
                                f"{self.block_size}")
            if per + p.kv + 1 > self.max_model_len:
                raise GridError(f"point {p.key()}: {per + p.kv + 1} tokens per request > max_model_len={self.max_model_len}")
            if p.batch * (per + p.kv + 1) > self.kv_capacity_tokens:
                raise GridError(f"point {p.key()}: exceeds the KV cache ({self.kv_capacity_tokens} tokens)")
        else:
            if p.context < 2:
                raise GridError(f"point {p.key()}: context {p.context} < 2")
            total = p.context - 1 + self.decode_max_tokens(p, repeats)
            if total > self.max_model_len:
                raise GridError(f"point {p.key()}: {total} tokens per request (context − 1 + "
                                f"{self.decode_max_tokens(p, repeats)} generated over admission and {repeats} measured "
                                f"passes) > max_model_len={self.max_model_len}")
            blocks = math.ceil(total / self.block_size) * self.block_size
            if p.batch * blocks > self.kv_capacity_tokens:
                raise GridError(f"point {p.key()}: {p.batch} × {blocks} tokens (block-rounded) exceeds the KV cache "
                                f"({self.kv_capacity_tokens} tokens)")


def _pow2(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


@dataclass(frozen=True)
class GridPlan:
    """A default grid: ``points`` to run, and ``excluded`` — every candidate left out, with the reason (the
    engine limit that makes it unreachable, or ``max_points`` thinning), known before anything runs."""

    points: list[Point]
    excluded: list[tuple[Point, str]]

    def excluded_dicts(self) -> list[dict[str, str]]:
        return [{"key": p.key(), "reason": r} for p, r in self.excluded]


def plan_grid(limits: Limits, mode: str, *, max_points: int = 64, repeats: int = 3) -> GridPlan:
    """Default grid for ``mode`` (``prefill``, ``decode`` or ``agg`` = both), largest shapes first within a
    phase (the largest points warm the allocator). Candidates: prefill batch 1, 2, 4 × total tokens 16·batch …
    ``max_num_batched_tokens`` (powers of 2) × KV-read 0 and one block (with prefix caching); decode batch
    1 … min(max_num_seqs, 16) × context 16 … max_model_len/2 (powers of 2). Every kept point passes
    :meth:`Limits.check` for ``repeats``; the others are in ``excluded`` with the limit's message."""
    if mode not in ("prefill", "decode", "agg"):
        raise GridError(f"mode {mode!r}; allowed: prefill, decode, agg")
    candidates: list[Point] = []
    if mode in ("prefill", "agg"):
        kvs = [0] + ([limits.block_size] if limits.prefix_caching else [])
        candidates += [Point("prefill", b, tokens=t, kv=kv) for b in (1, 2, 4)
                       for t in _pow2(16 * b, limits.max_num_batched_tokens) for kv in kvs]
    if mode in ("decode", "agg"):
        candidates += [Point("decode", b, context=c) for b in _pow2(1, min(limits.max_num_seqs, 16))
                       for c in _pow2(16, limits.max_model_len // 2)]
    points: list[Point] = []
    excluded: list[tuple[Point, str]] = []
    for p in candidates:
        try:
            limits.check(p, repeats)
        except GridError as e:
            excluded.append((p, str(e)))
            continue
        points.append(p)
    points.sort(key=lambda p: (PHASES.index(p.phase), -p.batch * max(p.tokens, p.context), p.key()))
    if len(points) > max_points:  # thin uniformly, keeping both ends
        idx = sorted({round(i * (len(points) - 1) / (max_points - 1)) for i in range(max_points)})
        keep = set(idx)
        excluded += [(p, f"point {p.key()}: thinned to max_points={max_points}") for i, p in enumerate(points)
                     if i not in keep]
        points = [points[i] for i in idx]
    return GridPlan(points, excluded)


def build_grid(limits: Limits, mode: str, *, max_points: int = 64, repeats: int = 3) -> list[Point]:
    """The points of :func:`plan_grid` (every one reachable on ``limits``)."""
    return plan_grid(limits, mode, max_points=max_points, repeats=repeats).points


def load_points(path: str | Path, limits: Limits, repeats: int = 3) -> list[Point]:
    """Explicit points file: JSON ``{"points": [{"phase", "batch", "tokens"?, "kv"?, "context"?}, ...]}``.
    Every point must be feasible (raises :class:`GridError` naming the point and the limit)."""
    from genartifact_fpm_bench.artifact import JSONFileError, read_json

    try:
        raw = read_json(path)
    except JSONFileError as e:
        raise GridError(f"points file {str(path)!r} cannot be read as JSON: {e}") from None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("points"), list) or not raw["points"]:
        raise GridError("points file must be an object with a non-empty 'points' list")
    pts = []
    for i, d in enumerate(raw["points"]):
        p = point_from_dict(d, f"points[{i}]")
        limits.check(p, repeats)
        pts.append(p)
    return pts


def point_from_dict(d: Any, where: str) -> Point:
    """``d``, a point as JSON holds it (``{"phase", "batch", "tokens"?, "kv"?, "context"?}``), as a :class:`Point`.
    Raises :class:`GridError` naming ``where`` for other keys or counts that are not integers (the phase and the
    counts' ranges are :meth:`Limits.check`'s)."""
    if not isinstance(d, Mapping) or set(d) - {"phase", "batch", "tokens", "kv", "context"}:
        raise GridError(f"{where}: keys must be among phase, batch, tokens, kv, context")
    if not all(isinstance(d.get(k, 0), int) and not isinstance(d.get(k, 0), bool) for k in ("batch", "tokens", "kv", "context")):
        raise GridError(f"{where}: batch, tokens, kv, context must be integers")
    return Point(str(d.get("phase")), int(d.get("batch", 0)), int(d.get("tokens", 0)), int(d.get("kv", 0)),
                 int(d.get("context", 0)))


def points_file_keys(path: str | Path) -> list[str]:
    """Point keys of a points file, checked for shape but not against an engine's limits (no engine here)."""
    unbounded = Limits(max_num_batched_tokens=1 << 40, max_num_seqs=1 << 40, max_model_len=1 << 40,
                       kv_capacity_tokens=1 << 60, block_size=1, prefix_caching=True)
    return [p.key() for p in load_points(path, unbounded)]


def grid_digest(points: Sequence[Point]) -> str:
    """SHA-256 (hex) of the canonical JSON of the ordered points."""
    body = json.dumps([p.as_dict() for p in points], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def points_from_dicts(ds: Iterable[Mapping[str, Any]]) -> list[Point]:
    return [Point(**dict(d)) for d in ds]
