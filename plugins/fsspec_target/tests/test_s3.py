"""managed_fsspec on a real S3 implementation (SeaweedFS on loopback, started by the root conftest)."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
import uuid

import pytest
import structlog
from genartifact.errors import DeliveryError, TargetError
from genartifact_fsspec_target import ManagedFsspecTarget, open_object, parse_profiles


def target(s3, **extra):
    prof = {"url": f"s3://{s3['bucket']}/art", "allowed_prefixes": ["runs/"], "storage_options": s3["storage_options"],
            **extra}
    return ManagedFsspecTarget(parse_profiles({"profiles": {"s3": prof}}))


def deliver(t, key, data):
    v = t.validate({"kind": "managed_fsspec", "profile": "s3", "object_key": key})
    return asyncio.run(t.deliver(v, data, hashlib.sha256(data).hexdigest()))


def key():
    return f"runs/{uuid.uuid4().hex}.gart"


def test_put_and_read_back(s3_server):
    t, k = target(s3_server), key()
    assert deliver(t, k, b"hello artifact") == f"s3:{k}"
    got = s3_server["client"].get_object(Bucket="ga-test", Key=f"art/{k}")["Body"].read()
    assert got == b"hello artifact" == open_object(t.profiles["s3"], k)


@pytest.mark.fault("s3", "second write to an S3 key")
def test_conditional_create_never_overwrites(s3_server):
    t, k = target(s3_server), key()
    deliver(t, k, b"first")
    with pytest.raises(DeliveryError) as e:
        deliver(t, k, b"second")
    assert e.value.code == "object_exists"
    assert s3_server["client"].get_object(Bucket="ga-test", Key=f"art/{k}")["Body"].read() == b"first"


def _resend_first_put(monkeypatch):
    """Make botocore resend every delivery's first PutObject whatever it answered, as if its response had been
    lost (a ``needs-retry`` handler on the plugin's session, more specific than the retry handler's)."""
    import genartifact_fsspec_target as ft

    sess = ft._botocore_session(None)
    calls = []

    def needs_retry(attempts, **kw):
        calls.append(attempts)
        return 0 if attempts == 1 else None  # retry once, at once

    sess.register("needs-retry.s3.PutObject", needs_retry)
    monkeypatch.setattr(ft, "_RESEND_UNREGISTER", lambda: sess.unregister("needs-retry.s3.PutObject", needs_retry),
                        raising=False)
    return calls


@pytest.mark.fault("s3", "landed PUT resent (response lost)")
def test_retry_after_landed_put_is_idempotent(s3_server, monkeypatch):
    """A PUT that landed but whose response was lost is resent; the resend meets 412, the stored bytes are read
    back and are ours: success, stored once."""
    import genartifact_fsspec_target as ft

    t, k = target(s3_server), key()
    calls = _resend_first_put(monkeypatch)
    try:
        assert deliver(t, k, b"same bytes") == f"s3:{k}"
    finally:
        ft._RESEND_UNREGISTER()
    assert calls[:2] == [1, 2]  # the first PUT landed and was resent
    assert s3_server["client"].get_object(Bucket="ga-test", Key=f"art/{k}")["Body"].read() == b"same bytes"


@pytest.mark.fault("s3", "duplicate request with identical bytes")
def test_duplicate_with_identical_bytes_is_object_exists(s3_server, monkeypatch):
    """A 412 on the first PUT is an object that was there before this delivery: object_exists even when its bytes
    are identical (a duplicate request), with no read-back at all."""
    t, k = target(s3_server), key()
    s3_server["client"].put_object(Bucket="ga-test", Key=f"art/{k}", Body=b"same bytes")
    sent = _spy_requests(monkeypatch)
    try:
        with pytest.raises(DeliveryError) as e:
            deliver(t, k, b"same bytes")
    finally:
        import genartifact_fsspec_target as ft
        ft._SPY_UNREGISTER()
    assert e.value.code == "object_exists"
    assert [m for m, _ in sent] == ["PUT"]


def _spy_requests(monkeypatch):
    """Record (operation, method, header names) of every request the plugin's S3 clients send."""
    import genartifact_fsspec_target as ft

    sent = []
    sess = ft._botocore_session(None)

    def before_send(request, **kw):
        sent.append((request.method, {k.lower() for k in request.headers}))

    sess.register("before-send.s3", before_send)
    monkeypatch.setattr(ft, "_SPY_UNREGISTER", lambda: sess.unregister("before-send.s3", before_send), raising=False)
    return sent


def test_single_put_object_no_multipart_no_checksum_headers(s3_server, monkeypatch):
    sent = _spy_requests(monkeypatch)
    try:
        t = target(s3_server)
        deliver(t, key(), b"x" * (12 << 20))
    finally:
        import genartifact_fsspec_target as ft
        ft._SPY_UNREGISTER()
    assert [m for m, _ in sent] == ["PUT"]  # one PutObject, no multipart
    headers = sent[0][1]
    assert "if-none-match" in headers
    assert not {h for h in headers if h.startswith("x-amz-checksum") or h in ("x-amz-sdk-checksum-algorithm",
                                                                               "content-md5")}


def test_checksum_header_is_configurable(s3_server, monkeypatch):
    sent = _spy_requests(monkeypatch)
    try:
        deliver(target(s3_server, checksum="when_supported"), key(), b"y" * 1000)
    finally:
        import genartifact_fsspec_target as ft
        ft._SPY_UNREGISTER()
    assert any(h.startswith("x-amz-checksum") or h == "x-amz-sdk-checksum-algorithm" for h in sent[0][1])


@pytest.mark.fault("s3", "bad checksum mode")
def test_bad_checksum_mode_refused():
    from genartifact.errors import ConfigError

    with pytest.raises(ConfigError, match="checksum"):
        parse_profiles({"profiles": {"p": {"url": "s3://b/x", "allowed_prefixes": [""], "checksum": "always"}}})
    with pytest.raises(ConfigError, match=r"storage_options: key\(s\) \['use_ssl_typo'\]"):
        parse_profiles({"profiles": {"p": {"url": "s3://b/x", "allowed_prefixes": [""],
                                           "storage_options": {"use_ssl_typo": True}}}})


def test_one_client_per_profile_and_event_loop(s3_server, monkeypatch):
    import genartifact_fsspec_target as ft

    made = []
    orig = ft._client_kwargs

    def spy(prof):
        made.append(prof.name)
        return orig(prof)

    monkeypatch.setattr(ft, "_client_kwargs", spy)
    t = target(s3_server)

    async def three():
        for i in range(3):
            v = t.validate({"kind": "managed_fsspec", "profile": "s3", "object_key": key()})
            await t.deliver(v, b"%d" % i, hashlib.sha256(b"%d" % i).hexdigest())

    asyncio.run(three())  # event loop 1: one client for three deliveries
    assert made == ["s3"]
    asyncio.run(three())  # event loop 2: its own client (a client is bound to its loop)
    assert made == ["s3", "s3"]


@pytest.mark.fault("s3", "resent PUT meets a large foreign object")
def test_retry_check_asks_size_first_and_never_reads_a_foreign_object(s3_server, monkeypatch):
    """A resent PUT meets a foreign object of another size at the key: object_exists after a HEAD, with no GET
    at all."""
    t, k = target(s3_server), key()
    s3_server["client"].put_object(Bucket="ga-test", Key=f"art/{k}", Body=b"f" * (3 << 20))
    sent = _spy_requests(monkeypatch)
    _resend_first_put(monkeypatch)
    try:
        with pytest.raises(DeliveryError) as e:
            deliver(t, k, b"mine")
    finally:
        import genartifact_fsspec_target as ft
        ft._SPY_UNREGISTER()
        ft._RESEND_UNREGISTER()
    assert e.value.code == "object_exists"
    assert [m for m, _ in sent] == ["PUT", "PUT", "HEAD"]


def test_concurrent_deliveries_one_loop(s3_server):
    t = target(s3_server)

    async def many():
        vs = [t.validate({"kind": "managed_fsspec", "profile": "s3", "object_key": key()}) for _ in range(16)]
        return await asyncio.gather(*(t.deliver(v, b"d%d" % i, hashlib.sha256(b"d%d" % i).hexdigest())
                                      for i, v in enumerate(vs)))

    assert len(set(asyncio.run(many()))) == 16


def at_endpoint(s3, port):
    """The s3 fixture's options pointed at another loopback port."""
    so = {**s3["storage_options"], "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"}}
    return {**s3, "storage_options": so}


@pytest.fixture
def blackhole_port():
    """A loopback port that accepts the TCP handshake (backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("profile, limit", [({"read_timeout_s": 0.3, "connect_timeout_s": 0.3, "max_attempts": 1,
                                              "timeout_s": 2.0}, 3),    # per-read timeout
                                             ({"read_timeout_s": 30, "timeout_s": 0.5}, 2)],  # whole-delivery deadline
                         ids=["read-timeout", "deadline"])
@pytest.mark.fault("s3", "unresponsive endpoint")
def test_unresponsive_endpoint_times_out(s3_server, blackhole_port, profile, limit):
    t = target(at_endpoint(s3_server, blackhole_port), **profile)
    t0 = time.monotonic()
    with pytest.raises(DeliveryError) as e:
        deliver(t, key(), b"x")
    assert e.value.code == "timeout" and time.monotonic() - t0 < limit


@pytest.mark.fault("s3", "refused endpoint")
def test_refused_endpoint_fails_without_detail(s3_server):
    from genartifact.testing import free_port

    port = free_port()  # nobody listens there (outside the ephemeral range: no outbound connection takes it)
    t = target(at_endpoint(s3_server, port), max_attempts=2, connect_timeout_s=0.5)
    with structlog.testing.capture_logs() as logs, pytest.raises(DeliveryError) as e:
        deliver(t, key(), b"x")
    assert e.value.code == "delivery_failed"
    text = str(e.value) + repr(logs) + repr(t) + repr(t.profiles)
    assert "testing-secret-key-do-not-log" not in text and str(port) not in str(e.value)


def test_profiles_from_environment(s3_server, monkeypatch):
    import json

    monkeypatch.setenv("GENARTIFACT_STORAGE_PROFILES", json.dumps({"envp": {
        "url": f"s3://{s3_server['bucket']}/env", "allowed_prefixes": ["x/"],
        "storage_options": s3_server["storage_options"]}}))
    profiles = parse_profiles({"profiles": {"local": {"url": "memory://m", "allowed_prefixes": [""]}}})
    assert sorted(profiles) == ["envp", "local"] and profiles["envp"].is_s3


@pytest.mark.fault("s3", "bad GENARTIFACT_STORAGE_PROFILES")
def test_bad_environment_profiles(monkeypatch):
    from genartifact.errors import ConfigError

    monkeypatch.setenv("GENARTIFACT_STORAGE_PROFILES", "{not json")
    with pytest.raises(ConfigError, match="GENARTIFACT_STORAGE_PROFILES is not valid JSON"):
        parse_profiles({})
    monkeypatch.setenv("GENARTIFACT_STORAGE_PROFILES", '{"p": {"url": "s3://b/x", "allowed_prefixes": [""], "timeout_s": -1}}')
    with pytest.raises(ConfigError, match="timeout_s"):
        parse_profiles({})


def test_read_back_protocol_on_s3(s3_server):
    from genartifact.errors import ObjectNotFoundError, ObjectTooLargeError

    t, k = target(s3_server), key()
    oid = f"s3:{k}"
    assert asyncio.run(t.exists(oid)) is False
    with pytest.raises(ObjectNotFoundError):
        asyncio.run(t.open(oid, 10))
    deliver(t, k, b"0123456789")
    assert asyncio.run(t.exists(oid)) and asyncio.run(t.open(oid, 10)) == b"0123456789"
    with pytest.raises(ObjectTooLargeError):
        asyncio.run(t.open(oid, 9))
    assert asyncio.run(t.delete(oid, hashlib.sha256(b"nope").hexdigest())) is False
    assert asyncio.run(t.delete(oid, hashlib.sha256(b"0123456789").hexdigest())) is True
    assert asyncio.run(t.exists(oid)) is False


@pytest.mark.parametrize("attempts", [1, 3])
def test_max_attempts_is_the_number_of_puts_sent(s3_server, attempts):
    """docs/storage.md: max_attempts is botocore's total attempts. A store answering 503 receives exactly
    max_attempts PUTs (503 closes nothing, so aiohttp's one resend on a dropped keep-alive never applies)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_PUT(self):
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            seen.append(self.path)
            body = b"<Error><Code>SlowDown</Code><Message>busy</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t = target(at_endpoint(s3_server, srv.server_address[1]), max_attempts=attempts)
        with pytest.raises(DeliveryError) as e:
            deliver(t, key(), b"x" * 100)
    finally:
        srv.shutdown()
        srv.server_close()
    assert e.value.code == "delivery_failed"
    assert len(seen) == attempts


@pytest.mark.fault("s3", "wrong secret in storage_options")
def test_credentials_come_from_storage_options_not_the_environment(s3_server, monkeypatch):
    """The profile's storage_options key/secret sign the requests: with the environment's AWS_* credentials
    removed the delivery works; with a wrong secret in storage_options (and correct ones in the environment) the
    store refuses it (403) — delivery_failed, and a read-back is an error, never "absent"."""
    from genartifact.errors import ObjectNotFoundError

    k = key()
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    assert deliver(target(s3_server), k, b"signed with the profile's key") == f"s3:{k}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server["storage_options"]["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server["storage_options"]["secret"])
    bad = target(s3_server, storage_options={**s3_server["storage_options"], "secret": "not-the-secret"})
    k2 = key()
    with pytest.raises(DeliveryError) as e:
        deliver(bad, k2, b"x")
    assert e.value.code == "delivery_failed" and "not-the-secret" not in str(e.value)
    with pytest.raises(TargetError, match="read-back failed") as e:  # the object does exist: never "absent"
        asyncio.run(bad.open(f"s3:{k}", 1 << 20))
    assert not isinstance(e.value, ObjectNotFoundError) and "not-the-secret" not in str(e.value)
    listed = s3_server["client"].list_objects_v2(Bucket="ga-test", Prefix=f"art/{k2}").get("Contents", [])
    assert listed == []  # nothing stored by the refused request
