"""Worker-side route recorder, engine-agnostic (numpy only) so it is unit-testable without vLLM.

Rows are attributed by *absolute token position*: a step is described by segments
``(capture_id, start_position, num_tokens)`` in the order the tokens were flattened into the forward
batch. Each MoE layer's ``topk_ids [num_tokens_in_step, top_k]`` is kept by reference during the forward (no
copy, no device sync per layer); at step end the layers are stacked token-major and converted to the compact
dtype in one operation each (one device-to-host copy on a GPU) and each segment is scattered into its request's
buffer ``[positions, routers, top_k]`` (position-major; :meth:`RouteRecorder.fetch` hands rows over
router-major). A decode step's row for the position right after a request's last recorded one (nearly every row)
is appended to the request's byte tail instead — a bytes copy, no numpy call: this is the work the recorder does
per request per step on the engine's critical path — and the tail goes into the buffer in one copy when anything
else touches the request (a prefill chunk, a recompute, fetch). This relies on the router not writing into
``topk_ids`` after handing them to its capture callback: true in vLLM 0.32, whose EPLB mapping and index-dtype
conversion after the callback are out of place (``BaseRouter._select_experts``); the route tests compare every
row with an independent transformers forward, so a router that did would be caught there.
Chunked prefill, mixed batches and preemption/recompute are all handled by positions (a recomputed
position simply overwrites the same row). A per-position ``filled`` mask proves completeness at fetch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: numpy dtype string -> torch dtype of the recorder's compact buffer (filled on first use; torch imported lazily)
_TORCH_DTYPES: dict[str, Any] = {}


@dataclass
class _Req:
    buf: np.ndarray  # [capacity, routers, top_k]
    filled: np.ndarray  # bool [capacity]
    max_pos: int = 0  # one past the highest recorded position (the tail's included)
    #: rows of positions ``tail_start .. max_pos-1`` appended by decode steps, not yet in ``buf`` (see flush)
    tail: bytearray = field(default_factory=bytearray)
    tail_start: int = 0

    def flush(self) -> None:
        """Move the tail's rows into ``buf`` (one copy) and mark them filled: before anything else reads or
        writes the request's rows. Tail positions lie past every position recorded before them, so none of them is
        a recompute."""
        if not self.tail:
            return
        end = self.max_pos
        self.ensure(end)
        rows = np.frombuffer(self.tail, self.buf.dtype).reshape(end - self.tail_start, *self.buf.shape[1:])
        self.buf[self.tail_start:end] = rows
        self.filled[self.tail_start:end] = True
        self.tail = bytearray()

    def ensure(self, n: int) -> None:
        cap = self.buf.shape[0]
        if n <= cap:
            return
        new = max(n, 2 * cap, 64)
        buf = np.zeros((new, *self.buf.shape[1:]), self.buf.dtype)
        buf[:cap] = self.buf
        filled = np.zeros(new, bool)
        filled[:cap] = self.filled
        self.buf, self.filled = buf, filled


@dataclass
class RouteRecorder:
    """Collects rows for flagged requests.

    :param router_ids: decoder-layer ids of the MoE routers, ascending (the router axis order).
    :param top_k: experts per token.
    :param dtype: compact dtype of expert ids (``uint8`` for <= 256 experts else ``uint16``).
    :param max_positions: hard cap on positions per request (the engine's max model length).
    """

    router_ids: Sequence[int]
    top_k: int
    dtype: np.dtype[Any]
    max_positions: int
    reqs: dict[str, _Req] = field(default_factory=dict)
    _segments: list[tuple[str, int, int, int]] = field(default_factory=list)
    #: the step's per-router ``topk_ids`` (as handed to :meth:`on_layer`; None until seen), or None when the step
    #: has no flagged request
    _stash: list[Any] | None = None
    steps: int = 0
    recomputed_positions: int = 0  # positions written again (preemption + recompute)

    def __post_init__(self) -> None:
        self._index = {lid: i for i, lid in enumerate(self.router_ids)}
        self.dtype = np.dtype(self.dtype)
        #: one row (a position's ids of one router: ``top_k * itemsize`` bytes) as the fewest equal unsigned machine
        #: words that hold it (top-8 ``uint8`` ids: one ``uint64``): :meth:`fetch` copies a whole row per element
        self._row_bytes = self.top_k * self.dtype.itemsize
        self._word = np.dtype(f"<u{next(w for w in (8, 4, 2, 1) if self._row_bytes % w == 0)}")

    def begin_step(self, segments: Sequence[tuple[str | None, int, int]]) -> None:
        """Describe the step: per scheduled request in batch order ``(capture_id | None, start_pos, n)``.
        Requests without a capture id occupy rows but are not recorded."""
        self._segments = []
        off = 0
        for cid, start, n in segments:
            if cid is not None and n > 0:
                self._segments.append((cid, start, n, off))
            off += n
        self._total = off
        self._stash = [None] * len(self.router_ids) if self._segments else None

    @property
    def recording(self) -> bool:
        """True between :meth:`begin_step` and :meth:`end_step` of a step with at least one flagged request."""
        return self._stash is not None

    def on_layer(self, layer_id: int, topk_ids: Any) -> None:
        """Record one MoE layer's ``topk_ids``: ``[>= tokens_in_step, top_k]``, a numpy array or a torch tensor
        (any device) of any integer dtype (or float, for a recorder of weights); rows beyond the step's tokens
        (padding) are ignored. Kept by reference until :meth:`end_step`, which converts all layers at once: the
        caller must not write into it before then."""
        if self._stash is None:
            return
        i = self._index.get(layer_id)
        if i is not None:
            self._stash[i] = topk_ids

    def _step_rows(self, stash: list[Any]) -> np.ndarray:
        """The step's rows ``[tokens_in_step, routers, top_k]`` in the recorder's dtype, from the layers' arrays:
        one stack and one conversion (and one device-to-host copy for device tensors)."""
        total = self._total
        if any(a.shape[0] != total for a in stash):
            stash = [a[:total] for a in stash]
        if isinstance(stash[0], np.ndarray):
            return np.stack(stash, axis=1).astype(self.dtype, copy=False)
        import torch

        if not stash[0].is_floating_point() and all(a.is_cpu for a in stash):
            # host expert ids: torch's stack, then numpy's cast (a new array, never a view of the router's tensors),
            # about 10 us per step less than a torch cast (docs/benchmarks.md, issue 13, eleventh pass); floats
            # (route weights, maybe bfloat16, which numpy lacks) keep torch's cast
            return torch.stack(stash, dim=1).numpy().astype(self.dtype)
        tdt = _TORCH_DTYPES.get(self.dtype.str)
        if tdt is None:
            tdt = _TORCH_DTYPES[self.dtype.str] = torch.from_numpy(np.empty(0, self.dtype)).dtype
        return torch.stack(stash, dim=1).detach().to(device="cpu", dtype=tdt).numpy()

    def end_step(self) -> None:
        """Scatter the step's rows to each flagged request by absolute position."""
        stash, self._stash = self._stash, None
        if stash is None:
            return
        if any(a is None for a in stash):
            # some router produced no rows this step: leave the positions unfilled so fetch reports them
            for cid, _start, _n, _off in self._segments:
                self._req(cid)
            return
        step = np.ascontiguousarray(self._step_rows(stash))  # [tokens, routers, top_k]
        row = step[0].nbytes if len(step) else 0
        rows = memoryview(step).cast("B")
        reqs, max_positions = self.reqs, self.max_positions
        for cid, start, n, off in self._segments:
            r = reqs.get(cid)
            if r is None:
                r = self._req(cid)
            if n == 1 and start == r.max_pos and start < max_positions:  # a decode step's next row
                if not r.tail:
                    r.tail_start = start
                r.tail += rows[off * row : (off + 1) * row]
                r.max_pos = start + 1
                continue
            r.flush()
            end = min(start + n, max_positions)
            if end <= start:
                continue
            r.ensure(end)
            filled = r.filled
            self.recomputed_positions += int(np.count_nonzero(filled[start:end]))
            filled[start:end] = True
            r.buf[start:end] = step[off : off + (end - start)]
            if end > r.max_pos:
                r.max_pos = end
        self.steps += 1

    def _req(self, cid: str) -> _Req:
        r = self.reqs.get(cid)
        if r is None:
            r = self.reqs[cid] = _Req(np.zeros((0, len(self.router_ids), self.top_k), self.dtype), np.zeros(0, bool))
        return r

    def fetch(self, cid: str, start: int, end: int) -> dict[str, Any] | None:
        """Pop request ``cid`` and return its rows for positions ``start .. end-1`` as
        ``{"shape": [routers, n, top_k], "dtype": str, "data": bytearray, "missing": [first, count] | None}``
        (``missing``: first unfilled position in the range and how many are unfilled; their rows are zeros). None
        if unknown.

        This runs on the engine's critical path when a request finishes (the worker hands its rows over before the
        next forward), so it moves each row once: from the buffer (positions before the decode tail) and from the
        tail itself (never flushed into the buffer first), router-major into a new ``bytearray`` (``data``: bytes-like,
        the step file writes it as it is, a fetch RPC pickles it). Each row is moved as one or a few machine words
        (``_word``): numpy's transpose copy of a ``[positions, routers, top_k]`` ``uint8`` array moves
        one byte at a time: with the tail's flush, ~5x slower (a 32k-token request of 48 routers x top-8: ~33 ms against
        ~7 ms, ``benchmarks/bench_worker_finish.py``)."""
        r = self.reqs.pop(cid, None)
        if r is None:
            return None
        end = max(0, min(end, self.max_positions))
        start = min(max(0, start), end)
        n = end - start
        routers, word = len(self.router_ids), self._word
        data = bytearray(routers * n * self._row_bytes)  # zeros: an unfilled position's rows
        t0 = r.tail_start if r.tail else r.max_pos  # rows from here on are in the tail (none past max_pos)
        hi = max(start, min(end, t0, r.buf.shape[0]))  # positions start .. hi-1 from the buffer
        lo, thi = hi, hi  # positions lo .. thi-1 from the tail (every tail row is filled)
        holes, first = 0, -1
        if n:
            out = np.frombuffer(data, word).reshape(routers, n, -1)
            if hi > start:
                out[:, : hi - start] = r.buf[start:hi].view(word).transpose(1, 0, 2)
                filled = r.filled[start:hi]
                if not filled.all():
                    h = np.flatnonzero(~filled)
                    holes, first = int(h.size), start + int(h[0])
            if r.tail and min(end, r.max_pos) > max(start, t0):
                lo, thi = max(start, t0), min(end, r.max_pos)
                tail = np.frombuffer(r.tail, word).reshape(-1, routers, out.shape[2])[lo - t0 : thi - t0]
                out[:, lo - start : thi - start] = tail.transpose(1, 0, 2)
        # unfilled: buffer holes, positions between the buffer's and the tail's, positions past both
        gaps = [(hi, lo - hi), (thi, end - thi)] if thi > lo else [(hi, end - hi)]
        for at, count in gaps:
            if count > 0:
                first = at if first < 0 else first
                holes += count
        return {
            "shape": [routers, n, self.top_k],
            "dtype": self.dtype.str,
            "data": data,
            "missing": [first, holes] if holes else None,
        }

    def discard(self, cid: str) -> bool:
        return self.reqs.pop(cid, None) is not None

    def retained_bytes(self) -> int:
        return sum(r.buf.nbytes + len(r.tail) for r in self.reqs.values())

