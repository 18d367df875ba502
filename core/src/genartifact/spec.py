"""The artifact request spec (JSON-compatible dict), validated strictly before inference::

    {"format": "generation_artifact_v1", "contents": ["moe_routes", ...], "codec": "zstd",
     "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", ...kind-specific...}}}

Unknown keys are rejected at every level that genartifact owns; the target's own keys are validated by
the target plugin.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from genartifact.errors import RequestSpecError
from genartifact.format import CODECS, FORMAT_NAME

_TOP = {"format", "contents", "codec", "delivery"}
_DELIVERY = {"mode", "target"}
MAX_CONTENTS = 16
CONTENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class ArtifactRequest:
    """A validated request spec. ``contents`` keeps request order; ``target`` is the raw target dict."""

    contents: tuple[str, ...]
    target: Mapping[str, Any] = field(repr=False)
    codec: str = "zstd"
    format: str = FORMAT_NAME

    @property
    def target_kind(self) -> str:
        return str(self.target["kind"])


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` as an error message shows it: at most ``limit`` characters (a request's own 200 KB string
    comes back as its first 80 and ``...``)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _keys(obj: Any, allowed: set[str], required: set[str], where: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise RequestSpecError(f"{where} must be an object, got {type(obj).__name__}")
    unknown = set(obj) - allowed
    if unknown:
        raise RequestSpecError(f"{where}: unknown key(s) {_short(sorted(map(str, unknown)))}; allowed: {sorted(allowed)}")
    missing = required - set(obj)
    if missing:
        raise RequestSpecError(f"{where}: missing key(s) {sorted(missing)}")
    return obj


def parse_request(obj: Any, *, n: int = 1) -> ArtifactRequest:
    """Validate a request spec. ``n`` is the request's number of choices (must be 1).

    Raises :class:`RequestSpecError` naming the field: wrong ``format`` or ``codec``, empty, duplicate or
    non-string ``contents``, missing/unknown keys, ``delivery.mode`` other than ``object_store``,
    a target without a string ``kind``, or ``n != 1``. Whether content names and the target kind are
    installed and enabled is checked by the session against the plugin host.
    """
    spec = _keys(obj, _TOP, {"format", "contents", "delivery"}, "generation_artifact")
    if spec["format"] != FORMAT_NAME:
        raise RequestSpecError(f"generation_artifact.format {_short(spec['format'])} unsupported; allowed: ['{FORMAT_NAME}']")
    codec = spec.get("codec", "zstd")
    if not isinstance(codec, str) or codec not in CODECS:
        raise RequestSpecError(f"generation_artifact.codec {_short(codec)} unsupported; allowed: {sorted(CODECS)}")
    contents = spec["contents"]
    if not isinstance(contents, list) or not contents or not all(isinstance(c, str) and c for c in contents):
        raise RequestSpecError("generation_artifact.contents must be a non-empty list of content names")
    if len(contents) > MAX_CONTENTS:
        raise RequestSpecError(f"generation_artifact.contents has {len(contents)} names; at most {MAX_CONTENTS}")
    bad = [c for c in contents if not CONTENT_NAME.fullmatch(c)]
    if bad:
        raise RequestSpecError(f"generation_artifact.contents name {_short(bad[0])} invalid; allowed: [A-Za-z0-9_.-], 1..64 chars")
    norm = [c.replace("-", "_") for c in contents]  # plugin names treat '-' and '_' alike
    dup = sorted({c for c in norm if norm.count(c) > 1})
    if dup:
        raise RequestSpecError(f"generation_artifact.contents has duplicates: {_short(dup)}")
    delivery = _keys(spec["delivery"], _DELIVERY, _DELIVERY, "generation_artifact.delivery")
    if delivery["mode"] != "object_store":
        raise RequestSpecError(f"generation_artifact.delivery.mode {_short(delivery['mode'])} unsupported; allowed: ['object_store']")
    target = delivery["target"]
    if not isinstance(target, Mapping) or not isinstance(target.get("kind"), str) or not target["kind"]:
        raise RequestSpecError("generation_artifact.delivery.target must be an object with a string 'kind'")
    if not isinstance(n, int) or isinstance(n, bool) or n != 1:
        raise RequestSpecError(f"generation artifacts require n=1 (one choice per request); got n={_short(n)}")
    return ArtifactRequest(contents=tuple(norm), target=dict(target), codec=codec)
