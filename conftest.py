"""Root pytest configuration: services shared by every test directory (loopback only)."""

from __future__ import annotations

import os
import socket

import pytest
from genartifact.testing.s3server import ACCESS_KEY as S3_KEY
from genartifact.testing.s3server import SECRET_KEY as S3_SECRET
from genartifact.testing.s3server import SeaweedS3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
