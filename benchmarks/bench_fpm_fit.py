"""FPM step-time model accuracy: measure the default grid and a set of off-grid points on the tiny model (two
``bench run``s, one engine each, sequentially), ``bench fit`` both model kinds, and print holdout MAPE / max error
per phase — leave-one-point-out on the grid and on the off-grid points — over points with CV <= 0.1 and over all
points. Target (issue 12): holdout MAPE <= 5 % per phase for points with CV <= 0.1. Writes the artifacts, the
model and the report (``report.html``) under ``--out``.

    .venv/bin/python benchmarks/bench_fpm_fit.py [--model .models/tiny-qwen3-moe] [--out DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
import time
from pathlib import Path

#: off-grid shapes: batch sizes and token/context counts between (and beside) the grid's powers of two
OFF_GRID = ([{"phase": "prefill", "batch": 1, "tokens": t} for t in (24, 96, 384, 768)] +
            [{"phase": "prefill", "batch": 3, "tokens": t} for t in (96, 384, 768)] +
            [{"phase": "prefill", "batch": 2, "tokens": t, "kv": 128} for t in (192, 768)] +
            [{"phase": "decode", "batch": b, "context": c} for b in (3, 6, 12) for c in (24, 96, 384)] +
            [{"phase": "decode", "batch": 2, "context": 768}, {"phase": "decode", "batch": 8, "context": 48}])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    from genartifact_fpm_bench.fit import fit, summary_lines, write_model
    from genartifact_fpm_bench.report import report
    from genartifact_fpm_bench.run import run_rank

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/tiny-qwen3-moe")
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-points", type=int, default=80)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="ga-fpm-fit-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "offgrid_points.json").write_text(json.dumps({"points": OFF_GRID}, indent=1))
    kw = {"max_num_batched_tokens": 1024}
    t0 = time.perf_counter()
    grid = asyncio.run(run_rank(model=args.model, mode="agg", out_dir=str(out / "grid"), repeats=args.repeats,
                                port_base=free_port(), max_points=args.max_points, progress=False, engine_kwargs=kw))
    t1 = time.perf_counter()
    off = asyncio.run(run_rank(model=args.model, mode="agg", out_dir=str(out / "offgrid"), repeats=args.repeats,
                               points_file=str(out / "offgrid_points.json"), port_base=free_port(), progress=False,
                               engine_kwargs=kw))
    t2 = time.perf_counter()
    for name, p in (("grid", grid), ("off-grid", off)):
        cov = json.loads(Path(p).read_text())["coverage"]
        print(f"{name}: {cov['completed_points']}/{cov['expected_points']} points completed, "
              f"{len(cov.get('excluded_points', []))} candidates excluded before running")
    doc = fit([grid], [off])
    write_model(doc, out / "model.json")
    md = report(grid, out / "report", model=out / "model.json")
    print("\n".join(summary_lines(doc)))
    print(f"grid run {t1 - t0:.0f} s, off-grid run {t2 - t1:.0f} s; model {out / 'model.json'}, report {md}")


if __name__ == "__main__":
    main()
