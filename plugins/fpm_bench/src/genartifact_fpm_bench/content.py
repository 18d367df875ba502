"""Reproducible prompt content (content identity ``coordinate_rank_slot_v1``).

A request's prompt tokens derive only from: the content seed (``GENARTIFACT_BENCH_CONTENT_SEED``, default "0"),
the point's coordinates, the data-parallel rank and the request's slot in the batch — never from request
counters, run order or which subset of the grid runs. The batch shape enters each slot's seed through one
SHA-256 digest computed once per batch, so seeding costs one digest per batch plus one per slot (linear).

Prompt hashes: SHA-256 of the token ids as uint32 little-endian; the aggregate hash is the SHA-256 of the
per-slot hex digests joined in slot order.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from genartifact_fpm_bench.grid import Point

IDENTITY = "coordinate_rank_slot_v1"
HASH_ENCODING = "uint32_le"


def content_seed() -> str:
    return os.environ.get("GENARTIFACT_BENCH_CONTENT_SEED", "0")


@dataclass(frozen=True)
class BatchContent:
    """Prompt tokens per slot (``uint32 [len]`` arrays) and their hashes."""

    prompts: list[np.ndarray]
    hashes: list[str]
    aggregate: str


def batch_digest(seed: str, point: Point, rank: int, role: str) -> bytes:
    """One digest for the batch shape + coordinates (+ ``role``: ``measure``, ``prefix``, ``warmup``)."""
    body = json.dumps({"seed": seed, "point": point.as_dict(), "rank": rank, "role": role}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(body.encode()).digest()


def prompt_hash(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).hexdigest()


def make_batch(point: Point, rank: int, lengths: list[int], vocab: tuple[int, int], *, seed: str | None = None,
               role: str = "measure", prefix: list[np.ndarray] | None = None) -> BatchContent:
    """Token ids for each slot: ``lengths[slot]`` tokens drawn uniformly from ``[vocab[0], vocab[1])`` by a
    generator seeded from ``SHA-256(batch digest || slot)``; ``prefix[slot]`` (if given) is prepended."""
    seed = content_seed() if seed is None else seed
    digest = batch_digest(seed, point, rank, role)
    prompts, hashes = [], []
    for slot, n in enumerate(lengths):
        slot_seed = hashlib.sha256(digest + slot.to_bytes(4, "little")).digest()
        rng = np.random.default_rng(np.frombuffer(slot_seed, dtype="<u4"))
        body = rng.integers(vocab[0], vocab[1], size=n, dtype=np.uint32)
        toks = body if prefix is None else np.concatenate([prefix[slot].astype(np.uint32), body])
        prompts.append(toks)
        hashes.append(prompt_hash(toks))
    agg = hashlib.sha256("".join(hashes).encode()).hexdigest()
    return BatchContent(prompts, hashes, agg)
