"""Worker-side capture of the sampled token's logprob (``logprobs_mode = raw_logprobs``), so that
``selected_logprobs`` need not route every token's logprobs through vLLM's logprobs pipeline (sampler gather,
pythonized lists, serialization, output processing — about 15 % of tokens/s on the tiny CPU model).

Installed in each worker by the genartifact worker extension. It wraps the runner's sampler: for the rows of
flagged requests (``SamplingParams.extra_args["genartifact_logprobs_id"]``) it computes exactly what vLLM's
sampler computes for ``raw_logprobs`` — ``logits.log_softmax(-1, dtype=float32)`` on the raw logits, before any
processing (``vllm/v1/sample/sampler.py``) — and keeps, per request, ``position -> (token id, logprob)`` of each
real sample (a chunked-prefill pass whose sample vLLM discards is skipped: real iff computed + scheduled tokens
reach the request's token count). The driver fetches a finished request's entries and aligns them with the
completion tokens by position and token id.
"""

from __future__ import annotations

import functools
from typing import Any

from genartifact.engine.worker_ext import track_flagged

CAPTURE_KEY = "genartifact_logprobs_id"


class _State:
    def __init__(self, worker: Any) -> None:
        mr = worker.model_runner
        self.worker = worker
        self.sched: Any = None
        self.store: dict[str, dict[int, tuple[int, float]]] = {}
        self.flagged: dict[str, str] = {}  # engine request id -> capture id, live flagged requests only
        orig_exec = mr.execute_model

        @functools.wraps(orig_exec)
        def execute_model(scheduler_output: Any, *a: Any, **kw: Any) -> Any:
            self.sched = scheduler_output  # kept for the sampling call that follows
            track_flagged(scheduler_output, CAPTURE_KEY, self.flagged)
            return orig_exec(scheduler_output, *a, **kw)

        mr.execute_model = execute_model
        sampler = mr.sampler
        orig_forward = sampler.forward

        @functools.wraps(orig_forward)
        def forward(logits: Any, sampling_metadata: Any, *a: Any, **kw: Any) -> Any:
            if not self.flagged:
                return orig_forward(logits, sampling_metadata, *a, **kw)
            rows = self._rows(logits.shape[0])
            lp = logits.log_softmax(dim=-1, dtype=__import__("torch").float32) if rows else None
            out = orig_forward(logits, sampling_metadata, *a, **kw)
            if rows:
                import torch

                idx = torch.tensor([r for r, _, _ in rows], dtype=torch.long)
                tok = out.sampled_token_ids.index_select(0, idx)[:, 0].long()
                vals = lp.index_select(0, idx).gather(1, tok[:, None])[:, 0]
                for (_, cid, pos), t, v in zip(rows, tok.tolist(), vals.tolist(), strict=True):
                    self.store.setdefault(cid, {})[pos] = (t, v)
            return out

        sampler.forward = forward

    def _rows(self, n_rows: int) -> list[tuple[int, str, int]]:
        so = self.sched
        if so is None:
            return []
        mr = self.worker.model_runner
        ib = mr.input_batch
        rows = []
        for i, rid in enumerate(ib.req_ids[: min(ib.num_reqs, n_rows)]):
            cid = self.flagged.get(rid)
            if cid is None:
                continue
            n = int(so.num_scheduled_tokens.get(rid, 0))
            end = int(ib.num_computed_tokens_cpu[i]) + n
            req = mr.requests.get(rid)
            if req is not None and end >= int(req.num_tokens):  # a real sample (not a discarded partial prefill)
                rows.append((i, cid, end))
        return rows


def install(worker: Any) -> None:
    if getattr(worker, "_genartifact_logprobs", None) is None:
        worker._genartifact_logprobs = _State(worker)


def call(worker: Any, verb: str, args: list[Any]) -> Any:
    """``fetch(id)`` -> ``{"positions": [...], "token_ids": [...], "logprobs": [...]}`` sorted by position (popped),
    or ``{"unknown": True}``; ``discard(id)`` -> bool; ``stats()`` -> dict."""
    install(worker)
    st: _State = worker._genartifact_logprobs
    if verb == "fetch":
        entries = st.store.pop(str(args[0]), None)
        if entries is None:
            return {"unknown": True}
        pos = sorted(entries)
        return {"positions": pos, "token_ids": [entries[p][0] for p in pos], "logprobs": [entries[p][1] for p in pos]}
    if verb == "discard":
        return st.store.pop(str(args[0]), None) is not None
    if verb == "stats":
        return {"requests": len(st.store)}
    raise ValueError(f"selected_logprobs worker verb {verb!r} unknown; allowed: ['discard', 'fetch', 'stats']")
