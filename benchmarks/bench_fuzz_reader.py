"""Long-mode reader fuzz: structure-aware mutations (genartifact.testing.hostile) of valid artifacts, plus
decompression bombs; every case must raise only ArtifactFormatError (or decode to a valid artifact), and the
process's peak RSS must stay bounded. Prints cases run per mutation kind, failures (goal 0) and peak RSS.

    .venv/bin/python benchmarks/bench_fuzz_reader.py [--cases 20000] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import random
import resource
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "tests"))

from genartifact import format as fmt  # noqa: E402
from genartifact.errors import ArtifactFormatError  # noqa: E402
from genartifact.testing import hostile  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="20 cases (a test that the script runs)")
    args = ap.parse_args()
    if args.smoke:
        args.cases = 20
    from test_format_hostile import SEEDS

    r = random.Random(args.seed)
    ran, rejected, accepted = collections.Counter(), collections.Counter(), collections.Counter()
    failures = []
    t0 = time.perf_counter()
    for i in range(args.cases):
        obj = r.choice(SEEDS)
        kinds = []
        for _ in range(r.randint(1, 3)):
            try:
                kind, obj = hostile.mutate(obj, r)
            except Exception:  # noqa: BLE001 - structure-aware mutation needs a decodable input
                kind, obj = hostile.mutate(obj, r, "blocks")
            kinds.append(kind)
        kinds = kinds[-1:]  # later structure-aware mutations re-pack the object: count by the last one
        ran[kinds[0]] += 1
        try:
            fmt.decode(obj)
            accepted[kinds[0]] += 1
        except ArtifactFormatError:
            rejected[kinds[0]] += 1
        except BaseException as e:  # noqa: BLE001 - the finding
            failures.append((i, kinds, type(e).__name__, traceback.format_exc(limit=3)))
    for declared, actual in ((64 << 20, 800 << 20), (16 << 20, 2048 << 20)):
        for single in (False, True):
            ran["bomb"] += 1
            try:
                fmt.decode(hostile.object_bomb(declared, actual, single_segment=single))
                failures.append(("bomb", declared, actual, "accepted"))
            except ArtifactFormatError:
                rejected["bomb"] += 1
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{sum(ran.values())} cases in {dt:.1f} s, {len(failures)} failures, peak RSS {peak:.0f} MiB")
    for k in sorted(ran):
        print(f"  {k:16} ran {ran[k]:6}  rejected {rejected[k]:6}  accepted-valid {accepted[k]:5}")
    for f in failures[:10]:
        print("FAILURE", f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
