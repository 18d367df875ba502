"""Loaders through the real read-back of managed_fsspec: a local profile and a real S3 server (SeaweedFS)."""

from __future__ import annotations

import numpy as np
from genartifact import format as fmt
from genartifact import loaders as ld
from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles

ROWS = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 1], [4, 3]], [[0, 7], [6, 5]]], np.uint8)


def make(i: int) -> fmt.EncodedArtifact:
    return fmt.encode(fmt.ArtifactInput(
        np.array([11, 12, 13, 14, i], np.uint32), 3, ["moe_routes"],
        {"moe_routes": {"token_start": 0, "router_ids": [0, 1], "expert_counts": [8, 8], "top_k": 2,
                        "layout": "router_major", "source": "test"}},
        [fmt.TensorPart("moe_routes.expert_ids", np.ascontiguousarray(ROWS.transpose(1, 0, 2)))]))


def receipt(enc, oid):
    return {"state": "ready", "byte_count": enc.byte_count, "sha256": enc.sha256, "object_id": oid}


def test_local_profile(tmp_path):
    t = ManagedFsspecTarget(parse_profiles({"profiles": {"p": {"url": f"file://{tmp_path}", "allowed_prefixes": ["runs/"]}}}))
    enc = make(1)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a.gart").write_bytes(enc.data)
    res = ld.load_batch([receipt(enc, "p:runs/a.gart"), "p:runs/missing.gart", "p:elsewhere/x.gart"], t, layout="raw")
    assert res.items[0].data == ROWS.tobytes()
    assert [(e.index, e.check) for e in res.errors] == [(1, "fetch"), (2, "fetch")]
    assert "does not exist" in res.errors[0].message and "allowed prefixes" in res.errors[1].message


def test_s3_profile_verifies_each_object(s3_server):
    prof = {"url": f"s3://{s3_server['bucket']}/ld", "allowed_prefixes": ["runs/"],
            "storage_options": s3_server["storage_options"]}
    t = ManagedFsspecTarget(parse_profiles({"profiles": {"s3": prof}}))
    client, bucket = s3_server["client"], s3_server["bucket"]
    encs = [make(i) for i in range(12)]
    for i, e in enumerate(encs):
        client.put_object(Bucket=bucket, Key=f"ld/runs/{i}.gart", Body=e.data)
    client.put_object(Bucket=bucket, Key="ld/runs/5.gart", Body=encs[6].data)  # a different (valid) object
    client.put_object(Bucket=bucket, Key="ld/runs/7.gart", Body=encs[7].data + b"x")  # grew
    items = [receipt(e, f"s3:runs/{i}.gart") for i, e in enumerate(encs)]
    res = ld.load_batch(items, t, layout="slime", max_concurrency=4, max_bytes_in_flight=2 * encs[0].byte_count)
    assert [(e.index, e.check) for e in res.errors] == [(5, "sha256"), (7, "byte_count")]
    assert res.peak_bytes_in_flight <= 2 * encs[0].byte_count
    for i in set(range(12)) - {5, 7}:
        assert np.array_equal(res.items[i], ROWS.astype(np.int32))
