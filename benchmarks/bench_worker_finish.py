"""What a long request's finish costs the capturing worker before the next forward (issue 13, fifteenth pass).

    .venv/bin/python benchmarks/bench_worker_finish.py [--tokens 32768] [--prompt 512] [--routers 48]
                                                       [--top-k 8] [--experts 128] [--rounds 6] [--finishes 4]
                                                       [--forward-ms 30]

vLLM tells the workers that a request finished in the next step's scheduler output; the capturing worker then hands
the request's rows over (``WorkerRuntime._track``: each content's ``handover`` and the step file) before that
step's forward runs, so every request in the batch waits for it. A long RL rollout is where this is large: a
``--prompt`` + ``--tokens`` request of a Qwen3-30B-A3B-shaped model (48 MoE layers, top-8 of 128 experts, the
defaults) hands over ~12 MiB of routes and 32k logprobs.

This drives the real worker runtime (``genartifact.engine.worker_ext.WorkerRuntime``) with the real
``moe_routes`` and ``selected_logprobs`` worker captures, holding the state a long request leaves (its prompt's
rows in the recorder's buffer, its decode rows in the recorder's tail, one sample per completion token), a real
handover folder in ``/dev/shm``, and a stand-in forward (``torch.mm`` on all cores for ``--forward-ms``, as the CPU
engine's forward uses every core). Per finish: the time from the step's entry to the forward's start (the
engine's critical path) and the step's wall time.

Two sides, alternated per round (``--finishes`` finishes each):

* "writer thread": the product (step files of ``HANDOVER_THREAD_BYTES`` or more written by the worker's writer
  thread while the forward runs);
* "before the forward": the same with every step file written before the forward (``handover_writer`` raised).

And, alternated in the same rounds on the same state, the two copies a finish makes, against the straightforward
procedure they replaced: ``RouteRecorder.fetch`` (router-major, a row per element, straight from buffer and tail)
against flushing the tail into the buffer, numpy's transpose copy and ``tobytes``; ``Samples.answer`` against a
position-keyed dict of ``(token, logprob)`` turned into the answer (``worker_answer``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, product_logging, ratio_line, rotation, side_line  # noqa: E402

ROUTES_KEY, LOGPROBS_KEY = "genartifact_capture_id", "genartifact_logprobs_id"


class Request:
    """The captured state one long request leaves on the worker, made once and copied per finish."""

    def __init__(self, prompt: int, tokens: int, routers: int, top_k: int, experts: int) -> None:
        from genartifact_logprobs.worker import Samples

        rng = np.random.default_rng(0)
        self.routers, self.top_k, self.prompt, self.tokens = routers, top_k, prompt, tokens
        self.dtype = np.dtype("<u1") if experts <= 256 else np.dtype("<u2")
        # after the prefill (one chunk) and `tokens - 1` decode steps: positions 0..prompt-1 in the buffer, each
        # decode step's row appended to the tail (RouteRecorder.end_step), the last token never forwarded
        self.buf = rng.integers(0, experts, (prompt, routers, top_k), dtype=np.int64).astype(self.dtype)
        self.tail = bytearray(rng.integers(0, experts, (tokens - 1, routers, top_k), dtype=np.int64)
                              .astype(self.dtype).tobytes())
        self.samples = Samples()
        toks, vals = rng.integers(0, 151_936, tokens).tolist(), (-rng.exponential(size=tokens)).tolist()
        for i in range(tokens):
            self.samples.add(prompt + i + 1, toks[i], vals[i])
        self.dict_samples = {prompt + i + 1: (toks[i], vals[i]) for i in range(tokens)}

    @property
    def forwarded(self) -> int:
        return self.prompt + self.tokens - 1

    def req(self) -> Any:
        """A fresh recorder entry holding this request's rows (``_Req``)."""
        from genartifact_route_capture.recorder import _Req

        return _Req(self.buf.copy(), np.ones(self.prompt, bool), self.forwarded, bytearray(self.tail), self.prompt)

    def samples_copy(self) -> Any:
        from genartifact_logprobs.worker import Samples

        s = Samples()
        s.positions, s.token_ids, s.logprobs = (a[:] for a in (self.samples.positions, self.samples.token_ids,
                                                               self.samples.logprobs))
        return s


def reference_fetch(r: Any, start: int, end: int) -> bytes:
    """The rows' bytes as the recorder gave them before this pass: tail flushed into the buffer (grown as
    ``ensure`` grows it), then numpy's transpose copy and ``tobytes``."""
    r.flush()
    r.ensure(end)
    np.nonzero(~r.filled[start:end])
    return np.ascontiguousarray(r.buf[start:end].transpose(1, 0, 2)).tobytes()


def reference_answer(entries: dict[int, tuple[int, float]]) -> dict[str, bytes]:
    """``selected_logprobs``' answer as the worker made it before this pass: from a position-keyed dict."""
    from genartifact_logprobs.answer import worker_answer

    pos = sorted(entries)
    return worker_answer(pos, [entries[p][0] for p in pos], [entries[p][1] for p in pos])


class Runner:
    """A model runner whose ``execute_model`` is the stand-in forward; records when the forward started."""

    def __init__(self, forward_ms: float) -> None:
        import torch

        self.torch = torch
        self.a = torch.randn(512, 512)
        self.reps = 1
        self.started = 0.0
        for _ in range(5):  # warm (the first calls are slow), then calibrated on the median of 7 calls
            self._forward()
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            self._forward()
            ts.append(time.perf_counter() - t0)
        self.reps = max(1, round(forward_ms / 1e3 / max(statistics.median(ts), 1e-6)))

    def _forward(self) -> None:
        for _ in range(self.reps):
            self.torch.mm(self.a, self.a)

    def execute_model(self, so: Any) -> Any:
        self.started = time.perf_counter()
        self._forward()
        return "output"

    def sample_tokens(self, grammar: Any) -> Any:
        return None


class Worker:
    """The capturing worker: the real runtime and captures over :class:`Runner`, a handover folder in /dev/shm."""

    def __init__(self, req: Request, forward_ms: float) -> None:
        from genartifact.engine.worker_ext import Handover, WorkerRuntime
        from genartifact_logprobs.worker import LogprobCapture
        from genartifact_route_capture.recorder import RouteRecorder
        from genartifact_route_capture.worker import RouteCapture

        self.r = req
        self.routes = RouteCapture.__new__(RouteCapture)  # (its __init__ binds vLLM's routers: none here)
        self.routes.recorder = RouteRecorder(router_ids=tuple(range(req.routers)), top_k=req.top_k, dtype=req.dtype,
                                             max_positions=req.forwarded + 1)
        self.routes.step, self.routes._kept = None, []
        self.logprobs = LogprobCapture.__new__(LogprobCapture)  # (its __init__ wraps vLLM's sampler)
        self.logprobs.store, self.logprobs.step, self.logprobs._sampled = {}, None, None
        caps = [self.routes, self.logprobs]
        host = NS(hooks=NS(worker_captures=lambda worker, settings: [(None, c) for c in caps]))  # (info, capture)
        self.runner = Runner(forward_ms)
        self.worker = NS(rank=0, model_runner=self.runner, vllm_config=NS(parallel_config=NS(
            tensor_parallel_size=1, data_parallel_rank=0, data_parallel_size=1)))
        self.ho = Handover()
        self.ho.contents = {"moe_routes", "selected_logprobs"}
        self.rt = WorkerRuntime(self.worker, {"contents": ["moe_routes", "selected_logprobs"],
                                              "handover": self.ho.config()}, host=host)
        self.n = 0

    def finish(self) -> tuple[float, float]:
        """One long request started, given its captured state, and finished: ``(ms from the finishing step's
        entry to its forward, the step's ms)``; its step file removed (and waited for) after the clock stops."""
        self.n += 1
        rid, cid = f"r{self.n}", f"c{self.n}"
        extra = {ROUTES_KEY: cid, LOGPROBS_KEY: cid}
        mr = self.worker.model_runner  # (the runtime's wrapper)
        mr.execute_model(NS(scheduled_new_reqs=[NS(req_id=rid, sampling_params=NS(extra_args=extra))],
                            finished_req_ids=set(), num_scheduled_tokens={rid: 1}))
        self.rt.settle()
        self.routes.recorder.reqs[cid] = self.r.req()
        self.logprobs.store[cid] = self.r.samples_copy()
        t0 = time.perf_counter()
        mr.execute_model(NS(scheduled_new_reqs=[], finished_req_ids={rid}, num_scheduled_tokens={}))
        t1 = time.perf_counter()
        self.rt.reap_writes(wait=True)
        self.rt.settle()
        if self.rt.unwritten["moe_routes"] or self.ho.files() != ["moe_routes." + cid, "selected_logprobs." + cid]:
            raise SystemExit(f"the step file was not written: {self.ho.files()} {self.rt.unwritten}")
        self.ho.drop("moe_routes", cid)
        self.ho.drop("selected_logprobs", cid)
        return (self.runner.started - t0) * 1e3, (t1 - t0) * 1e3

    def close(self) -> None:
        self.ho.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768, help="completion tokens of the long request")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--routers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--finishes", type=int, default=4, help="finishes per side and round")
    ap.add_argument("--forward-ms", type=float, default=30.0, help="the stand-in forward's length")
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.prompt, args.routers, args.rounds, args.finishes, args.forward_ms = 300, 20, 4, 1, 1, 2.0
    product_logging()
    import genartifact.engine.worker_ext as wx
    from genartifact_route_capture.recorder import RouteRecorder

    req = Request(args.prompt, args.tokens, args.routers, args.top_k, args.experts)
    w = Worker(req, args.forward_ms)
    rec = RouteRecorder(router_ids=tuple(range(args.routers)), top_k=args.top_k, dtype=req.dtype,
                        max_positions=req.forwarded + 1)
    sides = ["writer thread", "before the forward"]
    entry: dict[str, list[float]] = {s: [] for s in sides}
    stepms: dict[str, list[float]] = {s: [] for s in sides}
    copies = ["fetch", "reference fetch", "answer", "reference answer"]
    copy_ms: dict[str, list[float]] = {c: [] for c in copies}
    try:
        w.finish()  # warm-up: the writer thread exists, the folder's pages were touched once
        for r in range(args.rounds):
            for side in rotation(sides, r):
                w.rt.handover_thread_bytes = wx.HANDOVER_THREAD_BYTES if side == "writer thread" else 1 << 62
                got = [w.finish() for _ in range(args.finishes)]
                entry[side].append(statistics.median(g[0] for g in got))
                stepms[side].append(statistics.median(g[1] for g in got))
            for c in rotation(copies, r):
                ts = []
                for _ in range(args.finishes):
                    if c in ("fetch", "reference fetch"):
                        rec.reqs["x"] = state = req.req()
                        t0 = time.perf_counter()
                        if c == "fetch":
                            out = rec.fetch("x", 0, req.forwarded)
                        else:
                            out = reference_fetch(state, 0, req.forwarded)
                            rec.reqs.pop("x")
                    else:
                        s = req.samples_copy()
                        t0 = time.perf_counter()
                        out = s.answer() if c == "answer" else reference_answer(req.dict_samples)
                    ts.append((time.perf_counter() - t0) * 1e3)
                    del out
                copy_ms[c].append(statistics.median(ts))
        # the two procedures give the same bytes
        rec.reqs["x"] = req.req()
        if bytes(rec.fetch("x", 0, req.forwarded)["data"]) != reference_fetch(req.req(), 0, req.forwarded):
            raise SystemExit("RouteRecorder.fetch and the reference procedure disagree")
        if req.samples_copy().answer() != reference_answer(req.dict_samples):
            raise SystemExit("Samples.answer and the reference procedure disagree")
    finally:
        w.close()
    size = req.routers * req.forwarded * req.top_k * req.dtype.itemsize
    print(f"one request of {args.prompt} prompt + {args.tokens} completion tokens finishing: {args.routers} routers, "
          f"top-{args.top_k} of {args.experts} ({size / 2**20:.1f} MiB of routes), {args.tokens} logprobs; "
          f"stand-in forward {args.forward_ms:g} ms (torch.mm, {w.runner.torch.get_num_threads()} threads); "
          f"{args.finishes} finishes per side and round, {args.rounds} rounds alternated; "
          f"handover folder {os.path.dirname(w.ho.dir)}; {load_line()}")
    for side in sides:
        print(side_line(f"{side}: step entry to forward", entry[side], "ms", higher_is_better=False))
        print(side_line(f"{side}: step wall time", stepms[side], "ms", higher_is_better=False))
    for c in copies:
        print(side_line(c, copy_ms[c], "ms", higher_is_better=False))
    print(ratio_line("worker's critical path at a long request's finish (step entry to forward), writer thread / "
                     "before the forward", entry["writer thread"], entry["before the forward"]))
    print(ratio_line("finishing step's wall time, writer thread / before the forward", stepms["writer thread"],
                     stepms["before the forward"]))
    print(ratio_line("moe_routes rows out of the recorder, RouteRecorder.fetch / flush + numpy transpose + tobytes",
                     copy_ms["fetch"], copy_ms["reference fetch"]))
    print(ratio_line("selected_logprobs answer, Samples.answer / position-keyed dict + worker_answer",
                     copy_ms["answer"], copy_ms["reference answer"]))


if __name__ == "__main__":
    main()
