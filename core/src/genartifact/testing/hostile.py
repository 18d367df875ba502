"""Hostile ``generation_artifact_v1`` objects for reader tests, fuzzing and benchmarks.

``zstd_bomb``: a zstd frame whose header declares ``declared`` bytes while its blocks hold ``actual`` bytes
(RLE blocks of 128 KiB, 4 encoded bytes each: 800 MiB fit in ~26 KB). ``mutate``: one structure-aware mutation
of a valid object (prelude, manifest JSON, frame header, block headers/bytes, payload, length, trailing data),
driven by a ``random.Random``-like ``draw`` (hypothesis' ``st.randoms()`` in tests). Frame layout per RFC 8878.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable

import zstandard

from genartifact import format as fmt

BLOCK_MAX = 128 << 10


def rle_blocks(actual: int, byte: int = 0) -> bytes:
    """zstd RLE blocks producing ``actual`` bytes of ``byte`` (the last one flagged last)."""
    out = bytearray()
    n = actual
    while n > 0:
        bs = min(n, BLOCK_MAX)
        n -= bs
        out += ((1 if n == 0 else 0) | (1 << 1) | (bs << 3)).to_bytes(3, "little") + bytes([byte])
    if actual == 0:
        out += (1 | (1 << 1)).to_bytes(3, "little") + b"\0"
    return bytes(out)


def zstd_bomb(declared: int, actual: int, *, single_segment: bool = False, window_log: int = 20) -> bytes:
    """A zstd frame declaring ``declared`` content bytes (4-byte Frame_Content_Size) whose RLE blocks hold
    ``actual`` bytes. ``single_segment``: no window descriptor (window = declared size); else a window of
    ``2**window_log`` bytes."""
    if single_segment:
        head = bytes([0xA0])
    else:
        head = bytes([0x80, (window_log - 10) << 3])
    return b"\x28\xb5\x2f\xfd" + head + struct.pack("<I", declared) + rle_blocks(actual)


def prelude() -> bytes:
    return fmt.PRELUDE.pack(fmt.MAGIC, fmt.MAJOR, fmt.MINOR, fmt.CODEC_ZSTD)


def object_bomb(declared: int, actual: int, **kw: object) -> bytes:
    """A whole object: a valid prelude followed by :func:`zstd_bomb`."""
    return prelude() + zstd_bomb(declared, actual, **kw)  # type: ignore[arg-type]


def split(obj: bytes) -> tuple[bytes, bytes, dict, bytes]:
    """(prelude, body, manifest, payload) of a valid object."""
    body = zstandard.ZstdDecompressor().decompress(obj[fmt.PRELUDE_SIZE:])
    (mlen,) = struct.unpack_from("<I", body, 0)
    manifest = json.loads(body[4 : 4 + mlen])
    return obj[: fmt.PRELUDE_SIZE], body, manifest, body[fmt.align_up(4 + mlen):]


def repack(manifest_bytes: bytes, payload: bytes, pre: bytes | None = None) -> bytes:
    head = struct.pack("<I", len(manifest_bytes)) + manifest_bytes
    body = head + b"\0" * (fmt.align_up(len(head)) - len(head)) + payload
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(body)
    return (pre if pre is not None else prelude()) + frame


def _json_mutations(m: object, r: random.Random) -> object:
    """Replace one random node of the manifest with a hostile value."""
    hostile = [None, True, -1, 0, 2**63, -(2**63), 1e308, "", "x" * 300, [], {}, [0] * 9, "\u2028", 1.5]
    if isinstance(m, dict) and m:
        k = r.choice(sorted(m))
        if r.random() < 0.15:
            d = dict(m)
            del d[k]
            return d
        return {**m, k: _json_mutations(m[k], r) if r.random() < 0.6 else r.choice(hostile)}
    if isinstance(m, list) and m:
        i = r.randrange(len(m))
        out = list(m)
        if r.random() < 0.15:
            out.pop(i)
        elif r.random() < 0.15:
            out.append(out[i])
        else:
            out[i] = _json_mutations(m[i], r) if r.random() < 0.6 else r.choice(hostile)
        return out
    return r.choice(hostile)


def _flip(data: bytes, lo: int, hi: int, r: random.Random, n: int = 1) -> bytes:
    b = bytearray(data)
    hi = min(hi, len(b))
    if hi <= lo:
        return bytes(b)
    for _ in range(n):
        i = r.randrange(lo, hi)
        b[i] = r.choice([0, 0xFF, b[i] ^ (1 << r.randrange(8)), r.randrange(256)])
    return bytes(b)


MUTATIONS: dict[str, Callable[[bytes, random.Random], bytes]] = {}


def _mutation(name: str) -> Callable[[Callable[[bytes, random.Random], bytes]], Callable[[bytes, random.Random], bytes]]:
    def deco(fn: Callable[[bytes, random.Random], bytes]) -> Callable[[bytes, random.Random], bytes]:
        MUTATIONS[name] = fn
        return fn
    return deco


@_mutation("prelude")
def _m_prelude(obj: bytes, r: random.Random) -> bytes:
    return _flip(obj, 0, fmt.PRELUDE_SIZE, r, r.randint(1, 3))


@_mutation("manifest_json")
def _m_manifest(obj: bytes, r: random.Random) -> bytes:
    _pre, _body, manifest, payload = split(obj)
    return repack(fmt.canonical_json(_json_mutations(manifest, r)), payload)


@_mutation("manifest_bytes")
def _m_manifest_bytes(obj: bytes, r: random.Random) -> bytes:
    _pre, body, _m, payload = split(obj)
    (mlen,) = struct.unpack_from("<I", body, 0)
    raw = _flip(body[4 : 4 + mlen], 0, mlen, r, r.randint(1, 4))
    return repack(raw, payload)


@_mutation("manifest_length")
def _m_manifest_length(obj: bytes, r: random.Random) -> bytes:
    _pre, body, _m, _payload = split(obj)
    b = bytearray(body)
    struct.pack_into("<I", b, 0, r.choice([0, 1, len(body), len(body) + 1, 2**32 - 1, r.randrange(2**32)]))
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(b))
    return prelude() + frame


@_mutation("payload")
def _m_payload(obj: bytes, r: random.Random) -> bytes:
    _pre, body, _m, _payload = split(obj)
    (mlen,) = struct.unpack_from("<I", body, 0)
    start = fmt.align_up(4 + mlen)
    b = _flip(body, start, len(body), r, r.randint(1, 8)) if len(body) > start else body + b"\1"
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(b)
    return prelude() + frame


@_mutation("frame_header")
def _m_frame_header(obj: bytes, r: random.Random) -> bytes:
    return _flip(obj, fmt.PRELUDE_SIZE, fmt.PRELUDE_SIZE + 14, r, r.randint(1, 3))


@_mutation("declared_size")
def _m_declared_size(obj: bytes, r: random.Random) -> bytes:
    """Rewrite the frame's content size field (the encoder writes a single-segment header)."""
    frame = bytearray(obj[fmt.PRELUDE_SIZE:])
    fhd = frame[4]
    fcs_len = {0: 1 if fhd & 0x20 else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    off = 5 + (0 if fhd & 0x20 else 1) + {0: 0, 1: 1, 2: 2, 3: 4}[fhd & 3]
    if fcs_len:
        v = int.from_bytes(frame[off : off + fcs_len], "little")
        new = (v + r.choice([-64, -1, 1, 64, 4096, 1 << 20])) % (1 << (8 * fcs_len))
        frame[off : off + fcs_len] = new.to_bytes(fcs_len, "little")
    return obj[: fmt.PRELUDE_SIZE] + bytes(frame)


@_mutation("blocks")
def _m_blocks(obj: bytes, r: random.Random) -> bytes:
    return _flip(obj, fmt.PRELUDE_SIZE + 6, len(obj), r, r.randint(1, 6))


@_mutation("truncate")
def _m_truncate(obj: bytes, r: random.Random) -> bytes:
    return obj[: r.randrange(len(obj))]


@_mutation("trailing")
def _m_trailing(obj: bytes, r: random.Random) -> bytes:
    extra = r.choice([b"\0", b"x" * r.randint(1, 64), obj[fmt.PRELUDE_SIZE:],
                      b"\x50\x2a\x4d\x18\x04\x00\x00\x00abcd"])  # a whole second frame, a skippable frame
    return obj + extra


@_mutation("bomb_tail")
def _m_bomb_tail(obj: bytes, r: random.Random) -> bytes:
    """Replace the frame by one that declares the real body size but holds up to 64x more."""
    _pre, body, _m, _p = split(obj)
    return prelude() + zstd_bomb(len(body), len(body) * r.choice([2, 8, 64]) + 1,
                                 single_segment=r.random() < 0.5)


def mutate(obj: bytes, r: random.Random, kind: str | None = None) -> tuple[str, bytes]:
    """One mutation of valid object ``obj``: returns (mutation name, mutated bytes)."""
    kind = kind or r.choice(sorted(MUTATIONS))
    return kind, MUTATIONS[kind](obj, r)
