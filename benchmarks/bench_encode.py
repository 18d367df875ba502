"""Encode+hash throughput of our encoder vs raw zstd-1 + SHA-256 of the same tensor bytes (target >= 0.85).

    .venv/bin/python benchmarks/bench_encode.py
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).parent))
from common import synthetic_routes  # noqa: E402
from genartifact import format as fmt  # noqa: E402


def best_of(fn, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    tokens, prompt = 32768, 8192
    routes = synthetic_routes(tokens=tokens - 1)
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, 150_000, tokens, dtype=np.uint32)
    logprobs = -rng.exponential(2.0, tokens - prompt).astype(np.float32)
    inp = fmt.ArtifactInput(
        token_ids=token_ids, prompt_token_count=prompt, contents=["moe_routes", "selected_logprobs"],
        sections={"moe_routes": {"token_start": 0, "router_ids": list(range(48)), "expert_counts": [128] * 48,
                                 "top_k": 8, "layout": "router_major"},
                  "selected_logprobs": {"token_start": prompt}},
        tensors=[fmt.TensorPart("moe_routes.expert_ids", routes), fmt.TensorPart("selected_logprobs.logprobs", logprobs)],
        header={"engine": {"name": "bench", "version": "0"}},
    )
    raw = token_ids.tobytes() + routes.tobytes() + logprobs.tobytes()
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)

    def baseline():
        hashlib.sha256(cctx.compress(raw)).hexdigest()

    def ours():
        fmt.encode(inp)

    ours()
    t_base, t_ours = best_of(baseline), best_of(ours)
    mb = len(raw) / 1e6
    enc = fmt.encode(inp)
    print(f"tensor bytes: {len(raw)} ({mb:.1f} MB); object: {enc.byte_count} bytes")
    print(f"raw zstd-1 + sha256: {mb / t_base:8.1f} MB/s")
    print(f"genartifact encode : {mb / t_ours:8.1f} MB/s  (includes validation, layout, hash)")
    print(f"ratio ours/raw = {t_base / t_ours:.3f}  (target >= 0.85)")


if __name__ == "__main__":
    main()
