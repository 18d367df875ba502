"""``generation_artifact_v1``: encoder and strict, bounded reader.

The byte layout is specified in ``docs/format.md``; this module is its reference implementation.

Object = 16-byte prelude (uncompressed) + exactly one zstd frame that declares its content size.
The decompressed *body* is::

    u32 LE manifest_length | manifest (canonical JSON, ASCII) | zero padding to 64 | payload

The payload holds every tensor listed in ``manifest["tensors"]``, little-endian, C order, each starting
at the next multiple of 64 bytes (relative to the body start) after the previous one, padding bytes zero.
Offsets are relative to the payload start. The manifest is the single source of truth: a reader
recomputes the canonical placement and rejects anything else (overlap, gap, trailing bytes).

Only ``numpy`` and ``zstandard`` are imported here: the reader runs without an engine.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

from genartifact.errors import ArtifactFormatError, PluginFault

FORMAT_NAME = "generation_artifact_v1"
MAGIC = b"GENART\x00\x01"
MAJOR = 1
MINOR = 0
CODEC_ZSTD = 1
CODECS = {"zstd": CODEC_ZSTD}
PRELUDE = struct.Struct("<8sHHB3x")  # magic, major, minor, codec, 3 reserved zero bytes
PRELUDE_SIZE = PRELUDE.size  # 16
ALIGN = 64
ZSTD_LEVEL = 1

#: Hard ceilings of the reader (bytes). The decoded limit may be lowered by the caller, never raised.
MAX_MANIFEST_BYTES = 1 << 20
MAX_DECODED_BYTES = 64 << 20

#: dtype codes stored in the manifest -> numpy little-endian dtype
DTYPES: dict[str, np.dtype[Any]] = {
    "u8": np.dtype("<u1"),
    "u16": np.dtype("<u2"),
    "u32": np.dtype("<u4"),
    "i32": np.dtype("<i4"),
    "i64": np.dtype("<i8"),
    "f32": np.dtype("<f4"),
}
_CODE_OF = {v: k for k, v in DTYPES.items()}


def align_up(n: int, a: int = ALIGN) -> int:
    """Round ``n`` (bytes) up to the next multiple of ``a``."""
    return (n + a - 1) // a * a


def zstd_compress_bound(n: int) -> int:
    """Worst-case size in bytes of a zstd frame holding ``n`` bytes (``ZSTD_COMPRESSBOUND`` of zstd.h,
    plus the maximal 18-byte frame header and 4-byte checksum)."""
    margin = ((128 << 10) - n) >> 11 if n < (128 << 10) else 0
    return n + (n >> 8) + margin + 18 + 4


def encoded_size_bound(decoded_bytes: int) -> int:
    """Conservative upper bound (bytes) of the stored object for a body of ``decoded_bytes``."""
    return PRELUDE_SIZE + zstd_compress_bound(decoded_bytes)


# One encoder for every canonical serialization: ``json.dumps`` with options other than its defaults builds a new
# ``JSONEncoder`` per call (~4 us of a 13 us manifest on the 2026-12-05 AMX box; four calls per artifact request).
# The encoder holds no per-call state (``encode`` makes a fresh C encoder each time), so sharing it across threads
# is safe.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def canonical_json(obj: Any) -> bytes:
    """Canonical manifest bytes: sorted keys, no whitespace, ASCII only, no NaN/Infinity
    (``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)``).
    Raises :class:`ArtifactFormatError` for values JSON cannot carry (NaN, infinities, non-JSON types)."""
    try:
        return _CANONICAL.encode(obj).encode()
    except (ValueError, TypeError, RecursionError) as e:
        raise ArtifactFormatError(f"manifest value not representable in canonical JSON: {e}") from None


def route_dtype_code(max_expert_count: int) -> str:
    """Compact dtype code for expert ids: ``u8`` when every router has at most 256 experts, else ``u16``
    (the vLLM AuxOutput convention, ``routed_experts_capturer.py``). Raises ``ValueError`` above 65536."""
    if max_expert_count <= 256:
        return "u8"
    if max_expert_count <= 65536:
        return "u16"
    raise ValueError(f"expert count {max_expert_count} exceeds 65536; allowed: 1..65536")


@dataclass(frozen=True)
class TensorPart:
    """One named tensor contributed to the payload by a content plugin.

    ``array`` must already have its canonical dtype (one of ``DTYPES``); it is written little-endian,
    C order. ``name`` is ``"<content>.<tensor>"`` (e.g. ``"moe_routes.expert_ids"``) or ``"token_ids"``.
    """

    name: str
    array: np.ndarray


@dataclass
class ArtifactInput:
    """Everything the encoder needs.

    ``token_ids``: ``uint32 [prompt_token_count + completion_token_count]`` — prompt then completion; the
    alignment authority for every other tensor. ``sections``: per content name, the manifest section
    (JSON-compatible dict). ``tensors``: the content tensors, in manifest order (sorted by name by the
    encoder). ``header``: engine/model/sampling metadata (JSON-compatible).
    """

    token_ids: np.ndarray
    prompt_token_count: int
    contents: Sequence[str]
    sections: Mapping[str, Mapping[str, Any]]
    tensors: Sequence[TensorPart]
    header: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EncodedArtifact:
    """Encoded object: the exact bytes to store, their length (bytes) and SHA-256 (hex)."""

    data: bytes
    byte_count: int
    sha256: str
    decoded_bytes: int


def _check_name(name: str) -> None:
    rest = name.replace(".", "").replace("_", "")  # every other character must be alphanumeric (str.isalnum)
    if not name or len(name) > 128 or (rest and not rest.isalnum()):
        raise ArtifactFormatError(f"tensor name {name!r} invalid: 1..128 characters, each a letter or digit "
                                  f"(any script, str.isalnum) or '.' or '_'")


def _layout(tensors: Sequence[TensorPart]) -> tuple[list[dict[str, Any]], int]:
    refs, pos = [], 0
    for t in tensors:
        a = t.array
        code = _CODE_OF.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
        if code is None:
            raise ArtifactFormatError(
                f"tensor {t.name!r} dtype {a.dtype} not allowed; allowed: {sorted(DTYPES)}"
            )
        pos = align_up(pos)
        refs.append({"name": t.name, "dtype": code, "shape": list(a.shape), "offset": pos, "byte_count": a.nbytes})
        pos += a.nbytes
    return refs, pos


def build_manifest(inp: ArtifactInput) -> tuple[dict[str, Any], list[TensorPart]]:
    """Validate ``inp`` and return the manifest dict and the tensors in payload order."""
    tok = np.asarray(inp.token_ids)
    if tok.ndim != 1 or tok.dtype.kind not in "iu":
        raise ArtifactFormatError("token_ids must be a 1-D integer array")
    # (an unsigned dtype of at most 4 bytes, as every session's uint32 buffer, cannot hold an id out of range)
    if tok.size and not (tok.dtype.kind == "u" and tok.dtype.itemsize <= 4) and (
            int(tok.min()) < 0 or int(tok.max()) > 0xFFFFFFFF):
        raise ArtifactFormatError("token_ids out of range: allowed 0..2**32-1")
    if not 0 <= inp.prompt_token_count <= tok.size:
        raise ArtifactFormatError(
            f"prompt_token_count {inp.prompt_token_count} out of range: allowed 0..{tok.size}"
        )
    contents = sorted(inp.contents)
    if len(set(contents)) != len(contents):
        raise ArtifactFormatError(f"contents has duplicates: {list(inp.contents)}")
    if sorted(inp.sections) != contents:
        raise ArtifactFormatError(f"sections {sorted(inp.sections)} do not match contents {contents}")
    parts = [TensorPart("token_ids", tok.astype("<u4", copy=False))]
    for t in sorted(inp.tensors, key=lambda p: p.name):
        _check_name(t.name)
        if t.name.split(".", 1)[0] not in contents:
            raise ArtifactFormatError(f"tensor {t.name!r} does not belong to any content in {contents}")
        parts.append(t)
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise ArtifactFormatError(f"duplicate tensor names: {names}")
    refs, _ = _layout(parts)
    manifest = {
        "format": FORMAT_NAME,
        "version": [MAJOR, MINOR],
        "prompt_token_count": int(inp.prompt_token_count),
        "completion_token_count": int(tok.size - inp.prompt_token_count),
        "contents": contents,
        "header": dict(inp.header),
        "sections": {k: dict(inp.sections[k]) for k in contents},
        "tensors": refs,
    }
    return manifest, parts


def encode(inp: ArtifactInput, *, level: int = ZSTD_LEVEL, readers: Mapping[str, Any] | None = None) -> EncodedArtifact:
    """Encode ``inp`` to ``generation_artifact_v1`` bytes.

    Deterministic: the same input gives the same bytes (and SHA-256). Each content's reader validates its
    section and tensors here too (``readers``: content name -> reader, else looked up by
    :func:`genartifact.readers.reader_for`), so an object that would not read back is never produced. Raises
    :class:`ArtifactFormatError` on invalid input, a content without a reader, or when the decoded body would
    exceed :data:`MAX_DECODED_BYTES`.
    """
    manifest, parts = build_manifest(inp)
    mbytes = canonical_json(manifest)
    if len(mbytes) > MAX_MANIFEST_BYTES:
        raise ArtifactFormatError(f"manifest is {len(mbytes)} bytes; limit {MAX_MANIFEST_BYTES}")
    head = 4 + len(mbytes)
    payload_start = align_up(head)
    refs = manifest["tensors"]
    payload_len = refs[-1]["offset"] + refs[-1]["byte_count"]
    total = payload_start + payload_len
    if total > MAX_DECODED_BYTES:
        raise ArtifactFormatError(f"decoded artifact is {total} bytes; limit {MAX_DECODED_BYTES}")
    # The body is never assembled: its pieces (length, manifest, zero padding, each tensor's little-endian bytes)
    # go to zstd's streaming compressor in order, and the readers validate the stored-dtype arrays directly.
    pieces: list[Any] = [struct.pack("<I", len(mbytes)), mbytes]
    views: dict[str, np.ndarray] = {}
    pos = head
    for ref, part in zip(refs, parts, strict=True):
        o = payload_start + ref["offset"]
        if o > pos:
            pieces.append(bytes(o - pos))
        arr = _stored(part.array, DTYPES[ref["dtype"]], ref["shape"])
        views[ref["name"]] = arr
        pieces.append(arr.reshape(-1).view(np.uint8).data if arr.size else b"")
        pos = o + ref["byte_count"]
    if pos != total:  # pragma: no cover - build_manifest lays tensors out back to back
        raise ArtifactFormatError(f"tensor layout covers {pos} of {total} body bytes")
    data, digest = _compress_and_hash(pieces, total, level,
                                      lambda: _validate_contents(manifest, views, readers, plugin_faults=True))
    return EncodedArtifact(data=data, byte_count=len(data), sha256=digest, decoded_bytes=total)


def _stored(a: np.ndarray, dt: np.dtype[Any], shape: Sequence[int]) -> np.ndarray:
    """``a`` as the stored tensor: C-contiguous, dtype ``dt`` (little-endian), ``shape``; read-only. ``a`` itself
    (no copy) when it already is all of that, else a converted copy (``same_kind`` casting, as ``np.copyto``)."""
    if a.dtype == dt and a.flags.c_contiguous and tuple(a.shape) == tuple(shape):
        out = a.view()
    else:
        out = np.empty(tuple(shape), dt)
        np.copyto(out, a, casting="same_kind")
    out.flags.writeable = False
    return out


def _frame_pieces(cctx: Any, pieces: Sequence[Any], size: int, sink: Any) -> Any:
    """Stream the body given as ``pieces`` (bytes-like, in order, ``size`` bytes in all) into a zstd frame with its
    content size declared (``ZSTD_compressStream2``: ``ZSTD_e_continue`` per input piece of at most
    :data:`ENCODE_CHUNK_BYTES`), passing each output piece (about 128 KiB, ``ZSTD_CStreamOutSize``) to
    ``sink.write`` in order (``sink.check_process()`` before each input chunk); returns the stream writer, whose ``flush(zstandard.FLUSH_FRAME)`` (``ZSTD_e_end``)
    writes the frame's last pieces. Ending with a separate ``ZSTD_e_end`` call, never with a single ``ZSTD_e_end``
    call holding all input, keeps libzstd off its one-pass shortcut, which does not follow the multi-threaded
    streaming output (facebook/zstd#2327). With ``cctx`` from :func:`_compressor` the frame does not depend on how
    the body is split into pieces, nor on the number of worker threads (pinned by ``core/tests/test_format.py``):
    it is the frame that ``docs/format.md`` defines."""
    w = cctx.stream_writer(sink, size=size, closefd=False)
    try:
        for piece in pieces:
            mv = memoryview(piece)
            for i in range(0, len(mv), ENCODE_CHUNK_BYTES):
                sink.check_process()
                w.write(mv[i : i + ENCODE_CHUNK_BYTES])
    except BaseException:
        # a traceback kept by the caller must not keep the compressor alive (see _compress_and_hash)
        cctx = w = None
        raise
    return w


class _HashingSink:
    """Where the frame's output pieces go (:func:`_frame_pieces`): each is hashed (SHA-256, after the prelude)
    and appended to the object while it is still in the CPU cache. ``io.BytesIO.getvalue()`` hands over its
    buffer without a copy.

    ``pid``: the process that started the frame. A process forked from inside this frame (by code that runs during
    it: a validator, a signal handler, a finalizer) has the compressor but not its zstd worker threads; going on
    with the frame there would wait forever for them, so :meth:`check_process` (called before each input chunk,
    each output piece and the frame's end) raises ``RuntimeError`` in such a child instead."""

    def __init__(self, prelude: bytes, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.hash = hashlib.sha256(prelude)
        self.object = io.BytesIO()
        self.object.write(prelude)

    def check_process(self) -> None:
        """Raise ``RuntimeError`` when this is not the process that started the frame (see the class)."""
        if os.getpid() != self.pid:
            raise RuntimeError("genartifact encode: this process was forked in the middle of a zstd frame; "
                               "the frame cannot be finished here (its zstd worker threads stayed in the parent)")

    def write(self, piece: Any) -> int:
        self.check_process()
        self.hash.update(piece)
        return self.object.write(piece)


#: idle compressors of this process by ``(level, zstd worker threads)``, guarded by :data:`_IDLE_LOCK`
_IDLE_COMPRESSORS: dict[tuple[int, int], list[Any]] = {}
#: held only around a ``list`` pop or bounded append (no allocation of a compressor, no call out); made anew in a
#: forked child (:func:`_after_fork_in_child`), where a fork from another thread may have left it held
_IDLE_LOCK = threading.Lock()
#: idle compressors kept per level: single-threaded ones (a few hundred KiB each) and multi-threaded ones (an idle
#: one keeps its zstd worker and job buffers: about 13-20 MiB after a 12.8 MB frame); more concurrent encodes make
#: their own and free them after
MAX_IDLE_COMPRESSORS = 8
MAX_IDLE_MT_COMPRESSORS = 2


def _compressor(level: int, threads: int) -> Any:
    """Take an idle ``ZstdCompressor`` for ``level`` with ``threads`` zstd worker threads (content size written,
    no zstd checksum), making one when none is idle; give it back with :func:`_return_compressor` once its frame
    is done. Building one costs about as much as compressing a small artifact, and a new multi-threaded one
    faults in fresh job buffers (about 15 % of a 12.8 MB encode). A compressor serves one frame at a time:
    python-zstandard's objects are not for concurrent use, and a second ``compressobj`` on the same compressor
    silently corrupts the first, unfinished frame. Taken out while in use, a compressor is never shared: not
    across threads, nor by an encode re-entered in the same thread (a signal handler or finalizer that encodes
    gets another one). Reuse does not change the frame: every frame starts fresh. Only compressors whose last
    frame was finished come back; one whose frame was abandoned is dropped (:func:`_compress_and_hash`).

    Process-wide, not per thread, because of fork: a multi-threaded compressor owns zstd worker threads that a
    forked child does not have, and freeing one there joins them, which waits forever. The child's interpreter
    frees other threads' thread-local data right after the fork, so a per-thread cache would hang every child
    of a process whose pool threads had encoded; this cache is instead emptied in the child without freeing
    (:func:`_after_fork_in_child`)."""
    with _IDLE_LOCK:
        idle = _IDLE_COMPRESSORS.get((level, threads))
        if idle:
            return idle.pop()
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False, threads=threads)


def _return_compressor(level: int, threads: int, c: Any) -> None:
    """Give ``c`` (taken by :func:`_compressor`, its last frame finished) back to the idle cache, or let it be freed
    when :data:`MAX_IDLE_COMPRESSORS` / :data:`MAX_IDLE_MT_COMPRESSORS` of its kind are already idle."""
    with _IDLE_LOCK:
        idle = _IDLE_COMPRESSORS.setdefault((level, threads), [])
        if len(idle) < (MAX_IDLE_COMPRESSORS if threads == 0 else MAX_IDLE_MT_COMPRESSORS):
            idle.append(c)
            return
    # freed here, outside the lock: freeing a multi-threaded one joins its zstd workers


def _leak(objs: list[Any]) -> None:
    """Keep ``objs`` alive until this process ends, interpreter shutdown included: each gets one reference that
    nothing owns (CPython's ``Py_IncRef``). For compressors inherited over a fork, whose freeing would wait
    forever for zstd worker threads that exist only in the parent."""
    if objs:
        import ctypes

        for o in objs:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))


def _compress_and_hash(pieces: Sequence[Any], size: int, level: int, validate: Any) -> tuple[bytes, str]:
    """``(prelude + zstd frame of the body, SHA-256 hex of those bytes)``, after ``validate()`` returned; the body
    is ``pieces`` (``size`` bytes, see :func:`_frame_pieces`).

    Bodies of more than 512 KiB are compressed by libzstd's worker thread(s) (:data:`ENCODE_THREADS`), while this
    thread copies the input in, hashes each output piece as it arrives, appends it to the object, and — once
    all input is in — runs ``validate()`` (the content readers' checks) while the workers finish the last jobs.
    Compression and hashing therefore overlap: on this project's 2-core box encode + SHA-256 is faster than one
    single-threaded zstd call followed by a hash of its frame (``benchmarks/bench_encode.py``). Smaller bodies
    are compressed in this thread with a single-threaded compressor, which writes the same frame (libzstd does
    not start workers for them, :data:`ZSTDMT_JOBSIZE_MIN`); below :data:`ONE_SHOT_BELOW_BYTES`, in one call.
    Pieces that do not hold exactly ``size`` bytes (an array whose ``nbytes`` lies about its data) raise
    :class:`ArtifactFormatError` on every path (the streamed frame's declared size refused them with a zstd
    error, an ``internal_error`` receipt instead of ``encode_failed``). ``validate`` raising drops the frame: nothing is
    returned, and no zstd worker is left reading the inputs (input is copied into zstd's own job buffers)."""
    held = sum(memoryview(p).nbytes for p in pieces)
    if held != size:  # an array whose nbytes lies: refused alike on both paths, before a compressor is taken
        raise ArtifactFormatError(f"body pieces hold {held} bytes; the manifest lays out {size}")
    threads = 0 if size <= ZSTDMT_JOBSIZE_MIN else ENCODE_THREADS
    pid = os.getpid()
    cctx = _compressor(level, threads)
    try:
        if size < ONE_SHOT_BELOW_BYTES:
            out = _compress_and_hash_small(cctx, pieces, validate)
        else:
            out = _compress_and_hash_with(cctx, pieces, size, validate, pid)
    except BaseException:
        # An abandoned frame's compressor is never reused: libzstd's multi-threaded context, abandoned after some
        # but not all input (an error in a sink write or an input chunk), crashes (SIGSEGV) in the next frame's
        # first call. It is dropped here, in this frame, not by whoever keeps the traceback: freed now when this
        # is still the process that took it (its zstd workers are joined), kept alive forever in a process forked
        # mid-frame (freeing it there would wait for workers that stayed in the parent).
        if pid != os.getpid():
            _leak([cctx])
        cctx = None
        raise
    _return_compressor(level, threads, cctx)
    return out


#: bodies below this many bytes are compressed in one call (:func:`_compress_and_hash_small`). Below it the one-shot
#: frame is the streamed one, byte for byte (swept: every size 2**k +- 1 and 3,000 random sizes up to 512 KiB at
#: levels 1 and 3; 256-512 KiB at levels 9 and 19); at exactly 256 KiB and 512 KiB libzstd's one-shot frame is
#: 3 bytes shorter than the streamed one, so those sizes, and everything from 256 KiB up, keep the streamed procedure
ONE_SHOT_BELOW_BYTES = 256 << 10


def _compress_and_hash_small(cctx: Any, pieces: Sequence[Any], validate: Any) -> tuple[bytes, str]:
    """:func:`_compress_and_hash` of a body of fewer than :data:`ONE_SHOT_BELOW_BYTES` bytes with the single-threaded
    compressor ``cctx``: the pieces joined, ``validate()``, one ``ZSTD_compress2`` (python-zstandard's
    ``compress``: the content size declared), then one SHA-256 of prelude + frame. The same frame as the streamed
    procedure of :func:`_frame_pieces` (pinned by ``core/tests/test_format.py::
    test_small_body_one_shot_frame_is_the_streamed_frame``) for less of its fixed cost: no stream writer (whose
    128 KiB output buffer is allocated per frame), no sink, no per-piece calls. The
    per-request artifacts of a run are all this size (a 64-token request with both built-in contents: ~2 KiB),
    and their encode runs on the driver's event loop (docs/benchmarks.md, issue 13). ``validate`` raising
    returns nothing; no zstd worker thread is involved, so a fork cannot strand one. The caller has checked that the
    pieces hold the manifest's layout: the one-call frame declares the size it is given."""
    body = b"".join(pieces)
    validate()
    data = PRELUDE.pack(MAGIC, MAJOR, MINOR, CODEC_ZSTD) + cctx.compress(body)
    return data, hashlib.sha256(data).hexdigest()


def _compress_and_hash_with(cctx: Any, pieces: Sequence[Any], size: int, validate: Any,
                            pid: int | None = None) -> tuple[bytes, str]:
    """:func:`_compress_and_hash` with the compressor ``cctx`` (in this thread's sole use until it returns), for a
    frame started in process ``pid`` (default: this one)."""
    sink = _HashingSink(PRELUDE.pack(MAGIC, MAJOR, MINOR, CODEC_ZSTD), pid)
    w = None
    try:
        w = _frame_pieces(cctx, pieces, size, sink)
        validate()
        sink.check_process()
        w.flush(zstandard.FLUSH_FRAME)
    except BaseException:
        cctx = w = None  # see _compress_and_hash: the traceback must not own the compressor
        raise
    return sink.object.getvalue(), sink.hash.hexdigest()


# ----------------------------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class Artifact:
    """A decoded, validated artifact. Arrays are read-only zero-copy views into the decoded body.

    ``token_ids``: ``uint32 [P + C]``. :meth:`content` gives a content's typed view (from its plugin's reader);
    :meth:`routes` (``[rows, routers, top_k]``) and :meth:`selected_logprobs` (``float32 [C]``) are shortcuts
    to the built-in contents' tensors.
    """

    manifest: dict[str, Any]
    tensors: dict[str, np.ndarray]
    sha256: str
    byte_count: int
    readers: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def _reader(self, name: str) -> Any:
        """The content's reader, isolated (:class:`genartifact.host.GuardedReader`): a reader that raises or
        returns a wrong value becomes a :class:`~genartifact.errors.PluginFault` naming its plugin."""
        from genartifact.host import guard_reader
        from genartifact.readers import reader_for

        return guard_reader(self.readers.get(name) or reader_for(name), None, name)

    @property
    def contents(self) -> list[str]:
        return list(self.manifest["contents"])

    @property
    def token_ids(self) -> np.ndarray:
        return self.tensors["token_ids"]

    @property
    def prompt_token_count(self) -> int:
        return int(self.manifest["prompt_token_count"])

    @property
    def completion_token_count(self) -> int:
        return int(self.manifest["completion_token_count"])

    @property
    def completion_token_ids(self) -> np.ndarray:
        return self.token_ids[self.prompt_token_count :]

    def routes(self) -> np.ndarray:
        """Expert ids as ``[rows, routers, top_k]`` (uint8/uint16), row *i* = routing of the token at
        absolute position ``token_start + i`` when fed as input; vLLM's top-k order is preserved.
        A zero-copy transposed view of the stored router-major ``[routers, rows, top_k]`` tensor.
        Raises ``KeyError`` when the artifact has no ``moe_routes``."""
        return self.tensors["moe_routes.expert_ids"].transpose(1, 0, 2)

    def selected_logprobs(self) -> np.ndarray:
        """``float32 [completion_token_count]``: logprob of each sampled token. ``KeyError`` if absent."""
        return self.tensors["selected_logprobs.logprobs"]

    def content(self, name: str) -> Any:
        """The typed view of content ``name`` from its reader's optional ``view(manifest, section, tensors)``
        (else the dict of its tensors). Raises ``KeyError`` when the artifact has no such content."""
        if name not in self.manifest["sections"]:
            raise KeyError(name)
        own = {k: v for k, v in self.tensors.items() if k.split(".", 1)[0] == name}
        reader = self._reader(name)
        return reader.view(self.manifest, self.manifest["sections"][name], own) if reader is not None else own

    def content_summary(self, name: str) -> dict[str, Any]:
        """Content ``name``'s reader ``summary(manifest, section, tensors)`` (JSON-compatible); without an
        installed reader ``{"tensors": [names]}``. Raises :class:`~genartifact.errors.PluginFault` (naming the
        plugin) when the reader raises or returns a non-JSON value; ``KeyError`` for an absent content."""
        if name not in self.manifest["sections"]:
            raise KeyError(name)
        own = {k: v for k, v in self.tensors.items() if k.split(".", 1)[0] == name}
        reader = self._reader(name)
        if reader is None:
            return {"tensors": sorted(own)}
        return reader.summary(self.manifest, self.manifest["sections"][name], own)

    def summary(self) -> dict[str, Any]:
        """Per content name :meth:`content_summary` (raises the first reader's
        :class:`~genartifact.errors.PluginFault`; ``genartifact inspect`` isolates them per content)."""
        return {name: self.content_summary(name) for name in self.manifest["contents"]}

    def to_torch(self, name: str) -> Any:
        """Tensor ``name`` as a ``torch.Tensor`` (copy; torch needs writable memory). Imports torch lazily."""
        import torch

        return torch.from_numpy(np.array(self.tensors[name]))


def _fail(msg: str) -> ArtifactFormatError:
    return ArtifactFormatError(msg)


def read_prelude(data: bytes | memoryview) -> None:
    """Check the 16-byte prelude; raises :class:`ArtifactFormatError` naming the bad field."""
    if len(data) < PRELUDE_SIZE:
        raise _fail(f"truncated: {len(data)} bytes, prelude needs {PRELUDE_SIZE}")
    magic, major, minor, codec = PRELUDE.unpack_from(data, 0)
    if magic != MAGIC:
        raise _fail(f"bad magic {magic!r}; expected {MAGIC!r}")
    if major != MAJOR:
        raise _fail(f"unsupported major version {major}; supported: {MAJOR}")
    if minor > MINOR:
        raise _fail(f"unsupported minor version {minor}; supported: <= {MINOR}")
    if codec != CODEC_ZSTD:
        raise _fail(f"unsupported codec {codec}; supported: {CODEC_ZSTD} (zstd)")
    if bytes(data[13:16]) != b"\x00\x00\x00":
        raise _fail("reserved prelude bytes must be zero")


MAX_OBJECT_BYTES = encoded_size_bound(MAX_DECODED_BYTES)


def decode(data: bytes | bytearray | memoryview, *, max_decoded_bytes: int | None = None,
           require_readers: bool = True, readers: Mapping[str, Any] | None = None) -> Artifact:
    """Decode and validate one object. Bounded: objects larger than the encoded bound of the decoded limit
    are refused, and the frame's declared content size is checked against the decoded limit before any
    allocation. The decoded limit is ``max_decoded_bytes``, else ``GENARTIFACT_MAX_DECODED_BYTES``, capped at
    :data:`MAX_DECODED_BYTES` (64 MiB).

    The generic envelope is checked here; each content's section and tensors are checked by its reader (the
    content plugin's ``genartifact_content_reader``; ``readers`` overrides the lookup). Built-in and third-party
    contents alike: a content whose reader is not installed fails unless ``require_readers=False``.

    Raises :class:`ArtifactFormatError` (never another exception type) for non-bytes input, bad
    magic/version/codec, truncation, a frame without a declared size, trailing data or extra frames, a
    malformed or non-canonical manifest, bad tensor placement, or a content its reader rejects (e.g.
    out-of-range expert ids, NaN/+inf logprobs).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ArtifactFormatError(f"data must be bytes-like, got {type(data).__name__}")
    if max_decoded_bytes is None:
        from genartifact.limits import max_decoded_bytes as env_limit

        try:
            max_decoded_bytes = env_limit()
        except ValueError as e:
            raise ArtifactFormatError(str(e)) from None
    limit = min(max_decoded_bytes, MAX_DECODED_BYTES)
    if len(data) > encoded_size_bound(limit):
        raise _fail(f"object is {len(data)} bytes; the largest valid object for a {limit}-byte body is "
                    f"{encoded_size_bound(limit)}")
    data = bytes(data)
    read_prelude(data)
    # hash while decompressing: SHA-256 of the exact stored bytes runs in a helper thread (hashlib and zstd
    # both release the GIL), so on two or more cores the digest costs no wall time
    digest = _hash_async(data)
    frame = memoryview(data)[PRELUDE_SIZE:]  # no copy of the compressed frame
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as e:
        raise _fail(f"invalid zstd frame header: {e}") from None
    size = params.content_size
    if size == zstandard.CONTENTSIZE_UNKNOWN or size == zstandard.CONTENTSIZE_ERROR:
        raise _fail("zstd frame does not declare its content size")
    if size > limit:
        raise _fail(f"declared decoded size {size} exceeds limit {limit}")
    if size < 4:
        raise _fail(f"declared decoded size {size} is shorter than the manifest length field")
    if params.dict_id != 0:
        raise _fail("zstd dictionaries are not allowed")
    end = _frame_end(frame, params.has_checksum)
    if end < len(frame):
        raise _fail(f"{len(frame) - end} bytes of trailing data after the zstd frame")
    body = _decompress_bounded(frame, size)
    try:
        manifest, payload_start = _parse_manifest(body)
        views = _views(manifest, memoryview(body), payload_start)
        _validate_contents(manifest, views, readers, require_readers=require_readers)
    except ArtifactFormatError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        # a safety net: every structural check below is explicit, but hostile manifests must never surface
        # as anything but a format error
        raise _fail(f"malformed manifest ({type(e).__name__})") from None
    return Artifact(manifest=manifest, tensors=views, sha256=digest(), byte_count=len(data),
                    readers=dict(readers or {}))


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: objects at least this large (bytes) are hashed in a helper thread during decompression; smaller ones inline.
#: Only with more than two usable CPUs: on a 2-core box shared with an engine the helper thread finds no free
#: core and the hand-off costs more than it saves (measured, ``benchmarks/bench_decode.py``).
PARALLEL_HASH_BYTES = 1 << 20 if _usable_cpus() > 2 else 1 << 62
#: zstd worker threads of the encoder's compressor for bodies over 512 KiB (``ZSTD_c_nbWorkers``): half the usable
#: CPUs, at least two, at most four. Two beat one on this project's 2-core box (the encoding thread's hashing and
#: copying leaves room: 1.09–1.14× against 1.06–1.08× of raw zstd-1 + SHA-256, ``benchmarks/bench_encode.py``);
#: past four, level-1 jobs of 2 MiB leave workers idle on typical artifacts. Not part of the format: libzstd's
#: multi-threaded streaming output is the same for every worker count >= 1 ("the multi-threaded output is the same
#: for any number of threads", facebook/zstd#2238), pinned by ``core/tests/test_format.py``.
ENCODE_THREADS = min(4, max(2, _usable_cpus() // 2))
#: libzstd compresses frames whose pledged size is at most this (``ZSTDMT_JOBSIZE_MIN`` of libzstd's
#: ``zstdmt_compress.h``, 512 KiB) in the calling thread even when workers are configured: such bodies are encoded
#: with a cached single-threaded compressor, which writes the very same frame
ZSTDMT_JOBSIZE_MIN = 512 << 10
#: input bytes fed to zstd's streaming compressor per call (:func:`_frame_pieces`); the frame does not depend on it
ENCODE_CHUNK_BYTES = 1 << 20
_HASH_POOL: Any = None
_HASH_POOL_LOCK = threading.Lock()


def _reset_hash_pool() -> None:
    """After fork, in the child: the child inherits the pool object but not its threads, and the pool's lock in
    whatever state it had at the fork (held, if another thread was creating the pool): both are made anew, or
    the child's first encode or decode of a large object would wait forever."""
    global _HASH_POOL, _HASH_POOL_LOCK
    _HASH_POOL = None
    _HASH_POOL_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """In a forked child: a new helper pool (:func:`_reset_hash_pool`), and the parent's idle compressors
    dropped from the cache without being freed (:func:`_leak`; see :func:`_compressor`)."""
    global _IDLE_LOCK
    _reset_hash_pool()
    _IDLE_LOCK = threading.Lock()
    inherited = [c for idle in _IDLE_COMPRESSORS.values() for c in idle]
    _leak(inherited)
    _IDLE_COMPRESSORS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _hash_async(data: bytes) -> Any:
    """A callable returning the SHA-256 hex digest of ``data``: computed in a helper thread (two at most,
    shared by all decodes of the process) for objects of at least :data:`PARALLEL_HASH_BYTES`, else inline."""
    if len(data) < PARALLEL_HASH_BYTES:
        h = hashlib.sha256(data).hexdigest()
        return lambda: h
    fut = _hash_pool().submit(lambda: hashlib.sha256(data).hexdigest())
    return fut.result


def _hash_pool() -> Any:
    """The process's helper threads for hashing during decode (two, created on first use, re-created after fork)."""
    global _HASH_POOL
    with _HASH_POOL_LOCK:
        if _HASH_POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _HASH_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="genartifact-sha256")
        return _HASH_POOL


def _frame_end(frame: bytes, has_checksum: bool) -> int:
    """Offset just past the zstd frame that starts ``frame``, found by walking its block headers (RFC 8878
    section 3.1.1.2: 3-byte header = last-block bit, type, size; a RLE block carries 1 byte, raw and compressed
    blocks carry ``size`` bytes; an optional 4-byte checksum follows the last block). Reads headers only, no
    decompression. Raises :class:`ArtifactFormatError` for a truncated frame or a reserved block type."""
    try:
        pos = zstandard.frame_header_size(frame)
    except zstandard.ZstdError as e:
        raise _fail(f"invalid zstd frame header: {e}") from None
    n = len(frame)
    while True:
        if pos + 3 > n:
            raise _fail("truncated zstd frame")
        hdr = int.from_bytes(frame[pos : pos + 3], "little")
        last, btype, bsize = hdr & 1, (hdr >> 1) & 3, hdr >> 3
        if btype == 3:
            raise _fail("corrupt zstd frame: reserved block type")
        if bsize > 128 << 10:
            raise _fail("corrupt zstd frame: block larger than 128 KiB")
        pos += 3 + (1 if btype == 1 else bsize)
        if pos > n:
            raise _fail("truncated zstd frame")
        if last:
            break
    if has_checksum:
        pos += 4
        if pos > n:
            raise _fail("truncated zstd frame")
    return pos


def _decompress_bounded(frame: bytes, size: int) -> bytes:
    """Decompress one frame into a buffer of exactly its declared ``size`` bytes (zstd one-shot decompression
    into a fixed-capacity destination): blocks that hold more than declared fail with "destination buffer is
    too small" after producing at most ``size`` bytes, so peak memory is ``size`` plus a constant whatever the
    blocks say (the streaming decoder checks the declared size only at the end of the frame)."""
    try:
        body = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as e:
        if "too small" in str(e):
            raise _fail(f"zstd frame holds more than its declared {size} bytes") from None
        raise _fail(f"corrupt zstd frame: {e}") from None
    if len(body) != size:
        raise _fail(f"decoded {len(body)} bytes but the frame declared {size}")
    return body


_MANIFEST_KEYS = {"format", "version", "prompt_token_count", "completion_token_count", "contents", "header", "sections", "tensors"}
_REF_KEYS = {"name", "dtype", "shape", "offset", "byte_count"}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_manifest(body: bytes) -> tuple[dict[str, Any], int]:
    if len(body) < 4:
        raise _fail("body shorter than its manifest length field")
    (mlen,) = struct.unpack_from("<I", body, 0)
    if mlen > MAX_MANIFEST_BYTES:
        raise _fail(f"manifest length {mlen} exceeds limit {MAX_MANIFEST_BYTES}")
    if 4 + mlen > len(body):
        raise _fail("manifest runs past the end of the body")
    raw = body[4 : 4 + mlen]
    try:
        manifest = json.loads(raw.decode("ascii"), parse_constant=lambda c: (_ for _ in ()).throw(_fail(f"manifest has {c}")))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(f"manifest is not ASCII JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise _fail("manifest must be a JSON object")
    if canonical_json(manifest) != raw:
        raise _fail("manifest is not canonical (sorted keys, compact separators, ASCII)")
    if set(manifest) != _MANIFEST_KEYS:
        raise _fail(f"manifest keys {sorted(manifest)}; expected {sorted(_MANIFEST_KEYS)}")
    for key, typ in (("header", dict), ("sections", dict), ("contents", list), ("tensors", list)):
        if not isinstance(manifest[key], typ):
            raise _fail(f"manifest {key} must be a JSON {'object' if typ is dict else 'array'}")
    if manifest["format"] != FORMAT_NAME or manifest["version"] != [MAJOR, MINOR]:
        raise _fail(f"manifest format/version {manifest['format']!r} {manifest['version']!r}; expected {FORMAT_NAME} [1, 0]")
    payload_start = align_up(4 + mlen)
    if any(body[4 + mlen : payload_start]):
        raise _fail("manifest padding bytes must be zero")
    refs = manifest["tensors"]
    if not isinstance(refs, list) or not refs or not all(isinstance(r, dict) and set(r) == _REF_KEYS for r in refs):
        raise _fail(f"manifest tensors must be a non-empty list of objects with keys {sorted(_REF_KEYS)}")
    for r in refs:
        if not isinstance(r["name"], str) or not isinstance(r["dtype"], str) or not _is_int(r["offset"]):
            raise _fail("tensor name and dtype must be strings and offset an integer")
        if not isinstance(r["shape"], list) or len(r["shape"]) > 8:
            raise _fail(f"tensor {r['name']!r} shape must be a list of at most 8 dimensions")
    names = [r["name"] for r in refs]
    if names[0] != "token_ids" or names[1:] != sorted(names[1:]) or len(set(names)) != len(names):
        raise _fail("tensors must start with token_ids followed by unique names in sorted order")
    pos = 0
    for r in refs:
        if r["dtype"] not in DTYPES:
            raise _fail(f"tensor {r['name']!r} dtype {r['dtype']!r}; allowed {sorted(DTYPES)}")
        shape = r["shape"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _fail(f"tensor {r['name']!r} shape {shape!r} invalid")
        expect_bytes = math.prod(shape) * DTYPES[r["dtype"]].itemsize
        # (zero dimensions left out: an empty tensor whose other dimensions no body could hold is refused too;
        # numpy cannot even shape one)
        if expect_bytes > len(body) or math.prod(d for d in shape if d) * DTYPES[r["dtype"]].itemsize > len(body):
            raise _fail(f"tensor {r['name']!r} shape {str(shape)[:120]} is larger than the body")
        if not _is_int(r["byte_count"]) or r["byte_count"] != expect_bytes:
            raise _fail(f"tensor {r['name']!r} byte_count {r['byte_count']!r} != shape x itemsize {expect_bytes}")
        pos = align_up(pos)
        if r["offset"] != pos:
            raise _fail(f"tensor {r['name']!r} offset {r['offset']!r}; canonical placement is {pos} (overlap or gap)")
        pos += expect_bytes
    if payload_start + pos != len(body):
        raise _fail(f"payload is {len(body) - payload_start} bytes but tensors cover {pos}")
    tok = refs[0]
    if tok["dtype"] != "u32" or len(tok["shape"]) != 1:
        raise _fail("token_ids must be u32 with rank 1")
    p, c = manifest["prompt_token_count"], manifest["completion_token_count"]
    if not (_is_int(p) and _is_int(c) and p >= 0 and c >= 0 and p + c == tok["shape"][0]):
        raise _fail("prompt_token_count + completion_token_count must equal len(token_ids)")
    contents = manifest["contents"]
    if not all(isinstance(c, str) for c in contents) or contents != sorted(set(contents)) \
            or sorted(manifest["sections"]) != contents:
        raise _fail("contents must be sorted unique strings matching the sections")
    for n in names[1:]:
        if n.split(".", 1)[0] not in contents:
            raise _fail(f"tensor {n!r} belongs to no declared content")
    return manifest, payload_start


def _views(manifest: dict[str, Any], body: memoryview, payload_start: int) -> dict[str, np.ndarray]:
    out = {}
    for r in manifest["tensors"]:
        dt = DTYPES[r["dtype"]]
        off = payload_start + r["offset"]
        if off % dt.itemsize:
            raise _fail(f"tensor {r['name']!r} misaligned")
        n = math.prod(r["shape"])
        a = np.frombuffer(body, dtype=dt, count=n, offset=off).reshape(r["shape"])
        a.flags.writeable = False
        out[r["name"]] = a
    return out


def _validate_contents(manifest: dict[str, Any], views: dict[str, np.ndarray],
                       readers: Mapping[str, Any] | None = None, *, require_readers: bool = True,
                       plugin_faults: bool = False) -> None:
    """Per-content semantic checks shared by encoder and reader, delegated to each content's reader (the
    content plugin's ``genartifact_content_reader`` hook, see :mod:`genartifact.readers`).

    Raises :class:`ArtifactFormatError` if a content's reader rejects its section/tensors, or, with
    ``require_readers``, if no reader is installed for a content (name and fix given). A reader that itself fails
    (raises anything but ``ArtifactFormatError``) is a plugin fault: with ``plugin_faults`` (encode) the
    :class:`~genartifact.errors.PluginFault` naming its plugin propagates (the request's receipt is
    ``internal_error``, not ``encode_failed``); otherwise (decode, which raises only format errors) it becomes an
    ``ArtifactFormatError`` that names the content, the plugin and the redacted error, chained to the plugin's
    exception (``genartifact --traceback`` shows where it raised)."""
    from genartifact.readers import reader_for

    for name in manifest["contents"]:
        section = manifest["sections"][name]
        if not isinstance(section, dict):
            raise _fail(f"section {name!r} must be a JSON object")
        reader = (readers or {}).get(name) or reader_for(name)
        if reader is None:
            if require_readers:
                raise _fail(f"no reader installed for content {name!r}: install the distribution that provides "
                            f"it (entry-point group genartifact.contents), or decode with require_readers=False "
                            f"(Python API) to check the envelope only")
            continue
        own = {k: v for k, v in views.items() if k.split(".", 1)[0] == name}
        try:
            reader.validate(manifest, section, own)
        except ArtifactFormatError:
            raise
        except PluginFault as e:  # a guarded reader: the fault names its plugin (and was logged as plugin_fault)
            if plugin_faults:
                raise
            raise _fail(f"content {name!r} reader failed: {e}") from e
        except Exception as e:  # noqa: BLE001 - an unguarded reader (registered in-process): still a format error
            from genartifact.host import redact

            raise _fail(f"content {name!r} reader failed: {type(e).__name__}: {redact(str(e))}") from e


def _dtype_of(manifest: dict[str, Any], name: str) -> str | None:
    for r in manifest["tensors"]:
        if r["name"] == name:
            return str(r["dtype"])
    return None
