"""How long a long request's finalize blocks the driver's event loop (issue 13, fourteenth pass).

    .venv/bin/python benchmarks/bench_loop_stall.py [--model .models/tiny-qwen3-moe] [--tokens 32000] [--wave 1]
                                                    [--rounds 6] [--routers 48] [--experts 128] [--top-k 8]

The driver's event loop also runs vLLM's output handler and every other request's stream: while it is blocked,
no token reaches any client. This drives the real driver path of ``benchmarks/bench_driver_request.py`` (real
host, ``moe_routes`` + ``selected_logprobs``, a real handover step file as a worker writes it, a ``file://``
target) for ``--wave`` requests of 12 prompt + ``--tokens`` completion tokens finishing together, on a model
config made from ``--model``'s with ``--routers`` MoE layers of ``--experts`` experts, top-``--top-k``
(defaults: Qwen3-30B-A3B's shape: a 32k-token request hands over ~12 MB of routes), while a task ticks every
1 ms on the same loop. Per wave: the longest stall (the largest tick overshoot) and the loop time blocked in
all (overshoots above 2 ms), against the wave's wall time from the step file's rename to the last receipt.

Two sides, alternated per round: "reader thread" (the product: a step file above ``STEP_INLINE_MAX`` is read by
the handover's reader thread) and "on the loop" (the same files read on the event loop: ``STEP_INLINE_MAX``
raised for that side). The step file, the prepared requests and the completion are made before the clock starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, product_logging, ratio_line, rotation, side_line  # noqa: E402


async def _ticker(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t - 0.001)


async def wave(drv, size: int) -> tuple[float, float, float]:
    """One wave through the driver path: ``(longest stall ms, blocked ms, wall ms)``."""
    preps, completion, path = drv.stage(size)
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.ensure_future(_ticker(lags, stop))
    await asyncio.sleep(0.01)
    lags.clear()
    t0 = time.perf_counter()
    os.replace(path + ".tmp", path)  # the worker's rename: the takes wake
    await drv.finish(preps, completion)
    wall = time.perf_counter() - t0
    stop.set()
    await tick
    return max(max(lags), 1e-6) * 1e3, sum(x for x in lags if x > 0.002) * 1e3, wall * 1e3


async def main_async(args) -> None:
    import genartifact.engine.worker_ext as wx
    from bench_driver_request import Driver

    root = Path(tempfile.mkdtemp(prefix="ga-bench-stall-"))
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    cfg.update(num_hidden_layers=args.routers, mlp_only_layers=[], decoder_sparse_step=1, num_experts=args.experts,
               num_local_experts=args.experts, num_experts_per_tok=args.top_k,
               max_position_embeddings=args.tokens + 64)
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(cfg))
    drv = Driver(str(root / "model"), root, args.tokens)
    drv.eng.model_info.engine_options["max_model_len"] = args.tokens + 64
    inline_max = wx.STEP_INLINE_MAX
    sides = ["reader thread", "on the loop"]
    res: dict[str, list[tuple[float, float, float]]] = {s: [] for s in sides}
    try:
        await wave(drv, args.wave)  # warm-up
        for r in range(args.rounds):
            for side in rotation(sides, r):
                wx.STEP_INLINE_MAX = inline_max if side == "reader thread" else sys.maxsize
                try:
                    res[side].append(await wave(drv, args.wave))
                finally:
                    wx.STEP_INLINE_MAX = inline_max
        size = os.path.getsize(next(iter(sorted((root / "runs").iterdir()))))
    finally:
        drv.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"waves of {args.wave} request(s) of 12 prompt + {args.tokens} completion tokens finishing together, "
          f"{args.routers} routers x top-{args.top_k} of {args.experts} experts (~{args.routers * args.tokens * args.top_k / 1e6:.1f} MB "
          f"of routes per request; stored object {size / 1e6:.2f} MB), {args.rounds} rounds alternated; {load_line()}")
    for side in sides:
        print(side_line(f"{side}: longest loop stall", [x[0] for x in res[side]], "ms", higher_is_better=False))
        print(side_line(f"{side}: loop blocked", [x[1] for x in res[side]], "ms", higher_is_better=False))
        print(side_line(f"{side}: wave wall time", [x[2] for x in res[side]], "ms", higher_is_better=False))
    print(ratio_line("longest loop stall, reader thread / on the loop", [x[0] for x in res["reader thread"]],
                     [x[0] for x in res["on the loop"]]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".models/tiny-qwen3-moe", help="model folder (only its config.json is read)")
    ap.add_argument("--tokens", type=int, default=32000, help="completion tokens per request")
    ap.add_argument("--wave", type=int, default=1, help="requests finishing together")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--routers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.rounds, args.routers = 2048, 1, 48
    product_logging()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
