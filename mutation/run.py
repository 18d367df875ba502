"""Mutation testing of the safety-critical modules with cosmic-ray (https://cosmic-ray.readthedocs.io).

Each module is mutated in a throw-away copy of the repository (cosmic-ray edits files in place), one mutant
at a time, and the module's own fast tests are run against it; a mutant the tests do not fail "survived".

    python mutation/run.py                     # every module, a seeded sample of 80 mutants each
    python mutation/run.py --sample 0          # every mutant (hours on a laptop)
    python mutation/run.py journal --sample 20 # one module

Prints killed/survived/score per module and writes mutation/last-report.md. Operators: all of cosmic-ray's
core operators; the sample is uniform over the module's mutants (seed fixed) so runs are comparable.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULES = {
    "journal": ("core/src/genartifact/journal.py", "tests/test_journal_reconcile.py"),
    "format_reader": ("core/src/genartifact/format.py", "core/tests/test_format.py core/tests/test_format_hostile.py"),
    "admission": ("core/src/genartifact/session.py", "tests/test_session_pipeline.py"),
    "presigned_target": ("plugins/http_put_target/src/genartifact_http_put_target/__init__.py",
                         "plugins/http_put_target/tests"),
    "fsspec_target": ("plugins/fsspec_target/src/genartifact_fsspec_target/__init__.py",
                      "plugins/fsspec_target/tests/test_fsspec_target.py plugins/fsspec_target/tests/test_s3.py "
                      "tests/test_journal_reconcile.py"),
    # route and logprob finalize: captured rows -> admitted tensors (row counts, expert-id ranges, NaN/+inf)
    "route_finalize": ("plugins/route_capture/src/genartifact_route_capture/__init__.py",
                       "plugins/route_capture/tests tests/test_session_pipeline.py"),
    "logprob_finalize": ("plugins/logprobs/src/genartifact_logprobs/__init__.py",
                         "plugins/logprobs/tests tests/test_session_pipeline.py"),
}


def copy_repo(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = ROOT / f.decode()
        if src.is_file():
            (dst / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f.decode())
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)


def annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) (row 1-based, col) of every type annotation: with ``from __future__ import annotations``
    annotations are never evaluated, so a mutant inside one is equivalent by construction and is not run."""
    import ast

    tree = ast.parse(path.read_text())
    spans = []
    for node in ast.walk(tree):
        anns = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            anns.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            anns.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            anns.append(node.annotation)
        for a in anns:
            spans.append(((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)))  # rows 1-based, as cosmic-ray
    return spans


def run_module(name: str, sample: int, seed: int, work: Path, timeout: float) -> dict:
    module, tests = MODULES[name]
    cfg = work / f"{name}.toml"
    db = work / f"{name}.sqlite"
    cfg.write_text(f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = {timeout}\nexcluded-modules = []\n'
                   f'test-command = "{sys.executable} -m pytest -x -q -p no:cacheprovider {tests}"\n'
                   f'[cosmic-ray.distributor]\nname = "local"\n')
    env = {**os.environ, "PYTHONPATH": ":".join([str(work / "core/src"), *(str(p) for p in (work / "plugins").glob("*/src"))]),
           "GENARTIFACT_FUZZ_EXAMPLES": os.environ.get("GENARTIFACT_FUZZ_EXAMPLES", "100")}
    base = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests.split()],
                          cwd=work, env=env, capture_output=True, text=True)
    if base.returncode != 0:  # a failing baseline would count every mutant as killed
        raise SystemExit(f"{name}: the unmutated tests fail; fix them first:\n{base.stdout[-2000:]}")
    subprocess.run(["cosmic-ray", "init", str(cfg), str(db)], cwd=work, env=env, check=True, capture_output=True)
    con = sqlite3.connect(db)
    spans = annotation_spans(work / module)
    equivalent = [job for job, row, col in con.execute("select job_id, start_pos_row, start_pos_col from mutation_specs")
                  if any(a <= (row, col) < b for a, b in spans)]
    con.executemany("delete from mutation_specs where job_id = ?", [(j,) for j in equivalent])
    con.executemany("delete from work_items where job_id = ?", [(j,) for j in equivalent])
    con.commit()
    ids = [r[0] for r in con.execute("select job_id from work_items")]
    total = len(ids)
    if sample and sample < total:
        keep = set(random.Random(seed).sample(ids, sample))
        drop = [(i,) for i in ids if i not in keep]
        con.executemany("delete from mutation_specs where job_id = ?", drop)
        con.executemany("delete from work_items where job_id = ?", drop)
        con.commit()
    con.close()
    t0 = time.time()
    subprocess.run(["cosmic-ray", "exec", str(cfg), str(db)], cwd=work, env=env, check=True, capture_output=True)
    con = sqlite3.connect(db)
    rows = con.execute("select r.test_outcome, s.operator_name, s.start_pos_row, r.output from work_results r "
                       "join mutation_specs s on s.job_id = r.job_id").fetchall()
    con.close()
    outcome = [str(r[0]).lower().rsplit(".", 1)[-1] for r in rows]  # cosmic-ray stores KILLED/SURVIVED/INCOMPETENT
    killed = outcome.count("killed")
    incompetent = outcome.count("incompetent")
    survived = [(r[1], r[2]) for r, o in zip(rows, outcome, strict=True) if o == "survived"]
    return {"module": module, "mutants_total": total, "annotation_mutants_skipped": len(equivalent), "run": len(rows), "killed": killed, "incompetent": incompetent,
            "survived": sorted(survived, key=lambda x: x[1]), "seconds": round(time.time() - t0)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("modules", nargs="*", default=list(MODULES))
    ap.add_argument("--sample", type=int, default=80, help="mutants per module (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    lines = ["| module | mutants (total, annotations excluded) | run | killed | incompetent | survived | score | s |",
             "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="ga-mutation-") as tmp:
        work = Path(tmp)
        copy_repo(work)
        for name in args.modules:
            r = run_module(name, args.sample, args.seed, work, args.timeout)
            judged = r["run"] - r["incompetent"]
            score = r["killed"] / judged if judged else 0.0
            lines.append(f"| {name} (`{r['module']}`) | {r['mutants_total']} | {r['run']} | {r['killed']} | "
                         f"{r['incompetent']} | {len(r['survived'])} | {score:.0%} | {r['seconds']} |")
            print(lines[-1], flush=True)
            for op, row in r["survived"]:
                src = (work / r["module"]).read_text().splitlines()[row - 1].strip()
                print(f"    survived: line {row}: {op}: {src[:100]}", flush=True)
    (ROOT / "mutation" / "last-report.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
