"""FPM self-benchmark costs: (1) instrumentation overhead = seconds the recorder spends per pass ÷ the pass's
scheduler wall time, measured in the same run (target < 2 %); (2) merge of 8 synthetic ranks × 3,000 points
(target < 2 s) and with 6,000 points (linear: ≈ 2×).

    .venv/bin/python benchmarks/bench_fpm.py [--model .models/tiny-qwen3-moe]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path


def overhead(model: str) -> None:
    from genartifact_fpm_bench.run import run_rank

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp(prefix="ga-fpm-"))
    points = out / "points.json"
    points.write_text(json.dumps({"points": [{"phase": "decode", "batch": b, "context": c}
                                             for b in (1, 4, 16) for c in (64, 512)] +
                                            [{"phase": "prefill", "batch": b, "tokens": t}
                                             for b in (1, 4) for t in (256, 1024)]}))
    path = asyncio.run(run_rank(model=model, mode="agg", out_dir=str(out), points_file=str(points), repeats=5,
                                port_base=port, progress=False,
                                engine_kwargs={"max_num_batched_tokens": 1024}))
    doc = json.loads(Path(path).read_text())
    ratios = []
    for rec in doc["points"]:
        for smp in rec["raw_samples"]:
            ratios.append(smp["recorder_s"] / smp["timing"]["wall_time"])
    print(f"instrumentation overhead per pass: median {100 * statistics.median(ratios):.3f} %, "
          f"p95 {100 * sorted(ratios)[int(0.95 * len(ratios))]:.3f} %, over {len(ratios)} passes (target < 2 %)")


def synthetic(rank: int, n: int) -> dict:
    pts = [{"key": f"decode:b{1 + i % 16}:c{i}", "dp_rank": rank, "status": "completed", "point": {"phase": "decode"},
            "estimate": {"wall_time": 0.001, "raw_sample_indices": [1]},
            "raw_samples": [{"sample_index": 0, "forward_index": i, "timing": {"wall_time": 0.001}}]} for i in range(n)]
    return {"schema": "genartifact.fpm_bench.rank", "schema_version": 1, "artifact_type": "rank", "run_id": "r",
            "grid_digest": "g", "mode": "agg", "dp": {"rank": rank, "size": 8}, "protocol": {}, "limits": {},
            "coverage": {"expected_points": n, "completed_points": n, "failed_points": 0}, "points": pts,
            "warmup_evidence": [], "engine": {"model": {"model": "m"}}, "capture_errors": {}}


def merge_speed() -> None:
    from genartifact_fpm_bench.artifact import merge

    times = {}
    for n in (3000, 6000):
        d = Path(tempfile.mkdtemp(prefix="ga-merge-"))
        paths = []
        for r in range(8):
            p = d / f"r{r}.json"
            p.write_text(json.dumps(synthetic(r, n)))
            paths.append(p)
        t0 = time.perf_counter()
        merge(paths, d / "merged.json")
        times[n] = time.perf_counter() - t0
    print(f"merge 8 ranks x 3000 points: {times[3000]:.2f} s (target < 2 s); x 6000: {times[6000]:.2f} s "
          f"(ratio {times[6000] / times[3000]:.2f}, linear = 2)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/tiny-qwen3-moe")
    args = ap.parse_args()
    merge_speed()
    overhead(args.model)


if __name__ == "__main__":
    main()
