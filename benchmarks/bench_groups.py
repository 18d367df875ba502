"""GRPO group dedup: stored bytes of a group with the prompt's routes stored once (prompt part + sample parts)
÷ the same group stored as full per-sample artifacts, and a check that the loaders return exactly the rows of
the non-deduplicated artifacts.

    .venv/bin/python benchmarks/bench_groups.py [--prompt 2048] [--samples 16] [--completion 256]

Group: prompt 2,048 tokens, 16 samples x 256 completion tokens, routes 48 layers x top-8 of 128 experts
(synthetic skewed routes, ``common.synthetic_routes``; each sample's completion rows drawn independently),
selected logprobs per sample; one sample's prefill routed 3 prompt rows at ``--mismatch-at`` differently: that
sample then keeps its rows from the first differing position on (``--mismatch-at -1``: no mismatch).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, synthetic_routes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--routers", type=int, default=48)
    ap.add_argument("--mismatch-at", type=int, default=100,
                    help="prompt position where one sample's 3 rows differ (-1: none)")
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.prompt, args.samples, args.completion, args.routers, args.mismatch_at = 64, 2, 16, 4, 10
    from genartifact import format as fmt
    from genartifact import groups

    p, c, n, r = args.prompt, args.completion, args.samples, args.routers
    routes = synthetic_routes(tokens=p - 1 + n * c, routers=r)  # one popularity model per layer for the group
    prompt_rows = routes[:, : p - 1]
    rng = np.random.default_rng(0)
    prompt_tok = rng.integers(0, 150_000, p)
    samples = []
    for k in range(n):
        pr = prompt_rows.copy()
        if k == n // 2 and args.mismatch_at >= 0:
            m = args.mismatch_at
            pr[:, m : m + 3] = np.roll(pr[:, m : m + 3], 1, axis=2)  # 3 prompt rows routed in another order
        comp = routes[:, p - 1 + k * c : p - 1 + (k + 1) * c]
        tok = np.concatenate([prompt_tok, rng.integers(0, 150_000, c)]).astype(np.uint32)
        samples.append(fmt.ArtifactInput(
            tok, p, ["moe_routes", "selected_logprobs"],
            {"moe_routes": {"token_start": 0, "router_ids": list(range(r)), "expert_counts": [128] * r, "top_k": 8,
                            "layout": "router_major", "source": "bench"}, "selected_logprobs": {"token_start": p}},
            [fmt.TensorPart("moe_routes.expert_ids", np.ascontiguousarray(np.concatenate([pr, comp], 1))),
             fmt.TensorPart("selected_logprobs.logprobs", -rng.exponential(1.0, c).astype(np.float32))]))
    t0 = time.perf_counter()
    full = [fmt.encode(s) for s in samples]
    t_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    part = fmt.encode(groups.prompt_part(samples, "bench"))
    sparts = groups.sample_parts(samples, "bench", {"sha256": part.sha256, "byte_count": part.byte_count,
                                                    "object_id": "x:prompt"})
    encs = [fmt.encode(sp.input) for sp in sparts]
    t_dedup = time.perf_counter() - t0
    without = sum(e.byte_count for e in full)
    with_ = part.byte_count + sum(e.byte_count for e in encs)
    pa = fmt.decode(part.data)
    exact = all(np.array_equal(groups.join(pa, fmt.decode(e.data)).rows, fmt.decode(f.data).routes())
                for e, f in zip(encs, full, strict=True))
    print(f"group: prompt {p}, {n} samples x {c}, {r} layers x top-8 of 128")
    print(f"without dedup: {without / 1e6:.2f} MB ({n} full artifacts; encode {t_full:.2f} s)")
    print(f"with dedup   : {with_ / 1e6:.2f} MB (prompt part {part.byte_count / 1e6:.2f} MB + {n} sample parts; "
          f"encode {t_dedup:.2f} s)")
    print(f"RATIO stored bytes with / without dedup: {with_ / without:.3f}  (saving {1 - with_ / without:.1%})")
    print(f"prompt-row mismatches kept with their sample: {[sp.prompt_row_mismatches for sp in sparts]}")
    print(f"joined rows equal the non-deduplicated rows for every sample: {exact}")
    assert exact


if __name__ == "__main__":
    main()
