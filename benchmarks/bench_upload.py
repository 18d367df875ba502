"""Upload throughput of a 32 MiB artifact through each storage target ÷ a bare client sending the same bytes
to the same S3-compatible server (moto server mode on loopback), target >= 0.9.

    .venv/bin/python benchmarks/bench_upload.py [--mib 32] [--reps 5]

presigned_http_put ÷ bare ``httpx.put`` of the same presigned URL; managed_fsspec (s3://) ÷ bare
``s3fs.pipe_file``. Best of N per side, alternated to cancel drift.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import socket
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the S3 server's access log (it prints full URLs)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret")
    import boto3
    import s3fs
    from botocore.config import Config
    from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles
    from genartifact_http_put_target import PresignedHttpPutTarget, PresignedSettings
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    so = {"key": "bench", "secret": "bench-secret", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(signature_version="s3v4"))
    client.create_bucket(Bucket="bench")
    data = os.urandom(args.mib << 20)
    sha = hashlib.sha256(data).hexdigest()
    presigned = PresignedHttpPutTarget(PresignedSettings.parse({"insecure_http_hosts": [f"127.0.0.1:{port}"],
                                                                "read_timeout_s": 120, "total_timeout_s": 300}))
    managed = ManagedFsspecTarget(parse_profiles({"profiles": {"b": {"url": "s3://bench/m", "allowed_prefixes": [""],
                                                                     "storage_options": so, "timeout_s": 300,
                                                                     "read_timeout_s": 120}}}))
    bare_fs = s3fs.S3FileSystem(skip_instance_cache=True, **so)

    def url(key):
        return client.generate_presigned_url("put_object", Params={"Bucket": "bench", "Key": key}, ExpiresIn=600)

    def ours_presigned():
        k = f"p/{uuid.uuid4().hex}"
        v = presigned.validate({"kind": "presigned_http_put", "url": url(k), "max_bytes": len(data) + 1,
                                "expires_at": (datetime.now(UTC) + timedelta(minutes=9)).isoformat(),
                                "required_headers": {"if-none-match": "*"}, "object_id": k})
        t0 = time.perf_counter()
        asyncio.run(presigned.deliver(v, data, sha))
        return time.perf_counter() - t0

    def bare_httpx():
        u = url(f"p/{uuid.uuid4().hex}")
        t0 = time.perf_counter()
        r = httpx.put(u, content=data, headers={"if-none-match": "*"}, timeout=120)
        r.raise_for_status()
        return time.perf_counter() - t0

    def ours_managed():
        v = managed.validate({"kind": "managed_fsspec", "profile": "b", "object_key": f"k/{uuid.uuid4().hex}"})
        t0 = time.perf_counter()
        asyncio.run(managed.deliver(v, data, sha))
        return time.perf_counter() - t0

    def bare_s3fs():
        t0 = time.perf_counter()
        bare_fs.pipe_file(f"bench/bare/{uuid.uuid4().hex}", data, mode="create")
        return time.perf_counter() - t0

    res: dict[str, list[float]] = {k: [] for k in ("ours_presigned", "bare_httpx", "ours_managed", "bare_s3fs")}
    fns = {"ours_presigned": ours_presigned, "bare_httpx": bare_httpx, "ours_managed": ours_managed,
           "bare_s3fs": bare_s3fs}
    for f in fns.values():
        f()  # warm-up
    for _ in range(args.reps):
        for name, f in fns.items():
            res[name].append(f())
    server.stop()
    mb = len(data) / 1e6
    for name, ts in res.items():
        print(f"{name:15} best {mb / min(ts):7.1f} MB/s  (median {mb / sorted(ts)[len(ts) // 2]:7.1f})")
    print(f"presigned_http_put / bare httpx PUT = {min(res['bare_httpx']) / min(res['ours_presigned']):.3f}  (target >= 0.9)")
    print(f"managed_fsspec s3 / bare s3fs pipe  = {min(res['bare_s3fs']) / min(res['ours_managed']):.3f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
