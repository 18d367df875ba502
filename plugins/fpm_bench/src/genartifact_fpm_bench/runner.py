"""Measure grid points on a live engine through the FPM stream.

Each point execution pauses the scheduler (``AsyncLLM.pause_generation(mode="keep")``), submits its whole batch,
and resumes, so the batch is scheduled together; the FPMs the instrumented scheduler publishes during the
execution are collected from its ZMQ stream and kept raw (every sample, with its forward index and timing).

* prefill ``(tokens, batch, kv)``: a discarded replica of the same shape, then ``repeats`` measured executions,
  each one forward pass; KV-read tokens come from a staging request that computes the prefix first (same cache
  salt); ``kv = 0`` executions get a fresh cache salt, so a repeated coordinate never reuses a measured prefix.
* decode ``(batch, context)``: requests with ``context − 1`` prompt tokens are admitted over as many passes as the
  token budget needs (``Limits.decode_admission_passes``; recorded as ``admission`` samples, never measured) and
  generate enough tokens (``Limits.decode_max_tokens``) that the whole batch then decodes together; the first
  ``repeats`` such steady passes are measured, later ones (and the passes where the batch drains) are kept as
  ``drain`` samples. Requests admitted in an earlier pass have decoded a few tokens more, so a measured pass's
  contexts spread by up to the number of admission passes; the exact shape of every pass is in its sample.

Estimate: the median ``wall_time`` (``schedule_to_output``) of the measured samples; CV = stdev / mean; a point is
flagged noisy when CV > 0.1. What this engine cannot show (CUDA-graph dispatch on CPU, kernel identity) is
recorded as unavailable, never guessed.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

import structlog

from genartifact_fpm_bench.content import make_batch
from genartifact_fpm_bench.fpm import FPM, parse_frames
from genartifact_fpm_bench.grid import Limits, Point

log = structlog.get_logger("genartifact.fpm_bench")
NOISY_CV = 0.1
UNOBSERVED = {"cudagraph_dispatch": "unavailable: CPU engine (enforce_eager, no CUDA graphs)",
              "kernel_identity": "unavailable: not exposed by the engine",
              "sampled_continuation_token_ids": "not recorded",
              "kv_cache_tensors": "not recorded"}


class FpmCollector:
    """SUB side of the scheduler's FPM stream for one rank."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        import zmq

        self._zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.connect(f"tcp://{host}:{port}")
        self.last_seq: int | None = None
        self.gaps = 0

    def drain(self, settle_s: float = 0.05) -> list[FPM]:
        """Every FPM received so far (waits ``settle_s`` for stragglers)."""
        out: list[FPM] = []
        deadline = time.monotonic() + settle_s
        while True:
            if self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                seq, fpm = parse_frames(self.sock.recv_multipart())
                if self.last_seq is not None and seq != self.last_seq + 1:
                    self.gaps += 1
                self.last_seq = seq
                if fpm is not None:
                    out.append(fpm)
                deadline = time.monotonic() + settle_s
            elif time.monotonic() >= deadline:
                return out

    def close(self) -> None:
        self.sock.close(0)


def _sample(i: int, fpm: FPM, role: str) -> dict[str, Any]:
    return {"sample_index": i, "forward_index": fpm.counter_id, "role": role,
            "timing": {"basis": fpm.timing_basis, "start_monotonic": fpm.t_schedule, "end_monotonic": fpm.t_output,
                       "wall_time": fpm.wall_time, "inter_output": fpm.inter_output},
            "recorder_s": fpm.recorder_s,
            "scheduled": {f: getattr(fpm.scheduled, f) for f in fpm.scheduled.__struct_fields__},
            "queued": {f: getattr(fpm.queued, f) for f in fpm.queued.__struct_fields__}}


class BenchRunner:
    """Runs points on ``llm`` (a vLLM ``AsyncLLM`` with the instrumented scheduler) for DP rank ``rank``."""

    def __init__(self, llm: Any, collector: FpmCollector, rank: int, vocab: tuple[int, int], limits: Limits,
                 repeats: int = 3, warmup_iterations: int = 5) -> None:
        self.llm, self.collector, self.rank, self.vocab, self.limits = llm, collector, rank, vocab, limits
        self.repeats, self.warmup_iterations = repeats, warmup_iterations
        self.warmup_evidence: list[dict[str, Any]] = []

    async def _batch(self, prompts: list[list[int]], max_tokens: int, salt: str) -> None:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)

        async def one(i: int, p: list[int]) -> None:
            async for _ in self.llm.generate(TokensPrompt(prompt_token_ids=p, cache_salt=salt), params,
                                             f"bench-{uuid.uuid4().hex}-{i}"):
                pass

        await self.llm.pause_generation(mode="keep", clear_cache=False)
        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.05)  # let every request reach the (paused) scheduler
        await self.llm.resume_generation()
        await asyncio.gather(*tasks)

    async def warmup(self) -> None:
        """Global warmup: one 256-token prefill with ``warmup_iterations`` decode steps; recorded as evidence."""
        self.collector.drain()
        attempt: dict[str, Any] = {"kind": "global", "attempted_shape": {"prefill_tokens": 256, "batch": 1,
                                                                         "decode_steps": self.warmup_iterations}}
        try:
            pt = Point("prefill", 1, tokens=256)
            content = make_batch(pt, self.rank, [256], self.vocab, role="warmup")
            await self._batch([content.prompts[0].tolist()], self.warmup_iterations + 1, uuid.uuid4().hex)
            attempt["status"] = "completed"
        except Exception as e:  # noqa: BLE001 - evidence, not a crash
            attempt["status"] = f"failed: {type(e).__name__}"
        fpms = self.collector.drain()
        attempt.update(_evidence(fpms))
        self.warmup_evidence.append(attempt)

    async def run_point(self, p: Point) -> dict[str, Any]:
        """Measure one point; returns its record (``status`` completed or failed, raw samples, estimate)."""
        samples: list[dict[str, Any]] = []
        measured: list[int] = []
        self._current = p
        rec: dict[str, Any] = {"point": p.as_dict(), "key": p.key(), "dp_rank": self.rank}
        try:
            if p.phase == "prefill":
                per = p.tokens // p.batch
                prefix = None
                if p.kv:
                    prefix = make_batch(p, self.rank, [p.kv] * p.batch, self.vocab, role="prefix").prompts
                content = make_batch(p, self.rank, [per] * p.batch, self.vocab, prefix=prefix)
                for rep in range(self.repeats + 1):  # replica 0 is the discarded same-shape replica
                    salt = uuid.uuid4().hex
                    if prefix is not None:  # staging computes the prefix into the cache (same salt)
                        await self._batch([x.tolist() for x in prefix], 1, salt)
                        self._take(samples, "staging")
                    await self._batch([x.tolist() for x in content.prompts], 1, salt)
                    role = "discarded_replica" if rep == 0 else "measure"
                    idx = self._take(samples, role, want=lambda f: f.scheduled.num_prefill_requests == p.batch
                                     and f.scheduled.sum_prefill_tokens == p.tokens
                                     and f.scheduled.sum_prefill_kv_tokens == p.batch * p.kv)  # prefix really hit
                    if role == "measure":
                        measured += idx
            else:
                content = make_batch(p, self.rank, [p.context - 1] * p.batch, self.vocab)

                def full_decode(f: FPM) -> bool:
                    return f.scheduled.num_decode_requests == p.batch and f.scheduled.num_prefill_requests == 0

                max_tokens = self.limits.decode_max_tokens(p, self.repeats)
                for rep in range(2):  # 0: discarded replica, 1: measured
                    await self._batch([x.tolist() for x in content.prompts], max_tokens, uuid.uuid4().hex)
                    idx = self._take(samples, "discarded_replica" if rep == 0 else "measure", want=full_decode,
                                     other_role="admission", limit=self.repeats, after_role="drain")
                    if rep == 1:
                        measured += idx
            rec["prompts"] = {"status": "recorded", "sha256": content.aggregate,
                              "requests": [{"slot": i, "num_tokens": int(x.size), "sha256": h}
                                           for i, (x, h) in enumerate(zip(content.prompts, content.hashes, strict=True))]}
            rec["estimate"] = estimate(samples, measured)
            rec["status"] = "completed"
        except Exception as e:  # noqa: BLE001 - a failed point is recorded, the run goes on
            rec["status"] = "failed"
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["raw_samples"] = samples
        return rec

    def _take(self, samples: list[dict[str, Any]], role: str, want: Any = None, other_role: str = "unmatched",
              limit: int | None = None, after_role: str | None = None) -> list[int]:
        """Record every drained FPM as a sample; those matching ``want`` (at most ``limit``) get ``role`` and
        their indices are returned; the others get ``other_role`` — or ``after_role``, when given, once the
        matches began (e.g. ``admission`` before the steady passes, ``drain`` after)."""
        idx = []
        fpms = self.collector.drain()
        if role == "discarded_replica":  # per-shape warmup replica: preparation evidence
            self.warmup_evidence.append({"kind": "shape_replica", "point_key": self._current.key(),
                                         "attempted_shape": self._current.as_dict(),
                                         "status": "completed" if fpms else "failed: no forward pass observed",
                                         "matched_shape": bool(want is None or any(want(f) for f in fpms)),
                                         **_evidence(fpms)})
        started = False
        for f in fpms:
            match = (want is None or want(f)) and (limit is None or len(idx) < limit)
            i = len(samples)
            started = started or match
            samples.append(_sample(i, f, role if match else (after_role if started and after_role else other_role)))
            if match:
                idx.append(i)
        return idx


def estimate(samples: list[dict[str, Any]], measured: list[int]) -> dict[str, Any]:
    """The point estimate from raw samples: median ``wall_time`` (seconds) of the ``measured`` samples, their CV
    (population stdev / mean; None with one sample) and the noisy flag (CV > ``NOISY_CV``). Raises
    ``RuntimeError`` when no sample was measured (no forward pass had the point's shape)."""
    walls = [samples[i]["timing"]["wall_time"] for i in measured]
    if not walls:
        raise RuntimeError("no forward pass had the point's shape (the scheduler split the batch)")
    cv = statistics.pstdev(walls) / statistics.fmean(walls) if len(walls) > 1 else None
    return {"method": "median", "timing_basis": "schedule_to_output", "raw_sample_indices": list(measured),
            "wall_time": statistics.median(walls), "cv": cv, "noisy": bool(cv is not None and cv > NOISY_CV)}


def combine_rounds(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from the records of the same point measured in successive rounds (the whole grid runs once per
    round, so a point's samples are spread over the run's time instead of falling into one contention burst):
    raw samples concatenated in round order (each tagged ``round``; ``sample_index`` renumbered), the estimate
    recomputed over every measured sample; ``rounds`` lists each round's status. Completed only if every round
    completed (else failed with the first round's error)."""
    if len(recs) == 1:
        return recs[0]
    out = {k: v for k, v in recs[0].items() if k not in ("raw_samples", "estimate", "status", "error")}
    samples: list[dict[str, Any]] = []
    measured: list[int] = []
    for r, rec in enumerate(recs):
        base = len(samples)
        for smp in rec["raw_samples"]:
            samples.append({**smp, "sample_index": base + smp["sample_index"], "round": r})
        if rec.get("status") == "completed":
            measured += [base + i for i in rec["estimate"]["raw_sample_indices"]]
    out["raw_samples"] = samples
    out["rounds"] = [{"round": r, "status": rec.get("status"), **({"error": rec["error"]} if "error" in rec else {})}
                     for r, rec in enumerate(recs)]
    failed = [rec for rec in recs if rec.get("status") != "completed"]
    if failed:
        out["status"], out["error"] = "failed", failed[0].get("error")
    else:
        out["status"], out["estimate"] = "completed", estimate(samples, measured)
    return out


def _evidence(fpms: list[FPM]) -> dict[str, Any]:
    if not fpms:
        return {"forward_range": None, "first_scheduled": None, "last_scheduled": None}

    def shape(f: FPM) -> dict[str, int]:
        s = f.scheduled
        return {"prefill_requests": s.num_prefill_requests, "prefill_tokens": s.sum_prefill_tokens,
                "decode_requests": s.num_decode_requests}

    return {"forward_range": [fpms[0].counter_id, fpms[-1].counter_id], "first_scheduled": shape(fpms[0]),
            "last_scheduled": shape(fpms[-1])}
