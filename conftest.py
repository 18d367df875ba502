"""Root pytest configuration: services shared by every test directory (loopback only)."""

from __future__ import annotations

import os
import socket

import pytest

S3_KEY, S3_SECRET = "testing-key-id", "testing-secret-key-do-not-log"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server (moto's server mode) on 127.0.0.1:<free port>, with bucket ``ga-test``.

    Yields ``{"endpoint", "authority", "bucket", "storage_options", "client"}`` (``client`` is boto3)."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", S3_KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import logging

    import boto3
    from botocore.config import Config
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's access log prints full (signed) URLs
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                          region_name="us-east-1", config=Config(signature_version="s3v4"))
    client.create_bucket(Bucket="ga-test")
    yield {
        "endpoint": endpoint,
        "authority": f"127.0.0.1:{port}",
        "bucket": "ga-test",
        "client": client,
        "storage_options": {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": endpoint,
                                                                                "region_name": "us-east-1"}},
    }
    server.stop()
