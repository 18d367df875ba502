"""Root pytest configuration: services shared by every test directory (loopback only)."""

from __future__ import annotations

import os

import pytest
from genartifact.testing.s3server import ACCESS_KEY as S3_KEY
from genartifact.testing.s3server import SECRET_KEY as S3_SECRET
from genartifact.testing.s3server import SeaweedS3


def _genartifact_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("GENARTIFACT_")}


@pytest.fixture(autouse=True)
def _no_leaked_genartifact_env():
    """Fail a test that leaves a ``GENARTIFACT_*`` environment variable changed after its teardown (monkeypatch's
    undo included): a leaked one reaches every later test and every subprocess they start. One did: a
    ``GENARTIFACT_STORAGE_PROFILES`` set behind monkeypatch's back made a later benchmark read another profile."""
    before = _genartifact_env()
    yield
    after = _genartifact_env()
    if after != before:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        for k in changed:  # put them back, so the rest of the session is not affected
            if k in before:
                os.environ[k] = before[k]
            else:
                os.environ.pop(k, None)
        pytest.fail(f"the test left environment variable(s) {changed} changed; use monkeypatch.setenv/delenv",
                    pytrace=False)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 implementation (SeaweedFS ``weed mini``, see :mod:`genartifact.testing.s3server`) with every
    listener on a free 127.0.0.1 port and bucket ``ga-test``; it checks SigV4 signatures, presigned expiry and
    ``If-None-Match: *``.

    Yields ``{"endpoint", "authority", "bucket", "storage_options", "client", "server"}`` (``client`` is boto3,
    path-style; ``server`` the :class:`SeaweedS3`)."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", S3_KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with SeaweedS3("ga-test") as server:
        yield {
            "endpoint": server.endpoint,
            "authority": server.authority,
            "bucket": server.bucket,
            "client": server.client(),
            "storage_options": server.storage_options(),
            "server": server,
        }
