"""FPM self-benchmark costs: (1) instrumentation overhead = generation throughput of the same workload on an
engine with vLLM's stock ``Scheduler`` ÷ on an engine with ``InstrumentedScheduler`` (publishing every FPM over
ZMQ to a connected collector, as ``bench run`` does), both engines alive in the same run with otherwise identical
options (the bench's: prefix caching on, seed 0, max_num_batched_tokens 1024), rounds alternated in rotating
order, same statistics per side (target: overhead < 2 %, i.e. ratio instrumented/stock >= 0.98); (2) merge of
8 synthetic ranks × 3,000 points (target < 2 s) and with 6,000 points (linear: ≈ 2×).

    .venv/bin/python benchmarks/bench_fpm.py [--model .models/tiny-qwen3-moe] [--rounds 6]

The overhead is measured end to end (wall time of the workload: record construction, queueing and the
publisher thread all count), not self-timed inside the recorder; the recorder's own per-pass seconds
(``recorder_s``) are printed too, for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, product_logging, ratio_line, rotation, side_line  # noqa: E402
from genartifact.testing import free_port  # noqa: E402


async def workload(llm, prompts: list[list[int]], max_tokens: int, inflight: int) -> float:
    """Generation tokens/s of ``prompts`` (token ids) with at most ``inflight`` requests in flight."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    gate = asyncio.Semaphore(inflight)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)

    async def one(ids):
        n = 0
        async with gate:
            async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), params, uuid.uuid4().hex):
                n += len(out.outputs[0].token_ids)
        return n

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return n / (time.perf_counter() - t0)


async def overhead_async(args) -> None:
    import numpy as np
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.host import PluginHost
    from genartifact_fpm_bench import SCHEDULER_QUALNAME
    from genartifact_fpm_bench.runner import FpmCollector

    port = free_port()
    os.environ.update(GENARTIFACT_FPM_STREAM="1", GENARTIFACT_FPM_PORT_BASE=str(port), GENARTIFACT_FPM_DP_RANK="0")
    common = {"enable_prefix_caching": True, "seed": 0, "max_num_batched_tokens": 1024}
    engines: dict[str, VllmEngine] = {}
    collector = None
    try:
        engines["instrumented"] = await VllmEngine(PluginHost({}), args.model, scheduler_cls=SCHEDULER_QUALNAME,
                                                   **common).start()
        collector = FpmCollector(port)
        engines["stock"] = await VllmEngine(PluginHost({}), args.model, **common).start()
        vocab = int(engines["stock"].model_info.hf_config.get("vocab_size", 512))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(4, vocab, args.prompt_tokens).tolist() for _ in range(args.requests)]
        fpms: list = []
        for eng in engines.values():  # warm-up
            await workload(eng.llm, prompts, 4, args.inflight)
        collector.drain(0.3)
        tps: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(args.rounds):
            for name in rotation(list(engines), r):
                tps[name].append(await workload(engines[name].llm, prompts, args.max_tokens, args.inflight))
                if name == "instrumented":
                    fpms += collector.drain(0.1)  # after the timed round: the driver's receive is not engine cost
    finally:
        if collector is not None:
            collector.close()
        for eng in engines.values():
            eng.shutdown()
    print(f"FPM instrumentation overhead: {args.requests} requests x {args.max_tokens} tokens "
          f"({args.prompt_tokens}-token prompts), {args.inflight} in flight, {args.rounds} rounds alternated in "
          f"rotating order; {load_line()}")
    for name, v in tps.items():
        print(side_line(f"{name} scheduler", v, "tok/s"))
    print(f"  FPMs received from the instrumented engine: {len(fpms)}; recorder self-time per pass: median "
          f"{1e6 * statistics.median(f.recorder_s for f in fpms):.1f} us, "
          f"{100 * statistics.median(f.recorder_s / f.wall_time for f in fpms if f.wall_time > 0):.3f} % of the pass")
    assert fpms, "the instrumented engine published no FPM"
    print(ratio_line("FPM instrumented / stock scheduler (throughput)", tps["instrumented"], tps["stock"],
                     ">= 0.98, i.e. overhead < 2 %"))


def synthetic(rank: int, n: int) -> dict:
    """A rank artifact of ``n`` decode points that passes the merge's checks (records match their keys and the
    grid digest)."""
    from genartifact_fpm_bench.grid import Point, grid_digest

    grid = [Point("decode", batch=1 + i % 16, context=i) for i in range(n)]
    pts = [{"key": p.key(), "dp_rank": rank, "status": "completed", "point": p.as_dict(),
            "estimate": {"wall_time": 0.001, "raw_sample_indices": [1]},
            "raw_samples": [{"sample_index": 0, "forward_index": i, "timing": {"wall_time": 0.001}}]}
           for i, p in enumerate(grid)]
    return {"schema": "genartifact.fpm_bench.rank", "schema_version": 1, "artifact_type": "rank", "run_id": "r",
            "grid_digest": grid_digest(grid), "mode": "agg", "dp": {"rank": rank, "size": 8}, "protocol": {},
            "limits": {},
            "coverage": {"expected_points": n, "completed_points": n, "failed_points": 0}, "points": pts,
            "warmup_evidence": [], "engine": {"model": {"model": "m"}}, "capture_errors": {}}


def merge_speed(sizes: tuple[int, int] = (3000, 6000)) -> None:
    from genartifact_fpm_bench.artifact import merge

    times = {}
    for n in sizes:
        d = Path(tempfile.mkdtemp(prefix="ga-merge-"))
        paths = []
        for r in range(8):
            p = d / f"r{r}.json"
            p.write_text(json.dumps(synthetic(r, n)))
            paths.append(p)
        t0 = time.perf_counter()
        merge(paths, d / "merged.json")
        times[n] = time.perf_counter() - t0
        shutil.rmtree(d)
    a, b = sizes
    print(f"merge 8 ranks x {a} points: {times[a]:.2f} s (target < 2 s at 3000); x {b}: {times[b]:.2f} s")
    print(f"RATIO merge time {b} / {a} points: {times[b] / times[a]:.2f}  (linear = {b / a:.0f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/tiny-qwen3-moe")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    add_smoke(ap)
    args = ap.parse_args()
    product_logging()
    if args.smoke:
        args.rounds, args.requests, args.inflight, args.max_tokens, args.prompt_tokens = 1, 4, 4, 4, 8
    merge_speed((300, 600) if args.smoke else (3000, 6000))
    asyncio.run(overhead_async(args))


if __name__ == "__main__":
    main()
