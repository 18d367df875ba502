"""Worker-side route recording cost per engine step: ``RouteRecorder`` (layers kept by reference, stacked and
converted once at the step's end) ÷ the per-layer copy it replaced (each layer's ``topk_ids`` copied into the
compact step buffer as it arrives: a numpy view, ``torch.from_numpy`` and a ``copy_`` per layer), same steps.

    .venv/bin/python benchmarks/bench_route_recorder.py [--rounds 8] [--steps 400]

Shapes: decode steps of ``T`` flagged requests (one token each) through ``R`` MoE layers with top-``k``: the tiny
model (4 × top-2), the 45M model (6 × top-4) and a 48-layer top-8 model (Qwen3-30B-A3B's router layout) at 16,
64 and 256 requests per step. The cost is per layer per step and does not depend on the model's FLOPs: a GPU
engine with steps of a few milliseconds pays it too (there the per-layer copy was also a device-to-host copy,
i.e. a synchronisation, per layer). Reports CPU µs per step (``time.process_time``), rotated rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, ratio_line, rotation, side_line  # noqa: E402


class PerLayerCopy:
    """The recorder's step path before issue 13's fourth pass (reference side): a compact step buffer
    allocated per step, each layer copied into it on arrival, then the same scatter."""

    def __init__(self, rec):
        self.rec = rec

    def begin_step(self, segments):
        self.rec.begin_step(segments)
        r = self.rec
        self.buf = np.zeros((len(r.router_ids), r._total, r.top_k), r.dtype) if r.recording else None

    def on_layer(self, i, t):
        import torch

        if self.buf is not None:
            torch.from_numpy(self.buf[i]).copy_(t[: self.rec._total])
            self.rec._stash[i] = self.buf[i]  # the recorder's scatter then reads the copied rows

    def end_step(self):
        self.rec.end_step()


def run(make, layers, steps, T):
    rec = make()
    t0 = time.process_time()
    for s in range(steps):
        rec.begin_step([(f"c{j}", 64 + s, 1) for j in range(T)])
        for i, t in enumerate(layers):
            rec.on_layer(i, t)
        rec.end_step()
    return (time.process_time() - t0) / steps


def main() -> None:
    import torch
    from genartifact_route_capture.recorder import RouteRecorder

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=400)
    add_smoke(ap)
    args = ap.parse_args()
    shapes = [(4, 16, 2), (6, 16, 4), (48, 16, 8), (48, 64, 8), (48, 256, 8)]
    if args.smoke:
        args.rounds, args.steps, shapes = 1, 5, [(4, 4, 2)]
    print(load_line())
    for R, T, k in shapes:
        g = torch.Generator().manual_seed(R * 1000 + T)
        layers = [torch.randint(0, 64, (T, k), generator=g, dtype=torch.int32) for _ in range(R)]

        def new(R=R, k=k):
            return RouteRecorder(router_ids=list(range(R)), top_k=k, dtype=np.dtype("u1"),
                                 max_positions=args.steps + 128)

        def old(R=R, k=k):
            return PerLayerCopy(new(R, k))

        # both sides record the same rows
        a, b = new(), old()
        for rec in (a, b):
            rec.begin_step([(f"c{j}", 0, 1) for j in range(T)])
            for i, t in enumerate(layers):
                rec.on_layer(i, t)
            rec.end_step()
        rb = b.rec
        assert all(np.array_equal(a.reqs[c].buf, rb.reqs[c].buf) for c in a.reqs), "sides disagree"
        times: dict[str, list[float]] = {"stash": [], "per-layer copy": []}
        for r in range(args.rounds):
            for side in rotation(list(times), r):
                times[side].append(run(new if side == "stash" else old, layers, args.steps, T))
        print(f"{R} layers x top-{k}, {T} requests per decode step, {args.steps} steps per round:")
        for side, v in times.items():
            print(side_line(f"{side} us/step", [x * 1e6 for x in v], "us", higher_is_better=False))
        print(ratio_line(f"route recording per step, per-layer copy / stash ({R}x{T}x{k})", times["stash"],
                         times["per-layer copy"], higher_is_better=False))


if __name__ == "__main__":
    main()
