"""Shared helpers for benchmarks: realistic synthetic routes and order-0 entropy."""

from __future__ import annotations

import numpy as np


def synthetic_routes(tokens: int = 32768, routers: int = 48, top_k: int = 8, experts: int = 128,
                     skew: float = 0.3, seed: int = 0) -> np.ndarray:
    """Router-major ``uint8 [routers, tokens, top_k]``: per layer a skewed expert popularity
    (Dirichlet(skew)), each token's top-k drawn without replacement (distinct experts per row, like top-k)."""
    rng = np.random.default_rng(seed)
    out = np.empty((routers, tokens, top_k), np.uint8)
    for r in range(routers):
        p = rng.dirichlet(np.full(experts, skew))
        # Gumbel top-k = sampling k distinct experts proportional to p, in descending score order
        g = np.log(p)[None, :] - np.log(-np.log(rng.random((tokens, experts))))
        out[r] = np.argsort(-g, axis=1)[:, :top_k]
    return out


def order0_entropy_bytes(routes: np.ndarray) -> float:
    """Order-0 entropy bound in bytes: sum over routers of (symbols x H(empirical per-router distribution))."""
    total_bits = 0.0
    for layer in routes.reshape(routes.shape[0], -1):
        counts = np.bincount(layer, minlength=1).astype(np.float64)
        p = counts[counts > 0] / layer.size
        total_bits += -(p * np.log2(p)).sum() * layer.size
    return total_bits / 8
