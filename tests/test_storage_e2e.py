"""Both storage targets against a real S3 implementation on loopback (SeaweedFS): presigned URLs
signed by boto3, managed s3fs profiles, the bounded pipeline under load, and the main job end to end."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
import tracemalloc
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact.host import PluginHost
from genartifact.journal import DeliveryJournal
from genartifact.session import ArtifactSession
from genartifact.spec import parse_request
from genartifact.types import Delta, ModelInfo

ROOT = Path(__file__).resolve().parents[1]


def presign(s3, key, expires=600, **params):
    """A SigV4 presigned PutObject URL that signs ``If-None-Match: *`` (and any extra ``params``)."""
    return s3["client"].generate_presigned_url("put_object", Params={"Bucket": s3["bucket"], "Key": key,
                                                                     "IfNoneMatch": "*", **params}, ExpiresIn=expires)


def presigned_target(s3, key, url=None, headers=None):
    return {"kind": "presigned_http_put", "url": url or presign(s3, key),
            "expires_at": (datetime.now(UTC) + timedelta(minutes=9)).isoformat(), "max_bytes": 1 << 20,
            "required_headers": headers or {"if-none-match": "*"}, "object_id": f"caller/{key}"}


def settings(s3):
    return {
        "managed_fsspec": {"profiles": {"s3": {"url": f"s3://{s3['bucket']}/managed", "allowed_prefixes": ["runs/"],
                                               "storage_options": s3["storage_options"]}}},
        "presigned_http_put": {"allowed_hosts": [], "insecure_http_hosts": [s3["authority"]]},
    }


@pytest.fixture(scope="module")
def host():
    return PluginHost({"contents": ["selected_logprobs"], "targets": ["managed_fsspec", "presigned_http_put"]})


def session(host, s3, target, journal=None):
    spec = {"format": "generation_artifact_v1", "contents": ["selected_logprobs"],
            "delivery": {"mode": "object_store", "target": target}}
    s = ArtifactSession.for_request(host, parse_request(spec), ModelInfo("m", {}), settings(s3), journal)
    s.admit(2, 3)
    s.record(Delta([1, 2], [3, 4, 5], [{3: -0.5}, {4: -1.5}, {5: -np.inf}], finished=True))
    return s


@pytest.mark.fault("presigned", "second presigned PUT to a SeaweedFS key")
async def test_presigned_put_to_s3_and_create_only(host, s3_server, tmp_path):
    key = f"presigned/{uuid.uuid4().hex}.gart"
    journal = DeliveryJournal(tmp_path / "j.jsonl")
    r = await session(host, s3_server, presigned_target(s3_server, key), journal).finalize()
    assert r["state"] == "ready" and r["object_id"] == f"caller/{key}"
    body = s3_server["client"].get_object(Bucket="ga-test", Key=key)["Body"].read()
    assert hashlib.sha256(body).hexdigest() == r["sha256"]
    assert fmt.decode(body).selected_logprobs().tolist() == [-0.5, -1.5, -np.inf]
    again = await session(host, s3_server, presigned_target(s3_server, key), journal).finalize()
    assert again["state"] == "failed" and again["error_code"] == "object_exists"
    assert s3_server["client"].get_object(Bucket="ga-test", Key=key)["Body"].read() == body
    text = (tmp_path / "j.jsonl").read_text()
    assert "X-Amz-Signature" not in text and "Credential" not in text  # journal holds no secrets
    assert [(d["last_state"], d["last_code"]) for d in journal.deliveries()] == [("ready", None),
                                                                                 ("failed", "object_exists")]
    assert journal.unresolved() == []  # 412: the store kept nothing of the second delivery


@pytest.mark.fault("presigned", "SeaweedFS 403s: tampered signature, expired URL")
async def test_real_store_403s_are_classified_by_body(host, s3_server):
    """SeaweedFS checks SigV4: a tampered signature, a signed header sent with another value, and an expired URL
    each give 403; the receipt says which (only the expired one is ``expired``). Nothing is stored."""
    import re

    k1, k2, k3 = (f"presigned/{uuid.uuid4().hex}.gart" for _ in range(3))
    tampered = re.sub(r"X-Amz-Signature=([0-9a-f])", lambda m: "X-Amz-Signature=" + ("0" if m.group(1) != "0" else "1"),
                      presign(s3_server, k1))
    r1 = await session(host, s3_server, presigned_target(s3_server, k1, url=tampered)).finalize()
    ct = presign(s3_server, k2, ContentType="application/octet-stream")
    r2 = await session(host, s3_server, presigned_target(
        s3_server, k2, url=ct, headers={"if-none-match": "*", "content-type": "text/plain"})).finalize()
    short = presign(s3_server, k3, expires=1)
    s3 = session(host, s3_server, presigned_target(s3_server, k3, url=short))  # expires_at claims 9 minutes
    await asyncio.sleep(2.5)
    r3 = await s3.finalize()
    assert [r1["error_code"], r2["error_code"], r3["error_code"]] == ["signature_mismatch", "signature_mismatch",
                                                                     "expired"]
    for k in (k1, k2, k3):
        assert "Contents" not in s3_server["client"].list_objects_v2(Bucket="ga-test", Prefix=k)


@pytest.mark.fault("presigned", "grant missing a signed header (SeaweedFS)")
def test_grant_missing_a_signed_header_is_refused_before_inference(host, s3_server):
    from genartifact.errors import TargetError

    key = f"presigned/{uuid.uuid4().hex}.gart"
    url = presign(s3_server, key, ContentType="application/octet-stream")
    with pytest.raises(TargetError, match=r"missing \['content-type'\]"):
        session(host, s3_server, presigned_target(s3_server, key, url=url))


@pytest.mark.fault("presigned", "grant expiring after admission (SeaweedFS)")
async def test_grant_expiring_after_admission_is_never_sent(host, s3_server):
    key = f"presigned/{uuid.uuid4().hex}.gart"
    t = presigned_target(s3_server, key)
    t["expires_at"] = (datetime.now(UTC) + timedelta(seconds=2.5)).isoformat()
    s = session(host, s3_server, t)  # admitted while valid
    await asyncio.sleep(2.0)  # expiry margin is 1 s: too late to start the upload now
    r = await s.finalize()
    assert r["state"] == "failed" and r["error_code"] == "expired"
    assert "Contents" not in s3_server["client"].list_objects_v2(Bucket="ga-test", Prefix=key)


async def test_managed_s3_profile(host, s3_server):
    key = f"runs/{uuid.uuid4().hex}.gart"
    r = await session(host, s3_server, {"kind": "managed_fsspec", "profile": "s3", "object_key": key}).finalize()
    assert r["state"] == "ready" and r["object_id"] == f"s3:{key}"
    body = s3_server["client"].get_object(Bucket="ga-test", Key=f"managed/{key}")["Body"].read()
    assert hashlib.sha256(body).hexdigest() == r["sha256"]


async def _load(host, s3, n, cancel_half, rng):
    keys = [f"runs/load-{uuid.uuid4().hex}.gart" for _ in range(n)]
    sessions = [session(host, s3, {"kind": "managed_fsspec", "profile": "s3", "object_key": k}) for k in keys]
    tracemalloc.reset_peak()
    tasks = [asyncio.ensure_future(s.finalize()) for s in sessions]
    cancelled = set()
    if cancel_half:
        await asyncio.sleep(0.05)
        # only tasks that were still running count as cancelled: on a busy loop some have already finished
        # (cancel() then returns False and the task's result stands)
        cancelled = {i for i in rng.sample(range(n), n // 2) if tasks[i].cancel()}
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return keys, results, cancelled, tracemalloc.get_traced_memory()[1]


async def _loop_lag(out: list[float], every_s: float = 0.005) -> None:
    """Event-loop lag probe: how late each ``sleep(every_s)`` wakes up (seconds)."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(every_s)
        out.append(max(0.0, loop.time() - t - every_s))


async def test_event_loop_lag_during_64_deliveries(host, s3_server, monkeypatch):
    """Event-loop lag p99 while 64 deliveries go through the pipeline (S3 target, one client per profile and
    loop; encoding off the loop). Recorded in docs/benchmarks.md (goal < 50 ms); asserted loosely here because
    the test machine is shared."""
    monkeypatch.setenv("GENARTIFACT_PIPELINE_CONCURRENCY", "4")
    monkeypatch.setenv("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY", "4")  # these artifacts are small
    host._pipelines.clear()
    host._small_pipelines.clear()
    await asyncio.gather(*(session(host, s3_server, {"kind": "managed_fsspec", "profile": "s3",
                                                     "object_key": f"runs/warm-{uuid.uuid4().hex}.gart"}).finalize()
                           for _ in range(4)))  # this loop's client exists from here on
    sessions = [session(host, s3_server, {"kind": "managed_fsspec", "profile": "s3",
                                          "object_key": f"runs/lag-{uuid.uuid4().hex}.gart"}) for _ in range(64)]
    lags: list[float] = []
    probe = asyncio.ensure_future(_loop_lag(lags))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(s.finalize() for s in sessions))
    wall = time.perf_counter() - t0
    probe.cancel()
    assert all(r["state"] == "ready" for r in results)
    lags.sort()
    p50, p99 = lags[len(lags) // 2] * 1e3, lags[int(0.99 * (len(lags) - 1))] * 1e3
    load1, load5, _ = os.getloadavg()  # the host is shared: the lag is only comparable with its load
    print(f"event-loop lag during 64 deliveries ({wall:.2f} s): p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
          f"max {lags[-1] * 1e3:.1f} ms over {len(lags)} probes; load average {load1:.2f} (1 min), "
          f"{load5:.2f} (5 min), {os.cpu_count()} CPUs")
    assert p99 < 250, f"event loop blocked: p99 lag {p99:.0f} ms"


@pytest.mark.fault("s3", "64 deliveries with cancellations")
async def test_64_concurrent_deliveries_bounded_pipeline_no_leaks(host, s3_server, monkeypatch):
    monkeypatch.setenv("GENARTIFACT_PIPELINE_CONCURRENCY", "4")
    monkeypatch.setenv("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY", "4")  # these artifacts are small
    host._pipelines.clear()
    host._small_pipelines.clear()
    active = peak = 0
    import genartifact_fsspec_target as ft

    orig = ft.ManagedFsspecTarget.deliver

    async def counting(self, target, data, sha256):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            await asyncio.sleep(0.02)
            return await orig(self, target, data, sha256)
        finally:
            active -= 1

    monkeypatch.setattr(ft.ManagedFsspecTarget, "deliver", counting)
    rng = random.Random(0)
    tracemalloc.start()
    try:
        await _load(host, s3_server, 4, False, rng)  # warm-up: imports, botocore models
        _, _, _, peak16 = await _load(host, s3_server, 16, False, rng)
        keys, results, cancelled, peak64 = await _load(host, s3_server, 64, True, rng)
        while active:
            await asyncio.sleep(0.02)
    finally:
        tracemalloc.stop()
    assert peak <= 4
    assert host.pipeline(small=True)._value == 4 and host.pipeline()._value == 4  # every slot returned
    ready = [r for r in results if isinstance(r, dict) and r["state"] == "ready"]
    assert len(ready) == 64 - len(cancelled)
    listed = {o["Key"] for o in s3_server["client"].list_objects_v2(Bucket="ga-test", Prefix="managed/runs/load-")
              .get("Contents", [])}
    mine = [k for k in keys if f"managed/{k}" in listed]
    for k in mine:  # every stored object is complete (decodes); cancelled-before-start ones never uploaded
        fmt.decode(s3_server["client"].get_object(Bucket="ga-test", Key=f"managed/{k}")["Body"].read())
    assert len(ready) <= len(mine) < 64
    # bounded: 4x the deliveries through the same 4 slots must not need materially more memory
    print(f"traced peak: 16 deliveries {peak16 / 1e6:.1f} MB, 64 deliveries {peak64 / 1e6:.1f} MB")
    assert peak64 < 1.5 * peak16 + (8 << 20), (peak16, peak64)


@pytest.mark.engine
def test_generate_job_to_both_targets_and_inspect_from_s3(s3_server, qwen_model, tmp_path):
    cfg = tmp_path / "genartifact.toml"
    cfg.write_text(f"""
[plugins]
contents = ["moe_routes", "selected_logprobs"]
targets = ["managed_fsspec", "presigned_http_put"]

[targets.managed_fsspec.profiles.s3]
url = "s3://{s3_server['bucket']}/job"
allowed_prefixes = ["runs/"]
storage_options = {json.dumps(s3_server['storage_options']).replace('": ', '" = ').replace('{"', '{ "')}

[targets.presigned_http_put]
allowed_hosts = []
insecure_http_hosts = ["{s3_server['authority']}"]

[journal]
path = "{tmp_path}/journal.jsonl"
""")
    prompts = tmp_path / "prompts.jsonl"
    lines = []
    for i, text in enumerate(["The quick brown fox.", "Once upon a time there lived an old woman.",
                              "Numbers such as 1, 2, 3.", "The ocean is deep and blue."]):
        row = {"prompt": text, "max_tokens": 8 + i}
        if i % 2:
            row["target"] = presigned_target(s3_server, f"job-presigned/{uuid.uuid4().hex}.gart")
        lines.append(json.dumps(row))
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "receipts.jsonl"
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_server["endpoint"]}
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "generate", "--config", str(cfg), "--model",
                           str(qwen_model), "--prompts", str(prompts), "--target", "managed_fsspec:s3",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    receipts = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["index"])  # completion order
    assert [r["state"] for r in receipts] == ["ready"] * 4
    assert [r["object_id"].split(":")[0] for r in receipts][::2] == ["s3", "s3"]
    assert "X-Amz-Signature" not in proc.stderr + proc.stdout + out.read_text()
    frozen = re.search(r"generate_heap_frozen\s+objects=(\d+)", proc.stderr + proc.stdout)  # no full-heap GC pauses
    assert frozen and int(frozen.group(1)) > 100_000, proc.stderr[-3000:]
    # inspect reads a managed object back from the S3 server through an fsspec URL
    key = receipts[0]["object_id"].split(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "inspect", f"s3://{s3_server['bucket']}/job/{key}",
                           "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["sha256"] == receipts[0]["sha256"] and summary["moe_routes"]["rows"] > 0
    # and the presigned one, by key, straight from the bucket
    pres = receipts[1]["object_id"].split("/", 1)[1]
    body = s3_server["client"].get_object(Bucket="ga-test", Key=pres)["Body"].read()
    assert hashlib.sha256(body).hexdigest() == receipts[1]["sha256"]
    assert DeliveryJournal(tmp_path / "journal.jsonl").unresolved() == []


@pytest.mark.engine
@pytest.mark.fault("generate", "crash before any receipt, no journal, --resume on SeaweedFS")
def test_resume_without_journal_recognises_stored_objects_on_s3(s3_server, qwen_model, tmp_path):
    """generate --resume with no journal and no receipts (a crash before any receipt was written): rows whose
    object is already on SeaweedFS with exactly the bytes the rerun encodes (temperature 0) are ready
    ("recovered": "rerun_match"); a row whose rerun encodes other bytes (its temperature changed in between, which
    the artifact header records) stays object_exists; the stored objects are never replaced."""
    cfg = tmp_path / "genartifact.toml"
    cfg.write_text(f"""
[plugins]
contents = ["moe_routes", "selected_logprobs"]
targets = ["managed_fsspec"]

[targets.managed_fsspec.profiles.s3]
url = "s3://{s3_server['bucket']}/resume"
allowed_prefixes = ["runs/"]
storage_options = {json.dumps(s3_server['storage_options']).replace('": ', '" = ').replace('{"', '{ "')}
""")
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "The quick brown fox.", "max_tokens": 6, "temperature": 0},
            {"prompt": "Once upon a time", "max_tokens": 9, "temperature": 0},
            {"prompt": "Numbers such as 1, 2, 3.", "max_tokens": 12, "temperature": 0.5}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "receipts.jsonl"
    run_id = f"resume-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_server["endpoint"]}
    cmd = [sys.executable, "-m", "genartifact.cli", "generate", "--config", str(cfg), "--model", str(qwen_model),
           "--prompts", str(prompts), "--target", "managed_fsspec:s3", "--out", str(out), "--run-id", run_id]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert [before[i]["state"] for i in range(3)] == ["ready"] * 3
    out.write_text("")  # the crash: every object stored, no receipt written, no journal configured
    rows[2]["temperature"] = 0  # this row's rerun now encodes other bytes (header sampling.temperature)
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    second = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    after = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(after) == [0, 1, 2], second.stderr[-3000:]
    for i in (0, 1):
        assert after[i]["state"] == "ready" and after[i]["recovered"] == "rerun_match", (after[i], second.stderr[-2000:])
        assert {k: after[i][k] for k in ("object_id", "sha256", "byte_count")} == \
            {k: before[i][k] for k in ("object_id", "sha256", "byte_count")}
    assert after[2]["state"] == "failed" and after[2]["error_code"] == "object_exists"
    assert second.returncode == 1
    for i in range(3):  # nothing replaced: the bucket holds the first run's bytes
        key = "resume/" + before[i]["object_id"].split(":", 1)[1]
        body = s3_server["client"].get_object(Bucket=s3_server["bucket"], Key=key)["Body"].read()
        assert hashlib.sha256(body).hexdigest() == before[i]["sha256"]
