"""Fixtures shared by the managed_fsspec tests."""

from __future__ import annotations

import os
import stat

import pytest


@pytest.fixture
def sync_events(monkeypatch):
    """``sync_events(root)`` starts recording this test's ``os.fsync`` and ``os.link`` calls and returns the list they
    are appended to, in order: ``"fsync_file"``, ``"link"``, or ``("fsync_dir", <directory relative to root>)``."""

    def start(root):
        events: list = []
        real_fsync, real_link = os.fsync, os.link

        def fsync(fd):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                events.append(("fsync_dir", os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), root)))
            else:
                events.append("fsync_file")
            return real_fsync(fd)

        def link(src, dst, **kw):
            events.append("link")
            return real_link(src, dst, **kw)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "link", link)
        return events

    return start
