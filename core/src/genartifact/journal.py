"""Local delivery journal: an intent line is made durable before every upload, an outcome line after it.

Every delivery (one upload attempt sequence of one request) has its own id, even when two requests name the
same object. An outcome is recorded for every intent: ``ready``; ``failed`` with the receipt's error code;
``interrupted`` (cancelled or crashed mid-upload, as far as the process could tell). A process that dies
between the upload and the outcome leaves an intent with no outcome. ``genartifact reconcile`` reads the
journal (:func:`assess`): it never calls an object an orphan when any ``ready`` outcome or ready receipt
vouches for that object id, treats outcomes that prove nothing of ours was stored (``object_exists``,
``expired``... see :data:`NOT_STORED_CODES`) as explained, and leaves deliveries younger than an age guard
alone (an upload may still be in flight).

Lines are JSON, appended with ``O_APPEND`` and fsync'ed. Entries hold only non-secret references (profile and
key, or the upload host and the caller's opaque object id) — never URLs, query strings, header values or
credentials.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genartifact.errors import ConfigError

# Failure codes after which the store holds nothing written by this delivery: the store refused the write
# (412 object_exists, 403 expired/signature_mismatch/forbidden, 413 too_large, 3xx redirect_refused) or it was never
# sent (target_invalid, too_large before sending). delivery_failed/timeout/internal_error are ambiguous.
NOT_STORED_CODES = frozenset({"object_exists", "expired", "signature_mismatch", "forbidden", "too_large",
                              "target_invalid",
                              "redirect_refused", "encode_failed", "capture_invalid"})
RESOLVED_STATES = frozenset({"ready", "deleted", "absent", "vouched", "foreign"})
DEFAULT_OLDER_THAN_S = 3600.0


class DeliveryJournal:
    """Append-only JSONL journal at ``path`` (parent directories are created on first write).

    Writes raise ``OSError`` (e.g. ENOSPC) to the caller, which decides what that fails (an intent that cannot
    be written must stop the upload; an outcome that cannot be written must not undo a stored object)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def _append(self, record: Mapping[str, Any]) -> None:
        """Append one record as one line, durably (fsync), or leave the file as it was: a write that fails or
        comes up short (ENOSPC) is cut back off, so the file never keeps a torn line of this process. A torn
        tail left by a writer that died mid-line (a power loss) is cut off first, so a record never continues
        another one's partial line (such a line read as "not JSON" and stopped every later reconcile and resume).
        Appends of every process are serialised by an exclusive ``flock`` on the file (several runs may share
        one journal). Raises ``OSError``."""
        import fcntl

        line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released by close, also when this process dies
                size = _whole_lines_size(fd)
                try:
                    n = _write(fd, line)
                    if n != len(line):
                        raise OSError(28, "short write to the delivery journal")
                    os.fsync(fd)
                except BaseException:
                    try:  # nothing of this record stays behind (a later append starts on a whole line)
                        os.ftruncate(fd, size)
                    except OSError:
                        pass  # cut off by the next append's torn-tail check instead
                    raise
            finally:
                os.close(fd)

    def intent(self, *, kind: str, object_id: str, ref: Mapping[str, Any], sha256: str, byte_count: int) -> str:
        """Record an upload about to start; returns the delivery id (a fresh UUID per delivery)."""
        did = uuid.uuid4().hex
        self._append({"event": "intent", "id": did, "t": time.time(), "kind": kind, "object_id": object_id,
                      "ref": dict(ref), "sha256": sha256, "byte_count": byte_count})
        return did

    def outcome(self, delivery_id: str, state: str, error_code: str | None = None) -> None:
        """Record how delivery ``delivery_id`` ended: ``ready``, ``failed`` (with ``error_code``),
        ``interrupted``, or a reconcile verdict (``deleted``, ``absent``, ``vouched``, ``foreign``)."""
        self._append({"event": "outcome", "id": delivery_id, "t": time.time(), "state": state,
                      "error_code": error_code})

    def deliveries(self) -> list[dict[str, Any]]:
        """Every intent, oldest first, with ``last_state`` and ``last_code`` of its latest outcome (None when
        the process died before any). Raises :class:`ConfigError` for a malformed line other than a torn
        last line (a crash mid-append)."""
        if not self.path.exists():
            return []
        intents: dict[str, dict[str, Any]] = {}
        last: dict[str, tuple[str, str | None]] = {}
        with open(self.path, "rb") as f:
            lines = f.read().split(b"\n")
        while lines and not lines[-1].strip():
            lines.pop()
        for n, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested too deeply
                if n == len(lines):
                    continue  # a torn last line from a crash mid-append
                raise ConfigError(f"journal {self.path}:{n} is not JSON (a damaged line: move the journal aside or "
                                  f"delete that line, then rerun)") from None
            problem = _record_problem(rec)
            if problem:
                if n == len(lines):
                    continue
                raise ConfigError(f"journal {self.path}:{n}: {problem}")
            if rec.get("event") == "intent":
                intents[rec["id"]] = rec
            elif rec.get("event") == "outcome":
                last[rec["id"]] = (rec["state"], rec.get("error_code"))
        return [{**rec, "last_state": last.get(did, (None, None))[0], "last_code": last.get(did, (None, None))[1]}
                for did, rec in intents.items()]

    def unresolved(self) -> list[dict[str, Any]]:
        """Deliveries that may have left an object nobody was told about: no outcome, ``interrupted``, or
        ``failed`` with an ambiguous code (not in :data:`NOT_STORED_CODES`); oldest first."""
        return [d for d in self.deliveries() if _needs_check(d)]


#: ``os.write``, looked up here at call time (the tests' full-disk faults replace this name, not ``os.write`` for
#: every thread of the process)
def _write(fd: int, data: bytes) -> int:
    return os.write(fd, data)


def _whole_lines_size(fd: int) -> int:
    """The size of the journal open at ``fd`` after cutting off a torn tail (bytes after the last newline: a line
    whose writer died mid-write); the file is truncated to it. Called with the append lock held."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size
    while end > 0:  # back to the last newline, in blocks
        start = max(0, end - 65536)
        i = os.pread(fd, end - start, start).rfind(b"\n")
        if i >= 0:
            end = start + i + 1
            break
        end = start
    os.ftruncate(fd, end)
    return end


_INTENT_FIELDS = {"id": str, "kind": str, "object_id": str, "sha256": str, "t": (int, float), "byte_count": int}
_OUTCOME_FIELDS = {"id": str, "state": str, "t": (int, float)}


def _record_problem(rec: Any) -> str | None:
    """What is wrong with one parsed journal line (a damaged file: zero-filled blocks after a power loss,
    a foreign writer), or None when it is a well-formed intent/outcome record or another event (ignored)."""
    if not isinstance(rec, dict):
        return f"record is a JSON {type(rec).__name__}, not an object"
    event = rec.get("event")
    fields = {"intent": _INTENT_FIELDS, "outcome": _OUTCOME_FIELDS}.get(event) if isinstance(event, str) else None
    if fields is None:
        return None  # another event (a later version's note): ignored, as before
    for key, typ in fields.items():
        v = rec.get(key)
        if isinstance(v, bool) or not isinstance(v, typ):
            return f"{rec['event']} field {key!r} is {type(v).__name__}; expected {getattr(typ, '__name__', 'number')}"
    return None


def _needs_check(d: Mapping[str, Any]) -> bool:
    state = d.get("last_state")
    if state in RESOLVED_STATES:
        return False
    return not (state == "failed" and d.get("last_code") in NOT_STORED_CODES)


@dataclass
class Assessment:
    """What reconcile concluded for one unresolved delivery. ``status``: ``in_flight`` (younger than the age
    guard; untouched), ``vouched`` (a ready outcome/receipt names this object with these bytes: it is good),
    ``absent``, ``orphan`` (our bytes, no ready receipt), ``foreign`` (other bytes; never touched),
    ``unverifiable`` (the target cannot read back), ``deleted``."""

    delivery: dict[str, Any]
    status: str
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def vouchers(deliveries: Iterable[Mapping[str, Any]], receipts: Iterable[Mapping[str, Any]] = ()) -> dict[str, set[str]]:
    """object id -> SHA-256 digests that a ``ready`` journal outcome or a ready receipt vouches for. A ready
    group sample's receipt also vouches for the prompt part it references (``group.prompt_part``: its
    ``object_id`` and ``sha256``), so reconcile never calls a referenced prompt part an orphan."""
    out: dict[str, set[str]] = {}
    for d in deliveries:
        if d.get("last_state") == "ready":
            out.setdefault(d["object_id"], set()).add(d["sha256"])
    for r in receipts:
        if r.get("state") != "ready":
            continue
        refs = [r]
        g = r.get("group")
        if isinstance(g, dict) and isinstance(g.get("prompt_part"), dict):
            refs.append(g["prompt_part"])
        for x in refs:
            if isinstance(x.get("object_id"), str) and isinstance(x.get("sha256"), str):
                out.setdefault(x["object_id"], set()).add(x["sha256"])
    return out


def split_by_age(unresolved: Iterable[dict[str, Any]], older_than_s: float, now: float | None = None
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(old enough to judge, still possibly in flight) by intent time ``t`` (seconds) vs ``older_than_s``."""
    now = time.time() if now is None else now
    old, young = [], []
    for d in unresolved:
        (old if now - float(d.get("t", now)) >= older_than_s else young).append(d)
    return old, young
