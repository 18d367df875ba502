"""Worker-side capture of the sampled token's logprob (``logprobs_mode = raw_logprobs``), so that
``selected_logprobs`` need not route every token's logprobs through vLLM's logprobs pipeline (sampler gather,
pythonized lists, serialization, output processing — about 15 % of tokens/s on the tiny CPU model).

A :class:`~genartifact.engine.worker_ext.WorkerCapture` run by genartifact's worker runtime on the capturing
rank of each engine. It wraps the runner's sampler: during steps with a flagged request
(``SamplingParams.extra_args["genartifact_logprobs_id"]``; the runtime's step hook) it computes, for the rows of
flagged requests only, exactly what vLLM's sampler computes for ``raw_logprobs`` —
``logits.log_softmax(-1, dtype=float32)`` on the raw logits, before any processing (``vllm/v1/sample/sampler.py``)
— and keeps, per request, ``position -> (token id, logprob)`` of each real sample (a chunked-prefill pass whose
sample vLLM discards is skipped: real iff computed + scheduled tokens reach the request's token count). The
driver fetches a finished request's entries and aligns them with the completion tokens by position and token id.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from genartifact.engine.worker_ext import WorkerCapture, WorkerStep

NAME = "selected_logprobs"
CAPTURE_KEY = "genartifact_logprobs_id"


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
    ``docs/benchmarks.md``, issue 13, tenth pass); device tensors gather on the device and copy the ``n`` values.
    The values are the same either way: an index, no arithmetic. Raises IndexError (numpy) or RuntimeError
    (torch) for a token id outside ``0 .. vocab-1``."""
    import numpy as np

    if lp.device.type == "cpu" and sampled_token_ids.device.type == "cpu":
        s = sampled_token_ids.numpy()
        tok = s[:, 0] if all_rows else s[idx.numpy(), 0]
        if tok.size and tok.min() < 0:  # numpy would read the row from its end; torch's gather raises
            raise IndexError(f"sampled token id {int(tok.min())} out of range for the logprobs' vocabulary")
        vals = lp.numpy()[np.arange(tok.shape[0]), tok]
        return tok.tolist(), vals.tolist()
    sampled = sampled_token_ids if all_rows else sampled_token_ids.index_select(0, idx)
    t = sampled[:, 0].long()
    return t.tolist(), lp.gather(1, t[:, None])[:, 0].tolist()


class LogprobCapture(WorkerCapture):
    """``pop(cid, [])`` -> ``{"positions": [...], "token_ids": [...], "logprobs": [...]}`` sorted by position."""

    name = NAME
    capture_key = CAPTURE_KEY

    def __init__(self, worker: Any) -> None:
        import torch

        mr = worker.model_runner
        self.worker = worker
        self.step: WorkerStep | None = None
        self.store: dict[str, dict[int, tuple[int, float]]] = {}
        sampler = mr.sampler
        orig_forward = sampler.forward

        @functools.wraps(orig_forward)
        def forward(logits: Any, sampling_metadata: Any, *a: Any, **kw: Any) -> Any:
            if self.step is None:
                return orig_forward(logits, sampling_metadata, *a, **kw)
            rows = self._rows(logits.shape[0])
            if not rows:
                return orig_forward(logits, sampling_metadata, *a, **kw)
            # rows are ascending batch rows: as many as the batch has means every row, in order (no gather)
            all_rows = len(rows) == logits.shape[0]
            idx = None if all_rows else torch.tensor([r for r, _, _ in rows], dtype=torch.long)
            # before the sampler, which may change the logits in place (temperature, penalties)
            lp = flagged_log_softmax(logits, idx, all_rows)
            out = orig_forward(logits, sampling_metadata, *a, **kw)
            toks, vals = selected_values(lp, out.sampled_token_ids, idx, all_rows)
            store = self.store
            for (_, cid, pos), t, v in zip(rows, toks, vals, strict=True):
                entries = store.get(cid)
                if entries is None:
                    entries = store[cid] = {}
                entries[pos] = (t, v)
            return out

        sampler.forward = forward

    def begin_step(self, step: WorkerStep) -> None:
        self.step = step

    def end_step(self, step: WorkerStep) -> None:
        self.step = None

    def _rows(self, n_rows: int) -> list[tuple[int, str, int]]:
        step = self.step
        assert step is not None
        so, flagged = step.scheduler_output, step.flagged.get(NAME, {})
        mr = self.worker.model_runner
        ib = mr.input_batch
        rows = []
        k = min(ib.num_reqs, n_rows)
        computed = ib.num_computed_tokens_cpu[:k].tolist()  # one conversion, not a numpy scalar per row
        sched, reqs = so.num_scheduled_tokens, mr.requests
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
        if entries is None:
            return None
        pos = sorted(entries)
        return {"positions": pos, "token_ids": [entries[p][0] for p in pos], "logprobs": [entries[p][1] for p in pos]}

    def handover(self, capture_id: str, extra_args: Any) -> Any | None:
        """Samples of a finished request for out-of-band handover (the same payload as :meth:`pop`)."""
        return self.pop(capture_id, [])

    def drop(self, capture_id: str) -> bool:
        return self.store.pop(capture_id, None) is not None

    def stats(self) -> dict[str, Any]:
        return {"requests": len(self.store)}
