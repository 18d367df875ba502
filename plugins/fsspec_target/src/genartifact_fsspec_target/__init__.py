"""``managed_fsspec``: deliver artifacts to a server-managed fsspec profile.

Server-side settings (config ``[targets.managed_fsspec]``)::

    [targets.managed_fsspec.profiles.local]
    url = "./artifacts"            # fsspec URL root (file://, memory://, s3://...); relative = local path
    allowed_prefixes = ["runs/"]   # object keys must be at or under one of these
    max_bytes = 67108864           # optional, default and ceiling 64 MiB
    storage_options = {}           # optional, passed to fsspec (credentials stay here, never in requests)

Request target: ``{"kind": "managed_fsspec", "profile": "local", "object_key": "runs/x/0001.gart"}``.
Receipt object id: ``"<profile>:<object_key>"``.

Create-only and all-or-nothing: local files are written to a hidden temp file in the destination
directory and published with ``os.link`` (atomic, fails if the key exists); other filesystems use
fsspec ``pipe_file(mode="create")`` (a single conditional PUT on s3fs).
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pluggy
from genartifact.errors import ConfigError, DeliveryError, TargetError
from genartifact.format import MAX_DECODED_BYTES, encoded_size_bound
from genartifact.types import ValidatedTarget

hookimpl = pluggy.HookimplMarker("genartifact")
KIND = "managed_fsspec"
__version__ = "0.1.0"

PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
KEY_SEGMENT = re.compile(r"[A-Za-z0-9_.=+@-]{1,255}")
MAX_KEY_BYTES = 1024
MAX_OBJECT_BYTES = encoded_size_bound(MAX_DECODED_BYTES)
_PROFILE_KEYS = {"url", "allowed_prefixes", "max_bytes", "storage_options"}
_TARGET_KEYS = {"kind", "profile", "object_key"}


@dataclass(frozen=True)
class Profile:
    """A validated storage profile; ``storage_options`` may hold credentials and is never shown."""

    name: str
    url: str
    allowed_prefixes: tuple[str, ...]
    max_bytes: int
    storage_options: Mapping[str, Any] = field(repr=False, default_factory=dict)

    @property
    def is_local(self) -> bool:
        return self.url.startswith("file://")


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
    return prefix == "" or key == prefix.rstrip("/") or key.startswith(prefix if prefix.endswith("/") else prefix + "/")


def parse_profiles(settings: Mapping[str, Any], base_dir: Path | None = None) -> dict[str, Profile]:
    """Validate ``settings["profiles"]``. Raises :class:`ConfigError` naming profile and key."""
    unknown = set(settings) - {"profiles", "base_dir"}
    if unknown:
        raise ConfigError(f"[targets.managed_fsspec]: unknown key(s) {sorted(unknown)}; allowed: ['profiles']")
    base = Path(settings.get("base_dir") or base_dir or Path.cwd())
    raw = settings.get("profiles", {})
    if not isinstance(raw, Mapping):
        raise ConfigError("[targets.managed_fsspec.profiles] must be a table")
    out = {}
    for name, p in raw.items():
        where = f"[targets.managed_fsspec.profiles.{name}]"
        if not PROFILE_NAME.fullmatch(name):
            raise ConfigError(f"{where}: profile name must match {PROFILE_NAME.pattern}")
        if not isinstance(p, Mapping) or set(p) - _PROFILE_KEYS or "url" not in p or "allowed_prefixes" not in p:
            raise ConfigError(f"{where}: needs 'url' and 'allowed_prefixes'; allowed keys: {sorted(_PROFILE_KEYS)}")
        url = p["url"]
        if not isinstance(url, str) or not url:
            raise ConfigError(f"{where}.url must be a non-empty string")
        if "://" not in url:
            url = "file://" + str((base / url).resolve())
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
        out[name] = Profile(name, url.rstrip("/"), tuple(prefixes), mb, dict(so))
    return out


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

    async def deliver(self, target: ValidatedTarget, data: bytes, sha256: str) -> str:
        """Create-only, all-or-nothing write of ``data``; returns ``"<profile>:<key>"``.
        Raises :class:`DeliveryError` with code ``object_exists``, ``too_large`` or ``delivery_failed``."""
        prof, key = target.detail
        if len(data) > prof.max_bytes:
            raise DeliveryError("artifact exceeds managed storage byte limit", "too_large")
        if prof.is_local:
            await asyncio.to_thread(_write_local_create_only, Path(prof.url[len("file://"):]) / key, data)
        else:
            await asyncio.to_thread(_write_fsspec_create_only, prof, key, data)
        return target.object_id


def _write_local_create_only(dest: Path, data: bytes) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest.parent)
    except OSError:
        raise DeliveryError("managed artifact write failed") from None
    try:
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


def open_object(profile: Profile, key: str) -> bytes:
    """Read a stored object back (for inspect/verify/tests)."""
    fs, root = fsspec.core.url_to_fs(profile.url, **profile.storage_options)
    return fs.cat_file(f"{root.rstrip('/')}/{key}")


@hookimpl
def genartifact_storage_target(kind: str, settings: Mapping[str, Any]) -> ManagedFsspecTarget | None:
    if kind != KIND:
        return None
    return ManagedFsspecTarget(parse_profiles(settings))
