"""managed_fsspec against the kit's target conformance suite on every backend it supports: file://, memory://
and S3 (the kit's SeaweedFS server on loopback)."""

from __future__ import annotations

import uuid

import fsspec
import pytest
from genartifact.testing.conformance import TargetConformance
from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles


class _Base(TargetConformance):
    url = ""
    storage_options: dict = {}

    def make_target(self):
        common = {"allowed_prefixes": ["conformance/"], "storage_options": self.storage_options}
        return ManagedFsspecTarget(parse_profiles({"profiles": {
            "p": {"url": self.url, **common}, "small": {"url": self.url, "max_bytes": 1024, **common}}}))

    def target_spec(self, key):
        return {"kind": "managed_fsspec", "profile": "p", "object_key": key}

    def small_target_spec(self, key):
        return {"kind": "managed_fsspec", "profile": "small", "object_key": key}

    def bad_specs(self):
        return [({"kind": "managed_fsspec", "profile": "nope", "object_key": "conformance/x"}, "profile"),
                ({"kind": "managed_fsspec", "profile": "p", "object_key": "../escape"}, "object_key"),
                ({"kind": "managed_fsspec", "profile": "p", "object_key": "elsewhere/x"}, "allowed prefixes"),
                ({"kind": "managed_fsspec", "profile": "p", "object_key": "conformance/x", "url": "s3://x"},
                 "unknown key")]


class TestLocalConformance(_Base):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path):
        self.url = f"file://{tmp_path}"
        self.root = tmp_path

    def target_root(self):
        return self.root

    def fail_during_write(self, target, monkeypatch):
        """The bytes reach the temp file, then fsync fails (ENOSPC) before the atomic publish."""
        import errno
        import os

        def fsync(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "fsync", fsync)
        from genartifact.errors import DeliveryError

        return DeliveryError


class TestMemoryConformance(_Base):
    @pytest.fixture(autouse=True)
    def _root(self):
        root = f"/conformance-{uuid.uuid4().hex}"
        self.url = f"memory://{root}"
        yield
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)


class TestS3Conformance(_Base):
    @pytest.fixture(autouse=True)
    def _s3(self, s3_server):
        self.url = f"s3://{s3_server['bucket']}/conf-{uuid.uuid4().hex[:8]}"
        self.storage_options = s3_server["storage_options"]
        self.secrets = [s3_server["storage_options"]["secret"]]
