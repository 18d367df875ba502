"""moe_route_weights storage cost: bytes per row (one token position, all MoE routers) of the router weights
stored fp32 vs bf16 vs raw (uncompressed), next to the routes themselves, in whole zstd artifacts
(genartifact.format.encode, the product's codec and level).

    .venv/bin/python benchmarks/bench_route_weights.py [--tokens N] [--artifacts DIR] [--smoke]

Synthetic rows are shaped like a Qwen3-MoE-30B-A3B rollout: 48 routers x top-8 of 128 experts; per router a
skewed expert popularity (Dirichlet 0.3 as in bench_compression) plus Gaussian token logits; ids = top-8 of
the logits in descending order, weights = softmax over the 8 selected logits (norm_topk_prob=True, what vLLM's
CPURouter._softmax_topk returns). ``--artifacts`` also reports captured tiny-model objects that hold the content.
Output: one line per variant, and RATIO lines (stored bytes relative to routes-only / to raw weights).
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke  # noqa: E402
from genartifact import format as fmt  # noqa: E402
from genartifact_route_weights import to_bf16_bits  # noqa: E402


def synthetic(tokens: int, routers: int = 48, top_k: int = 8, experts: int = 128, seed: int = 0):
    """``(ids uint8 [routers, tokens, k], weights float32 [routers, tokens, k])`` router-major."""
    rng = np.random.default_rng(seed)
    ids = np.empty((routers, tokens, top_k), np.uint8)
    w = np.empty((routers, tokens, top_k), np.float32)
    for r in range(routers):
        bias = np.log(rng.dirichlet(np.full(experts, 0.3)) + 1e-9) * 0.5
        logits = (bias[None, :] + rng.standard_normal((tokens, experts)) * 1.5).astype(np.float32)
        top = np.argpartition(-logits, top_k, axis=1)[:, :top_k]
        vals = np.take_along_axis(logits, top, 1)
        order = np.argsort(-vals, axis=1, kind="stable")
        top, vals = np.take_along_axis(top, order, 1), np.take_along_axis(vals, order, 1)
        e = np.exp(vals - vals.max(1, keepdims=True))
        ids[r], w[r] = top, e / e.sum(1, keepdims=True)
    return ids, w


def encode(ids: np.ndarray, w: np.ndarray | None, dtype: str) -> int:
    """Stored bytes of one artifact with moe_routes (+ moe_route_weights in ``dtype`` when ``w`` is given)."""
    routers, rows, k = ids.shape
    tokens = np.zeros(rows + 1, np.uint32)
    sections = {"moe_routes": {"token_start": 0, "router_ids": list(range(routers)), "expert_counts": [128] * routers,
                               "top_k": k, "layout": "router_major"}}
    parts = [fmt.TensorPart("moe_routes.expert_ids", ids)]
    contents = ["moe_routes"]
    if w is not None:
        contents.append("moe_route_weights")
        sections["moe_route_weights"] = {"token_start": 0, "router_ids": list(range(routers)), "top_k": k,
                                         "dtype": dtype, "layout": "router_major", "router_scale": [1.0] * routers,
                                         "output_scale": [1.0] * routers}
        parts.append(fmt.TensorPart("moe_route_weights.weights", to_bf16_bits(w) if dtype == "bf16" else w))
    return fmt.encode(fmt.ArtifactInput(tokens, rows + 1, contents, sections, parts)).byte_count


def report(name: str, ids: np.ndarray, w: np.ndarray) -> None:
    routers, rows, k = ids.shape
    base = encode(ids, None, "f32")
    f32, bf16 = encode(ids, w, "f32"), encode(ids, w, "bf16")
    raw_f32, raw_bf16 = routers * k * 4, routers * k * 2
    print(f"{name}: {rows} rows x {routers} routers x top-{k}")
    print(f"  routes only           : {base / rows:9.1f} B/row stored   (raw ids {routers * k} B/row)")
    for label, total, raw in (("weights fp32", f32, raw_f32), ("weights bf16", bf16, raw_bf16)):
        extra = (total - base) / rows
        print(f"  + {label:<20}: {total / rows:9.1f} B/row stored, weights add {extra:8.1f} B/row "
              f"(raw {raw} B/row, {extra / raw:.3f} of raw)")
    tag = name.split(":")[0]
    print(f"RATIO stored bytes routes+weights fp32 / routes only ({tag}): {f32 / base:.3f}")
    print(f"RATIO stored bytes routes+weights bf16 / routes only ({tag}): {bf16 / base:.3f}")
    print(f"RATIO weights bytes bf16 / fp32, stored ({tag}): {(bf16 - base) / (f32 - base):.3f}")
    print(f"RATIO weights bytes stored / raw fp32 ({tag}): fp32 {(f32 - base) / rows / raw_f32:.3f}, "
          f"bf16 {(bf16 - base) / rows / raw_f32:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384, help="synthetic rows (token positions)")
    ap.add_argument("--artifacts", default="artifacts/runs", help="directory searched for captured .gart objects")
    add_smoke(ap)
    args = ap.parse_args()
    tokens, routers = (256, 4) if args.smoke else (args.tokens, 48)
    ids, w = synthetic(tokens, routers)
    report(f"synthetic Qwen3-MoE-30B-A3B-like: {tokens} tokens", ids, w)
    found = []
    for f in sorted(glob.glob(f"{args.artifacts}/**/*.gart", recursive=True)):
        try:
            a = fmt.decode(Path(f).read_bytes())
        except Exception:  # noqa: BLE001 - other contents' readers may be missing; skip what cannot be read
            continue
        if "moe_route_weights" in a.contents:
            found.append((a.tensors["moe_routes.expert_ids"], a.content("moe_route_weights").transpose(1, 0, 2)))
    if found:
        report(f"tiny-model captured ({len(found)} artifacts, rows concatenated)",
               np.ascontiguousarray(np.concatenate([x for x, _ in found], 1)),
               np.ascontiguousarray(np.concatenate([y for _, y in found], 1), np.float32))
    else:
        print(f"no captured artifacts with moe_route_weights under {args.artifacts}")


if __name__ == "__main__":
    main()
