"""Local delivery journal: an intent line is made durable before every upload, an outcome line after it.

A process that dies between the upload and the receipt leaves an intent without a ``ready`` outcome; the
``genartifact reconcile`` command lists such objects (and deletes them from managed profiles with
``--delete``). Lines are JSON, appended with ``O_APPEND`` and fsync'ed. Entries hold only non-secret
references (profile and key, or the upload host and the caller's opaque object id) — never URLs, query
strings, header values or credentials.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from genartifact.errors import ConfigError


class DeliveryJournal:
    """Append-only JSONL journal at ``path`` (parent directories are created on first write)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def _append(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    def intent(self, *, kind: str, object_id: str, ref: Mapping[str, Any], sha256: str, byte_count: int) -> str:
        """Record an upload about to start; returns the delivery id."""
        did = uuid.uuid4().hex
        self._append({"event": "intent", "id": did, "t": time.time(), "kind": kind, "object_id": object_id,
                      "ref": dict(ref), "sha256": sha256, "byte_count": byte_count})
        return did

    def outcome(self, delivery_id: str, state: str, error_code: str | None = None) -> None:
        """Record how delivery ``delivery_id`` ended (``ready``, ``failed``, ``deleted``, ``absent``)."""
        self._append({"event": "outcome", "id": delivery_id, "t": time.time(), "state": state,
                      "error_code": error_code})

    def unresolved(self) -> list[dict[str, Any]]:
        """Intents whose last outcome is not ``ready``/``deleted``/``absent`` (missing or ``failed``), oldest
        first; each with ``last_state`` (None when the process died before any outcome)."""
        if not self.path.exists():
            return []
        intents: dict[str, dict[str, Any]] = {}
        last: dict[str, str] = {}
        lines = self.path.read_text(encoding="utf-8").splitlines()
        for n, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                if n == len(lines):
                    continue  # a torn last line from a crash mid-append
                raise ConfigError(f"journal {self.path}:{n} is not JSON") from None
            if rec.get("event") == "intent":
                intents[rec["id"]] = rec
            elif rec.get("event") == "outcome":
                last[rec["id"]] = rec["state"]
        return [{**rec, "last_state": last.get(did)} for did, rec in intents.items()
                if last.get(did) not in ("ready", "deleted", "absent")]
