"""Environment-tunable limits. A limit may be lowered by the environment, never raised."""

from __future__ import annotations

import os

from genartifact.errors import ConfigError
from genartifact.format import MAX_DECODED_BYTES

DEFAULT_PIPELINE_CONCURRENCY = 2
DEFAULT_SMALL_PIPELINE_CONCURRENCY = 32
#: artifacts whose admitted worst-case encoded size is at most this many bytes use the small pipeline lane
SMALL_ARTIFACT_BYTES = 1 << 20


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; allowed: {lo}..{hi}") from None
    if not lo <= v <= hi:
        raise ConfigError(f"{name}={v} out of range; allowed: {lo}..{hi}")
    return v


def max_decoded_bytes() -> int:
    """Decoded-size ceiling in bytes: 64 MiB, lowered by ``GENARTIFACT_MAX_DECODED_BYTES`` (never higher)."""
    return _env_int("GENARTIFACT_MAX_DECODED_BYTES", MAX_DECODED_BYTES, 1, MAX_DECODED_BYTES)


def pipeline_concurrency() -> int:
    """Concurrent encode+deliver operations per event loop (``GENARTIFACT_PIPELINE_CONCURRENCY``, default 2)."""
    return _env_int("GENARTIFACT_PIPELINE_CONCURRENCY", DEFAULT_PIPELINE_CONCURRENCY, 1, 1024)


def small_pipeline_concurrency() -> int:
    """Concurrent encode+deliver operations per event loop for artifacts whose admitted worst-case encoded size is at
    most :data:`SMALL_ARTIFACT_BYTES` (``GENARTIFACT_PIPELINE_SMALL_CONCURRENCY``, default 32)."""
    return _env_int("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY", DEFAULT_SMALL_PIPELINE_CONCURRENCY, 1, 1024)
