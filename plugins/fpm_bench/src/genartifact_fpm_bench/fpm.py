"""Forward-pass metrics (FPM): one record per non-empty forward pass of one data-parallel rank.

Units: tokens for token counts, tokens² for variances (population variance), seconds for times. Field names
follow the closest existing system (NVIDIA Dynamo's ``ForwardPassMetrics`` v1) so consumers can map them 1:1.

Wire framing on the ZMQ PUB socket (three frames):

1. topic: empty (subscribe with an empty filter);
2. sequence: 8-byte big-endian unsigned, the publisher's counter — starts at 0 per rank and process, +1 per
   *published* FPM, so a gap means dropped messages;
3. payload: MessagePack of :class:`FPM` (``msgspec``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

import msgspec

VERSION = 1


class ScheduledStats(msgspec.Struct, frozen=True):
    """Shape of one forward pass (or of the queue). Prefill = requests still computing their prompt this
    step (chunked prefill included); decode = requests generating. ``*_kv_tokens`` are tokens already in the KV
    cache when the step starts (prefix-cache hits and earlier chunks for prefill; the context for decode)."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class FPM(msgspec.Struct, frozen=True):
    """One forward pass. ``counter_id``: this rank's FPM counter (0, 1, …; counts recorded passes, including
    any the publisher later dropped). ``wall_time``: seconds from ``schedule()`` returning the batch to
    ``update_from_output()`` receiving its result (``timing_basis = "schedule_to_output"``; host wall clock,
    no device synchronization). ``inter_output``: seconds since the previous ``update_from_output`` (None for the
    first pass after start). ``t_schedule``/``t_output``: ``time.monotonic()`` endpoints (process-local).
    ``recorder_s``: seconds the instrumentation itself spent on this pass (shape reading, record building,
    hand-off to the publisher), so its overhead is measured in the same run it affects."""

    version: int
    dp_rank: int
    counter_id: int
    wall_time: float
    inter_output: float | None
    t_schedule: float
    t_output: float
    scheduled: ScheduledStats
    queued: ScheduledStats
    timing_basis: str = "schedule_to_output"
    recorder_s: float = 0.0


def pvariance(xs: list[int]) -> float:
    return float(statistics.pvariance(xs)) if len(xs) > 1 else 0.0


def stats(prefill: Iterable[tuple[int, int, int]], decode: Iterable[int]) -> ScheduledStats:
    """``prefill``: ``(new_tokens, kv_tokens, prompt_length)`` per request; ``decode``: kv tokens per request."""
    p = list(prefill)
    d = list(decode)
    return ScheduledStats(
        num_prefill_requests=len(p),
        sum_prefill_tokens=sum(x[0] for x in p),
        var_prefill_length=pvariance([x[2] for x in p]),
        sum_prefill_kv_tokens=sum(x[1] for x in p),
        num_decode_requests=len(d),
        sum_decode_kv_tokens=sum(d),
        var_decode_kv_tokens=pvariance(d),
    )


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(FPM)


def encode(fpm: FPM) -> bytes:
    return _enc.encode(fpm)


def decode(payload: bytes) -> FPM | None:
    """Decode a payload; None for an unknown version (forward compatible consumers skip it)."""
    raw = msgspec.msgpack.decode(payload)
    if not isinstance(raw, dict) or raw.get("version") != VERSION:
        return None
    return _dec.decode(payload)


def frames(seq: int, fpm: FPM) -> list[bytes]:
    """The three wire frames for ``fpm`` with publisher sequence ``seq``."""
    return [b"", seq.to_bytes(8, "big"), encode(fpm)]


def parse_frames(parts: list[bytes]) -> tuple[int, FPM | None]:
    """Inverse of :func:`frames`; raises ``ValueError`` on malformed framing."""
    if len(parts) != 3 or parts[0] != b"" or len(parts[1]) != 8:
        raise ValueError("FPM message must be 3 frames: empty topic, 8-byte sequence, payload")
    return int.from_bytes(parts[1], "big"), decode(parts[2])
