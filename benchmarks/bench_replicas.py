"""The main job on N engine replicas (Ray actors) ÷ on 1: throughput of `generate --replicas`.

    .venv/bin/python benchmarks/bench_replicas.py [--model .models/tiny-qwen3-moe] [--rows 32] [--max-tokens 32]
                                                   [--replicas 2] [--max-inflight 8]

Runs the same prompts (local file target, both contents) once with 1 replica and once with N, each on a fresh
private local Ray instance, and prints per run: total wall seconds, the slowest replica's engine start, the
rows phase (wall - slowest start: what scale-out can speed up), rows/s and completion tokens/s over the rows
phase, and the N÷1 ratio of rows/s. On a machine with fewer cores than replicas x engine threads expect ~1x:
the replicas share the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


async def one(model: str, rows: int, max_tokens: int, replicas: int, inflight: int, tmp: Path) -> dict:
    from genartifact import config as config_mod
    from genartifact.engine.replicas import run_replicated

    cfg_path = tmp / f"g{replicas}.toml"
    cfg_path.write_text(f'[plugins]\ncontents = ["moe_routes", "selected_logprobs"]\ntargets = ["managed_fsspec"]\n'
                        f'[targets.managed_fsspec.profiles.local]\nurl = "{tmp}/store{replicas}"\n'
                        'allowed_prefixes = ["runs/"]\n')
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    prompts = [{"prompt": " ".join(words[(i + j) % len(words)] for j in range(8 + i % 9)), "max_tokens": max_tokens,
                "temperature": 0.0} for i in range(rows)]
    t0 = time.perf_counter()
    receipts, reports = await run_replicated(
        model=model, prompts=prompts, cfg=config_mod.load(cfg_path), contents=["moe_routes", "selected_logprobs"],
        target="managed_fsspec:local", max_tokens=max_tokens, run_id=f"bench-x{replicas}", engine_kwargs={},
        replicas=replicas, max_inflight=inflight, progress=False, start_together=True)
    wall = time.perf_counter() - t0
    ready = sum(r["state"] == "ready" for r in receipts)
    start = max(r.start_s or 0.0 for r in reports)
    phase = wall - start
    tokens = sum(r.get("completion_tokens", 0) for r in receipts)
    return {"replicas": replicas, "ready": ready, "rows": rows, "wall_s": wall, "start_s": start, "rows_phase_s": phase,
            "rows_per_s": ready / phase, "tokens_per_s": tokens / phase,
            "per_replica_rows": [r.rows for r in reports]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / ".models" / "tiny-qwen3-moe"))
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--max-inflight", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="2 rows x 4 tokens (a test that the script runs)")
    a = ap.parse_args()
    if a.smoke:
        a.rows, a.max_tokens, a.max_inflight = 2, 4, 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(f"cores: {os.cpu_count()}  rows: {a.rows} x {a.max_tokens} tokens  max_inflight: {a.max_inflight}")
    results = []
    with tempfile.TemporaryDirectory() as d:
        for n in (1, a.replicas):
            r = asyncio.run(one(a.model, a.rows, a.max_tokens, n, a.max_inflight, Path(d)))
            results.append(r)
            print(f"replicas={n}: {r['ready']}/{r['rows']} ready, wall {r['wall_s']:.1f} s, slowest start "
                  f"{r['start_s']:.1f} s, rows phase {r['rows_phase_s']:.1f} s, {r['rows_per_s']:.2f} rows/s, "
                  f"{r['tokens_per_s']:.1f} tok/s, rows per replica {r['per_replica_rows']}")
    print(f"RATIO rows/s x{a.replicas} / x1: {results[1]['rows_per_s'] / results[0]['rows_per_s']:.2f}")
    return 0 if all(r["ready"] == r["rows"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
