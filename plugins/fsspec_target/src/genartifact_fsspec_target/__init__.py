"""``managed_fsspec``: deliver artifacts to a server-managed fsspec profile.

Server-side settings (config ``[targets.managed_fsspec]``)::

    [targets.managed_fsspec.profiles.local]
    url = "./artifacts"            # file://, memory://, s3:// or s3a:// root; relative = local path
    allowed_prefixes = ["runs/"]   # object keys must be at or under one of these
    max_bytes = 67108864           # optional, default and ceiling 64 MiB + format overhead
    storage_options = {}           # optional, passed to fsspec (credentials stay here, never in requests)
    timeout_s = 60.0               # whole delivery deadline (seconds)
    connect_timeout_s = 5.0        # object stores: TCP/TLS connect timeout
    read_timeout_s = 30.0          # object stores: per-read socket timeout
    max_attempts = 3               # object stores: total PutObject attempts (botocore "standard" mode)
    checksum = "when_required"     # S3: botocore request_checksum_calculation; "when_supported" adds
                                   # x-amz-checksum-crc32 (some S3-compatible stores reject it)

Profiles may also come from ``GENARTIFACT_STORAGE_PROFILES`` (a JSON object name -> profile, same keys),
merged over the config's profiles.

Request target: ``{"kind": "managed_fsspec", "profile": "local", "object_key": "runs/x/0001.gart"}``.
Receipt object id: ``"<profile>:<object_key>"``.

Create-only and all-or-nothing: local files are written unnamed (``O_TMPFILE``) in the destination directory
and published with ``linkat`` (atomic, fails if the key exists), so a crash leaves nothing; on a filesystem
without ``O_TMPFILE`` a hidden temp file (``.genartifact-tmp-*``) is written and linked instead, and a crash can
leave that one, which ``genartifact reconcile`` lists and removes (:meth:`ManagedFsspecTarget.leftovers`).
``memory://`` (one process's in-memory store) is made create-only atomic by a process-wide lock around the
existence check and the write (the store is only visible inside the process, so the lock covers every writer).
S3 (``s3://``, ``s3a://``) goes through one aiobotocore client per profile and event loop (created on first use,
closed when the loop shuts down its async generators): one ``PutObject`` with ``If-None-Match: *``
(conditional create; a second write of the key fails with 412 and is reported as ``object_exists``), never
multipart, and no flexible checksum header unless the profile asks for it (``checksum``). A 412 on the
delivery's first PUT is ``object_exists`` (the object was there before this delivery, even with identical
bytes: a duplicate request never reads as ready). When a *resent* PUT (botocore's ``RetryAttempts`` > 0) meets
412, the stored object's size is asked first (HEAD); only an object of exactly our size is read back, streamed
and hashed, never more than ``max_bytes``: identical SHA-256 means an earlier attempt of ours landed
(success), anything else is ``object_exists``. A 409 (a concurrent conditional write) is always
``object_exists``. ETags are never used as digests.

Default timeouts: connect 5 s (a healthy object store answers in milliseconds; a dead endpoint should fail
fast enough to leave retry budget), read 30 s (one 64 MiB PUT at >= 3 MB/s), whole delivery 60 s (bounds the
pipeline slot a delivery can hold), 3 attempts in botocore's standard mode (transient 5xx, throttling and
connection errors, with jittered exponential backoff). ``max_attempts`` is the total number of PutObject
attempts botocore makes (``total_max_attempts``, the first included); in addition aiohttp may resend a request
once on a reused keep-alive connection that the server closed before answering (RFC 9112 section 9.3.1), so a
body can reach the wire at most ``2 * max_attempts`` times, and 412 makes any resend harmless.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import hashlib
import json
import math
import os
import pickle
import re
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pluggy
import structlog
from genartifact.errors import (
    ConfigError,
    DeliveryError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    TargetError,
)
from genartifact.format import MAX_DECODED_BYTES, encoded_size_bound
from genartifact.types import ValidatedTarget

hookimpl = pluggy.HookimplMarker("genartifact")
KIND = "managed_fsspec"
__version__ = "0.1.0"
log = structlog.get_logger("genartifact.fsspec_target")

PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
KEY_SEGMENT = re.compile(r"[A-Za-z0-9_.=+@-]{1,255}")
MAX_KEY_BYTES = 1024
MAX_OBJECT_BYTES = encoded_size_bound(MAX_DECODED_BYTES)
_PROFILE_KEYS = {"url", "allowed_prefixes", "max_bytes", "storage_options", "timeout_s", "connect_timeout_s",
                 "read_timeout_s", "max_attempts", "checksum"}
CHECKSUM_MODES = ("when_required", "when_supported")
TEMP_PREFIX = ".genartifact-tmp-"
_CHUNK = 1 << 20
S3_OPTION_KEYS = {"key", "secret", "token", "anon", "profile", "endpoint_url", "client_kwargs", "config_kwargs",
                  "session"}
ENV_PROFILES = "GENARTIFACT_STORAGE_PROFILES"
S3_PROTOCOLS = ("s3://", "s3a://")
CREATE_ONLY_PROTOCOLS = ("file://", "memory://", *S3_PROTOCOLS)
_TARGET_KEYS = {"kind", "profile", "object_key"}


@dataclass(frozen=True)
class Profile:
    """A validated storage profile; ``storage_options`` may hold credentials and is never shown."""

    name: str
    url: str
    allowed_prefixes: tuple[str, ...]
    max_bytes: int
    storage_options: Mapping[str, Any] = field(repr=False, default_factory=dict)
    timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_attempts: int = 3
    checksum: str = "when_required"

    @property
    def is_local(self) -> bool:
        return self.url.startswith("file://")

    @property
    def is_s3(self) -> bool:
        return self.url.startswith(S3_PROTOCOLS)


def validate_key(key: Any, field_name: str = "object_key") -> str:
    """Check a relative, normalized object key (``a/b/c``): 1..1024 bytes, no empty/``.``/``..`` segment,
    no leading ``/``, no backslash, segments of ``[A-Za-z0-9_.=+@-]``. Raises :class:`TargetError`."""
    if not isinstance(key, str) or not key:
        raise TargetError(f"{field_name} must be a non-empty string")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise TargetError(f"{field_name} is {len(key.encode())} bytes; at most {MAX_KEY_BYTES}")
    if key.startswith("/") or "\\" in key:
        raise TargetError(f"{field_name} must be a relative key (no leading '/') without backslashes")
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise TargetError(f"{field_name} must be normalized: no empty, '.' or '..' segments")
        if not KEY_SEGMENT.fullmatch(seg):
            raise TargetError(f"{field_name} segment {seg!r} has characters outside [A-Za-z0-9_.=+@-]")
    return key


def _under(key: str, prefix: str) -> bool:
    """``key`` lies strictly below ``prefix`` (a directory-like prefix: ``runs`` and ``runs/`` both mean
    ``runs/...``; the prefix itself is not a valid key, so an object can never take a directory's place)."""
    return prefix == "" or key.startswith(prefix.rstrip("/") + "/")


_FROM_ENVIRON: Any = object()


def parse_profiles(settings: Mapping[str, Any], base_dir: Path | None = None, *,
                   env_profiles: str | None = _FROM_ENVIRON) -> dict[str, Profile]:
    """Validate ``settings["profiles"]`` plus the JSON profiles of ``env_profiles`` (default: the value of
    ``GENARTIFACT_STORAGE_PROFILES`` now; None or empty: none). Relative urls resolve against
    ``settings["base_dir"]``, else ``base_dir``, else the working directory. Raises :class:`ConfigError`
    naming profile and key."""
    unknown = set(settings) - {"profiles", "base_dir"}
    if unknown:
        raise ConfigError(f"[targets.managed_fsspec]: unknown key(s) {sorted(unknown)}; allowed: ['profiles']")
    base = Path(settings.get("base_dir") or base_dir or Path.cwd())
    raw = settings.get("profiles", {})
    if not isinstance(raw, Mapping):
        raise ConfigError("[targets.managed_fsspec.profiles] must be a table")
    env = os.environ.get(ENV_PROFILES) if env_profiles is _FROM_ENVIRON else env_profiles
    if env:
        if len(env) > 1 << 20:
            raise ConfigError(f"{ENV_PROFILES} is larger than 1 MiB")
        try:
            extra = json.loads(env)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{ENV_PROFILES} is not valid JSON: {e.msg} at position {e.pos}") from None
        if not isinstance(extra, dict):
            raise ConfigError(f"{ENV_PROFILES} must be a JSON object of profile name -> profile")
        raw = {**raw, **extra}
    out = {}
    for name, p in raw.items():
        where = f"[targets.managed_fsspec.profiles.{name}]"
        if not PROFILE_NAME.fullmatch(name):
            raise ConfigError(f"{where}: profile name must match {PROFILE_NAME.pattern}")
        if not isinstance(p, Mapping):
            raise ConfigError(f"{where} must be a table")
        if set(p) - _PROFILE_KEYS:
            raise ConfigError(f"{where}: unknown key(s) {sorted(set(p) - _PROFILE_KEYS)}; allowed: {sorted(_PROFILE_KEYS)}")
        if "url" not in p or "allowed_prefixes" not in p:
            raise ConfigError(f"{where}: needs 'url' and 'allowed_prefixes'")
        url = p["url"]
        if not isinstance(url, str) or not url:
            raise ConfigError(f"{where}.url must be a non-empty string")
        if "://" not in url:
            url = "file://" + str((base / url).resolve())
        if not url.startswith(CREATE_ONLY_PROTOCOLS):
            raise ConfigError(f"{where}.url protocol {url.split('://', 1)[0]!r} unsupported; allowed: "
                              f"{[p.rstrip(':/') for p in CREATE_ONLY_PROTOCOLS]} (the backends with a verified "
                              f"create-only write; others silently overwrite or race)")
        prefixes = p["allowed_prefixes"]
        if not isinstance(prefixes, list) or not prefixes:
            raise ConfigError(f"{where}.allowed_prefixes must be a non-empty list")
        for pre in prefixes:
            if pre != "":
                try:
                    validate_key(pre.rstrip("/") if isinstance(pre, str) else pre, "allowed_prefixes entry")
                except TargetError as e:
                    raise ConfigError(f"{where}: {e}") from None
        mb = p.get("max_bytes", MAX_OBJECT_BYTES)
        if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= MAX_OBJECT_BYTES:
            raise ConfigError(f"{where}.max_bytes must be an integer in 1..{MAX_OBJECT_BYTES}")
        so = p.get("storage_options", {})
        if not isinstance(so, Mapping):
            raise ConfigError(f"{where}.storage_options must be a table")
        if url.startswith(S3_PROTOCOLS) and set(so) - S3_OPTION_KEYS:
            raise ConfigError(f"{where}.storage_options: key(s) {sorted(map(str, set(so) - S3_OPTION_KEYS))} "
                              f"unsupported for S3; allowed: {sorted(S3_OPTION_KEYS)}")
        times = {k: _seconds(p, k, d, where) for k, d in
                 (("timeout_s", 60.0), ("connect_timeout_s", 5.0), ("read_timeout_s", 30.0))}
        attempts = p.get("max_attempts", 3)
        if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= 10:
            raise ConfigError(f"{where}.max_attempts={attempts!r}; allowed: integer 1..10")
        checksum = p.get("checksum", "when_required")
        if checksum not in CHECKSUM_MODES:
            raise ConfigError(f"{where}.checksum={checksum!r}; allowed: {list(CHECKSUM_MODES)}")
        out[name] = Profile(name, url.rstrip("/"), tuple(prefixes), mb, dict(so), max_attempts=attempts,
                            checksum=checksum, **times)
    return out


def _seconds(p: Mapping[str, Any], key: str, default: float, where: str) -> float:
    v = p.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0.01 <= v <= 3600:
        raise ConfigError(f"{where}.{key}={v!r}; allowed: seconds in 0.01..3600")
    return float(v)


class ManagedFsspecTarget:
    """The ``managed_fsspec`` storage target over a set of validated profiles."""

    kind = KIND

    def __init__(self, profiles: Mapping[str, Profile]) -> None:
        self.profiles = dict(profiles)

    def __repr__(self) -> str:
        return f"ManagedFsspecTarget(profiles={sorted(self.profiles)})"

    def validate(self, spec: Mapping[str, Any]) -> ValidatedTarget:
        """Side-effect free check of ``{"kind", "profile", "object_key"}``; raises :class:`TargetError`."""
        extra = set(spec) - _TARGET_KEYS
        if extra:
            raise TargetError(f"managed_fsspec target: unknown key(s) {sorted(map(str, extra))}; allowed: {sorted(_TARGET_KEYS)}")
        name = spec.get("profile")
        if not isinstance(name, str) or name not in self.profiles:
            raise TargetError(f"managed_fsspec target.profile {name!r} unknown; configured: {sorted(self.profiles)}")
        prof = self.profiles[name]
        key = validate_key(spec.get("object_key"))
        if not any(_under(key, pre) for pre in prof.allowed_prefixes):
            raise TargetError(f"managed_fsspec target.object_key is outside the profile's allowed prefixes {list(prof.allowed_prefixes)}")
        reserved = next((seg for seg in key.split("/") if seg.startswith(TEMP_PREFIX)), None)
        if reserved is not None:  # `reconcile --delete` removes such names as crash leftovers: never an object's
            raise TargetError(f"managed_fsspec target.object_key segment {reserved[:80]!r} starts with "
                              f"{TEMP_PREFIX!r}, reserved for the target's temp files; allowed: any other name")
        return ValidatedTarget(kind=KIND, max_bytes=prof.max_bytes, object_id=f"{name}:{key}", detail=(prof, key))

    def describe(self, target: ValidatedTarget) -> dict[str, Any]:
        """Non-secret reference for the delivery journal: profile and key."""
        prof, key = target.detail
        return {"profile": prof.name, "key": key}

    async def deliver(self, target: ValidatedTarget, data: bytes, sha256: str) -> str:
        """Create-only, all-or-nothing write of ``data``; returns ``"<profile>:<key>"``.
        Raises :class:`DeliveryError` with code ``object_exists``, ``too_large`` or ``delivery_failed``."""
        prof, key = target.detail
        if len(data) > prof.max_bytes:
            raise DeliveryError("artifact exceeds managed storage byte limit", "too_large")
        try:
            async with asyncio.timeout(prof.timeout_s):
                if prof.is_local:
                    dest = _local_path(prof, key, whole=False)  # (the name itself is create-only: never followed)
                    if len(data) <= LOCAL_BATCH_MAX_BYTES:
                        await _local_writer(prof.url).write(dest, data)
                    else:
                        await asyncio.to_thread(_write_local_create_only, dest, data)
                elif prof.is_s3:
                    await _write_s3_create_only(prof, key, data, sha256)
                else:
                    await asyncio.to_thread(_write_memory_create_only, prof, key, data)
        except TimeoutError:
            raise DeliveryError("managed artifact write timed out", "timeout") from None
        return target.object_id

    def _resolve(self, object_id: str) -> tuple[Profile, str]:
        """``"<profile>:<key>"`` -> (profile, key); the key must be valid and under an allowed prefix."""
        if not isinstance(object_id, str) or ":" not in object_id:
            raise TargetError("managed_fsspec object id must be '<profile>:<object_key>'")
        name, key = object_id.split(":", 1)
        if name not in self.profiles:
            raise TargetError(f"managed_fsspec object id names profile {name!r}; configured: {sorted(self.profiles)}")
        prof = self.profiles[name]
        validate_key(key)
        if not any(_under(key, pre) for pre in prof.allowed_prefixes):
            raise TargetError("managed_fsspec object id key is outside the profile's allowed prefixes")
        return prof, key

    async def open(self, object_id: str, max_bytes: int) -> bytes:
        """Read ``"<profile>:<key>"`` back, at most ``max_bytes`` bytes (streamed; the size is checked first).
        Raises :class:`ObjectNotFoundError`, :class:`ObjectTooLargeError` or :class:`TargetError`."""
        prof, key = self._resolve(object_id)
        data = await _read(prof, key, max_bytes)
        if data is None:
            raise ObjectNotFoundError(f"managed_fsspec object {object_id!r} does not exist")
        return data

    async def exists(self, object_id: str) -> bool:
        """Whether ``"<profile>:<key>"`` is stored."""
        prof, key = self._resolve(object_id)
        return await _exists(prof, key)

    async def delete(self, object_id: str, sha256: str) -> bool:
        """Delete ``"<profile>:<key>"`` only if its bytes hash to ``sha256`` (streamed, at most the profile's
        ``max_bytes`` read; a larger object is kept). True if deleted; False if absent or different."""
        prof, key = self._resolve(object_id)
        if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise TargetError("managed_fsspec delete: sha256 must be 64 lowercase hex characters")
        return await _delete_if(prof, key, sha256)

    async def leftovers(self, older_than_s: float) -> list[dict[str, Any]]:
        """Crash leftovers per profile: ``file://`` temp files (``.genartifact-tmp-*``) older than
        ``older_than_s`` seconds under the allowed prefixes, as ``{"profile", "path", "age_s", "bytes", "object_id"}``
        (``object_id``: the id an object at that path would have; ``reconcile`` keeps a leftover a ready outcome or
        receipt vouches for).
        ``memory://`` and S3 leave none (an S3 PutObject is all-or-nothing; multipart is never used)."""
        out: list[dict[str, Any]] = []
        for prof in self.profiles.values():
            if prof.is_local:
                out += await asyncio.to_thread(_local_leftovers, prof, older_than_s)
        return out

    async def remove_leftover(self, item: Mapping[str, Any]) -> bool:
        """Remove one leftover reported by :meth:`leftovers` (re-checked: a temp file under the profile root)."""
        prof = self.profiles.get(item.get("profile", ""))
        if prof is None or not prof.is_local:
            return False
        root = Path(prof.url[len("file://"):]).resolve()
        path = Path(str(item.get("path", "")))
        if not path.name.startswith(TEMP_PREFIX) or root not in path.resolve().parents:
            raise TargetError("leftover path is not a genartifact temp file under the profile root")
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


#: ``open(2)`` flag for an unnamed file in a directory (Linux >= 3.11); 0 where the platform has none
_O_TMPFILE = getattr(os, "O_TMPFILE", 0)
#: errnos of ``open(dir, O_TMPFILE)`` on a filesystem or kernel without it (``open(2)``: EOPNOTSUPP from the
#: filesystem, EISDIR from kernels older than O_TMPFILE, which see a directory opened for writing) and of
#: ``linkat`` through ``/proc/self/fd`` where ``/proc`` is not mounted (ENOENT): each falls back to a named temp
_NO_TMPFILE_ERRNOS = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT})
#: errnos of an ``open(2)`` refused for want of a descriptor (the process's limit, the system's): a batch's group
#: then writes its remaining jobs one by one (:func:`_write_local_batch`)
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


def _write_local_create_only(dest: Path, data: bytes) -> None:
    """Write ``data`` (bytes) to the new file ``dest``, create-only and all-or-nothing; raises
    :class:`DeliveryError` (``object_exists`` when ``dest`` exists, else ``delivery_failed``).

    The bytes go to an unnamed file in ``dest``'s directory (``O_TMPFILE``), which is fsynced and then given its
    name with ``linkat`` (atomic; EEXIST if the key is taken; the ``/proc/self/fd`` form of ``open(2)``'s
    example). No reader ever sees a partial object, and a crash (kill -9, power loss) at any point leaves nothing
    behind: an unnamed file is freed by the kernel with its last descriptor. Where the filesystem has no
    ``O_TMPFILE`` (:data:`_NO_TMPFILE_ERRNOS`) a hidden named temp file (``.genartifact-tmp-*``) is written and
    linked instead; a crash can leave that one, which ``genartifact reconcile`` lists and removes. Either way the
    directory is fsynced after the link (a file's fsync does not make a *later* link durable) before the receipt
    can say ``ready``. Any OSError (ENOSPC, EDQUOT, EACCES, EIO...) leaves neither the key nor a temp file.
    Directories the key needed that did not exist yet (``a/b/`` of a key ``a/b/c``) are made, and each one's own
    entry synced too (its parent directory fsynced): a key under a new directory is durable only once that
    directory's name is. New objects get mode ``0o666`` less the process umask, like any created file.
    (A batch of one of :func:`_write_local_batch`.)"""
    err = _write_local_batch([(dest, data)])[0]
    if err is not None:
        raise err


def _write_local_batch(jobs: Sequence[tuple[Path, bytes]], sync: Any = None) -> list[DeliveryError | None]:
    """:func:`_write_local_create_only` for several objects with one **group commit**: every object is written,
    fsynced and linked first, then each directory that received a new name is fsynced once (and the parent of
    each directory made in this batch above a stored key once), instead of once per object. One directory fsync
    makes every link made in that directory before it durable, so each object's guarantees are those of
    :func:`_write_local_create_only` — its bytes fsynced before its link, its name synced before its result is
    returned — for fewer fsyncs. A key directory opened for an earlier job is reused only while the key's path
    still names it (one moved away, removed or replaced meanwhile is opened again at the path, as alone).

    The objects go in groups (:func:`_sync_group`: up to :data:`LOCAL_SYNC_GROUP`): each job's unnamed file is
    opened, then all of the group's files are written and fsynced at once by the threads of ``sync``
    (:meth:`_LocalWriter.sync_pool`; None: one after another here) and this one (:func:`_write_and_sync_all`:
    concurrent fsyncs share the journal's commits and the disk's cache flushes; one after another, each waits for
    its own), then each is linked, in job order, so that of two jobs for one key the first one wins. Jobs on a
    filesystem without ``O_TMPFILE``, a job whose key directory moved away since its file was opened, and the jobs
    of a group from the first one short of a descriptor (EMFILE, ENFILE, at its directory's or its file's open)
    on, are written one by one at the link step, as alone (the group's earlier files closed by then).

    Returns one result per job, in order: None (stored and durable) or the :class:`DeliveryError` that job would
    have raised alone (``object_exists``, ``delivery_failed``; any exception, not only an OSError, fails just its
    job). Jobs fail independently, except that a directory whose fsync fails fails every job that linked into it
    in this batch (each of those keys is removed again: no result, no object) and every later job of the batch
    that met one of those keys (it is no longer there: ``delivery_failed``, not ``object_exists``)."""
    results: list[DeliveryError | None] = [None] * len(jobs)
    # key directory -> (fd, (st_dev, st_ino), jobs linked in it, jobs that met a key linked in it by this batch)
    dirs: dict[Path, tuple[int, tuple[int, int], list[int], list[int]]] = {}
    opened: list[tuple[Path, tuple[int, tuple[int, int], list[int], list[int]]]] = []  # every one, to sync/close
    made: set[Path] = set()  # directories made for keys of this batch
    linked_by: dict[Path, Any] = {}  # key -> the directory entry it was linked in by this batch

    def failed(i: int, e: BaseException) -> None:
        log.warning("managed_write_failed", errno=getattr(e, "errno", None), error_type=type(e).__name__)
        results[i] = DeliveryError("managed artifact write failed")

    def key_dir(i: int, short_ok: bool = False) -> Any:
        """Job ``i``'s key directory entry (made and opened if needed); None when that failed (its result set), or
        with ``short_ok`` the string ``"short"`` when there was no descriptor for it (EMFILE, ENFILE: no result)."""
        dest = jobs[i][0]
        entry = dirs.get(dest.parent)
        if entry is not None and not _names_dir(dest.parent, entry[1]):
            entry = None  # moved away, removed or replaced since an earlier job: the key's path decides
        if entry is None:
            try:  # (a file where a directory is needed is EEXIST here: delivery_failed, not object_exists)
                d = dest.parent
                while not d.is_dir() and d.parent != d:  # the key's directories that are missing now
                    made.add(d)
                    d = d.parent
                dest.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    st = os.fstat(fd)
                except BaseException:
                    _close_quiet(fd)
                    raise
                entry = dirs[dest.parent] = (fd, (st.st_dev, st.st_ino), [], [])
                opened.append((dest.parent, entry))
            except Exception as e:  # noqa: BLE001 - any failure is this job's delivery_failed
                if short_ok and getattr(e, "errno", None) in _OUT_OF_DESCRIPTORS:
                    return "short"
                failed(i, e)
                return None
        return entry

    try:
        start = 0
        while start < len(jobs):
            group = _sync_group(jobs, start)
            start = group.stop
            staged: dict[int, tuple[int, Any]] = {}  # job -> (its unnamed file's fd, its key directory entry)
            named: set[int] = set()  # jobs on a filesystem without O_TMPFILE
            try:
                for i in group:  # each job's key directory and, where the filesystem has O_TMPFILE, unnamed file
                    entry = key_dir(i, short_ok=True)
                    if entry == "short":  # out of descriptors: the group's jobs from here on are written as alone
                        break
                    if entry is None:
                        continue
                    try:
                        fd = _open_unnamed(entry[0])
                    except Exception as e:  # noqa: BLE001 - any failure is this job's delivery_failed
                        if getattr(e, "errno", None) in _OUT_OF_DESCRIPTORS:
                            break
                        failed(i, e)
                        continue
                    if fd is None:
                        named.add(i)
                    else:
                        staged[i] = (fd, entry)
                try:
                    errors = _write_and_sync_all({i: (fd, jobs[i][1]) for i, (fd, _) in staged.items()}, sync)
                except BaseException:
                    staged.clear()  # interrupted: each descriptor is closed by it, or by the thread writing it
                    raise
                for i, err in errors.items():
                    if err is not None:
                        _close_quiet(staged.pop(i)[0])
                        failed(i, err)
                for i in group:  # linked in job order (of two jobs for one key, the first wins)
                    if results[i] is not None:
                        continue
                    dest, data = jobs[i]
                    fd, entry = staged.pop(i, (None, None))
                    try:
                        how = "named" if i in named else "again"  # no O_TMPFILE here / moved, or not staged
                        if fd is not None and _names_dir(dest.parent, entry[1]):
                            how = "linked" if _link_unnamed(fd, entry[0], dest.name) else "named"  # (no /proc)
                        if how != "linked":  # written as alone
                            if fd is not None:  # (its descriptor back first: the group may be short of them;
                                f, fd = fd, None  # fd cleared first: the finally below must not close it again)
                                _close_quiet(f)
                            entry = key_dir(i)
                            if entry is None:
                                continue
                            if how == "named" or not _publish_unnamed(entry[0], dest.name, data):
                                _publish_named(dest, data)
                        entry[2].append(i)
                        linked_by[dest] = entry
                    except FileExistsError:
                        results[i] = DeliveryError("managed artifact object already exists", "object_exists")
                        if entry is not None and linked_by.get(dest) is entry:
                            entry[3].append(i)
                    except Exception as e:  # noqa: BLE001 - any failure is this job's delivery_failed
                        failed(i, e)
                    finally:
                        if fd is not None:  # an unnamed file not linked is freed with it; once linked (its bytes
                            _close_quiet(fd)  # fsynced before), a close error changes nothing
            finally:
                for fd, _ in staged.values():  # an unexpected error left some unlinked: freed
                    _close_quiet(fd)
        synced: set[Path] = set()  # parents of new directories already synced in this batch
        for path, (fd, _, linked, met) in opened:
            if not linked:
                continue
            try:
                os.fsync(fd)
                d = path
                while d in made:  # a new directory's name is an entry of its parent
                    if d.parent not in synced:
                        _fsync_dir(d.parent)
                        synced.add(d.parent)
                    d = d.parent
            except Exception as e:  # noqa: BLE001 - the directory could not be synced: no receipt, so no object
                log.warning("managed_write_failed", errno=getattr(e, "errno", None), error_type=type(e).__name__)
                for i in linked:
                    _unlink_quiet(jobs[i][0].name, fd)
                for i in linked + met:
                    results[i] = DeliveryError("managed artifact write failed")
    finally:
        for _, (fd, _, _, _) in opened:
            _close_quiet(fd)
    return results


def _sync_group(jobs: Sequence[tuple[Path, bytes]], start: int) -> range:
    """The jobs from ``start`` that :func:`_write_local_batch` opens, writes and links together: at most
    :data:`LOCAL_SYNC_GROUP`, ending before a job under a path that an earlier job of the group has as its key (its
    directory would be made before that key is linked: the earlier job must meet the later one's directory no more
    than it would in job order)."""
    keys: set[Path] = set()
    end = start
    while end < len(jobs) and end - start < LOCAL_SYNC_GROUP:
        dest = jobs[end][0]
        if keys and any(p in keys for p in dest.parents):
            break
        keys.add(dest)
        end += 1
    return range(start, end)


def _names_dir(path: Path, ident: tuple[int, int]) -> bool:
    """``path`` is (still) the directory ``(st_dev, st_ino)``."""
    try:
        st = os.stat(path)
    except Exception:  # noqa: BLE001 - OSError, or a path os.stat refuses (ValueError): not that directory
        return False
    return (st.st_dev, st.st_ino) == ident


#: ``file://`` objects of at most this many bytes go through the profile's batch writer (:class:`_LocalWriter`);
#: larger ones get a thread each (their write and fsync dwarf a thread hop, and they must not queue behind one
#: another in a single writer)
LOCAL_BATCH_MAX_BYTES = 1 << 20
#: at most this many objects per batch (the rest wait for the next one): a delivery's result waits for its whole
#: batch, and a batch holds a descriptor per key directory until its end, so a burst of thousands of deliveries in
#: one loop turn neither delays the first results behind the last writes nor runs out of descriptors
LOCAL_BATCH_MAX_JOBS = 64
#: a batch's files are written and fsynced this many at a time (:func:`_write_local_batch`; each holds a descriptor
#: until it is linked)
LOCAL_SYNC_GROUP = 16
#: threads that write and fsync batches' files at once (:func:`_write_and_sync_all`), per process:
#: concurrent fsyncs share the journal's commits and the disk's cache flushes, where one after another each waits
#: for its own (a batch of 16 small objects on this project's VM: 20-45 % less wall time, docs/benchmarks.md);
#: 1: one after another in the writer's thread
LOCAL_SYNC_THREADS = 8


class _LocalWriter:
    """Small ``file://`` deliveries of one profile root and one event loop, written in batches by one writer thread
    with a group commit (:func:`_write_local_batch`).

    A thread hop per delivery (``asyncio.to_thread``) costs about as much driver CPU as writing a small object
    (a futex wake each way and a GIL hand-off; 0.14-0.23 ms of CPU per hop on this project's 2-core VMs,
    docs/benchmarks.md), and every object paid its own directory fsync. Here the deliveries asked for in one
    event-loop turn go to the writer thread together (one hop there, one back, whatever their number), and while
    a batch is being written the next deliveries queue up and go as the next batch, so under load a batch grows
    to whatever arrived during the previous one's fsyncs (group commit), up to :data:`LOCAL_BATCH_MAX_JOBS`
    objects. Each delivery's result is exactly what :func:`_write_local_create_only` gives it alone; a batch the
    writer thread cannot take (the interpreter is shutting down) fails its deliveries at once.

    The writer is a one-thread ``ThreadPoolExecutor`` per profile root (a slow filesystem never stops another
    root's writes: the sync threads that fsync a batch's files at once are shared, :meth:`sync_pool`, but a
    batch's own writer thread writes whatever no sync thread has started), made per process (a forked child makes
    its own, and remakes the table's lock: the parent's thread is not in it), so an interpreter exit waits for
    writes in progress as it does for ``asyncio.to_thread``.
    A delivery whose caller stops waiting (timeout, cancellation) still completes in the thread, as with
    ``to_thread``. The writer holds its loop weakly (the per-loop table is weak on the loop: a finished loop is
    freed with its writer)."""

    _executors: dict[str, tuple[int, Any]] = {}  # root -> (pid, executor)
    _sync: tuple[int | None, int, Any] = (None, 0, None)  # (pid, threads, executor) of sync_pool
    _lock = threading.Lock()

    def __init__(self, root: str, loop: asyncio.AbstractEventLoop) -> None:
        self.root, self._loop = root, weakref.ref(loop)
        self.pending: list[tuple[Path, bytes, asyncio.Future[None]]] = []
        self.busy = False  # a batch is in the thread, or one is about to go
        self.batches = 0
        self.objects = 0

    @classmethod
    def executor(cls, root: str) -> Any:
        """The writer thread of profile root ``root`` in this process."""
        from concurrent.futures import ThreadPoolExecutor

        with cls._lock:
            pid, ex = cls._executors.get(root, (None, None))
            if pid != os.getpid():
                ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genartifact-file-writer")
                cls._executors[root] = (os.getpid(), ex)
            return ex

    @classmethod
    def sync_pool(cls) -> Any:
        """The threads that write and fsync batches' files at once (:data:`LOCAL_SYNC_THREADS` of them; None when
        that is 1), shared by every profile root's writer in this process: made anew in a forked child, and when
        :data:`LOCAL_SYNC_THREADS` has changed (the old pool finishes what it has, then its threads end). A root
        whose filesystem hangs can hold them all; the other roots' batches then write their files in their own
        writer thread, one after another (:func:`_write_and_sync_all`: the batch's thread takes every job not yet
        started), so a stuck filesystem slows another root's writes but never stops them."""
        from concurrent.futures import ThreadPoolExecutor

        n = LOCAL_SYNC_THREADS
        if n <= 1:
            return None
        with cls._lock:
            pid, threads, ex = cls._sync
            if pid != os.getpid() or threads != n:
                if pid == os.getpid() and ex is not None:
                    ex.shutdown(wait=False)
                ex = ThreadPoolExecutor(max_workers=n, thread_name_prefix="genartifact-file-sync")
                cls._sync = (os.getpid(), n, ex)
            return ex

    def write(self, dest: Path, data: bytes) -> asyncio.Future[None]:
        """Queue one object; the future resolves once it is stored and durable (or with its DeliveryError)."""
        loop = self._loop()
        assert loop is not None  # called on its running loop
        fut = loop.create_future()
        self.pending.append((dest, data, fut))
        if not self.busy:
            self.busy = True
            loop.call_soon(self._send)  # after the other deliveries of this loop turn
        return fut

    def _send(self) -> None:
        waiting = [job for job in self.pending if not job[2].done()]  # its caller stopped waiting before it was sent
        batch, self.pending = waiting[:LOCAL_BATCH_MAX_JOBS], waiting[LOCAL_BATCH_MAX_JOBS:]
        if not batch:
            self.busy = False
            return
        self.batches += 1
        self.objects += len(batch)
        try:
            done = self.executor(self.root).submit(_write_local_batch, [(d, b) for d, b, _ in batch],
                                                   self.sync_pool())
        except Exception as e:  # noqa: BLE001 - no writer thread to be had (interpreter shutdown): fail, never hang
            self._finish(batch, _writer_failed(batch, e))
            return
        done.add_done_callback(lambda f: self._post(batch, f))

    def _post(self, batch: list[tuple[Path, bytes, asyncio.Future[None]]], done: Any) -> None:
        """In the writer thread: hand the batch's results to its loop."""
        try:
            results = done.result()
        except BaseException as e:  # noqa: BLE001 - the writer itself broke (e.g. interpreter shutdown)
            results = _writer_failed(batch, e)
        try:  # (the batch's futures hold their loop while it is in the thread)
            batch[0][2].get_loop().call_soon_threadsafe(self._finish, batch, results)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _finish(self, batch: list[tuple[Path, bytes, asyncio.Future[None]]],
                results: list[DeliveryError | None]) -> None:
        for (_, _, fut), err in zip(batch, results, strict=True):
            if fut.done():  # the caller stopped waiting (timeout, cancellation); the object is written anyway
                continue
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)
        if self.pending:
            self._send()
        else:
            self.busy = False


def _writer_failed(batch: Sequence[Any], e: BaseException) -> list[DeliveryError | None]:
    """Results of a batch the writer thread could not write at all: ``delivery_failed`` each (one error per job)."""
    log.warning("managed_write_failed", error_type=type(e).__name__)
    return [DeliveryError("managed artifact write failed") for _ in batch]


def _reset_writer_lock() -> None:
    _LocalWriter._lock = threading.Lock()  # a forked child: the parent's holder (another thread) is not in it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_writer_lock)

_LOCAL_WRITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _LocalWriter]] = (
    weakref.WeakKeyDictionary())


def _local_writer(root: str) -> _LocalWriter:
    """The running event loop's :class:`_LocalWriter` for profile root ``root``."""
    loop = asyncio.get_running_loop()
    per_loop = _LOCAL_WRITERS.get(loop)
    if per_loop is None:
        per_loop = _LOCAL_WRITERS[loop] = {}
    w = per_loop.get(root)
    if w is None:
        w = per_loop[root] = _LocalWriter(root, loop)
    return w


def _write_all(fd: int, data: bytes) -> None:
    """``data`` to ``fd`` in full (``os.write`` may write less than asked), then fsync. Raises OSError."""
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv):]
    os.fsync(fd)


def _publish_unnamed(dir_fd: int, name: str, data: bytes) -> bool:
    """``data`` to an unnamed, fsynced file in directory ``dir_fd``, then linked as ``name``; ``False`` (nothing
    written, nothing left) where the filesystem or system has no ``O_TMPFILE`` (:data:`_NO_TMPFILE_ERRNOS`) or no
    ``/proc``. Raises FileExistsError when ``name`` exists, OSError on other failures; the unnamed file never
    outlives its descriptor."""
    fd = _open_unnamed(dir_fd)
    if fd is None:
        return False
    try:
        _write_all(fd, data)
        return _link_unnamed(fd, dir_fd, name)
    finally:
        _close_quiet(fd)  # (once linked, its bytes were fsynced: a close error changes nothing)


def _open_unnamed(dir_fd: int) -> int | None:
    """A new unnamed file (``O_TMPFILE``, mode ``0o666`` less the umask) in directory ``dir_fd``: its descriptor,
    or None where the filesystem or kernel has none (:data:`_NO_TMPFILE_ERRNOS`). Raises OSError otherwise."""
    if not _O_TMPFILE:
        return None
    try:
        return os.open(".", os.O_WRONLY | _O_TMPFILE, 0o666, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in _NO_TMPFILE_ERRNOS:
            return None
        raise


def _link_unnamed(fd: int, dir_fd: int, name: str) -> bool:
    """Give the unnamed file ``fd`` the name ``name`` in directory ``dir_fd`` (``linkat`` through
    ``/proc/self/fd``, the form of ``open(2)``'s example; atomic); ``False`` where ``/proc`` is not mounted.
    Raises FileExistsError when ``name`` exists, OSError on other failures."""
    try:
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
    except FileNotFoundError:
        if os.path.exists(f"/proc/self/fd/{fd}"):
            raise  # the directory itself is gone
        return False  # no /proc: the named fallback
    return True


class _SyncJob:
    """One file's write and fsync (:func:`_write_all`) for :func:`_write_and_sync_all`, run at most once, by whoever
    claims it first: a sync thread or the batch's own thread. A job the pool queued but could not start a thread
    for (``ThreadPoolExecutor.submit`` queues its item before it starts a thread, and raises if that fails) is run
    by the batch's thread instead; when a thread takes the stale item later, it finds the job claimed and leaves
    the descriptor alone. A job whose batch gave up waiting (:meth:`abandon`) closes its descriptor itself when it
    is done, so that no descriptor is closed while a thread may still write it."""

    __slots__ = ("fd", "data", "error", "done", "_lock", "_owner", "_finished", "_abandoned")

    def __init__(self, fd: int, data: bytes) -> None:
        self.fd, self.data = fd, data
        self.error: BaseException | None = None
        self.done = threading.Event()  # set once run (whoever ran it)
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread that claimed it
        self._finished = False
        self._abandoned = False

    def claim(self) -> bool:
        """Take the job for this thread; False if someone already has (it is running or has run)."""
        with self._lock:
            if self._owner is not None:
                return False
            self._owner = threading.get_ident()
            return True

    def run(self) -> None:
        """Write and fsync, unless someone else has claimed the job. An Exception is kept in :attr:`error`; any
        other BaseException propagates."""
        if not self.claim():
            return
        try:
            _write_all(self.fd, self.data)
        except Exception as e:  # noqa: BLE001 - this file's failure
            self.error = e
        finally:
            self.data = b""  # a queued item of the job may outlive it (a pool busy elsewhere): not its bytes
            with self._lock:
                self._finished = True
                close = self._abandoned
            if close:
                _close_quiet(self.fd)
            self.done.set()

    def abandon(self) -> None:
        """The batch stops waiting for this job (it was interrupted): the descriptor is closed now where no other
        thread can touch it any more (never started: now it never will; finished; or claimed by this very thread,
        whose run was cut short), else by the thread running the job, once done. Never blocks."""
        self.data = b""  # (a running write has its own reference)
        with self._lock:
            if self._owner is None:
                self._owner = threading.get_ident()
            mine = self._finished or self._owner == threading.get_ident()
            self._abandoned = not mine
        if mine:
            _close_quiet(self.fd)


def _write_and_sync_all(files: Mapping[int, tuple[int, bytes]], sync: Any = None) -> dict[int, BaseException | None]:
    """:func:`_write_all` (write in full, then fsync) of each ``key -> (fd, data)``; returns each key's exception,
    None where written and fsynced. With an executor ``sync`` and several files they run at once on its threads,
    this thread taking any not yet started (:class:`_SyncJob`); without (or where it takes no more work: the
    interpreter is shutting down, no thread can be started) one after another here. Returns once every job is
    done; the caller closes the descriptors. Interrupted (a BaseException here, e.g. from a signal handler), it
    does not wait: every descriptor of ``files`` is then closed, now or by the thread still writing it when that
    is done (:meth:`_SyncJob.abandon`), and the caller must not close them."""
    jobs: dict[int, _SyncJob] = {}
    try:
        if sync is None or len(files) < 2:  # no thread to share with (every lone delivery): no job to claim either
            out: dict[int, BaseException | None] = {}
            for k, (fd, data) in files.items():
                try:
                    _write_all(fd, data)
                    out[k] = None
                except Exception as e:  # noqa: BLE001 - this file's failure
                    out[k] = e
            return out
        for k, (fd, data) in files.items():
            jobs[k] = _SyncJob(fd, data)
        for job in jobs.values():
            try:
                sync.submit(job.run)
            except Exception:  # noqa: BLE001 - takes no more: the rest here (one it queued anyway is claimed)
                break
        for job in jobs.values():
            job.run()  # here, unless a sync thread has it
            job.done.wait()
    except BaseException:
        for k, (fd, _) in files.items():  # every one, even if interrupted again meanwhile
            try:
                job = jobs.get(k)
                if job is None:  # written here, or interrupted before its job was made: no thread has it
                    _close_quiet(fd)
                else:
                    job.abandon()
            except BaseException:  # noqa: BLE001 - a second interrupt: the first one is the one raised
                pass
        raise
    return {k: job.error for k, job in jobs.items()}


def _close_quiet(fd: int) -> None:
    """``os.close``, its error ignored (the descriptor is released anyway, ``close(2)``; a file whose bytes matter was
    fsynced before)."""
    try:
        os.close(fd)
    except OSError:
        pass


def _publish_named(dest: Path, data: bytes) -> None:
    """``data`` to a hidden temp file (``.genartifact-tmp-*``) beside ``dest``, fsynced, linked as ``dest``, the temp
    name removed in all cases. Raises FileExistsError when ``dest`` exists, OSError on other failures."""
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=dest.parent)
    try:
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp creates 0600; objects follow the umask like any new file
            _write_all(fd, data)
        finally:
            os.close(fd)
        os.link(tmp, dest)  # atomic publish; EEXIST if the key exists
    finally:
        _unlink_quiet(tmp)


def _unlink_quiet(path: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: a new link, a removed temp name). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# memory:// is one process-global dict (fsspec MemoryFileSystem.store); this lock makes check-and-write atomic
# for every writer that can see that store (threads and event loops of this process).
_MEMORY_LOCK = threading.Lock()


def _memory_fs_path(prof: Profile, key: str) -> tuple[Any, str]:
    fs, root = fsspec.core.url_to_fs(prof.url, skip_instance_cache=True, **prof.storage_options)
    return fs, f"{root.rstrip('/')}/{key}"


def _write_memory_create_only(prof: Profile, key: str, data: bytes) -> None:
    fs, path = _memory_fs_path(prof, key)
    with _MEMORY_LOCK:
        try:
            if fs.exists(path):
                raise DeliveryError("managed artifact object already exists", "object_exists")
            fs.pipe_file(path, bytes(data))
        except DeliveryError:
            raise
        except Exception:  # noqa: BLE001 - provider detail never reaches the caller
            raise DeliveryError("managed artifact write failed") from None


def _local_path(prof: Profile, key: str, whole: bool = True) -> Path:
    """The file of ``key`` under ``prof``'s root. Raises :class:`TargetError` when a component of the key below the
    root is a symbolic link (planted in the store: a write, read or delete must not follow it out of the root; keys
    are checked lexically at validation): the key's directories, and with ``whole`` the object's own name too
    (a create-only write never follows the name: an existing entry is ``object_exists``). One ``lstat`` per
    component (~3 us each), on the caller's thread. A link swapped in between this check and the file's open is not
    caught: that needs write access to the store. The root itself may be a link."""
    root = prof.url[len("file://"):]
    parts = key.split("/")
    p = root
    for seg in parts if whole else parts[:-1]:
        p = f"{p}/{seg}"
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            break  # made as a real directory by the write (or not there to read)
        if stat.S_ISLNK(st.st_mode):
            raise TargetError("managed_fsspec object key passes a symbolic link in the store; allowed: keys whose "
                              "directories (and, to read, the object) are no links below the profile root")
    return Path(root) / key


def _read_capped_fileobj(f: Any, size: int | None, max_bytes: int, hasher: Any = None) -> bytes | None:
    """Read a file object in chunks; None if it turns out larger than ``max_bytes`` (never reads past +1)."""
    if size is not None and size > max_bytes:
        return None
    buf = bytearray()
    while True:
        chunk = f.read(min(_CHUNK, max_bytes + 1 - len(buf)))
        if not chunk:
            break
        buf += chunk
        if hasher is not None:
            hasher.update(chunk)
        if len(buf) > max_bytes:
            return None
    return bytes(buf)


def _local_read(prof: Profile, key: str, max_bytes: int) -> bytes | None:
    try:
        with open(_local_path(prof, key), "rb") as f:
            data = _read_capped_fileobj(f, os.fstat(f.fileno()).st_size, max_bytes)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise ObjectNotFoundError("managed_fsspec object does not exist") from None
    if data is None:
        raise ObjectTooLargeError(f"managed_fsspec object is larger than max_bytes={max_bytes}")
    return data


def _local_delete_if(prof: Profile, key: str, sha256: str) -> bool:
    path = _local_path(prof, key)
    try:
        f = open(path, "rb")  # noqa: SIM115
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False
    with f:
        st = os.fstat(f.fileno())
        h = hashlib.sha256()
        if _read_capped_fileobj(f, st.st_size, prof.max_bytes, h) is None or h.hexdigest() != sha256:
            return False
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return False
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            return False  # replaced while we hashed: not the bytes we checked
        os.unlink(path)
    return True


def _local_leftovers(prof: Profile, older_than_s: float) -> list[dict[str, Any]]:
    root = Path(prof.url[len("file://"):])
    now, out = time.time(), []
    tops = {root / pre.rstrip("/") if pre else root for pre in prof.allowed_prefixes}
    seen: set[Path] = set()
    for top in sorted(tops):
        if not top.is_dir():
            continue
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if not name.startswith(TEMP_PREFIX):
                    continue
                p = Path(dirpath) / name
                if p in seen:
                    continue
                seen.add(p)
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                age = now - st.st_mtime
                if age >= older_than_s:
                    # the object id the file would have: an object stored under a temp-like key before such keys
                    # were refused is one that reconcile finds vouched for and keeps
                    out.append({"profile": prof.name, "path": str(p), "age_s": round(age, 1), "bytes": st.st_size,
                                "object_id": f"{prof.name}:{p.relative_to(root).as_posix()}"})
    return out


def _memory_read(prof: Profile, key: str, max_bytes: int) -> bytes | None:
    fs, path = _memory_fs_path(prof, key)
    with _MEMORY_LOCK:
        if not fs.exists(path):
            raise ObjectNotFoundError("managed_fsspec object does not exist")
        if fs.size(path) > max_bytes:
            raise ObjectTooLargeError(f"managed_fsspec object is larger than max_bytes={max_bytes}")
        return bytes(fs.cat_file(path))


def _memory_delete_if(prof: Profile, key: str, sha256: str) -> bool:
    fs, path = _memory_fs_path(prof, key)
    with _MEMORY_LOCK:
        if not fs.exists(path) or fs.size(path) > prof.max_bytes:
            return False
        if hashlib.sha256(fs.cat_file(path)).hexdigest() != sha256:
            return False
        fs.rm_file(path)
    return True


async def _read(prof: Profile, key: str, max_bytes: int) -> bytes | None:
    if prof.is_local:
        return await asyncio.to_thread(_local_read, prof, key, max_bytes)
    if prof.is_s3:
        client = await s3_client(prof)
        try:
            data = await _s3_read(client, prof, key, max_bytes)
        except ObjectTooLargeError:
            raise
        except Exception as e:  # noqa: BLE001 - 403/5xx/timeouts: an error, never "absent"; no provider detail
            log.warning("managed_read_failed", profile=prof.name, error_type=type(e).__name__)
            raise TargetError("managed_fsspec read-back failed") from None
        if data is None:
            raise ObjectNotFoundError("managed_fsspec object does not exist")
        return data
    return await asyncio.to_thread(_memory_read, prof, key, max_bytes)


async def _exists(prof: Profile, key: str) -> bool:
    if prof.is_local:
        return await asyncio.to_thread(_local_path(prof, key).is_file)
    if prof.is_s3:
        return await _s3_size(await s3_client(prof), prof, key) is not None
    fs, path = _memory_fs_path(prof, key)
    with _MEMORY_LOCK:
        return bool(fs.exists(path))


async def _delete_if(prof: Profile, key: str, sha256: str) -> bool:
    if prof.is_local:
        return await asyncio.to_thread(_local_delete_if, prof, key, sha256)
    if prof.is_s3:
        client = await s3_client(prof)
        try:
            if not await _s3_matches(client, prof, key, sha256, None):
                return False
            # S3 has no portable compare-and-delete: a create-only key is only re-created after a delete, so
            # the window between the hash check and the delete cannot swap in other bytes of ours.
            await client.delete_object(Bucket=_bucket(prof), Key=_s3_key(prof, key))
        except Exception as e:  # noqa: BLE001 - provider detail never reaches the caller
            log.warning("managed_delete_failed", profile=prof.name, error_type=type(e).__name__)
            raise TargetError("managed_fsspec delete failed") from None
        return True
    return await asyncio.to_thread(_memory_delete_if, prof, key, sha256)


# ---- S3: one aiobotocore client per (profile, event loop) ---------------------------------------------------

_BOTOCORE_SESSIONS: dict[str | None, Any] = {}
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]] = weakref.WeakKeyDictionary()


def _botocore_session(profile_name: str | None = None) -> Any:
    """One aiobotocore session per process (and AWS profile name): it caches credential resolution and the
    parsed service models (tens of MB, ~0.2 s to build); connection pools live in the per-loop clients."""
    if profile_name not in _BOTOCORE_SESSIONS:
        from aiobotocore.session import AioSession

        _BOTOCORE_SESSIONS[profile_name] = AioSession(profile=profile_name)
    return _BOTOCORE_SESSIONS[profile_name]


def _bucket(prof: Profile) -> str:
    return prof.url.split("://", 1)[1].split("/", 1)[0]


def _s3_key(prof: Profile, key: str) -> str:
    rest = prof.url.split("://", 1)[1].split("/", 1)
    return f"{rest[1].strip('/')}/{key}" if len(rest) == 2 and rest[1].strip("/") else key


def _client_kwargs(prof: Profile) -> dict[str, Any]:
    """create_client kwargs from the profile's s3fs-style ``storage_options``: credentials, endpoint,
    ``client_kwargs`` and ``config_kwargs``; timeouts, retries and checksum behaviour from the profile."""
    from aiobotocore.config import AioConfig

    so = prof.storage_options
    kw: dict[str, Any] = {}
    for src, dst in (("key", "aws_access_key_id"), ("secret", "aws_secret_access_key"),
                     ("token", "aws_session_token"), ("endpoint_url", "endpoint_url")):
        if so.get(src) is not None:
            kw[dst] = so[src]
    kw.update(dict(so.get("client_kwargs") or {}))
    cfg = dict(so.get("config_kwargs") or {})
    cfg.update(connect_timeout=prof.connect_timeout_s, read_timeout=prof.read_timeout_s,
               retries={"total_max_attempts": prof.max_attempts, "mode": "standard"},
               request_checksum_calculation=prof.checksum, response_checksum_validation="when_required")
    if so.get("anon"):
        from botocore import UNSIGNED

        cfg["signature_version"] = UNSIGNED
    kw["config"] = AioConfig(**cfg)
    return kw


def _client_cache_key(prof: Profile) -> str:
    return json.dumps([prof.name, prof.url, prof.storage_options, prof.connect_timeout_s, prof.read_timeout_s,
                       prof.max_attempts, prof.checksum], sort_keys=True, default=str)


async def _close_at_loop_shutdown(creator: Any, cache: dict[str, Any], ck: str) -> Any:
    """An async generator parked on its first ``yield``: ``loop.shutdown_asyncgens()`` (run by ``asyncio.run``
    and uvicorn at shutdown) finalizes it, which closes the client on its own loop."""
    try:
        yield None
    finally:
        cache.pop(ck, None)
        try:
            await creator.__aexit__(None, None, None)
        except Exception:  # noqa: BLE001, S110 - best effort at loop shutdown
            pass


async def s3_client(prof: Profile) -> Any:
    """The aiobotocore S3 client of ``prof`` for the running event loop (created on first use, reused by every
    later delivery on that loop, closed at loop shutdown). Raises :class:`ConfigError` for unsupported
    ``storage_options``."""
    loop = asyncio.get_running_loop()
    per = _CLIENTS.setdefault(loop, {})
    ck = _client_cache_key(prof)
    entry = per.get(ck)
    if entry is None:
        lock = per.setdefault("__lock__", asyncio.Lock())
        async with lock:
            entry = per.get(ck)
            if entry is None:
                sess = prof.storage_options.get("session") or _botocore_session(prof.storage_options.get("profile"))
                creator = sess.create_client("s3", **_client_kwargs(prof))
                client = await creator.__aenter__()
                closer = _close_at_loop_shutdown(creator, per, ck)
                await closer.__anext__()
                entry = per[ck] = (client, closer)
    return entry[0]


def _client_error(e: Exception) -> tuple[int | None, str]:
    resp = getattr(e, "response", None) or {}
    return resp.get("ResponseMetadata", {}).get("HTTPStatusCode"), str(resp.get("Error", {}).get("Code", ""))


def _is_not_found(e: Exception) -> bool:
    """An S3 client error that means "no object at the key" (404 / NoSuchKey / NotFound)."""
    status, code = _client_error(e)
    return status == 404 or code in ("404", "NoSuchKey", "NotFound")


async def _s3_size(client: Any, prof: Profile, key: str) -> int | None:
    """HEAD: the stored size in bytes, or None when there is no object."""
    try:
        head = await client.head_object(Bucket=_bucket(prof), Key=_s3_key(prof, key))
    except Exception as e:
        if _is_not_found(e):
            return None
        raise
    return int(head["ContentLength"])


async def _s3_read(client: Any, prof: Profile, key: str, max_bytes: int, hasher: Any = None) -> bytes | None:
    """GET streamed in chunks, at most ``max_bytes`` (+1 to detect more; raises ObjectTooLargeError); None if
    absent. ``hasher`` (hashlib object) is fed while streaming."""
    try:
        resp = await client.get_object(Bucket=_bucket(prof), Key=_s3_key(prof, key))
    except Exception as e:
        if _is_not_found(e):
            return None
        raise
    body = resp["Body"]
    try:
        if int(resp.get("ContentLength", 0)) > max_bytes:
            raise ObjectTooLargeError(f"managed_fsspec object is larger than max_bytes={max_bytes}")
        buf = bytearray()
        while True:
            chunk = await body.read(min(_CHUNK, max_bytes + 1 - len(buf)))
            if not chunk:
                break
            buf += chunk
            if hasher is not None:
                hasher.update(chunk)
            if len(buf) > max_bytes:
                raise ObjectTooLargeError(f"managed_fsspec object is larger than max_bytes={max_bytes}")
        return bytes(buf)
    finally:
        body.close()


async def _s3_matches(client: Any, prof: Profile, key: str, sha256: str, size: int | None) -> bool:
    """Stored object has exactly ``size`` bytes (when given; asked first by HEAD) and SHA-256 ``sha256``,
    streamed and never reading more than the profile's ``max_bytes``."""
    stored = await _s3_size(client, prof, key)
    if stored is None or stored > prof.max_bytes or (size is not None and stored != size):
        return False
    h = hashlib.sha256()
    try:
        data = await _s3_read(client, prof, key, prof.max_bytes, h)
    except ObjectTooLargeError:
        return False
    return data is not None and h.hexdigest() == sha256


async def _write_s3_create_only(prof: Profile, key: str, data: bytes, sha256: str) -> None:
    from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

    try:
        client = await s3_client(prof)
        try:
            # one PutObject (never multipart), conditional create; no flexible checksum unless configured
            await client.put_object(Bucket=_bucket(prof), Key=_s3_key(prof, key), Body=data, IfNoneMatch="*",
                                    ContentLength=len(data))
        except (ConnectTimeoutError, ReadTimeoutError):
            raise
        except Exception as e:
            status, code = _client_error(e)
            if status not in (412, 409) and code not in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise
            # only a resend can meet our own earlier attempt: a 412 on this call's first PUT (botocore's
            # RetryAttempts == 0) is an object that was there before this delivery, whatever its bytes
            retried = int(((getattr(e, "response", None) or {}).get("ResponseMetadata") or {})
                          .get("RetryAttempts") or 0)
            if status == 409 or not retried or not await _s3_matches(client, prof, key, sha256, len(data)):
                raise DeliveryError("managed artifact object already exists", "object_exists") from None
            log.info("managed_put_idempotent", profile=prof.name)  # an earlier attempt of ours landed
    except DeliveryError:
        raise
    except (TimeoutError, ConnectTimeoutError, ReadTimeoutError):
        raise DeliveryError("managed artifact write timed out", "timeout") from None
    except Exception as e:  # noqa: BLE001 - provider detail never reaches the caller
        log.warning("managed_put_failed", profile=prof.name, error_type=type(e).__name__)
        raise DeliveryError("managed artifact write failed") from None


def s3_filesystem(prof: Profile, **extra: Any) -> Any:
    """A fresh s3fs filesystem for ``prof`` (for streaming readers such as ``inspect``), with the profile's
    timeouts, total attempts and checksum behaviour; s3fs's own extra retry loop is disabled."""
    import s3fs

    opts = dict(prof.storage_options)
    opts.setdefault("session", _botocore_session(opts.pop("profile", None)))
    cfg = dict(opts.pop("config_kwargs", {}) or {})
    cfg.update(connect_timeout=prof.connect_timeout_s, read_timeout=prof.read_timeout_s,
               retries={"total_max_attempts": prof.max_attempts, "mode": "standard"},
               request_checksum_calculation=prof.checksum, response_checksum_validation="when_required")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=cfg, **opts, **extra)
    fs.retries = 1
    return fs


def fs_and_path(profile: Profile, key: str) -> tuple[Any, str]:
    """A fresh filesystem for ``profile`` and the full path of ``key`` in it (for readers that stream)."""
    if profile.is_s3:
        return s3_filesystem(profile), f"{profile.url.split('://', 1)[1].rstrip('/')}/{key}"
    fs, root = fsspec.core.url_to_fs(profile.url, skip_instance_cache=True, **profile.storage_options)
    return fs, f"{root.rstrip('/')}/{key}"


def open_object(profile: Profile, key: str) -> bytes:
    """Read a stored object back synchronously (tests, scripts), at most the profile's ``max_bytes``."""
    fs, path = fs_and_path(profile, key)
    with fs.open(path, "rb") as f:
        data = _read_capped_fileobj(f, None, profile.max_bytes)
    if data is None:
        raise ObjectTooLargeError(f"managed_fsspec object is larger than max_bytes={profile.max_bytes}")
    return data


# The last target built, for the same settings: the host asks for a target per request, with the same settings
# object each time (a run's [targets.managed_fsspec] table); parsing the profiles again cost more driver time
# than encoding a small artifact. Reused only while every input of that parse is unchanged: that very settings
# object, still equal (same types too: 1 is not True, nor 1.0) to the snapshot that was parsed,
# GENARTIFACT_STORAGE_PROFILES and the working directory (relative profile urls resolve against it). The
# snapshot is taken before parsing and is what gets parsed, so a settings object changed meanwhile (another
# thread) cannot pair a new copy with a target of old settings. The target itself holds nothing per request.
# A snapshot of plain JSON-like values only (the usual TOML table) is also kept as its pickle: comparing the live
# settings' pickle with it is the same exact check (pickle writes each value's type: True, 1 and 1.0 differ; dict
# order and every key and value are in it) at 0.6 us instead of 7 us for the walk of :func:`_same` (2026-12-05
# AMX box). Anything else in the live settings (another type, an object that cannot be pickled) gives other
# bytes or an error: parse again.
_LAST_TARGET: tuple[Any, Any, bytes | None, str | None, str, ManagedFsspecTarget] | None = None
_PLAIN_SCALARS = (str, int, float, bool, type(None))


def _plain(v: Any, depth: int = 0) -> bool:
    """``v`` is made only of exact ``dict`` (string keys), ``list``, ``tuple`` and scalars of exact type ``str``,
    ``int``, ``float``, ``bool`` or ``None``, at most 64 levels deep: values whose pickle says all of them."""
    t = type(v)
    if t in _PLAIN_SCALARS:
        return True
    if depth > 64:
        return False
    if t is dict:
        return all(type(k) is str and _plain(x, depth + 1) for k, x in v.items())
    if t is list or t is tuple:
        return all(_plain(x, depth + 1) for x in v)
    return False


def _fingerprint(snapshot: Any) -> bytes | None:
    """The pickle of a plain ``snapshot`` (:func:`_plain`), else None (compare with :func:`_same`)."""
    try:
        return pickle.dumps(snapshot, protocol=5) if _plain(snapshot) else None
    except Exception:  # noqa: BLE001 - e.g. a recursion limit: compare the slow way
        return None


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """``a`` equals ``b`` with the same types throughout (dicts in the same order, lists element-wise). Any doubt
    (a comparison raising, an array's ambiguous truth value, more than 64 levels) is False: parse again."""
    if type(a) is not type(b) or depth > 64:
        return False
    if isinstance(a, Mapping):
        return len(a) == len(b) and all(_same(ka, kb, depth + 1) and _same(va, vb, depth + 1)
                                        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b, strict=True))
    eq = a == b
    return eq if isinstance(eq, bool) else False


@hookimpl
def genartifact_storage_target(kind: str, settings: Mapping[str, Any]) -> ManagedFsspecTarget | None:
    global _LAST_TARGET
    if kind != KIND:
        return None
    env = os.environ.get(ENV_PROFILES)
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed: parse as before (it matters only for relative urls)
        _LAST_TARGET = None
        return ManagedFsspecTarget(parse_profiles(settings, env_profiles=env))
    last = _LAST_TARGET
    if last is not None and last[0] is settings and last[3] == env and last[4] == cwd:
        try:
            if (pickle.dumps(settings, protocol=5) == last[2] if last[2] is not None else _same(last[1], settings)):
                return last[5]
        except Exception:  # noqa: BLE001 - a settings object changing while compared (another thread): parse
            pass
    try:
        snapshot = copy.deepcopy(settings)
    except Exception:  # noqa: BLE001 - settings that cannot be copied are simply parsed every time
        _LAST_TARGET = None
        return ManagedFsspecTarget(parse_profiles(settings, Path(cwd), env_profiles=env))
    target = ManagedFsspecTarget(parse_profiles(snapshot, Path(cwd), env_profiles=env))
    _LAST_TARGET = (settings, snapshot, _fingerprint(snapshot), env, cwd, target)
    return target


@hookimpl
def genartifact_target_shorthand(kind: str, value: str, run_id: str, index: int) -> dict[str, Any] | None:
    """``generate --target managed_fsspec:PROFILE``: key ``runs/<run_id>/<index:05d>.gart`` in ``PROFILE``."""
    if kind != KIND:
        return None
    return {"kind": KIND, "profile": value, "object_key": f"runs/{run_id}/{index:05d}.gart"}
