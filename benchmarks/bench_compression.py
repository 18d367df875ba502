"""Route compression vs the order-0 per-layer entropy bound (target >= 0.97), and router-major vs
token-major layout, on realistic synthetic routes and on routes captured from the tiny model.

    .venv/bin/python benchmarks/bench_compression.py [--artifacts DIR]

ratio = entropy_bound_bytes / compressed_bytes (1.0 = as small as an ideal order-0 coder).
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, order0_entropy_bytes, synthetic_routes  # noqa: E402
from genartifact import format as fmt  # noqa: E402


def report(name: str, routes: np.ndarray) -> None:
    h = order0_entropy_bytes(routes)
    c = zstandard.ZstdCompressor(level=fmt.ZSTD_LEVEL)
    rm = len(c.compress(np.ascontiguousarray(routes).tobytes()))
    tm = len(c.compress(np.ascontiguousarray(routes.transpose(1, 0, 2)).tobytes()))
    print(f"{name}: {routes.nbytes} raw bytes, entropy bound {h:,.0f} B")
    print(f"  router-major zstd-{fmt.ZSTD_LEVEL}: {rm:,} B  ratio to bound {h / rm:.3f}  (target >= 0.97)")
    print(f"RATIO entropy bound / router-major zstd-{fmt.ZSTD_LEVEL} bytes ({name.split(':')[0]}): {h / rm:.3f}"
          f"  (target >= 0.97)")
    print(f"  token-major  zstd-{fmt.ZSTD_LEVEL}: {tm:,} B  ratio to bound {h / tm:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default="artifacts/runs", help="directory searched for captured .gart objects")
    add_smoke(ap)
    args = ap.parse_args()
    t, r = (1024, 4) if args.smoke else (32768, 48)
    report(f"synthetic {t} tokens x {r} layers x top-8 of 128 (Dirichlet 0.3 popularity)",
           synthetic_routes(tokens=t, routers=r))
    report("synthetic, milder skew (Dirichlet 1.0)", synthetic_routes(tokens=t, routers=r, skew=1.0, seed=1))
    arts = []
    for f in sorted(glob.glob(f"{args.artifacts}/**/*.gart", recursive=True)):
        a = fmt.decode(Path(f).read_bytes())
        if "moe_routes" in a.contents and a.manifest["sections"]["moe_routes"]["router_ids"] == [0, 1, 2, 3]:
            arts.append(a.tensors["moe_routes.expert_ids"])
    if arts:
        report(f"tiny-model captured routes ({len(arts)} artifacts concatenated per layer)", np.concatenate(arts, axis=1))
        sizes = [(a.nbytes, len(zstandard.ZstdCompressor(level=1).compress(a.tobytes()))) for a in arts]
        print(f"  per-artifact (small objects, frame overhead dominates): raw {sum(s[0] for s in sizes):,} B -> "
              f"{sum(s[1] for s in sizes):,} B compressed in {len(sizes)} frames")
    else:
        print("no captured tiny-model artifacts found; run `make demo` first")


if __name__ == "__main__":
    main()
