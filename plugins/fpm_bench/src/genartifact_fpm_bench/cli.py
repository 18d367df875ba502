"""``genartifact bench run|merge|fit|live|report``: a plugin command (entry point ``genartifact.commands: bench``),
loaded by the core CLI only when ``bench`` runs."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import Any

import pluggy
from genartifact.engine.engine_args import accept_engine_args

hookimpl = pluggy.HookimplMarker("genartifact")


@hookimpl
def genartifact_command(name: str, parser: argparse.ArgumentParser) -> Callable[[Any], int] | None:
    """Register ``bench``: its arguments on ``parser``; the handler is :func:`main`."""
    if name != "bench":
        return None
    parser.description = "FPM self-benchmark: run a rank, merge ranks, fit a step-time model, check it live, render a report"
    add_arguments(parser)
    return main


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_cmd", required=True)
    r = sub.add_parser("run", help="measure one DP rank over a grid and write its rank artifact")
    r.add_argument("--model", required=True)
    r.add_argument("--mode", choices=["prefill", "decode", "agg"], default="agg")
    r.add_argument("--points", help="explicit points file (JSON)")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--dp-rank", type=int, default=0)
    r.add_argument("--dp-size", type=int, default=1)
    r.add_argument("--run-id", help="shared by all ranks of one run (default: random)")
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--rounds", type=int, default=1, help="run the grid this many times round-robin; a point's samples "
                   "from all rounds are pooled (spreads them over the run's time)")
    r.add_argument("--port-base", type=int, default=20380)
    r.add_argument("--max-points", type=int, default=24)
    accept_engine_args(r)  # vLLM's own engine arguments (default here: --max-num-batched-tokens 1024)
    m = sub.add_parser("merge", help="merge rank artifacts (identity checks) into one merged artifact + sidecar")
    m.add_argument("ranks", nargs="+", help="rank artifact files")
    m.add_argument("--out", required=True, help="merged artifact path (must not exist)")
    f = sub.add_parser("fit", help="fit a step-time model per phase (linear + interpolating), with holdout error")
    f.add_argument("artifacts", nargs="+", help="rank or merged artifacts of one run (the grid)")
    f.add_argument("--holdout", nargs="*", default=[], help="artifacts of off-grid points (bench run --points FILE)")
    f.add_argument("--holdout-points", help="points file: these points of the artifacts are held out (measured in the "
                   "same run, never trained on)")
    f.add_argument("--rank", type=int, default=None, help="fit one DP rank only (default: ranks pooled per point)")
    f.add_argument("--out", required=True, help="model JSON path (must not exist)")
    lv = sub.add_parser("live", help="run generate on a mixed workload with the FPM stream; compare each pass with a "
                                     "fitted model")
    lv.add_argument("--model", required=True, help="model directory (the engine's)")
    lv.add_argument("--fit", required=True, help="a bench fit model JSON")
    lv.add_argument("--prompts", help="JSONL prompts (default: a seeded mixed workload of 24 requests)")
    lv.add_argument("--max-tokens", type=int, default=32)
    lv.add_argument("--contents", help="comma list (default: moe_routes,selected_logprobs)")
    lv.add_argument("--port-base", type=int, default=20380)
    lv.add_argument("--out", required=True, help="live-check JSON path (must not exist)")
    rp = sub.add_parser("report", help="PNG plots and a Markdown summary of a rank or merged artifact")
    rp.add_argument("artifact")
    rp.add_argument("--out", required=True)
    rp.add_argument("--model", help="a bench fit model JSON: fit lines and residual plots")


def main(args: Any) -> int:
    """Run one ``bench`` subcommand; a refused input (bad artifact, existing output) prints ``error: …`` to
    stderr and returns 2."""
    from genartifact_fpm_bench.artifact import MergeError
    from genartifact_fpm_bench.fit import FitError
    from genartifact_fpm_bench.grid import GridError

    try:
        return _main(args)
    except (FitError, MergeError, GridError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(args: Any) -> int:
    if args.bench_cmd == "run":
        from genartifact import config as config_mod
        from genartifact.engine.engine_args import command_engine_kwargs

        from genartifact_fpm_bench.run import run_rank

        cfg = config_mod.load(getattr(args, "config", None))
        engine_kwargs = {"max_num_batched_tokens": 1024, **command_engine_kwargs(cfg, args)}
        path = asyncio.run(run_rank(model=args.model, mode=args.mode, out_dir=args.out, rank=args.dp_rank,
                                    dp_size=args.dp_size, run_id=args.run_id, points_file=args.points,
                                    repeats=args.repeats, port_base=args.port_base, max_points=args.max_points,
                                    rounds=args.rounds, probes=cfg.plugins.get("probes", []),
                                    engine_kwargs=engine_kwargs))
        print(f"rank artifact: {path}")
    elif args.bench_cmd == "merge":
        from genartifact_fpm_bench.artifact import merge

        merged = merge(args.ranks, args.out)
        print(f"merged {len(args.ranks)} ranks, {len(merged['points'])} records -> {args.out} "
              f"(+ {merged['worker_probe_path']})")
        if merged["unverified_ranks"]:
            print(f"warning: ranks {merged['unverified_ranks']} carry no engine provenance (their engine_config probe "
                  f"failed): not checked for identity with the others; see capture_errors", file=sys.stderr)
        elif merged["capture_errors"]:
            print(f"warning: ranks {sorted(map(int, merged['capture_errors']))} have capture errors: only the "
                  f"provenance they captured was compared; see capture_errors", file=sys.stderr)
    elif args.bench_cmd == "fit":
        from genartifact_fpm_bench.fit import fit, summary_lines, write_model

        keys: list[str] = []
        if args.holdout_points:
            from genartifact_fpm_bench.grid import points_file_keys

            keys = points_file_keys(args.holdout_points)
        doc = fit(args.artifacts, args.holdout, rank=args.rank, holdout_keys=keys)
        write_model(doc, args.out)
        print("\n".join(summary_lines(doc)))
        print(f"model: {args.out}")
    elif args.bench_cmd == "live":
        from pathlib import Path

        from genartifact_fpm_bench.artifact import write_once
        from genartifact_fpm_bench.fit import StepModel
        from genartifact_fpm_bench.live import live_check, summary_lines

        if Path(args.out).exists():
            raise FileExistsError(f"live-check output {args.out} exists; outputs are written once")
        StepModel.load(args.fit)  # a foreign model fails before the engine starts
        rows = None
        if args.prompts:
            from genartifact.engine.job import read_prompts

            rows = read_prompts(args.prompts)
        doc = asyncio.run(live_check(model_dir=args.model, step_model=args.fit, prompts=rows,
                                     max_tokens=args.max_tokens, port_base=args.port_base,
                                     contents=args.contents.split(",") if args.contents else None))
        write_once(args.out, doc)
        print("\n".join(summary_lines(doc)))
        print(f"live check: {args.out} ({doc['passes_observed']} passes, receipts {doc['receipts']})")
        if doc["not_ready"]:
            print(f"error: receipts not ready: {doc['not_ready']}", file=sys.stderr)
            return 1
    else:
        from genartifact_fpm_bench.report import report

        md = report(args.artifact, args.out, model=args.model)
        print(f"report: {md} and {md.with_name('report.html')}")
    return 0
