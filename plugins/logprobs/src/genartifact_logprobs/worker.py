"""Worker-side capture of the sampled token's logprob (``logprobs_mode = raw_logprobs``), so that
``selected_logprobs`` need not route every token's logprobs through vLLM's logprobs pipeline (sampler gather,
pythonized lists, serialization, output processing — about 15 % of tokens/s on the tiny CPU model).

A :class:`~genartifact.engine.worker_ext.WorkerCapture` run by genartifact's worker runtime on the capturing
rank of each engine. It wraps the runner's sampler: during steps with a flagged request
(``SamplingParams.extra_args["genartifact_logprobs_id"]``; the runtime's step hook) it computes, for the rows of
flagged requests only, exactly what vLLM's sampler computes for ``raw_logprobs`` —
``logits.log_softmax(-1, dtype=float32)`` on the raw logits, before any processing (``vllm/v1/sample/sampler.py``)
— and keeps, per request, the ``(position, token id, logprob)`` of each real sample (a chunked-prefill pass whose
sample vLLM discards is skipped: real iff computed + scheduled tokens reach the request's token count) in
:class:`Samples`. The
log-softmax is taken in the sampler's call (before the sampler may change the logits in place); the sampled ids
and their values are read and stored in ``end_step``, which the runtime runs after the step's output went back
to the engine (off its critical path). The driver fetches a finished request's entries and aligns them with the
completion tokens by position and token id.
"""

from __future__ import annotations

import functools
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from genartifact.engine.worker_ext import WorkerCapture, WorkerStep

NAME = "selected_logprobs"
CAPTURE_KEY = "genartifact_logprobs_id"


#: ``array`` type codes of 4-byte unsigned ints and floats (``worker_answer``'s ``<u4`` and ``<f4`` on a little-endian
#: host, which :meth:`Samples.answer` takes as they are)
_U4 = next(c for c in "ILH" if array(c).itemsize == 4)
_LITTLE = sys.byteorder == "little" and array("f").itemsize == 4


class Samples:
    """One request's samples, in the order they were taken: positions and token ids (``uint32``) and logprobs
    (``float32``, what the sampler computed) in three growing C arrays, so that a long request's answer is three
    buffer copies (a 32k-token request: ~0.02 ms, against ~10 ms from a dict of Python tuples;
    ``benchmarks/bench_worker_finish.py``). A position sampled again (a preempted request recomputed) is kept
    once, its last sample, as a position-keyed store would keep it; while positions only grow (the usual case)
    :meth:`answer` takes the arrays as they are."""

    __slots__ = ("positions", "token_ids", "logprobs", "ordered", "error")

    def __init__(self) -> None:
        self.positions, self.token_ids, self.logprobs = array(_U4), array(_U4), array("f")
        self.ordered = True  # every position so far above the one before it
        self.error: str | None = None  # the first sample that could not be stored (see refuse)

    def add(self, position: int, token_id: int, logprob: float) -> None:
        """Record one sample. Raises ``OverflowError`` for a negative or > 32-bit position or token id (nothing
        recorded then), ``TypeError`` for a value of another type."""
        pos, toks, vals = self.positions, self.token_ids, self.logprobs
        n = len(pos)
        try:
            pos.append(position)
            toks.append(token_id)
            vals.append(logprob)
        except BaseException:
            del pos[n:], toks[n:], vals[n:]
            raise
        if n and position <= pos[n - 1]:
            self.ordered = False

    def refuse(self, position: Any, e: BaseException) -> None:
        """A sample of this request that :meth:`add` refused (engine data out of bounds): the answer says so
        instead of holding samples (the driver fails this request's capture, ``capture_invalid``; the other
        requests of the step are unaffected)."""
        if self.error is None:
            self.error = (f"the sample at position {str(position)[:40]} could not be stored ({type(e).__name__}: "
                          f"{str(e)[:200]}); allowed: positions and token ids 0..{2**32 - 1}, a float logprob")

    def __len__(self) -> int:
        return len(self.positions)

    def answer(self) -> dict[str, bytes]:
        """The fetch answer (:func:`~genartifact_logprobs.answer.worker_answer`'s format): one entry per position,
        ascending, the last sample taken at it; ``{"error": text}`` after :meth:`refuse`."""
        if self.error is not None:
            return {"error": self.error}
        if self.ordered and _LITTLE:
            return {"positions": self.positions.tobytes(), "token_ids": self.token_ids.tobytes(),
                    "logprobs": self.logprobs.tobytes()}
        import numpy as np

        p = np.frombuffer(self.positions, np.uint32)
        order = np.argsort(p, kind="stable")  # equal positions keep their sampling order: the last is the latest
        ps = p[order]
        last = order[np.append(ps[1:] != ps[:-1], True)] if p.size else order
        return {"positions": p[last].astype("<u4").tobytes(),
                "token_ids": np.frombuffer(self.token_ids, np.uint32)[last].astype("<u4").tobytes(),
                "logprobs": np.frombuffer(self.logprobs, np.float32)[last].astype("<f4").tobytes()}


def flagged_log_softmax(logits: Any, idx: Any, all_rows: bool) -> Any:
    """``log_softmax(logits[idx], -1, dtype=float32)``: float32 ``[len(idx), vocab]`` for the rows ``idx`` (int64
    ``[n]``, ascending batch rows of flagged requests) of ``logits`` (``[batch, vocab]``); ``all_rows``: the flagged
    rows are every row in order (no gather; ``idx`` is not used and may be None). Only flagged rows are normalised: a row's log-softmax does not depend on
    the other rows of the batch (pinned bitwise against the whole-batch call vLLM's sampler makes for
    ``raw_logprobs``, ``plugins/logprobs/tests``), and at a 151,936-token vocabulary a mixed batch's unflagged
    rows would cost the worker milliseconds per step."""
    import torch

    sub = logits if all_rows else logits.index_select(0, idx)
    return sub.log_softmax(dim=-1, dtype=torch.float32)


def selected_values(lp: Any, sampled_token_ids: Any, idx: Any, all_rows: bool) -> tuple[list[int], list[float]]:
    """The sampled token ids and their logprobs as Python lists (``n`` each): ``lp`` float32 ``[n, vocab]`` (the
    flagged rows' log-softmax), ``sampled_token_ids`` int ``[batch, >= 1]`` (the sampler's output: column 0 is the
    sampled token), ``idx`` / ``all_rows`` as for :func:`flagged_log_softmax`. Host tensors are read through numpy
    views (no torch op: on vLLM-CPU each small torch op costs the worker's critical path several microseconds,
    ``docs/benchmarks.md``, issue 13, tenth and eleventh passes); device tensors gather on the device and copy the
    ``n`` values. The values are the same either way: an index, no arithmetic. Raises IndexError (numpy) or
    RuntimeError (torch) for a token id outside ``0 .. vocab-1``."""
    import numpy as np

    if lp.is_cpu and sampled_token_ids.is_cpu:
        s = sampled_token_ids.numpy()
        tok = s[:, 0] if all_rows else s[idx.numpy(), 0]
        toks = tok.tolist()
        if toks and min(toks) < 0:  # numpy would read the row from its end; torch's gather raises
            raise IndexError(f"sampled token id {min(toks)} out of range for the logprobs' vocabulary")
        n = len(toks)
        rows = _ARANGE.get(n)
        if rows is None:
            rows = _ARANGE[n] = np.arange(n)
        return toks, lp.numpy()[rows, tok].tolist()
    sampled = sampled_token_ids if all_rows else sampled_token_ids.index_select(0, idx)
    t = sampled[:, 0].long()
    return t.tolist(), lp.gather(1, t[:, None])[:, 0].tolist()


#: ``np.arange(n)`` by ``n`` (row indices of a step's flagged rows; read-only use); at most a batch's sizes
_ARANGE: dict[int, Any] = {}


class LogprobCapture(WorkerCapture):
    """``pop(cid, [])`` -> the request's samples by position, as :func:`~genartifact_logprobs.answer.worker_answer`
    builds them (binary arrays)."""

    name = NAME
    capture_key = CAPTURE_KEY

    def __init__(self, worker: Any) -> None:
        import torch

        mr = worker.model_runner
        self.worker = worker
        self.step: WorkerStep | None = None
        self.store: dict[str, Samples] = {}  # capture id -> its samples
        #: the step's sampled rows, read and stored by end_step: (rows, log-softmax, sampled ids, idx, all_rows)
        self._sampled: tuple[Any, ...] | None = None
        #: the runner keeps vLLM 0.32's per-step sample arrays (see :meth:`_rows`), else the per-request rule
        self._runner_arrays = _runner_arrays(mr)
        self._seq_tensor: Any = None  # the runner's optimistic_seq_lens_cpu last seen, and its numpy view
        self._seq_np: Any = None
        sampler = mr.sampler
        orig_forward = sampler.forward

        def before(logits: Any) -> tuple[Any, ...] | None:
            """The step's flagged rows and their log-softmax, taken before the sampler, which may change the
            logits in place (temperature, penalties); None when no flagged row holds a sample."""
            rows = self._rows(logits.shape[0])
            if not rows:
                return None
            # rows are ascending batch rows: as many as the batch has means every row, in order (no gather)
            all_rows = len(rows) == logits.shape[0]
            idx = None if all_rows else torch.tensor([r for r, _, _ in rows], dtype=torch.long)
            return rows, flagged_log_softmax(logits, idx, all_rows), idx, all_rows

        @functools.wraps(orig_forward)
        def forward(logits: Any, sampling_metadata: Any, *a: Any, **kw: Any) -> Any:
            step = self.step
            if step is None or step.closed:  # (a dummy run between a step's end and its end_step)
                return orig_forward(logits, sampling_metadata, *a, **kw)
            # our work is guarded (a fault fails this step's flagged requests, never the sampler); vLLM's sampler
            # runs exactly once, outside the guard
            pre = step.guard(NAME, before, logits)
            out = orig_forward(logits, sampling_metadata, *a, **kw)
            if pre is not None:  # read and stored in end_step, off the engine's critical path (the runtime defers it)
                rows, lp, idx, all_rows = pre
                self._sampled = (rows, lp, out.sampled_token_ids, idx, all_rows)
            return out

        sampler.forward = forward

    def begin_step(self, step: WorkerStep) -> None:
        self.step = step

    def end_step(self, step: WorkerStep) -> None:
        self.step = None
        sampled, self._sampled = self._sampled, None
        if sampled is None:
            return
        rows, lp, sampled_token_ids, idx, all_rows = sampled
        toks, vals = selected_values(lp, sampled_token_ids, idx, all_rows)
        store = self.store
        for (_, cid, pos), t, v in zip(rows, toks, vals, strict=True):
            entries = store.get(cid)
            if entries is None:
                entries = store[cid] = Samples()
            try:
                entries.add(pos, t, v)
            except (OverflowError, TypeError) as e:  # out of bounds: this request's capture fails, not the step's
                entries.refuse(pos, e)

    def _rows(self, n_rows: int) -> list[tuple[int, str, int]]:
        """The step's flagged rows that hold a real sample, ascending: ``(batch row, capture id, position)``, the
        position being the request's token count after this step (computed + scheduled tokens). A chunked-prefill
        pass whose sample vLLM discards is left out. Read from the runner's own per-step arrays where it has them
        (vLLM 0.32 ``GPUModelRunner._prepare_inputs``: ``optimistic_seq_lens_cpu`` and ``discard_request_mask``,
        this step's, set before the forward), else computed per request from the input batch and the scheduler
        output, the same rule (real iff computed + scheduled tokens reach the request's token count)."""
        step = self.step
        assert step is not None
        flagged = step.flagged.get(NAME, {})
        mr = self.worker.model_runner
        ib = mr.input_batch
        k = min(ib.num_reqs, n_rows)
        if self._runner_arrays:
            seq = mr.optimistic_seq_lens_cpu
            if seq is not self._seq_tensor:  # a numpy view of the runner's buffer: no torch op per step
                self._seq_tensor, self._seq_np = seq, seq.numpy()
            ends = self._seq_np[:k].tolist()
            dropped = mr.discard_request_mask.np[:k].tolist()
            return [(i, cid, ends[i]) for i, rid in enumerate(ib.req_ids[:k])
                    if (cid := flagged.get(rid)) is not None and not dropped[i]]
        rows = []
        computed = ib.num_computed_tokens_cpu[:k].tolist()  # one conversion, not a numpy scalar per row
        sched, reqs = step.scheduler_output.num_scheduled_tokens, mr.requests
        for i, rid in enumerate(ib.req_ids[:k]):
            cid = flagged.get(rid)
            if cid is None:
                continue
            end = int(computed[i]) + int(sched.get(rid, 0))
            req = reqs.get(rid)
            if req is not None and end >= int(req.num_tokens):  # a real sample (not a discarded partial prefill)
                rows.append((i, cid, end))
        return rows

    def pop(self, capture_id: str, args: Sequence[Any]) -> Any | None:
        entries = self.store.pop(capture_id, None)
        return None if entries is None else entries.answer()

    def handover(self, capture_id: str, extra_args: Any) -> Any | None:
        """Samples of a finished request for out-of-band handover (the same payload as :meth:`pop`)."""
        return self.pop(capture_id, [])

    def drop(self, capture_id: str) -> bool:
        return self.store.pop(capture_id, None) is not None

    def stats(self) -> dict[str, Any]:
        return {"requests": len(self.store), "runner_arrays": self._runner_arrays}


def _runner_arrays(mr: Any) -> bool:
    """``mr`` (a model runner) has vLLM 0.32's per-step ``optimistic_seq_lens_cpu`` (a host tensor) and
    ``discard_request_mask`` (a ``CpuGpuBuffer``: ``.np``) as :meth:`LogprobCapture._rows` reads them."""
    seq, mask = getattr(mr, "optimistic_seq_lens_cpu", None), getattr(mr, "discard_request_mask", None)
    return hasattr(seq, "numpy") and hasattr(seq, "is_cpu") and bool(seq.is_cpu) and \
        hasattr(getattr(mask, "np", None), "tolist")
