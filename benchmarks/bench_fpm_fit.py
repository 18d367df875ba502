"""FPM step-time model accuracy on the tiny model (issue 12 target: holdout MAPE <= 5 % per phase for points
with CV <= 0.1).

Run A (one engine): the default grid plus a set of off-grid points, ``--rounds`` times round-robin (so grid and
off-grid points see the same machine over the same minutes). ``bench fit`` trains on the grid points only and
reports leave-one-point-out error on the grid and the error on the off-grid points of the same run
(``holdout_keys``). Run B (a second engine, later): the off-grid points alone, as a second ``bench run --points``;
the same model's error on them is printed too — on a shared host it also contains the machine's drift between
the runs. Writes artifacts, model and report (``report/report.html``) under ``--out``.

    .venv/bin/python benchmarks/bench_fpm_fit.py [--model .models/tiny-qwen3-moe] [--out DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from genartifact.testing import free_port

#: off-grid shapes: batch sizes and token/context counts between (and beside) the grid's powers of two
OFF_GRID = ([{"phase": "prefill", "batch": 1, "tokens": t} for t in (24, 96, 384, 768)] +
            [{"phase": "prefill", "batch": 3, "tokens": t} for t in (96, 384, 768)] +
            [{"phase": "prefill", "batch": 2, "tokens": t, "kv": 128} for t in (192, 768)] +
            [{"phase": "decode", "batch": b, "context": c} for b in (3, 6, 12) for c in (24, 96, 384)] +
            [{"phase": "decode", "batch": 2, "context": 768}, {"phase": "decode", "batch": 8, "context": 48}])


def fmt(xs: list[float]) -> str:
    return f"MAPE {statistics.fmean(xs):.2f} % max {max(xs):.2f} % (n={len(xs)})" if xs else "–"


def main() -> None:
    from genartifact_fpm_bench.fit import (
        NOISY_CV,
        StepModel,
        fit,
        load_artifact,
        observations,
        summary_lines,
        write_model,
    )
    from genartifact_fpm_bench.grid import Limits, Point, plan_grid
    from genartifact_fpm_bench.report import report
    from genartifact_fpm_bench.run import run_rank

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/tiny-qwen3-moe")
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true",
                    help="4 grid points + 2 off-grid points, 1 repeat, 1 round (a test that the script runs)")
    args = ap.parse_args()
    if args.smoke:
        args.repeats, args.rounds = 1, 1
    out = Path(args.out or tempfile.mkdtemp(prefix="ga-fpm-fit-"))
    out.mkdir(parents=True, exist_ok=True)
    # the engine's limits with these settings (checked against the artifact below)
    limits = Limits(max_num_batched_tokens=1024, max_num_seqs=128, max_model_len=2048, kv_capacity_tokens=262144,
                    block_size=128, prefix_caching=True)
    grid = plan_grid(limits, "agg", max_points=1000, repeats=args.repeats).points
    off_grid = OFF_GRID
    if args.smoke:  # the smallest shapes of each phase: enough for a fit of both phases
        grid = sorted([p for p in grid if p.phase == "prefill"], key=lambda p: p.batch * p.tokens)[:3] + \
            sorted([p for p in grid if p.phase == "decode"], key=lambda p: p.batch * p.context)[:3]
        off_grid = [OFF_GRID[0], OFF_GRID[-1]]
    off_keys = [Point(**{"tokens": 0, "kv": 0, "context": 0, **p}).key() for p in off_grid]
    (out / "offgrid_points.json").write_text(json.dumps({"points": off_grid}, indent=1))
    (out / "run_a_points.json").write_text(json.dumps({"points": [p.as_dict() for p in grid] + off_grid}, indent=1))
    kw = {"max_num_batched_tokens": 1024}
    t0 = time.perf_counter()
    a = asyncio.run(run_rank(model=args.model, mode="agg", out_dir=str(out / "run_a"), repeats=args.repeats,
                             rounds=args.rounds, points_file=str(out / "run_a_points.json"), port_base=free_port(),
                             progress=False, engine_kwargs=kw))
    t1 = time.perf_counter()
    b = asyncio.run(run_rank(model=args.model, mode="agg", out_dir=str(out / "run_b"), repeats=args.repeats,
                             rounds=args.rounds, points_file=str(out / "offgrid_points.json"), port_base=free_port(),
                             progress=False, engine_kwargs=kw))
    t2 = time.perf_counter()
    da = load_artifact(a)
    if da["limits"] != limits.__dict__:
        print(f"NOTE: engine limits {da['limits']} differ from the assumed {limits.__dict__}")
    for name, d in (("run A (grid + off-grid)", da), ("run B (off-grid)", load_artifact(b))):
        cov = d["coverage"]
        print(f"{name}: {cov['completed_points']}/{cov['expected_points']} points completed")
    doc = fit([a], holdout_keys=off_keys)
    write_model(doc, out / "model.json")
    print(f"grid: {len(grid)} points; off-grid: {len(off_keys)} points; {args.repeats} repeats x {args.rounds} rounds")
    print("\n".join(summary_lines(doc)))
    model = StepModel(doc)
    for phase in ("prefill", "decode"):
        obs = [o for o in observations(load_artifact(b)) if o.phase == phase]
        ape = [(abs(model.predict(o.shape) - o.y) / o.y * 100, o.cv) for o in obs]
        ok = [e for e, cv in ape if cv is not None and cv <= NOISY_CV]
        print(f"{phase:7} {model.selected(phase):11} run B off-grid: {fmt(ok)} [CV<={NOISY_CV}], "
              f"{fmt([e for e, _ in ape])} [all]")
    md = report(a, out / "report", model=out / "model.json")
    print(f"run A {t1 - t0:.0f} s, run B {t2 - t1:.0f} s; model {out / 'model.json'}, report {md}")


if __name__ == "__main__":
    main()
