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
    max_attempts = 3               # object stores: botocore "standard" retries of transient errors

Profiles may also come from ``GENARTIFACT_STORAGE_PROFILES`` (a JSON object name -> profile, same keys),
merged over the config's profiles.

Request target: ``{"kind": "managed_fsspec", "profile": "local", "object_key": "runs/x/0001.gart"}``.
Receipt object id: ``"<profile>:<object_key>"``.

Create-only and all-or-nothing: local files are written to a hidden temp file in the destination
directory and published with ``os.link`` (atomic, fails if the key exists). S3 (``s3://``, ``s3a://``) goes
through s3fs's async API with a fresh ``S3FileSystem`` per delivery (no session or event-loop state shared
across loops): one ``PutObject`` with ``If-None-Match: *`` (conditional create; a second write of the key
fails with 412 and is reported as ``object_exists``), never multipart for objects up to ``max_bytes``. When a
retried PUT meets 412 the stored object is read back and compared by SHA-256: identical bytes mean an earlier
attempt landed (success), anything else is ``object_exists``. ETags are never used as digests. Other fsspec
filesystems use ``pipe_file(mode="create")``.

Default timeouts: connect 5 s (a healthy object store answers in milliseconds; a dead endpoint should fail
fast enough to leave retry budget), read 30 s (one 64 MiB PUT at >= 3 MB/s), whole delivery 60 s (bounds the
pipeline slot a delivery can hold), 3 attempts in botocore's standard mode (transient 5xx, throttling and
connection errors, with jittered exponential backoff).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pluggy
import structlog
from genartifact.errors import ConfigError, DeliveryError, TargetError
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
                 "read_timeout_s", "max_attempts"}
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


def parse_profiles(settings: Mapping[str, Any], base_dir: Path | None = None) -> dict[str, Profile]:
    """Validate ``settings["profiles"]``. Raises :class:`ConfigError` naming profile and key."""
    unknown = set(settings) - {"profiles", "base_dir"}
    if unknown:
        raise ConfigError(f"[targets.managed_fsspec]: unknown key(s) {sorted(unknown)}; allowed: ['profiles']")
    base = Path(settings.get("base_dir") or base_dir or Path.cwd())
    raw = settings.get("profiles", {})
    if not isinstance(raw, Mapping):
        raise ConfigError("[targets.managed_fsspec.profiles] must be a table")
    env = os.environ.get(ENV_PROFILES)
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
        times = {k: _seconds(p, k, d, where) for k, d in
                 (("timeout_s", 60.0), ("connect_timeout_s", 5.0), ("read_timeout_s", 30.0))}
        attempts = p.get("max_attempts", 3)
        if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= 10:
            raise ConfigError(f"{where}.max_attempts={attempts!r}; allowed: integer 1..10")
        out[name] = Profile(name, url.rstrip("/"), tuple(prefixes), mb, dict(so), max_attempts=attempts, **times)
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
                    await asyncio.to_thread(_write_local_create_only, Path(prof.url[len("file://"):]) / key, data)
                elif prof.is_s3:
                    await _write_s3_create_only(prof, key, data, sha256)
                else:
                    await asyncio.to_thread(_write_fsspec_create_only, prof, key, data)
        except TimeoutError:
            raise DeliveryError("managed artifact write timed out", "timeout") from None
        return target.object_id


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _write_local_create_only(dest: Path, data: bytes) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest.parent)
    except OSError:
        raise DeliveryError("managed artifact write failed") from None
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp creates 0600; published objects follow the umask like any file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, dest)  # atomic publish; EEXIST if the key exists
    except FileExistsError:
        raise DeliveryError("managed artifact object already exists", "object_exists") from None
    except OSError:
        raise DeliveryError("managed artifact write failed") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _write_fsspec_create_only(prof: Profile, key: str, data: bytes) -> None:
    fs, root = fsspec.core.url_to_fs(prof.url, skip_instance_cache=True, **prof.storage_options)
    path = f"{root.rstrip('/')}/{key}"
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        raise DeliveryError("managed artifact object already exists", "object_exists") from None
    except Exception:  # noqa: BLE001 - provider detail never reaches the caller
        raise DeliveryError("managed artifact write failed") from None


_BOTOCORE_SESSION: Any = None


def _botocore_session() -> Any:
    """One aiobotocore session per process: it only caches credentials resolution and the parsed service
    models (tens of MB and ~0.2 s to build); it holds no connection pool or event-loop state, which live in
    the per-delivery client."""
    global _BOTOCORE_SESSION
    if _BOTOCORE_SESSION is None:
        from aiobotocore.session import AioSession

        _BOTOCORE_SESSION = AioSession()
    return _BOTOCORE_SESSION


def s3_filesystem(prof: Profile, **extra: Any) -> Any:
    """A fresh s3fs filesystem for ``prof`` (``skip_instance_cache``: no client, connection pool or event-loop
    state shared across deliveries or loops; only the process-wide botocore model cache is reused), with the
    profile's connect/read timeouts and botocore standard-mode retries; s3fs's own extra retry loop is
    disabled so the attempt count is exactly ``max_attempts``."""
    import s3fs

    opts = dict(prof.storage_options)
    opts.setdefault("session", _botocore_session())
    cfg = dict(opts.pop("config_kwargs", {}) or {})
    cfg.update(connect_timeout=prof.connect_timeout_s, read_timeout=prof.read_timeout_s,
               retries={"max_attempts": prof.max_attempts, "mode": "standard"})
    fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=cfg, **opts, **extra)
    fs.retries = 1
    return fs


async def _write_s3_create_only(prof: Profile, key: str, data: bytes, sha256: str) -> None:
    fs = s3_filesystem(prof, asynchronous=True)
    path = f"{prof.url.split('://', 1)[1].rstrip('/')}/{key}"
    try:
        await fs.set_session()
        try:
            # chunksize >= max_bytes: s3fs sends one PutObject (multipart only above 2 x chunksize)
            await fs._pipe_file(path, data, mode="create", chunksize=max(prof.max_bytes, 5 << 20))
        except FileExistsError:
            stored = await fs._cat_file(path)
            if hashlib.sha256(stored).hexdigest() != sha256:
                raise DeliveryError("managed artifact object already exists", "object_exists") from None
            log.info("managed_put_idempotent", profile=prof.name)  # an earlier attempt of ours landed
    except DeliveryError:
        raise
    except TimeoutError:
        raise DeliveryError("managed artifact write timed out", "timeout") from None
    except Exception as e:  # noqa: BLE001 - provider detail never reaches the caller
        log.warning("managed_put_failed", profile=prof.name, error_type=type(e).__name__)
        raise DeliveryError("managed artifact write failed") from None
    finally:
        s3 = getattr(fs, "_s3", None)
        if s3 is not None:
            try:
                await s3.__aexit__(None, None, None)
            except Exception:  # noqa: BLE001, S110 - closing must not mask the outcome
                pass


def fs_and_path(profile: Profile, key: str) -> tuple[Any, str]:
    """A fresh filesystem for ``profile`` and the full path of ``key`` in it (for readers that stream)."""
    if profile.is_s3:
        return s3_filesystem(profile), f"{profile.url.split('://', 1)[1].rstrip('/')}/{key}"
    fs, root = fsspec.core.url_to_fs(profile.url, skip_instance_cache=True, **profile.storage_options)
    return fs, f"{root.rstrip('/')}/{key}"


def open_object(profile: Profile, key: str) -> bytes:
    """Read a stored object back (inspect, verify, reconcile, tests)."""
    fs, path = fs_and_path(profile, key)
    return fs.cat_file(path)


def object_exists(profile: Profile, key: str) -> bool:
    fs, path = fs_and_path(profile, key)
    return bool(fs.exists(path))


def delete_object(profile: Profile, key: str) -> None:
    fs, path = fs_and_path(profile, key)
    fs.rm_file(path)


@hookimpl
def genartifact_storage_target(kind: str, settings: Mapping[str, Any]) -> ManagedFsspecTarget | None:
    if kind != KIND:
        return None
    return ManagedFsspecTarget(parse_profiles(settings))


@hookimpl
def genartifact_target_shorthand(kind: str, value: str, run_id: str, index: int) -> dict[str, Any] | None:
    """``generate --target managed_fsspec:PROFILE``: key ``runs/<run_id>/<index:05d>.gart`` in ``PROFILE``."""
    if kind != KIND:
        return None
    return {"kind": KIND, "profile": value, "object_key": f"runs/{run_id}/{index:05d}.gart"}
