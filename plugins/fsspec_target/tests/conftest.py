"""Fixtures shared by the managed_fsspec tests."""

from __future__ import annotations

import os
import stat
import threading

import pytest


class SyncEvents(list):
    """The recorded calls (see :func:`sync_events`); ``files`` pairs each ``"fsync_file"`` and ``"link"`` with the
    file's inode, in the same order."""

    files: list

    def synced_before_linked(self) -> bool:
        """Every linked file was fsynced before its link."""
        synced = set()
        for kind, ino in self.files:
            if kind == "fsync_file":
                synced.add(ino)
            elif ino not in synced:
                return False
        return True

    def clear(self) -> None:
        super().clear()
        self.files.clear()


@pytest.fixture
def sync_events(monkeypatch):
    """``sync_events(root)`` starts recording this test's ``os.fsync`` and ``os.link`` calls and returns the list they
    are appended to, in order (:class:`SyncEvents`): ``"fsync_file"``, ``"link"``, or ``("fsync_dir", <directory
    relative to root>)``. A batch's files are fsynced from several threads: the lock keeps both lists in step."""

    def start(root):
        events = SyncEvents()
        events.files = []
        lock = threading.Lock()
        real_fsync, real_link = os.fsync, os.link

        def fsync(fd):
            st = os.fstat(fd)
            with lock:
                if stat.S_ISDIR(st.st_mode):
                    events.append(("fsync_dir", os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), root)))
                else:
                    events.append("fsync_file")
                    events.files.append(("fsync_file", st.st_ino))
            return real_fsync(fd)

        def link(src, dst, **kw):
            with lock:
                events.append("link")
                events.files.append(("link", os.stat(src).st_ino))
            return real_link(src, dst, **kw)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "link", link)
        return events

    return start
