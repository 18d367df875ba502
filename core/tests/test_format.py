"""generation_artifact_v1: round trip, determinism, golden vector, strict reader."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import threading
import time

import numpy as np
import pytest
import zstandard
from genartifact import format as fmt
from genartifact.errors import ArtifactFormatError
from genartifact.testing import wait_child


def sample_input(rows_extra: int = 0, logprobs: np.ndarray | None = None) -> fmt.ArtifactInput:
    p, c, routers, k = 5, 4, 3, 2
    tokens = np.arange(100, 100 + p + c, dtype=np.uint32)
    rows = p + c - 1 + rows_extra
    ids = (np.arange(routers * rows * k) % 8).astype(np.uint8).reshape(routers, rows, k)
    lp = np.array([-0.5, -1.25, -np.inf, -3.0], np.float32) if logprobs is None else logprobs
    return fmt.ArtifactInput(
        token_ids=tokens,
        prompt_token_count=p,
        contents=["selected_logprobs", "moe_routes"],
        sections={
            "moe_routes": {"token_start": 0, "router_ids": [1, 2, 3], "expert_counts": [8, 8, 8], "top_k": k,
                           "layout": "router_major", "source": "test"},
            "selected_logprobs": {"token_start": p},
        },
        tensors=[fmt.TensorPart("moe_routes.expert_ids", ids), fmt.TensorPart("selected_logprobs.logprobs", lp)],
        header={"engine": {"name": "test", "version": "0"}},
    )


# Golden vector: fixed input -> fixed bytes. A change here is a format change (bump the version).
# The body digest is fixed by the spec; the object digest also depends on the bundled libzstd (level 1).
GOLDEN_BODY_SHA256 = "6b6ecfb1b5833524922bf8b9d4d129b9679c248e4946459c2d806486332e41c0"
GOLDEN_SHA256 = "d07b2b38d23461eea57c140c439f140c2e3882d86ae88d01a906fccc295cf96f"
GOLDEN_BYTES = 426


def test_round_trip_and_views_are_zero_copy_readonly():
    enc = fmt.encode(sample_input())
    art = fmt.decode(enc.data)
    assert art.sha256 == enc.sha256 == hashlib.sha256(enc.data).hexdigest()
    assert art.byte_count == len(enc.data)
    assert art.contents == ["moe_routes", "selected_logprobs"]
    assert art.token_ids.dtype == np.dtype("<u4") and art.token_ids.tolist() == list(range(100, 109))
    routes = art.routes()
    assert routes.shape == (8, 3, 2) and routes.dtype == np.uint8
    src = sample_input().tensors[0].array
    assert np.array_equal(routes, src.transpose(1, 0, 2))
    lp = art.selected_logprobs()
    assert lp.dtype == np.float32 and np.isneginf(lp[2]) and lp[1] == np.float32(-1.25)
    assert not lp.flags.writeable and lp.base is not None  # a view, not a copy


def test_deterministic_bytes_and_golden_vector():
    a, b = fmt.encode(sample_input()), fmt.encode(sample_input())
    assert a.data == b.data
    body = zstandard.ZstdDecompressor().decompress(a.data[fmt.PRELUDE_SIZE:])
    assert hashlib.sha256(body).hexdigest() == GOLDEN_BODY_SHA256
    assert a.data[: fmt.PRELUDE_SIZE] == b"GENART\x00\x01" + bytes([1, 0, 0, 0, 1, 0, 0, 0])
    assert (a.sha256, a.byte_count) == (GOLDEN_SHA256, GOLDEN_BYTES)


def large_input() -> fmt.ArtifactInput:
    """A fixed multi-block input (1.6 MB decoded, ~1 MB stored) built from integer arithmetic only (no RNG stream
    that could change between numpy versions): skewed router-major routes, token ids, logprobs."""
    routers, rows, k, p = 24, 8191, 8, 4096
    i = np.arange(routers * rows * k, dtype=np.uint64)
    x = (i * np.uint64(2654435761)) ^ (i >> np.uint64(7))
    ids = ((x ^ (x >> np.uint64(13))) % np.uint64(64)).astype(np.uint8)
    ids[::3] = (i[::3] % np.uint64(5)).astype(np.uint8)  # runs for the match finder
    tokens = ((np.arange(rows + 1, dtype=np.uint64) * np.uint64(48271)) % np.uint64(150000)).astype(np.uint32)
    lp = -(np.arange(rows + 1 - p, dtype=np.float32) % 97) / np.float32(7.0)
    return fmt.ArtifactInput(
        token_ids=tokens, prompt_token_count=p, contents=["moe_routes", "selected_logprobs"],
        sections={"moe_routes": {"token_start": 0, "router_ids": list(range(routers)), "expert_counts": [64] * routers,
                                 "top_k": k, "layout": "router_major", "source": "test"},
                  "selected_logprobs": {"token_start": p}},
        tensors=[fmt.TensorPart("moe_routes.expert_ids", ids.reshape(routers, rows, k)),
                 fmt.TensorPart("selected_logprobs.logprobs", lp)],
        header={"engine": {"name": "test", "version": "0"}})


# SHA-256 of the encoding of large_input(), pinned before the encoder overlapped compression, validation and
# hashing (issue 13; unchanged when the frame became the streamed procedure, and when it became the multi-threaded
# one: its body fits one zstd job, where all three give the same bytes): the stored bytes must not depend on how
# the encoder schedules its work.
GOLDEN_LARGE_SHA256 = "66bc2f6dec305703a391f538c218f477fe2af24e9712f578761efbd2f971b084"
GOLDEN_LARGE_BYTES = 1020570


def multi_job_input() -> fmt.ArtifactInput:
    """Like :func:`large_input`, 6.4 MB decoded: several zstd jobs, where the multi-threaded frame differs from a
    single-threaded one."""
    routers, rows, k, p = 48, 16383, 8, 4096
    i = np.arange(routers * rows * k, dtype=np.uint64)
    x = (i * np.uint64(2654435761)) ^ (i >> np.uint64(7))
    ids = ((x ^ (x >> np.uint64(13))) % np.uint64(64)).astype(np.uint8)
    ids[::3] = (i[::3] % np.uint64(5)).astype(np.uint8)
    tokens = ((np.arange(rows + 1, dtype=np.uint64) * np.uint64(48271)) % np.uint64(150000)).astype(np.uint32)
    lp = -(np.arange(rows + 1 - p, dtype=np.float32) % 97) / np.float32(7.0)
    return fmt.ArtifactInput(
        token_ids=tokens, prompt_token_count=p, contents=["moe_routes", "selected_logprobs"],
        sections={"moe_routes": {"token_start": 0, "router_ids": list(range(routers)), "expert_counts": [64] * routers,
                                 "top_k": k, "layout": "router_major", "source": "test"},
                  "selected_logprobs": {"token_start": p}},
        tensors=[fmt.TensorPart("moe_routes.expert_ids", ids.reshape(routers, rows, k)),
                 fmt.TensorPart("selected_logprobs.logprobs", lp)],
        header={"engine": {"name": "test", "version": "0"}})


# pinned when the frame became libzstd's multi-threaded streaming output (issue 13, 2026-12-01)
GOLDEN_MULTI_JOB_SHA256 = "f977a2d8d280f366bab45ac035af35d1ae7251f4b4396cd1be2b02d94becddd1"
GOLDEN_MULTI_JOB_BYTES = 3998485


def _streamed(body: bytes, threads: int, piece: int) -> bytes:
    c = zstandard.ZstdCompressor(level=1, write_content_size=True, write_checksum=False,
                                 threads=threads).compressobj(size=len(body))
    return b"".join(c.compress(body[i : i + piece]) for i in range(0, len(body), piece)) + c.flush()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_encoding_is_pinned_whatever_the_worker_count(threads, monkeypatch):
    """The stored bytes are the same for every zstd worker count (``ENCODE_THREADS`` is a machine policy, not part
    of the format) and equal docs/format.md's procedure: libzstd's multi-threaded streaming frame (any worker
    count, any input split), which differs from a single-threaded frame on a multi-job body."""
    monkeypatch.setattr(fmt, "ENCODE_THREADS", threads)
    for make, sha, size in ((multi_job_input, GOLDEN_MULTI_JOB_SHA256, GOLDEN_MULTI_JOB_BYTES),
                            (large_input, GOLDEN_LARGE_SHA256, GOLDEN_LARGE_BYTES)):
        encs = [fmt.encode(make()) for _ in range(3)]  # the third reuses this thread's compressor twice
        assert {(e.sha256, e.byte_count) for e in encs} == {(sha, size)}
        assert all(e.sha256 == hashlib.sha256(e.data).hexdigest() for e in encs)  # the digest is of the stored bytes
    body = zstandard.ZstdDecompressor().decompress(encs[0].data[fmt.PRELUDE_SIZE:])
    multi = fmt.encode(multi_job_input()).data[fmt.PRELUDE_SIZE:]
    mbody = zstandard.ZstdDecompressor().decompress(multi)
    assert multi == _streamed(mbody, 1, 1 << 20) == _streamed(mbody, 4, 4096)
    assert multi != _streamed(mbody, 0, 1 << 20)  # the input really tells the multi-threaded frame apart
    assert encs[0].data[fmt.PRELUDE_SIZE:] == _streamed(body, 1, 1 << 20)


def test_small_bodies_keep_the_single_threaded_frame():
    """Up to 512 KiB (libzstd's ``ZSTDMT_JOBSIZE_MIN``) libzstd compresses in the calling thread: such objects
    (every ordinary per-request artifact) keep the bytes of the encoder before the multi-threaded frame."""
    assert fmt.encode(sample_input()).sha256 == GOLDEN_SHA256
    rng = np.random.default_rng(3)
    for n in (1000, 100_000, 130_900):  # u32 token ids: bodies up to 512 KiB
        enc = fmt.encode(_logprobs_only((rng.integers(0, 64, size=n, dtype=np.uint32) * 7).astype(np.uint32)))
        assert enc.decoded_bytes <= 512 << 10
        body = zstandard.ZstdDecompressor().decompress(enc.data[fmt.PRELUDE_SIZE:])
        assert enc.data[fmt.PRELUDE_SIZE:] == _streamed(body, 0, 1 << 20), n


@pytest.mark.parametrize("level", [1, 3, 9])
def test_small_body_one_shot_frame_is_the_streamed_frame(level):
    """Bodies below 256 KiB are compressed in one ``compress`` call (``_compress_and_hash_small``) instead of
    streamed piece by piece: the frame must be byte for byte the streamed procedure's, on both sides of zstd's
    128 KiB block size and up to the 256 KiB threshold, for repetitive and for incompressible bytes, whatever the
    pieces; and the digest is of the stored bytes."""
    rng = np.random.default_rng(level)
    prelude = fmt.PRELUDE.pack(fmt.MAGIC, fmt.MAJOR, fmt.MINOR, fmt.CODEC_ZSTD)
    below = fmt.ONE_SHOT_BELOW_BYTES
    assert below <= fmt.ZSTDMT_JOBSIZE_MIN  # only single-threaded frames are ever made in one call
    for n in (0, 1, 4095, (64 << 10), (128 << 10) - 1, 128 << 10, (128 << 10) + 1, 200_003, below - 1):
        for body in (bytes(rng.integers(0, 256, n, dtype=np.uint8)), (b"route rows " * (n // 11 + 1))[:n]):
            pieces = [body[: n // 3], memoryview(body)[n // 3 : n // 2], body[n // 2 :]]
            c = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
            data, digest = fmt._compress_and_hash_small(c, pieces, lambda: None)
            streamed = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False
                                                ).compressobj(size=n)
            frame = b"".join(streamed.compress(p) for p in pieces) + streamed.flush()
            assert data == prelude + frame, (n, level)
            assert digest == hashlib.sha256(data).hexdigest()
    # at exactly 256 KiB the one-shot frame would differ (3 bytes shorter): that size is streamed by encode
    body = bytes(rng.integers(0, 256, below, dtype=np.uint8))
    one = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False).compress(body)
    assert one != _streamed(body, 0, 1 << 20) or level != 1
    inp = _logprobs_only(np.frombuffer(body, "<u4").copy())
    enc = fmt.encode(inp, level=level)
    plain = zstandard.ZstdDecompressor().decompress(enc.data[fmt.PRELUDE_SIZE:])
    c = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False).compressobj(
        size=len(plain))
    assert enc.data[fmt.PRELUDE_SIZE:] == c.compress(plain) + c.flush()
    for size in (5, 300_001):  # both paths: a body whose pieces do not hold the manifest's layout is a format error
        with pytest.raises(ArtifactFormatError, match=f"lays out {size}"):
            fmt._compress_and_hash([b"abcd"], size, level, lambda: None)


def test_large_encode_validation_error_raises_and_returns_nothing():
    inp = multi_job_input()
    bad = inp.tensors[0].array.copy()
    bad[5, 100, 3] = 64  # expert id out of range for expert_counts 64: the routes reader refuses it
    inp = fmt.ArtifactInput(inp.token_ids, inp.prompt_token_count, inp.contents, inp.sections,
                            [fmt.TensorPart("moe_routes.expert_ids", bad), inp.tensors[1]], inp.header)
    with pytest.raises(ArtifactFormatError, match="expert"):
        fmt.encode(inp)
    assert fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256  # the compressor is left usable


def test_frame_declares_content_size_and_single_frame():
    enc = fmt.encode(sample_input())
    params = zstandard.get_frame_parameters(enc.data[fmt.PRELUDE_SIZE:])
    assert params.content_size == enc.decoded_bytes


def test_tensors_aligned_to_64():
    art = fmt.decode(fmt.encode(sample_input()).data)
    assert all(r["offset"] % 64 == 0 for r in art.manifest["tensors"])


def _logprobs_only(token_ids: np.ndarray) -> fmt.ArtifactInput:
    """``sample_input()`` with ``token_ids`` (u32) as its tokens, all but the last four prompt, no routes."""
    inp = sample_input()
    inp.token_ids = token_ids
    inp.prompt_token_count = len(token_ids) - 4
    inp.sections["selected_logprobs"]["token_start"] = inp.prompt_token_count
    inp.tensors = [t for t in inp.tensors if t.name != "moe_routes.expert_ids"]
    inp.contents = ["selected_logprobs"]
    del inp.sections["moe_routes"]
    return inp


@pytest.mark.parametrize("dtype,value,ok", [
    ("<u4", 2**32 - 1, True), ("<u2", 2**16 - 1, True), ("<i8", 2**32 - 1, True), ("<u8", 2**32 - 1, True),
    ("<i8", -1, False), ("<i4", -1, False), ("<i8", 2**32, False), ("<u8", 2**32, False),
])
def test_token_ids_of_any_integer_dtype_are_range_checked(dtype, value, ok):
    """Token ids are stored as uint32: a wider or signed array is refused when a value does not fit (an unsigned
    array of at most 4 bytes per id is not scanned: it cannot hold one)."""
    tokens = np.arange(8, dtype=dtype)
    tokens[3] = value
    inp = _logprobs_only(tokens)
    if ok:
        assert fmt.decode(fmt.encode(inp).data).token_ids[3] == value
    else:
        with pytest.raises(fmt.ArtifactFormatError, match="token_ids out of range"):
            fmt.encode(inp)


@pytest.mark.parametrize("tokens", [200_000, 2_000_000])  # one zstd job, and several (multi-threaded frame)
def test_encoded_bound_holds_for_incompressible_data(tokens):
    rng = np.random.default_rng(0)
    enc = fmt.encode(_logprobs_only(rng.integers(0, 2**32 - 1, size=tokens, dtype=np.uint32)))
    assert enc.byte_count <= fmt.encoded_size_bound(enc.decoded_bytes)
    assert enc.byte_count > enc.decoded_bytes  # really incompressible: the bound is what is tested


def test_torch_conversion():
    torch = pytest.importorskip("torch")
    art = fmt.decode(fmt.encode(sample_input()).data)
    t = art.to_torch("moe_routes.expert_ids")
    assert t.dtype == torch.uint8 and tuple(t.shape) == (3, 8, 2)


# ------------------------------------------------------------------------------------------------ reader


def _body(data: bytes) -> bytearray:
    return bytearray(zstandard.ZstdDecompressor().decompress(data[fmt.PRELUDE_SIZE:]))


def _repack(body: bytes | bytearray, prelude: bytes | None = None) -> bytes:
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(body))
    return (prelude or fmt.PRELUDE.pack(fmt.MAGIC, 1, 0, 1)) + frame


def _with_manifest(data: bytes, mutate) -> bytes:
    body = _body(data)
    (mlen,) = struct.unpack_from("<I", body, 0)
    m = json.loads(body[4 : 4 + mlen])
    payload = body[fmt.align_up(4 + mlen):]
    mutate(m)
    mb = fmt.canonical_json(m)
    head = struct.pack("<I", len(mb)) + mb
    return _repack(head + b"\0" * (fmt.align_up(len(head)) - len(head)) + payload)


GOOD = fmt.encode(sample_input()).data


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "truncated"),
        (GOOD[:10], "truncated"),
        (b"XXXXXXXX" + GOOD[8:], "bad magic"),
        (fmt.PRELUDE.pack(fmt.MAGIC, 2, 0, 1) + GOOD[16:], "major version"),
        (fmt.PRELUDE.pack(fmt.MAGIC, 1, 7, 1) + GOOD[16:], "minor version"),
        (fmt.PRELUDE.pack(fmt.MAGIC, 1, 0, 9) + GOOD[16:], "codec"),
        (GOOD[:13] + b"\x01" + GOOD[14:], "reserved"),
        (GOOD[:-5], "truncated zstd frame|corrupt"),
        (GOOD + b"\x00", "trailing data|corrupt"),
        (GOOD + GOOD[16:], "trailing data"),
        (GOOD[:16] + b"\x00" * 20, "invalid zstd frame|content size"),
    ],
    ids=["empty", "short", "magic", "major", "minor", "codec", "reserved", "truncated", "trailing-byte",
         "extra-frame", "garbage-frame"],
)
@pytest.mark.fault("reader", "malformed object bytes")
def test_reader_rejects_bad_objects(data, match):
    with pytest.raises(ArtifactFormatError, match=match):
        fmt.decode(data)


@pytest.mark.fault("reader", "zstd frame without a declared content size")
def test_reader_rejects_frame_without_declared_size():
    body = _body(GOOD)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(body))
    with pytest.raises(ArtifactFormatError, match="content size"):
        fmt.decode(GOOD[:16] + frame)


@pytest.mark.fault("reader", "declared body size over the limit")
def test_reader_checks_declared_size_before_allocating():
    # a 1 GiB frame of zeros compresses to a few KiB; the reader must refuse it from the header alone
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=True)
    frame = cobj.compress(b"\0" * (fmt.MAX_DECODED_BYTES + 1))
    with pytest.raises(ArtifactFormatError, match="exceeds limit"):
        fmt.decode(GOOD[:16] + frame)
    with pytest.raises(ArtifactFormatError, match="exceeds limit"):
        fmt.decode(GOOD, max_decoded_bytes=800)  # object fits the bound, declared body (848 B) does not


@pytest.mark.fault("reader", "non-canonical manifest JSON")
def test_reader_rejects_non_canonical_manifest():
    body = _body(GOOD)
    (mlen,) = struct.unpack_from("<I", body, 0)
    m = json.loads(body[4 : 4 + mlen])
    pretty = json.dumps(m, sort_keys=True, separators=(",", ":")).replace(":", ": ", 1).encode()
    payload = body[fmt.align_up(4 + mlen):]
    head = struct.pack("<I", len(pretty)) + pretty
    with pytest.raises(ArtifactFormatError, match="canonical"):
        fmt.decode(_repack(head + b"\0" * (fmt.align_up(len(head)) - len(head)) + payload))


@pytest.mark.fault("reader", "non-zero padding bytes")
@pytest.mark.parametrize("obj", [
    {"b": 1, "a": [1.5, None, True, "\u00e9\u2603\U0001f600"], "c": {"z": -0.0, "y": 10**30, "x": 1e-300}},
    {"": [], "\u00ff": {"\n": "\x00\x1f\"\\"}, "1": False, "10": 2, "2": 3},
    ["x", 3, [[]], {}], "a\u2028b", 7, None, 1.0000000000000002,
])
def test_canonical_json_is_json_dumps_with_the_canonical_options(obj):
    """The shared encoder gives exactly what ``json.dumps`` with the documented options gives (sorted keys at
    every level, no whitespace, ASCII escapes, shortest float repr), so no stored manifest changes."""
    want = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    assert fmt.canonical_json(obj) == want


@pytest.mark.parametrize("bad", [float("nan"), {"a": float("inf")}, {"a": object()}, {1: {"b": -float("inf")}}])
def test_canonical_json_refuses_what_json_cannot_carry(bad):
    with pytest.raises(ArtifactFormatError, match="not representable in canonical JSON"):
        fmt.canonical_json(bad)


def test_canonical_json_refuses_a_cycle_and_stays_usable():
    cyclic: dict = {}
    cyclic["self"] = cyclic
    with pytest.raises(ArtifactFormatError, match="not representable"):
        fmt.canonical_json(cyclic)
    assert fmt.canonical_json({"b": 1, "a": 2}) == b'{"a":2,"b":1}'  # no state left behind by the failure


def test_reader_rejects_nonzero_padding():
    body = _body(GOOD)
    (mlen,) = struct.unpack_from("<I", body, 0)
    assert fmt.align_up(4 + mlen) > 4 + mlen
    body[4 + mlen] = 1
    with pytest.raises(ArtifactFormatError, match="padding"):
        fmt.decode(_repack(body))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: m["tensors"][1].__setitem__("offset", m["tensors"][1]["offset"] - 8), "overlap or gap"),
        (lambda m: m["tensors"][1].__setitem__("offset", m["tensors"][1]["offset"] + 64), "overlap or gap"),
        (lambda m: m["tensors"][1].__setitem__("byte_count", 1), "byte_count"),
        (lambda m: m["tensors"][1].__setitem__("dtype", "f64"), "dtype"),
        (lambda m: m.__setitem__("extra", 1), "manifest keys"),
        (lambda m: m.__setitem__("completion_token_count", 3), "equal len"),
        (lambda m: m["sections"]["moe_routes"].__setitem__("expert_counts", [8, 8, 2]), "out of range for router 3"),
        (lambda m: m["sections"]["moe_routes"].__setitem__("router_ids", [3, 2, 1]), "ascending"),
        (lambda m: m["sections"]["moe_routes"].__setitem__("top_k", 3), "top_k"),
        (lambda m: m["sections"]["moe_routes"].__setitem__("token_start", 1), "rows"),
        (lambda m: m["sections"]["selected_logprobs"].__setitem__("token_start", 0), "token_start"),
        (lambda m: m.__setitem__("version", [1, 1]), "format/version"),
        (lambda m: m["tensors"].reverse(), "start with token_ids"),
        (lambda m: m["tensors"][1].update(shape=[0, 2**62, 2**62], byte_count=0), "shape .* larger than the body"),
    ],
    ids=["overlap", "gap", "byte-count", "dtype", "extra-key", "token-count", "expert-range", "router-order",
         "top-k", "rows", "logprob-start", "version", "order", "empty-but-huge-shape"],
)
@pytest.mark.fault("reader", "manifest field violations")
def test_reader_rejects_bad_manifests(mutate, match):
    with pytest.raises(ArtifactFormatError, match=match):
        fmt.decode(_with_manifest(GOOD, mutate))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.fault("encoder", "NaN / +inf logprob reaching the encoder")
def test_nan_and_positive_inf_logprobs_are_refused_not_nulled(bad):
    lp = np.array([-0.5, bad, -1.0, -2.0], np.float32)
    with pytest.raises(ArtifactFormatError, match=r"selected_logprobs\[1\]"):
        fmt.encode(sample_input(logprobs=lp))


@pytest.mark.fault("reader", "NaN logprob inside a stored object")
def test_nan_in_stored_object_is_rejected_by_reader():
    enc = fmt.encode(sample_input())
    body = _body(enc.data)
    art = fmt.decode(enc.data)
    ref = next(r for r in art.manifest["tensors"] if r["name"] == "selected_logprobs.logprobs")
    (mlen,) = struct.unpack_from("<I", body, 0)
    off = fmt.align_up(4 + mlen) + ref["offset"]
    body[off : off + 4] = np.array([np.nan], np.float32).tobytes()
    with pytest.raises(ArtifactFormatError, match="only finite values and -inf"):
        fmt.decode(_repack(body))


@pytest.mark.fault("encoder", "route tensor with wrong row count or dtype")
def test_encoder_rejects_wrong_row_count_and_dtype():
    with pytest.raises(ArtifactFormatError, match="rows"):
        fmt.encode(sample_input(rows_extra=1))
    inp = sample_input()
    inp.tensors = [fmt.TensorPart("moe_routes.expert_ids", inp.tensors[0].array.astype(np.uint16)), inp.tensors[1]]
    with pytest.raises(ArtifactFormatError, match="dtype must be u8"):
        fmt.encode(inp)


def test_route_layout_compresses_better_than_token_major():
    """Router-major per-layer streams vs token-major rows, on skewed synthetic routes."""
    rng = np.random.default_rng(1)
    routers, rows, k, experts = 16, 4000, 4, 64
    pops = [rng.dirichlet(np.full(experts, 0.3)) for _ in range(routers)]
    ids = np.stack([rng.choice(experts, size=(rows, k), p=p) for p in pops]).astype(np.uint8)  # [R, rows, k]
    c = zstandard.ZstdCompressor(level=1)
    router_major = len(c.compress(ids.tobytes()))
    token_major = len(c.compress(ids.transpose(1, 0, 2).copy().tobytes()))
    assert router_major < token_major


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m["tensors"][1].__setitem__("name", 5),
        lambda m: m["sections"]["moe_routes"].__setitem__("router_ids", [1, 2, "x"]),
        lambda m: m["tensors"][1].__setitem__("dtype", ["u8"]),
        lambda m: m.__setitem__("contents", [["moe_routes"], "selected_logprobs"]),
        lambda m: m["sections"]["moe_routes"].__setitem__("router_ids", [[1], 2, 3]),
        lambda m: m["tensors"][0].__setitem__("offset", 0.0),
        lambda m: m.__setitem__("sections", ["moe_routes"]),
        lambda m: m["tensors"][1].__setitem__("shape", [0, 10**30]),
        lambda m: m["tensors"][1].__setitem__("shape", [1] * 70),
        lambda m: m.__setitem__("header", "x"),
        lambda m: m["sections"]["moe_routes"].__setitem__("top_k", 2.0),
        lambda m: m["sections"].__setitem__("moe_routes", "x"),
    ],
    ids=["name-int", "router-mixed", "dtype-list", "contents-nested", "router-nested", "offset-float",
         "sections-list", "shape-huge", "rank-70", "header-str", "topk-float", "section-str"],
)
@pytest.mark.fault("reader", "hostile manifest values")
def test_hostile_manifests_only_raise_format_errors(mutate):
    with pytest.raises(ArtifactFormatError):
        fmt.decode(_with_manifest(GOOD, mutate))


@pytest.mark.fault("reader", "manifest nested past the recursion limit")
def test_deeply_nested_manifest_is_a_format_error():
    body = _body(GOOD)
    (mlen,) = struct.unpack_from("<I", body, 0)
    deep = b"[" * 50_000 + b"]" * 50_000
    head = struct.pack("<I", len(deep)) + deep
    with pytest.raises(ArtifactFormatError):
        fmt.decode(_repack(head + b"\0" * (fmt.align_up(len(head)) - len(head)) + body[fmt.align_up(4 + mlen):]))


@pytest.mark.fault("reader", "non-bytes input and oversized objects")
def test_non_bytes_input_and_oversized_objects():
    with pytest.raises(ArtifactFormatError, match="bytes-like"):
        fmt.decode(10**9)
    with pytest.raises(ArtifactFormatError, match="largest valid object"):
        fmt.decode(b"\0" * (fmt.MAX_OBJECT_BYTES + 1))


@pytest.mark.fault("reader", "object above GENARTIFACT_MAX_DECODED_BYTES")
def test_reader_honours_env_decoded_limit(monkeypatch):
    monkeypatch.setenv("GENARTIFACT_MAX_DECODED_BYTES", "100")
    with pytest.raises(ArtifactFormatError, match="limit 100|largest valid object"):
        fmt.decode(GOOD)
    monkeypatch.setenv("GENARTIFACT_MAX_DECODED_BYTES", "abc")
    with pytest.raises(ArtifactFormatError, match="GENARTIFACT_MAX_DECODED_BYTES"):
        fmt.decode(GOOD)


def _with_manifest_bytes(n: int) -> fmt.EncodedArtifact:
    """sample_input() with a header pad sized so that the manifest is exactly ``n`` bytes."""
    def enc(pad: int) -> fmt.EncodedArtifact:
        inp = sample_input()
        inp.header = {"engine": {"name": "test", "version": "0"}, "pad": "x" * pad}
        return fmt.encode(inp)

    def mlen(e: fmt.EncodedArtifact) -> int:
        body = zstandard.ZstdDecompressor().decompress(e.data[16:])
        return struct.unpack_from("<I", body, 0)[0]

    base = mlen(enc(0))
    e = enc(n - base)
    assert mlen(e) == n
    return e


@pytest.mark.fault("reader", "manifest one byte over 1 MiB")
def test_manifest_of_exactly_the_limit_is_accepted_one_more_byte_is_not(monkeypatch):
    """MAX_MANIFEST_BYTES (1 MiB) is inclusive in the encoder and the reader; one byte more is refused by both."""
    limit = fmt.MAX_MANIFEST_BYTES
    assert limit == 1 << 20
    at = _with_manifest_bytes(limit)
    assert fmt.decode(at.data).sha256 == at.sha256
    with pytest.raises(ArtifactFormatError, match=f"manifest is {limit + 1} bytes; limit {limit}"):
        _with_manifest_bytes(limit + 1)
    monkeypatch.setattr(fmt, "MAX_MANIFEST_BYTES", limit + 1)  # let the encoder write it...
    over = _with_manifest_bytes(limit + 1)
    monkeypatch.setattr(fmt, "MAX_MANIFEST_BYTES", limit)  # ...and the reader refuse it
    with pytest.raises(ArtifactFormatError, match=f"manifest length {limit + 1} exceeds limit {limit}"):
        fmt.decode(over.data)


@pytest.mark.parametrize("p, c", [(0, 3), (4, 0), (0, 0)], ids=["empty-prompt", "no-completion", "no-tokens"])
def test_edge_token_counts_round_trip(p, c):
    """P = 0 (a zero-token prompt) and C = 0 (nothing sampled) are valid objects: encoded and read back; a
    prompt count above the token count is refused by the encoder."""
    tokens = np.arange(p + c, dtype=np.uint32)
    inp = fmt.ArtifactInput(token_ids=tokens, prompt_token_count=p, contents=["selected_logprobs"],
                            sections={"selected_logprobs": {"token_start": p}},
                            tensors=[fmt.TensorPart("selected_logprobs.logprobs", np.full(c, -0.5, np.float32))],
                            header={})
    art = fmt.decode(fmt.encode(inp).data)
    assert (art.manifest["prompt_token_count"], art.manifest["completion_token_count"]) == (p, c)
    assert art.selected_logprobs().tolist() == [-0.5] * c
    inp.prompt_token_count = p + c + 1
    with pytest.raises(ArtifactFormatError, match="prompt_token_count"):
        fmt.encode(inp)


def test_frame_walk_names_an_oversized_block_and_a_torn_block_header():
    """RFC 8878: a block holds at most 128 KiB; the frame walk refuses a larger one by name before anything is
    decompressed, and a frame cut inside a 3-byte block header is truncated."""
    body = bytes(200 << 10)
    real = zstandard.ZstdCompressor(level=1, write_content_size=True, write_checksum=False).compress(body)
    hs = zstandard.frame_header_size(real)
    big = (1 | (0 << 1) | ((200 << 10) << 3)).to_bytes(3, "little")  # last, raw, 200 KiB
    with pytest.raises(ArtifactFormatError, match="block larger than 128 KiB"):
        fmt.decode(GOOD[:16] + real[:hs] + big + body)
    ok = (1 | (0 << 1) | ((128 << 10) << 3)).to_bytes(3, "little")  # exactly 128 KiB passes the walk
    with pytest.raises(ArtifactFormatError) as e:
        fmt.decode(GOOD[:16] + real[:hs] + ok + bytes(128 << 10))
    assert "128 KiB" not in str(e.value)  # refused later (the declared size), not as an oversized block
    for cut in (1, 2):
        with pytest.raises(ArtifactFormatError, match="truncated zstd frame"):
            fmt.decode(GOOD[:16] + real[:hs] + big[:cut])


@pytest.mark.fault("encoder", "fork while another thread holds the helper pool's lock")
def test_encode_in_a_child_forked_while_the_pool_lock_was_held(monkeypatch):
    """A child forked while another thread was inside the helper pool's lock (creating the pool) encodes large
    objects and decodes them with the hash in the helper pool, to the same bytes as ever, instead of waiting
    forever."""
    monkeypatch.setattr(fmt, "PARALLEL_HASH_BYTES", 1 << 20)
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with fmt._HASH_POOL_LOCK:
            inside.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            signal.alarm(20)  # a hang ends the child with SIGALRM
            enc = fmt.encode(multi_job_input())
            ok = enc.sha256 == GOLDEN_MULTI_JOB_SHA256 and fmt.decode(enc.data).sha256 == GOLDEN_MULTI_JOB_SHA256
            code = 0 if ok else 4
        finally:
            os._exit(code)
    release.set()
    t.join()
    assert wait_child(pid) == 0, "child: -14 or 'hung' means it waited forever"


@pytest.mark.fault("encoder", "concurrent multi-threaded encodes")
def test_concurrent_large_encodes_give_the_pinned_bytes():
    """Sixteen encodes from eight threads (each with its own compressor and zstd worker) all give the pinned
    bytes, and a validation error in some of them neither hangs nor changes the others' bytes."""
    from concurrent.futures import ThreadPoolExecutor

    inp = multi_job_input()
    bad_routes = inp.tensors[0].array.copy()
    bad_routes[5, 100, 3] = 64
    bad = fmt.ArtifactInput(inp.token_ids, inp.prompt_token_count, inp.contents, inp.sections,
                            [fmt.TensorPart("moe_routes.expert_ids", bad_routes), inp.tensors[1]], inp.header)

    def one(k: int) -> str:
        if k % 4 == 3:
            with pytest.raises(ArtifactFormatError, match="expert"):
                fmt.encode(bad)
            return "refused"
        return fmt.encode(multi_job_input()).sha256

    with ThreadPoolExecutor(8) as ex:
        out = list(ex.map(one, range(16), timeout=120))
    assert out == ["refused" if k % 4 == 3 else GOLDEN_MULTI_JOB_SHA256 for k in range(16)]
    # eight concurrent frames needed up to eight compressors; only a bounded few stay idle (each ~13-20 MiB)
    assert 1 <= len(fmt._IDLE_COMPRESSORS[(fmt.ZSTD_LEVEL, fmt.ENCODE_THREADS)]) <= fmt.MAX_IDLE_MT_COMPRESSORS


def test_frame_does_not_depend_on_how_the_body_is_split():
    """The encoder streams the body's pieces (length, manifest, padding, each tensor) without assembling it; the
    format defines the frame as streaming the whole body (docs/format.md). That holds only because libzstd's
    multi-threaded streaming compressor cuts its input into jobs of a fixed size, whatever the calls: pinned here
    for the installed zstd, on random splits."""
    enc = fmt.encode(multi_job_input())
    body = zstandard.ZstdDecompressor().decompress(enc.data[fmt.PRELUDE_SIZE:])
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True, write_checksum=False, threads=1)
    rng = np.random.default_rng(7)
    for n_cuts in (0, 1, 17, 300):
        cuts = [0, *sorted(rng.integers(1, len(body), size=n_cuts).tolist()), len(body)]
        sink = fmt._HashingSink(b"")
        w = fmt._frame_pieces(cctx, [body[a:b] for a, b in zip(cuts, cuts[1:], strict=False)], len(body), sink)
        w.flush(zstandard.FLUSH_FRAME)
        assert sink.object.getvalue() == enc.data[fmt.PRELUDE_SIZE:], n_cuts


def test_encoder_does_not_copy_or_alter_the_callers_tensors():
    inp = large_input()
    before = [t.array.copy() for t in inp.tensors]
    writeable = [t.array.flags.writeable for t in inp.tensors]
    fmt.encode(inp)
    assert all(np.array_equal(a, t.array) for a, t in zip(before, inp.tensors, strict=True))
    assert [t.array.flags.writeable for t in inp.tensors] == writeable  # read-only views, not the caller's flags


# ------------------------------------------------------------------------------------------ compressor
@pytest.mark.fault("encoder", "per-thread compressor after a frame abandoned by a validation error")
def test_compressor_reused_after_an_abandoned_frame_gives_the_same_bytes():
    inp = multi_job_input()  # the frame is abandoned after all input went to zstd's worker
    bad_routes = inp.tensors[0].array.copy()
    bad_routes[5, 100, 3] = 64
    bad = fmt.ArtifactInput(inp.token_ids, inp.prompt_token_count, inp.contents, inp.sections,
                            [fmt.TensorPart("moe_routes.expert_ids", bad_routes), inp.tensors[1]], inp.header)
    for _ in range(2):
        with pytest.raises(fmt.ArtifactFormatError):
            fmt.encode(bad)
        assert fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256  # same thread, same compressor


@pytest.mark.fault("encoder", "encode re-entered in the same thread mid-frame")
def test_an_encode_reentered_mid_frame_does_not_corrupt_the_outer_frame(monkeypatch):
    """A second ``compressobj`` on the same ``ZstdCompressor`` silently corrupts the first, unfinished frame. An
    encode re-entered in the same thread (a signal handler, a finalizer) must therefore not get the compressor
    of the encode it interrupted."""
    real = fmt._frame_pieces
    inner: list[str] = []

    class Reentering:
        def __init__(self, sink):
            self.sink = sink

        def check_process(self):
            self.sink.check_process()

        def write(self, piece):
            n = self.sink.write(piece)
            if not inner:  # once, mid-frame (the first output piece of a multi-job body)
                inner.append("")
                inner[0] = fmt.encode(multi_job_input()).sha256
            return n

    def frame_pieces(cctx, pieces, size, sink):
        return real(cctx, pieces, size, Reentering(sink))

    monkeypatch.setattr(fmt, "_frame_pieces", frame_pieces)
    assert fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256
    assert inner == [GOLDEN_MULTI_JOB_SHA256]


def _fork_and_encode() -> int | str:
    """Fork; the child encodes ``multi_job_input()`` and exits 0 when it got the pinned bytes."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            signal.alarm(20)
            code = 0 if fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256 else 4
        finally:
            os._exit(code)
    return wait_child(pid)


@pytest.mark.fault("encoder", "fork after multi-threaded encodes in this and other threads (zstd workers not forked)")
def test_a_forked_child_encodes_after_the_parents_large_encodes():
    """The child of a process whose threads (this one, and a finished pool thread: its thread-local data is
    cleared in the child right after the fork) made multi-threaded frames encodes to the same bytes and does not
    wait for zstd workers that only the parent has."""
    from concurrent.futures import ThreadPoolExecutor

    assert fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256
    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(lambda: fmt.encode(multi_job_input()).sha256).result() == GOLDEN_MULTI_JOB_SHA256
        assert _fork_and_encode() == 0  # the pool thread is still alive in the parent here


@pytest.mark.fault("encoder", "forked child that exits normally: interpreter shutdown frees inherited compressors")
def test_a_forked_child_that_exits_normally_does_not_hang_in_shutdown():
    """A child that ends through interpreter shutdown (not ``os._exit``) frees its module globals: the parent's
    idle multi-threaded compressors must not be among them (freeing one joins zstd workers the child lacks)."""
    import subprocess
    import sys
    from pathlib import Path

    script = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_format import multi_job_input, GOLDEN_MULTI_JOB_SHA256
from genartifact import format as fmt
assert fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256
pid = os.fork()
if pid == 0:
    ok = fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256
    sys.exit(0 if ok else 4)  # normal shutdown
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit(7)  # the child hung
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])


@pytest.mark.fault("encoder", "fork while another thread is inside a multi-threaded encode")
def test_a_fork_during_another_threads_large_encode_leaves_a_working_child():
    stop = threading.Event()
    shas: list[str] = []

    def loop() -> None:
        while not stop.is_set():
            shas.append(fmt.encode(multi_job_input()).sha256)

    t = threading.Thread(target=loop)
    t.start()
    try:
        time.sleep(0.05)
        codes = [_fork_and_encode() for _ in range(3)]
    finally:
        stop.set()
        t.join()
    assert codes == [0, 0, 0]
    assert shas and set(shas) == {GOLDEN_MULTI_JOB_SHA256}


@pytest.mark.fault("encoder", "tensor names: every code point, empty, dots/underscores only, 128/129 chars")
def test_tensor_name_check_accepts_exactly_what_the_per_character_rule_does():
    """``_check_name`` was rewritten for speed (strip ``.``/``_``, one ``str.isalnum``); it must accept and reject
    exactly what the defining per-character rule does: 1..128 characters, each ``str.isalnum()`` or ``.``/``_``."""
    import sys

    def rule(name: str) -> bool:
        return 0 < len(name) <= 128 and all(c.isalnum() or c in "._" for c in name)

    def check(name: str) -> bool:
        try:
            fmt._check_name(name)
            return True
        except ArtifactFormatError:
            return False

    fixed = ["", ".", "_", "._", "." * 128, "_" * 129, "a" * 128, "a" * 129, "x." + "_" * 126, "1", "a b", "a\x00",
             "a-b", "a/b", "ä", "٣", "Ⅷ", "²", "a\u0301", "\U0001d7d8"]
    mismatched = [n for n in fixed if rule(n) != check(n)]
    for cp in range(sys.maxunicode + 1):  # every code point alone (the rule is per character) ...
        c = chr(cp)
        if rule(c) != check(c):
            mismatched.append(c)
    for cp in range(0, sys.maxunicode + 1, 97):  # ... and a spread of them among dots, underscores, at 128 chars
        c = chr(cp)
        for n in ("a." + c + "_", "_" * 127 + c, "." * 128 + c):
            if rule(n) != check(n):
                mismatched.append(n)
    assert mismatched == []
