"""Trainer-side load throughput: ``genartifact.loaders`` (fetch through managed_fsspec's read-back + byte count
+ SHA-256 + strict decode + layout) ÷ bare ``s3fs`` cat + ``np.frombuffer`` of the same objects from the same
S3 server (SeaweedFS on loopback), same run, same concurrency. Target >= 0.8. Then peak memory of a load versus
its bound (bytes in flight + concurrent decodes x decoded body), measured with tracemalloc (numpy and bytes
allocations are traced) and with results discarded so that only transient memory counts.

    .venv/bin/python benchmarks/bench_load.py [--n 1000] [--tokens 1024] [--routers 24] [--reps 3]

Artifacts: synthetic routes (``benchmarks/common.synthetic_routes``: skewed experts, top-8 of 128) for
``tokens`` positions x ``routers`` MoE layers + selected logprobs, each object distinct.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, ratio_line, rotation, side_line, synthetic_routes  # noqa: E402


def build(n: int, tokens: int, routers: int, prompt: int) -> list:
    from genartifact import format as fmt

    base = synthetic_routes(tokens=tokens + 64, routers=routers, top_k=8, experts=128)
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        off = i % 64
        routes = np.ascontiguousarray(base[:, off : off + tokens - 1])
        tok = rng.integers(0, 150_000, tokens).astype(np.uint32)
        lp = -rng.exponential(1.0, tokens - prompt).astype(np.float32)
        out.append(fmt.encode(fmt.ArtifactInput(
            tok, prompt, ["moe_routes", "selected_logprobs"],
            {"moe_routes": {"token_start": 0, "router_ids": list(range(routers)), "expert_counts": [128] * routers,
                            "top_k": 8, "layout": "router_major", "source": "bench"},
             "selected_logprobs": {"token_start": prompt}},
            [fmt.TensorPart("moe_routes.expert_ids", routes), fmt.TensorPart("selected_logprobs.logprobs", lp)])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--routers", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=768)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.n, args.tokens, args.routers, args.prompt, args.reps = 8, 64, 4, 32, 1
    import s3fs
    from genartifact import loaders
    from genartifact.testing.s3server import SeaweedS3
    from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles

    encs = build(args.n, args.tokens, args.routers, args.prompt)
    total = sum(e.byte_count for e in encs)
    body = encs[0].decoded_bytes
    print(f"{args.n} artifacts, {args.tokens} tokens x {args.routers} routers x top-8: {total / 1e6:.1f} MB stored, "
          f"{body / 1e3:.0f} kB decoded each")
    with SeaweedS3("bench") as server:
        client = server.client()
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda ie: client.put_object(Bucket="bench", Key=f"l/runs/{ie[0]:05d}.gart", Body=ie[1].data),
                        enumerate(encs)))
        receipts = [{"state": "ready", "object_id": f"b:runs/{i:05d}.gart", "byte_count": e.byte_count,
                     "sha256": e.sha256} for i, e in enumerate(encs)]
        so = server.storage_options()
        target = ManagedFsspecTarget(parse_profiles({"profiles": {"b": {
            "url": "s3://bench/l", "allowed_prefixes": ["runs/"], "storage_options": so}}}))
        paths = [f"bench/l/runs/{i:05d}.gart" for i in range(args.n)]

        fs_holder: list = []

        async def bare() -> float:  # one s3fs filesystem per loop, reused (warm), as ours reuses its client
            if not fs_holder:
                fs_holder.append(s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **so))
                await fs_holder[0].set_session()
            fs = fs_holder[0]
            sem = asyncio.Semaphore(args.concurrency)

            async def one(p: str) -> int:
                async with sem:
                    data = await fs._cat_file(p)
                return np.frombuffer(data, np.uint8).size

            t0 = time.perf_counter()
            got = await asyncio.gather(*(one(p) for p in paths))
            dt = time.perf_counter() - t0
            assert sum(got) == total
            return dt

        async def ours(layout: str = "slime") -> float:
            t0 = time.perf_counter()
            res = await loaders.aload_batch(receipts, target, layout=layout, max_concurrency=args.concurrency,
                                            progress=False)
            dt = time.perf_counter() - t0
            assert res.ok and res.bytes_fetched == total, res.errors[:3]
            return dt

        async def run_all() -> None:
            await ours()  # warm both sides: client creation, connection pool, page cache on the server
            await bare()
            sides = {"bare s3fs cat + frombuffer": bare, "loaders verify+decode+slime": ours}
            times: dict[str, list[float]] = {k: [] for k in sides}
            for r in range(args.reps):
                for name in rotation(list(sides), r):
                    times[name].append(await sides[name]())
            await fs_holder[0]._s3.close()
            print(f"{args.reps} runs alternated in rotating order, concurrency {args.concurrency}; {load_line()}")
            for name, ts in times.items():
                print(side_line(name, [args.n / t for t in ts], "objects/s"))
            print(ratio_line("loaders / bare s3fs (throughput)", times["loaders verify+decode+slime"],
                             times["bare s3fs cat + frombuffer"], ">= 0.8", higher_is_better=False))

            # peak transient memory vs the bound: results discarded (layout returns a scalar)
            for bound in (1 << 20, 8 << 20):
                tracemalloc.start()
                tracemalloc.reset_peak()
                base_mem = tracemalloc.get_traced_memory()[0]
                res = await loaders.aload_batch(receipts, target, layout=lambda a: int(a.token_ids.shape[0]),
                                                max_concurrency=args.concurrency, max_bytes_in_flight=bound,
                                                max_decodes=2, progress=False)
                peak = tracemalloc.get_traced_memory()[1] - base_mem
                tracemalloc.stop()
                assert res.ok
                limit = bound + 2 * body
                print(f"bytes-in-flight bound {bound / 2**20:.0f} MiB: peak in flight {res.peak_bytes_in_flight / 2**20:.2f} "
                      f"MiB; peak traced memory {peak / 2**20:.2f} MiB vs bound + 2 decoded bodies "
                      f"{limit / 2**20:.2f} MiB ({peak / limit:.2f}x)")

        asyncio.run(run_all())


if __name__ == "__main__":
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    main()
