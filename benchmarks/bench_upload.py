"""Upload throughput of a 32 MiB artifact through each storage target ÷ a bare client sending the same bytes
to the same real S3 implementation (SeaweedFS ``weed mini`` on loopback, genartifact.testing.s3server: SigV4
and If-None-Match enforced), target >= 0.9.

    .venv/bin/python benchmarks/bench_upload.py [--mib 32] [--reps 5]

presigned_http_put ÷ bare ``httpx.put`` of the same kind of presigned URL (If-None-Match signed);
managed_fsspec (s3://, one reused client per event loop) ÷ a bare boto3 ``put_object(IfNoneMatch="*")``
with the same checksum setting (none). Client state is the same on both sides of each pair: presigned — a fresh
HTTP connection per upload on both sides (the target opens one ``httpx.AsyncClient`` per delivery; the bare side
calls ``httpx.put``, which does the same); managed — a warm client on both sides (ours: the per-profile, per-loop
aiobotocore client of a long-lived event loop, as in ``serve``; bare: one boto3 client reused), each warmed by one
upload first. Repetitions alternate the four sides in a rotating order; every side reports median and best, each
ratio also per repetition (paired).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, ratio_line, rotation, side_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=6)
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.mib, args.reps = 1, 1
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
        f()  # warm-up (managed: creates the per-loop client; bare boto3: opens its connection pool)
    for r in range(args.reps):
        for name in rotation(list(fns), r):
            res[name].append(fns[name]())
    loop.run_until_complete(loop.shutdown_asyncgens())  # closes the loop's S3 client (as asyncio.run does)
    loop.close()
    server.stop()
    mb = len(data) / 1e6
    print(f"{args.mib} MiB per upload, {args.reps} repetitions alternated in rotating order; {load_line()}")
    for name, ts in res.items():
        print(side_line(name, [mb / t for t in ts], "MB/s"))
    print(ratio_line("presigned_http_put / bare httpx PUT (throughput)", res["ours_presigned"], res["bare_httpx"],
                     ">= 0.9", higher_is_better=False))
    print(ratio_line("managed_fsspec s3 / bare boto3 put (throughput)", res["ours_managed"], res["bare_boto3"],
                     ">= 0.9", higher_is_better=False))

if __name__ == "__main__":
    main()
