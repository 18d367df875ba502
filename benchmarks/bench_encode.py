"""Encode+hash throughput of our encoder vs raw zstd-1 + SHA-256 of the same tensor bytes (target >= 1.0).

    .venv/bin/python benchmarks/bench_encode.py [--reps 30]

Baseline: single-threaded ``zstandard`` one-shot compression at level 1 (content size written, as ours) of the raw
tensor bytes, then SHA-256 of the frame. Ours: ``genartifact.format.encode`` (manifest, layout into one body's
pieces streamed into libzstd's multi-threaded compressor without assembling the body: its worker compresses while
the calling thread copies input in, hashes each output piece as it arrives and runs the content validation; SHA-256
of the stored bytes). Repetitions alternate the sides in a rotating order (base, ours, ... / ours, ..., base / ...);
every side reports median and best repetition, plus the per-repetition paired ratios. Also measured: the encoder
before the multi-threaded frame (the same steps with a single-threaded streamed frame: other bytes, all work in
the calling thread), and the floor of the one-shot encoder used before issue 13 (one-shot zstd of our body +
SHA-256 of the object, single thread: it cannot hash during compression).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, ratio_line, rotation, side_line, synthetic_routes  # noqa: E402
from genartifact import format as fmt  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--routers", type=int, default=48)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None,
                    help="zstd worker threads of our encoder (default: the product's ENCODE_THREADS for this machine)")
    add_smoke(ap)
    args = ap.parse_args()
    if args.threads is not None:
        fmt.ENCODE_THREADS = args.threads  # a machine policy only: the bytes are the same for every count >= 1
    if args.smoke:
        args.tokens, args.routers, args.reps = 512, 4, 2
    tokens, prompt = args.tokens, args.tokens // 4
    routes = synthetic_routes(tokens=tokens - 1, routers=args.routers)
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, 150_000, tokens, dtype=np.uint32)
    logprobs = -rng.exponential(2.0, tokens - prompt).astype(np.float32)
    inp = fmt.ArtifactInput(
        token_ids=token_ids, prompt_token_count=prompt, contents=["moe_routes", "selected_logprobs"],
        sections={"moe_routes": {"token_start": 0, "router_ids": list(range(args.routers)),
                                 "expert_counts": [128] * args.routers, "top_k": 8, "layout": "router_major"},
                  "selected_logprobs": {"token_start": prompt}},
        tensors=[fmt.TensorPart("moe_routes.expert_ids", routes), fmt.TensorPart("selected_logprobs.logprobs", logprobs)],
        header={"engine": {"name": "bench", "version": "0"}},
    )
    raw = token_ids.tobytes() + routes.tobytes() + logprobs.tobytes()
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)

    def baseline():
        hashlib.sha256(cctx.compress(raw)).hexdigest()

    def ours():  # the product's path: bodies > 512 KiB get libzstd's multi-threaded frame (ENCODE_THREADS workers)
        fmt.encode(inp)

    def ours_single():  # the encoder before the multi-threaded frame: single-threaded streamed frame, other bytes
        saved, fmt.ZSTDMT_JOBSIZE_MIN = fmt.ZSTDMT_JOBSIZE_MIN, 1 << 62
        try:
            fmt.encode(inp)
        finally:
            fmt.ZSTDMT_JOBSIZE_MIN = saved

    enc = fmt.encode(inp)
    body = zstandard.ZstdDecompressor().decompress(enc.data[fmt.PRELUDE_SIZE:])

    def floor():  # what the one-shot encoder (before issue 13) had to do at least: one-shot zstd of the body + SHA-256
        hashlib.sha256(fmt.PRELUDE.pack(fmt.MAGIC, fmt.MAJOR, fmt.MINOR, fmt.CODEC_ZSTD) + cctx.compress(body)).hexdigest()

    sides = {"raw zstd-1 + sha256": baseline, "genartifact encode": ours, "encode, single-threaded frame": ours_single,
             "one-shot floor (body zstd + sha)": floor}
    for fn in sides.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.reps):
        for name in rotation(list(sides), r):
            times[name].append(timed(sides[name]))
    mb = len(raw) / 1e6
    print(f"tensor bytes: {len(raw)} ({mb:.1f} MB); object: {enc.byte_count} bytes; zstd workers: "
          f"{fmt.ENCODE_THREADS}; {args.reps} repetitions alternated in rotating order; {load_line()}")
    for name, ts in times.items():
        print(side_line(name, [mb / t for t in ts], "MB/s"))
    print(ratio_line("encode / raw zstd-1 + sha256 (throughput)", times["genartifact encode"],
                     times["raw zstd-1 + sha256"], ">= 1.0", higher_is_better=False))
    print(ratio_line("encode with the single-threaded frame (before) / raw zstd-1 + sha256 (throughput)",
                     times["encode, single-threaded frame"],
                     times["raw zstd-1 + sha256"], higher_is_better=False))
    print(ratio_line("one-shot floor (body zstd + sha, single thread, the encoder before issue 13) / raw zstd-1 + sha256 (throughput)",
                     times["one-shot floor (body zstd + sha)"], times["raw zstd-1 + sha256"], higher_is_better=False))


if __name__ == "__main__":
    main()
