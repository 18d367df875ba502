"""Upload throughput of a 32 MiB artifact through each storage target ÷ a bare client sending the same bytes
to the same real S3 implementation (SeaweedFS ``weed mini`` on loopback, genartifact.testing.s3server: SigV4
and If-None-Match enforced), target >= 0.9.

    .venv/bin/python benchmarks/bench_upload.py [--mib 32] [--reps 5]

presigned_http_put ÷ bare ``httpx.put`` of the same kind of presigned URL (If-None-Match signed);
managed_fsspec (s3://, one reused client per event loop) ÷ a bare boto3 ``put_object(IfNoneMatch="*")``
with the same checksum setting (none). Best of N per side, alternated to cancel drift; ours run on one
long-lived event loop, as in ``serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import boto3
    from botocore.config import Config
    from genartifact.testing.s3server import SeaweedS3
    from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles
    from genartifact_http_put_target import PresignedHttpPutTarget, PresignedSettings

    server = SeaweedS3("bench").start()
    port = server.port
    so = server.storage_options()
    client = server.client()
    bare = server.client(request_checksum_calculation="when_required")
    data = os.urandom(args.mib << 20)
    sha = hashlib.sha256(data).hexdigest()
    presigned = PresignedHttpPutTarget(PresignedSettings.parse({"insecure_http_hosts": [f"127.0.0.1:{port}"],
                                                                "read_timeout_s": 120, "total_timeout_s": 300}))
    managed = ManagedFsspecTarget(parse_profiles({"profiles": {"b": {"url": "s3://bench/m", "allowed_prefixes": [""],
                                                                     "storage_options": so, "timeout_s": 300,
                                                                     "read_timeout_s": 120}}}))
    loop = asyncio.new_event_loop()
    _ = (Config, boto3)

    def url(key):
        return client.generate_presigned_url("put_object", Params={"Bucket": "bench", "Key": key, "IfNoneMatch": "*"},
                                             ExpiresIn=600)

    def ours_presigned():
        k = f"p/{uuid.uuid4().hex}"
        v = presigned.validate({"kind": "presigned_http_put", "url": url(k), "max_bytes": len(data) + 1,
                                "expires_at": (datetime.now(UTC) + timedelta(minutes=9)).isoformat(),
                                "required_headers": {"if-none-match": "*"}, "object_id": k})
        t0 = time.perf_counter()
        loop.run_until_complete(presigned.deliver(v, data, sha))
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
        loop.run_until_complete(managed.deliver(v, data, sha))
        return time.perf_counter() - t0

    def bare_boto3():
        t0 = time.perf_counter()
        bare.put_object(Bucket="bench", Key=f"bare/{uuid.uuid4().hex}", Body=data, IfNoneMatch="*")
        return time.perf_counter() - t0

    res: dict[str, list[float]] = {k: [] for k in ("ours_presigned", "bare_httpx", "ours_managed", "bare_boto3")}
    fns = {"ours_presigned": ours_presigned, "bare_httpx": bare_httpx, "ours_managed": ours_managed,
           "bare_boto3": bare_boto3}
    for f in fns.values():
        f()  # warm-up
    for _ in range(args.reps):
        for name, f in fns.items():
            res[name].append(f())
    loop.run_until_complete(loop.shutdown_asyncgens())  # closes the loop's S3 client (as asyncio.run does)
    loop.close()
    server.stop()
    mb = len(data) / 1e6
    for name, ts in res.items():
        print(f"{name:15} best {mb / min(ts):7.1f} MB/s  (median {mb / sorted(ts)[len(ts) // 2]:7.1f})")
    print(f"presigned_http_put / bare httpx PUT = {min(res['bare_httpx']) / min(res['ours_presigned']):.3f}  (target >= 0.9)")
    print(f"managed_fsspec s3 / bare boto3 put  = {min(res['bare_boto3']) / min(res['ours_managed']):.3f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
