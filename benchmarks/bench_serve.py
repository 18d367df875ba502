"""Serving throughput with artifacts requested ÷ the same load without (issue 13's goal: >= 0.95).

    .venv/bin/python benchmarks/bench_serve.py [--model .models/tiny-qwen3-moe] [--requests 64] [--concurrency 16]

Starts `genartifact serve` on a free loopback port, then alternates rounds of the same load (non-streaming
/v1/completions, --max-tokens each) with and without `generation_artifact` (both contents, file:// profile),
in a rotating order (with, without / without, with / ...). Both sides hit the same server (same engine options,
same sampling: the server builds the SamplingParams), with the same prompts, concurrency and client settings.
Reports requests/s and tokens/s per side with the same statistics (median of rounds, best round) and the ratios
(median-of-rounds, best-round, per-round paired), plus server RSS, and where the difference goes: each client
sends its next request when the last one answered, so requests/s follow the mean request latency, and the latency
artifacts add is split into the server's finalize (its ``genartifact_finalize_seconds`` histogram: last token ->
receipt) and the rest (the request's time in the engine and the HTTP path). A store probe before and after the
rounds (``common.store_probe``) prints what a small durable create costs on the store's filesystem then.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, ratio_line, rotation, side_line, store_probe  # noqa: E402

#: the server's /metrics samples this script reads: the ``genartifact_finalize_seconds`` histogram (last token of
#: an artifact request -> its receipt), its process's full (generation 2) garbage collections, its frozen start-up heap
FINALIZE_S, FINALIZE_N = "genartifact_finalize_seconds_sum", "genartifact_finalize_seconds_count"
FULL_GC, FROZEN = 'python_gc_collections_total{generation="2"}', "genartifact_gc_frozen_objects"


def server_metrics(base: str) -> dict[str, float]:
    """The samples above as scraped from the server's ``/metrics`` now (one missing: absent)."""
    wanted = {FINALIZE_S, FINALIZE_N, FULL_GC, FROZEN}
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            out[name] = float(value)
    return out


async def round_(base: str, n: int, conc: int, max_tokens: int, artifacts: bool) -> tuple[float, float, float]:
    """One round of ``n`` requests, ``conc`` at a time: ``(requests/s, tokens/s, mean request latency in s)``."""
    gate = asyncio.Semaphore(conc)
    latencies: list[float] = []

    async def one(c: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"Request {i}: the quick brown fox jumps over the lazy dog.", "max_tokens": max_tokens,
                "ignore_eos": True}
        if artifacts:
            body["generation_artifact"] = {
                "format": "generation_artifact_v1", "contents": ["moe_routes", "selected_logprobs"],
                "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "local",
                                                                "object_key": f"runs/{uuid.uuid4().hex}.gart"}}}
        async with gate:
            t = time.perf_counter()
            r = await c.post("/v1/completions", json=body)
            latencies.append(time.perf_counter() - t)
        r.raise_for_status()
        j = r.json()
        assert not artifacts or j["generation_artifact"]["state"] == "ready", j
        return j["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        t0 = time.perf_counter()
        toks = sum(await asyncio.gather(*(one(c, i) for i in range(n))))
        dt = time.perf_counter() - t0
    return n / dt, toks / dt, statistics.fmean(latencies)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/tiny-qwen3-moe")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.concurrency, args.max_tokens, args.rounds = 4, 4, 4, 1
    root = Path(tempfile.mkdtemp(prefix="ga-bench-serve-"))
    cfg = root / "c.toml"
    cfg.write_text(f'[plugins]\ncontents = ["moe_routes", "selected_logprobs"]\ntargets = ["managed_fsspec"]\n'
                   f'[targets.managed_fsspec.profiles.local]\nurl = "{root}/store"\nallowed_prefixes = ["runs/"]\n')
    from genartifact.testing import free_port

    port = free_port()  # bound by the server once it has started: outside the ephemeral range
    proc = subprocess.Popen([sys.executable, "-m", "genartifact.cli", "serve", "--model", args.model, "--config",
                             str(cfg), "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(360):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        sides = {"with artifacts": True, "without artifacts": False}
        for flag in sides.values():  # warm-up
            asyncio.run(round_(base, min(16, args.requests), args.concurrency, 8, flag))
        probes = [store_probe(root)]  # the store's filesystem before and after the rounds (its file:// cost)
        res: dict[str, list[tuple[float, float, float]]] = {k: [] for k in sides}
        fin_s = fin_n = 0.0  # the server's finalize histogram over the measured rounds
        # the server's own process (HTTP, driver, delivery; not its engine core and workers, which busy-poll):
        # CPU seconds per request, a load-robust measure of the per-request work artifacts add there
        p = psutil.Process(proc.pid)
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        full_gc = dict.fromkeys(sides, 0)  # the server's full garbage collections during each side's rounds
        for r in range(args.rounds):
            for side in rotation(list(sides), r):
                m0 = server_metrics(base)
                c0 = sum(p.cpu_times()[:2])
                res[side].append(asyncio.run(round_(base, args.requests, args.concurrency, args.max_tokens,
                                                    sides[side])))
                cpu[side].append((sum(p.cpu_times()[:2]) - c0) / args.requests)
                m1 = server_metrics(base)
                fin_s += m1.get(FINALIZE_S, 0.0) - m0.get(FINALIZE_S, 0.0)
                fin_n += m1.get(FINALIZE_N, 0.0) - m0.get(FINALIZE_N, 0.0)
                full_gc[side] += int(m1.get(FULL_GC, 0.0) - m0.get(FULL_GC, 0.0))
        probes.append(store_probe(root))
        rss = sum(x.memory_info().rss for x in [p, *p.children(recursive=True)])
        frozen = server_metrics(base).get(FROZEN, float("nan"))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)  # the server's config and stored objects
    print(f"{args.requests} requests x {args.max_tokens} tokens, concurrency {args.concurrency}, {args.rounds} rounds "
          f"alternated in rotating order; {load_line()}")
    for side, rounds in res.items():
        print(side_line(f"{side} req/s", [x[0] for x in rounds], "req/s"))
        print(side_line(f"{side} tok/s", [x[1] for x in rounds], "tok/s"))
    on, off = res["with artifacts"], res["without artifacts"]
    print(ratio_line("serving with / without artifacts, requests/s", [x[0] for x in on], [x[0] for x in off],
                     ">= 0.95"))
    print(ratio_line("serving with / without artifacts, tokens/s", [x[1] for x in on], [x[1] for x in off],
                     ">= 0.95"))
    # (a process's CPU times come in clock ticks, 10 ms: one round's per-request figure moves in steps of
    # 10 ms / --requests, 156 us at 64; the mean over all rounds resolves 10 ms / (rounds x requests))
    w, wo = (statistics.fmean(cpu[k]) * 1e6 for k in ("with artifacts", "without artifacts"))
    print(f"  server process CPU per request, mean over all rounds: with {w:.0f} us, without {wo:.0f} us; artifacts "
          f"add {w - wo:.0f} us")
    # where the requests/s go in this closed loop (each client sends its next request when the last one answered):
    # the added latency per request is the finalize (collect, encode, durable write, receipt: the server's
    # histogram) plus everything else, mostly the request's time in the engine (the per-step capture, and the
    # driver's added CPU competing with the engine for the cores)
    lw, lwo = (statistics.median([x[2] for x in res[k]]) * 1e3 for k in ("with artifacts", "without artifacts"))
    fin = fin_s / fin_n * 1e3 if fin_n else float("nan")
    print(f"  mean request latency, median of rounds: with {lw:.1f} ms, without {lwo:.1f} ms: artifacts add "
          f"{lw - lwo:.1f} ms, of which finalize (last token -> receipt, mean of {fin_n:.0f}) {fin:.1f} ms and "
          f"{lw - lwo - fin:.1f} ms elsewhere (the engine, HTTP)")
    print("  server full (oldest-generation) GC collections during the rounds: " +
          ", ".join(f"{k} {v}" for k, v in full_gc.items()) + f"; {frozen:.0f} start-up objects frozen out of them")
    print(f"  server RSS (all processes) after the run: {rss / 1e6:.0f} MB")
    print(f"  before the rounds, {probes[0]}\n  after the rounds, {probes[1]}")


if __name__ == "__main__":
    main()
