"""presigned_http_put: validation (SSRF, headers, expiry), wire behaviour, retries, faults, redaction."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata as md
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import structlog
from genartifact.errors import ConfigError, DeliveryError, TargetError
from genartifact_http_put_target import PresignedHttpPutTarget, PresignedSettings

SECRET = "X-Amz-Signature=TOPSECRETSIG"
HDR_SECRET = "hdr-secret-value"
DNS = {
    "bucket.example.com": "93.184.216.34",
    "internal.example.com": "10.0.0.5",
    "meta.example.com": "169.254.169.254",
    "v6local.example.com": "::1",
    "mixed.example.com": ["93.184.216.34", "10.0.0.5"],  # a public and a private answer
    "mixed6.example.com": ["93.184.216.34", "2606:4700::1", "fe80::1"],
}


def resolver(host, port, type=None):  # noqa: A002 - mirrors socket.getaddrinfo
    resolver.calls.append(host)
    if host not in DNS:
        raise OSError("no such host")
    addrs = DNS[host] if isinstance(DNS[host], list) else [DNS[host]]
    return [(None, None, None, "", (a, port)) for a in addrs]


resolver.calls = []


def settings(fault=None, **kw):
    base = {"allowed_hosts": ["bucket.example.com", "internal.example.com", "meta.example.com", "v6local.example.com",
                              "10.0.0.1", "169.254.169.254", "[::1]", "[::ffff:127.0.0.1]", "s3.example.com:8443",
                              "[fec0::1]", "[2002:7f00:1::1]", "[2002:a9fe:a9fe::1]",
                              "mixed.example.com", "mixed6.example.com"],
            "insecure_http_hosts": [fault.authority] if fault else [], "max_attempts": 3, "backoff_base_s": 0.01,
            "read_timeout_s": 1.0, "total_timeout_s": 5.0}
    base.update(kw)
    return PresignedSettings.parse(base, resolver=resolver)


def iso(dt: datetime) -> str:
    return dt.isoformat()


def grant(url="https://bucket.example.com/a/key?" + SECRET, headers=None, expires=None, **kw):
    g = {"kind": "presigned_http_put", "url": url,
         "expires_at": expires or iso(datetime.now(UTC) + timedelta(minutes=10)), "max_bytes": 1 << 20,
         "required_headers": {"if-none-match": "*", "x-amz-meta-run": HDR_SECRET} if headers is None else headers,
         "object_id": "obj-1"}
    g.update(kw)
    return g


def test_entry_point_declared():
    eps = {ep.name: ep for ep in md.entry_points(group="genartifact.targets")}
    assert eps["presigned_http_put"].dist.name == "genartifact-http-put-target"


URL_CASES = [
    ("http://bucket.example.com/k?" + SECRET, "must use https"),
    ("ftp://bucket.example.com/k", "must use https"),
    ("https://user:pw@bucket.example.com/k", "userinfo"),
    ("https://bucket.example.com/k?" + SECRET + "#frag", "fragment"),
    ("https://10.0.0.1/k", "non-global"),
    ("https://169.254.169.254/latest/meta-data", "non-global"),
    ("https://[::1]/k", "non-global"),
    ("https://[::ffff:127.0.0.1]/k", "non-global"),
    ("https://internal.example.com/k", "non-global"),
    ("https://meta.example.com/k", "non-global"),
    ("https://v6local.example.com/k", "non-global"),
    ("https://localhost/k", "local name"),
    ("https://foo.localhost/k", "local name"),
    ("https://printer.local/k", "local name"),
    ("https://bücket.example.com/k", "printable ASCII"),
    ("https://xn--bcket-kva.example.com/k", "allowed_hosts"),
    ("https://bucket.example.com.evil.net/k", "allowed_hosts"),
    ("https://bucket.example.com:8443/k", "allowed_hosts"),
    ("https://2130706433/k", "allowed_hosts"),
    ("https://bucket.example.com/" + "a" * 9000, "longer than"),
    ("https://bucket.example.com/k%zz?" + SECRET, "percent escape"),
    ("https://bucket.example.com/a b", "printable ASCII"),
    ("https://bucket.example.com:99999/k", "bad host or port"),
    ("https://[example.com]/k", "bad host or port"),
    ("https://example.com]/k", "bad host or port|allowed_hosts"),
    ("https://[fec0::1]/k", "non-global"),
    ("https://[2002:7f00:1::1]/k", "non-global|embedding"),
    ("https://[2002:a9fe:a9fe::1]/k", "non-global|embedding"),
    ("https:///k", "no host"),
]


@pytest.mark.parametrize("url, match", URL_CASES, ids=[f"url{i}" for i in range(len(URL_CASES))])
@pytest.mark.fault("presigned", "grant URL refused")
def test_url_rejected(fault_server, url, match):
    t = PresignedHttpPutTarget(settings(fault_server))
    with pytest.raises(TargetError, match=match) as e:
        t.validate(grant(url=url))
    assert "TOPSECRETSIG" not in str(e.value) and "pw" not in str(e.value)
    assert fault_server.requests == []


HEADER_CASES = [
    ({"x-amz-meta-a": "1"}, "if-none-match: \\*"),
    ({"if-none-match": "etag-123"}, "if-none-match: \\*"),
    ({"if-none-match": "*", "Authorization": "AWS4 " + HDR_SECRET}, "'authorization' must not be set"),
    ({"if-none-match": "*", "Host": "evil.example.com"}, "'host' must not be set"),
    ({"if-none-match": "*", "Content-Length": "1"}, "'content-length' must not be set"),
    ({"if-none-match": "*", "Transfer-Encoding": "chunked"}, "'transfer-encoding' must not be set"),
    ({"if-none-match": "*", "Cookie": "a=b"}, "'cookie' must not be set"),
    ({"if-none-match": "*", "Proxy-Authorization": "x"}, "'proxy-authorization' must not be set"),
    ({"if-none-match": "*", "X-Forwarded-For": "1.2.3.4"}, "'x-forwarded-for' must not be set"),
    ({"if-none-match": "*", "x-amz-copy-source": "/b/k"}, "'x-amz-copy-source' must not be set"),
    ({"if-none-match": "*", "x-amz-meta-a": "v\r\nX-Evil: 1"}, "control"),
    ({"if-none-match": "*", "x-amz-meta-a": "v\nX"}, "control"),
    ({"if-none-match": "*", "X-Evil\r\nA": "v"}, "HTTP tokens"),
    ({"if-none-match": "*", "": "v"}, "HTTP tokens"),
    ({"if-none-match": "*", **{f"x-h{i}": "v" for i in range(16)}}, "at most 16"),
    ({"if-none-match": "*", "x-amz-meta-a": "v" * 5000}, "at most 4096 bytes"),
    ({"if-none-match": "*", "If-None-Match": "*"}, "given twice"),
    ({"if-none-match": "*", "x-amz-meta-a": 5}, "must be a string"),
    ({"if-none-match": "*", "x-amz-meta-a": "é"}, "non-ASCII"),
    ({"if-none-match": "*", "x-amz-meta-a": " padded"}, "leading or trailing whitespace"),
    (["if-none-match", "*"], "must be an object"),
]


@pytest.mark.parametrize("headers, match", HEADER_CASES, ids=[f"hdr{i}" for i in range(len(HEADER_CASES))])
@pytest.mark.fault("presigned", "grant headers refused")
def test_headers_rejected(fault_server, headers, match):
    t = PresignedHttpPutTarget(settings(fault_server))
    with pytest.raises(TargetError, match=match) as e:
        t.validate(grant(headers=headers))
    assert HDR_SECRET not in str(e.value) and "TOPSECRETSIG" not in str(e.value)
    assert fault_server.requests == []


@pytest.mark.parametrize(
    "expires, match",
    [
        (lambda now: iso(now - timedelta(seconds=5)), "in the past"),
        (lambda now: (now + timedelta(minutes=5)).replace(tzinfo=None).isoformat(), "needs a timezone"),
        (lambda now: iso(now + timedelta(hours=2)), "max_ttl_s=3600"),
        (lambda now: "tomorrow", "RFC 3339"),
        (lambda now: 1767225600, "RFC 3339"),
        (lambda now: "9999-12-31T23:59:59-23:59", "out of range|max_ttl"),
        (lambda now: "0001-01-01T00:00:00+14:00", "out of range|in the past"),
    ],
    ids=["past", "naive", "too-far", "text", "number", "overflow-high", "overflow-low"],
)
@pytest.mark.fault("presigned", "grant expiry refused")
def test_expiry_rejected(fault_server, expires, match):
    t = PresignedHttpPutTarget(settings(fault_server))
    with pytest.raises(TargetError, match=match):
        t.validate(grant(expires=expires(datetime.now(UTC))))
    assert fault_server.requests == []


@pytest.mark.parametrize(
    "field, value, match",
    [("max_bytes", 0, "max_bytes"), ("max_bytes", True, "max_bytes"), ("max_bytes", 1 << 40, "max_bytes"),
     ("object_id", "", "object_id"), ("object_id", "a\nb", "object_id"), ("object_id", "x" * 600, "object_id"),
     ("extra", 1, "unknown key")],
)
@pytest.mark.fault("presigned", "other grant fields refused")
def test_other_fields_rejected(fault_server, field, value, match):
    t = PresignedHttpPutTarget(settings(fault_server))
    with pytest.raises(TargetError, match=match):
        t.validate(grant(**{field: value}))


@pytest.mark.fault("presigned", "grant field missing")
def test_missing_field():
    g = grant()
    del g["object_id"]
    with pytest.raises(TargetError, match=r"missing key\(s\) \['object_id'\]"):
        PresignedHttpPutTarget(settings()).validate(g)


@pytest.mark.fault("presigned", "target settings refused")
def test_settings_rejected():
    with pytest.raises(ConfigError, match="insecure_http_hosts entry 'example.com:80'.*loopback"):
        PresignedSettings.parse({"insecure_http_hosts": ["example.com:80"]})
    with pytest.raises(ConfigError, match="max_attempts"):
        PresignedSettings.parse({"max_attempts": 0})
    with pytest.raises(ConfigError, match="unknown key"):
        PresignedSettings.parse({"allow_http": True})


def test_valid_public_grant_and_redacted_reprs():
    t = PresignedHttpPutTarget(settings())
    v = t.validate(grant())
    assert v.object_id == "obj-1" and v.max_bytes == 1 << 20
    for text in (repr(v), repr(v.detail), repr(t), str(v)):
        assert "TOPSECRETSIG" not in text and HDR_SECRET not in text and "/a/key" not in text


# ------------------------------------------------------------------------------------------------- wire


def put(t, g, data=b"artifact-bytes"):
    v = t.validate(g)
    return asyncio.run(t.deliver(v, data, hashlib.sha256(data).hexdigest()))


def test_wire_exact_headers_content_length_raw_path(fault_server):
    t = PresignedHttpPutTarget(settings(fault_server))
    raw = "/ok/dir%2Fsub/key.gart?X-Amz-Credential=a%2F20261130%2Fus-east-1&X-Amz-Signature=ab%2B%3D"
    assert put(t, grant(url=fault_server.url(raw)), b"x" * 1000) == "obj-1"
    (seen,) = fault_server.requests
    assert seen.raw_path == raw  # presigned query/path forwarded byte for byte
    names = sorted(k.lower() for k, _ in seen.headers)
    assert names == ["content-length", "host", "if-none-match", "x-amz-meta-run"]
    assert dict((k.lower(), v) for k, v in seen.headers)["content-length"] == "1000"
    assert seen.body == b"x" * 1000


@pytest.mark.parametrize("mode, attempts", [("s503", 2), ("s429", 2)])
@pytest.mark.fault("presigned", "store answers 5xx / 429, then succeeds")
def test_retry_on_5xx_and_429(fault_server, mode, attempts):
    t = PresignedHttpPutTarget(settings(fault_server))
    assert put(t, grant(url=fault_server.url(f"/{mode}/k"))) == "obj-1"
    assert len(fault_server.requests) == attempts
    assert fault_server.requests[0].body == fault_server.requests[1].body


@pytest.mark.parametrize(
    "mode, code, attempts",
    [("always503", "delivery_failed", 3), ("redirect", "redirect_refused", 1), ("s413", "too_large", 1),
     ("s403", "forbidden", 1), ("s403expired", "expired", 1), ("s403signature", "signature_mismatch", 1),
     ("s400", "delivery_failed", 1)],
)
@pytest.mark.fault("presigned", "store keeps failing")
def test_final_failures(fault_server, mode, code, attempts):
    t = PresignedHttpPutTarget(settings(fault_server))
    with pytest.raises(DeliveryError) as e:
        put(t, grant(url=fault_server.url(f"/{mode}/k?{SECRET}")))
    assert e.value.code == code and "TOPSECRETSIG" not in str(e.value)
    assert len(fault_server.requests) == attempts
    assert fault_server.store == {}  # nothing stored by a refused upload
    assert all(not r.raw_path.startswith("/ok/redirected") for r in fault_server.requests)


@pytest.mark.fault("presigned", "second PUT to the key: 412")
def test_second_put_is_412_object_exists(fault_server):
    t = PresignedHttpPutTarget(settings(fault_server))
    put(t, grant(url=fault_server.url("/ok/same")))
    with pytest.raises(DeliveryError) as e:
        put(t, grant(url=fault_server.url("/ok/same")), b"other")
    assert e.value.code == "object_exists" and fault_server.store["/ok/same"] == b"artifact-bytes"


@pytest.mark.fault("presigned", "5xx after the store committed, then 412 on the resend")
def test_412_after_a_5xx_is_ambiguous_not_object_exists(fault_server):
    """The store kept the first attempt's bytes and answered 500; the resend gets 412. object_exists would tell the
    journal that nothing of ours was stored (reconcile would never list it), yet the object holds our bytes: the
    failure is ambiguous, delivery_failed. A 412 to a first attempt stays object_exists (above)."""
    t = PresignedHttpPutTarget(settings(fault_server))
    with pytest.raises(DeliveryError) as e:
        put(t, grant(url=fault_server.url("/s500store/k")))
    assert e.value.code == "delivery_failed" and len(fault_server.requests) == 2
    assert fault_server.store["/s500store/k"] == b"artifact-bytes"


@pytest.mark.fault("presigned", "store too slow to answer")
def test_slow_response_times_out(fault_server):
    t = PresignedHttpPutTarget(settings(fault_server, read_timeout_s=0.3))
    with pytest.raises(DeliveryError) as e:
        put(t, grant(url=fault_server.url("/slow/k")))
    assert e.value.code == "timeout"


@pytest.mark.fault("presigned", "delivery past its whole deadline")
def test_whole_delivery_deadline(fault_server):
    t = PresignedHttpPutTarget(settings(fault_server, total_timeout_s=0.4, read_timeout_s=10))
    t0 = time.monotonic()
    with pytest.raises(DeliveryError) as e:
        put(t, grant(url=fault_server.url("/slowheaders/k")))
    assert e.value.code == "timeout" and time.monotonic() - t0 < 1.5


@pytest.mark.fault("presigned", "connection reset mid-upload")
def test_connection_reset_is_a_failure_not_retried(fault_server):
    t = PresignedHttpPutTarget(settings(fault_server))
    with pytest.raises(DeliveryError) as e:
        put(t, grant(url=fault_server.url("/reset/k")))
    assert e.value.code == "delivery_failed"
    assert fault_server.counters["/reset/k"] == 1
    assert fault_server.store == {}


@pytest.mark.fault("presigned", "connection refused")
def test_connect_refused_retries_then_fails():
    from genartifact.testing import free_port

    port = free_port()  # nobody listens there (outside the ephemeral range: no outbound connection takes it)
    t = PresignedHttpPutTarget(settings(None, insecure_http_hosts=[f"127.0.0.1:{port}"]))
    sent = []

    class Counting(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request):
            sent.append(request.method)
            return await super().handle_async_request(request)

    t = PresignedHttpPutTarget(t.settings, transport=Counting())
    with pytest.raises(DeliveryError) as e:
        put(t, grant(url=f"http://127.0.0.1:{port}/k"))
    assert e.value.code == "delivery_failed"
    assert sent == ["PUT"] * 3  # max_attempts=3: nothing was sent, so every connect error is retried


@pytest.mark.parametrize("host", ["mixed.example.com", "mixed6.example.com"])
@pytest.mark.fault("presigned", "host resolving to a public and a private address")
def test_every_dns_answer_is_checked_not_only_the_first(host):
    t = PresignedHttpPutTarget(settings())
    with pytest.raises(TargetError, match="non-global address"):
        t.validate(grant(url=f"https://{host}/a/key?{SECRET}"))


@pytest.mark.fault("presigned", "grant expiring before the send")
def test_expiry_rechecked_before_sending(fault_server, monkeypatch):
    t = PresignedHttpPutTarget(settings(fault_server))
    v = t.validate(grant(url=fault_server.url("/ok/late")))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"x", "x"))
    assert e.value.code == "expired" and fault_server.requests == []


@pytest.mark.fault("presigned", "DNS rebinding between validation and send")
def test_dns_rebinding_checked_at_send_time(monkeypatch):
    t = PresignedHttpPutTarget(settings())
    v = t.validate(grant())
    monkeypatch.setitem(DNS, "bucket.example.com", "127.0.0.1")
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"x", "x"))
    assert e.value.code == "target_invalid"


@pytest.mark.fault("presigned", "object over the grant's max_bytes")
def test_over_grant_max_bytes_not_sent(fault_server):
    t = PresignedHttpPutTarget(settings(fault_server))
    with pytest.raises(DeliveryError) as e:
        put(t, grant(url=fault_server.url("/ok/big"), max_bytes=4), b"12345")
    assert e.value.code == "too_large" and fault_server.requests == []


@pytest.mark.fault("presigned", "secrets in URL and signed headers")
def test_secrets_never_logged(fault_server):
    t = PresignedHttpPutTarget(settings(fault_server))
    with structlog.testing.capture_logs() as logs:
        put(t, grant(url=fault_server.url(f"/s503/k?{SECRET}")))
        with pytest.raises(DeliveryError) as e:
            put(t, grant(url=fault_server.url(f"/always503/k?{SECRET}")))
    text = repr(logs) + str(e.value) + repr(e.value.__cause__) + repr(e.value.__context__)
    assert logs and "TOPSECRETSIG" not in text and HDR_SECRET not in text and "/s503/k" not in text


def test_httpx_request_log_stays_quiet(fault_server, caplog):
    import logging

    caplog.set_level(logging.INFO)
    t = PresignedHttpPutTarget(settings(fault_server))
    put(t, grant(url=fault_server.url(f"/ok/quiet?{SECRET}")))
    assert "TOPSECRETSIG" not in caplog.text


SIGV4 = ("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AK%2F20261130%2Fus-east-1%2Fs3%2Faws4_request"
         "&X-Amz-Date=20261130T000000Z&X-Amz-Expires=600&X-Amz-SignedHeaders={}&X-Amz-Signature=TOPSECRETSIG")


@pytest.mark.parametrize("signed, headers, match", [
    ("host%3Bif-none-match%3Bx-amz-meta-run", {"if-none-match": "*"}, r"missing \['x-amz-meta-run'\]"),
    ("host%3Bif-none-match", {"if-none-match": "*", "x-amz-meta-run": HDR_SECRET}, r"not signed \['x-amz-meta-run'\]"),
    ("host", {"if-none-match": "*"}, r"not signed \['if-none-match'\]"),
    ("host%3Bcontent-type%3Bif-none-match", {"if-none-match": "*"}, r"missing \['content-type'\]"),
])
@pytest.mark.fault("presigned", "grant headers differ from X-Amz-SignedHeaders")
def test_grant_headers_must_match_the_signed_header_list(signed, headers, match):
    t = PresignedHttpPutTarget(settings())
    with pytest.raises(TargetError, match=match) as e:
        t.validate(grant(url="https://bucket.example.com/a/key?" + SIGV4.format(signed), headers=headers))
    assert HDR_SECRET not in str(e.value) and "TOPSECRETSIG" not in str(e.value)


def test_signed_header_list_match_is_accepted_incl_host_and_content_length():
    t = PresignedHttpPutTarget(settings())
    t.validate(grant(url="https://bucket.example.com/a/key?" + SIGV4.format("content-length%3Bhost%3Bif-none-match"),
                     headers={"if-none-match": "*"}))
    goog = ("https://bucket.example.com/a/key?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-SignedHeaders=host%3Bx-goog-meta-a"
            "&X-Goog-Signature=abc")
    with pytest.raises(TargetError, match=r"missing \['x-goog-meta-a'\]"):
        t.validate(grant(url=goog, headers={"if-none-match": "*"}))


@pytest.mark.parametrize("path", ["/runs/../x.gart", "/runs/./x.gart", "/runs/%2e%2e/x.gart", "/runs/.%2E/x.gart",
                                  "/runs/%2E/x.gart", "/..", "/a/b/..", "/runs/%2e%2E/%2e%2e/x"])
@pytest.mark.fault("presigned", "dot segments in the signed path")
def test_dot_segments_are_refused_at_validation(path):
    t = PresignedHttpPutTarget(settings())
    with pytest.raises(TargetError, match="'.' or '..' segment"):
        t.validate(grant(url=f"https://bucket.example.com{path}?{SECRET}"))


@pytest.mark.parametrize("path", ["/runs/a%2Fb.gart", "/runs/x.gart", "/runs/%7Euser/..x.gart", "/runs/a.b/.c",
                                  "/runs/%41%62"])
def test_wire_path_is_byte_for_byte_the_signed_path(fault_server, path):
    """What reaches the socket (the request line the server read) is exactly the URL's path and query."""
    t = PresignedHttpPutTarget(settings(fault_server))
    raw = "/ok" + path + "?" + SECRET + "&x=%2e%2E"
    put(t, grant(url=fault_server.url(raw)))
    assert fault_server.requests[-1].raw_path == raw


# ---- boundaries pinned for mutation survivors (mutation/run.py) ----

def test_settings_defaults_and_boundaries():
    from genartifact_http_put_target import MAX_OBJECT_BYTES

    d = PresignedSettings.parse({})
    assert (d.max_attempts, d.read_timeout_s, d.backoff_base_s, d.max_bytes) == (3, 30.0, 0.2, MAX_OBJECT_BYTES)
    for key, ok, bad in (("max_attempts", (1, 10), (0, 11, True, 2.0)),
                         ("max_bytes", (1, MAX_OBJECT_BYTES), (0, MAX_OBJECT_BYTES + 1)),
                         ("read_timeout_s", (0.01, 3600), (0.009, 3600.5, float("nan"), True)),
                         ("backoff_base_s", (0.0, 60), (-0.1, 60.5))):
        for v in ok:
            assert getattr(PresignedSettings.parse({key: v}), key) == v
        for v in bad:
            with pytest.raises(ConfigError, match=key):
                PresignedSettings.parse({key: v})
    for hosts in (["127.0.0.1"], ["LOCALHOST:80"], [" 127.0.0.1:8000"], ["10.0.0.1:80"]):
        with pytest.raises(ConfigError, match="insecure_http_hosts"):
            PresignedSettings.parse({"insecure_http_hosts": hosts})


def test_default_ports_and_header_name_length_boundary(fault_server):
    t = PresignedHttpPutTarget(settings(fault_server))
    assert t.validate(grant()).detail.port == 443
    assert t.validate(grant(url=fault_server.url("/ok/p"))).detail.port == fault_server.server.server_address[1]
    name = "x-amz-meta-" + "a" * (256 - len("x-amz-meta-"))
    t.validate(grant(headers={"if-none-match": "*", name: "v"}))  # exactly 256 characters
    with pytest.raises(TargetError, match="header names"):
        t.validate(grant(headers={"if-none-match": "*", name + "b": "v"}))


def test_expiry_margin_applies_before_sending(fault_server, monkeypatch):
    t = PresignedHttpPutTarget(settings(fault_server))
    v = t.validate(grant(url=fault_server.url("/ok/margin")))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: v.detail.expires_at - 0.5)  # inside the 1 s margin
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"x", "x"))
    monkeypatch.setattr(time, "time", real)
    assert e.value.code == "expired" and fault_server.requests == []


@pytest.mark.fault("presigned", "retry that would end past expiry")
def test_no_retry_that_would_end_past_expiry(fault_server):
    t = PresignedHttpPutTarget(settings(fault_server, backoff_base_s=2.0, backoff_max_s=2.0))
    g = grant(url=fault_server.url("/always503/k"), expires=iso(datetime.now(UTC) + timedelta(seconds=2.6)))
    with pytest.raises(DeliveryError) as e:
        put(t, g)
    assert e.value.code == "expired" and len(fault_server.requests) == 1  # the 2 s backoff would cross expiry


@pytest.mark.parametrize("status, code", [(300, "redirect_refused"), (399, "redirect_refused"),
                                          (400, "delivery_failed"), (299, None)])
def test_status_ranges(fault_server, status, code):
    t = PresignedHttpPutTarget(settings(fault_server))
    if code is None:
        assert put(t, grant(url=fault_server.url(f"/code{status}/k"))) == "obj-1"  # any 2xx is success
        return
    with pytest.raises(DeliveryError) as e:
        put(t, grant(url=fault_server.url(f"/code{status}/k")))
    assert e.value.code == code


def test_presigned_target_is_not_readable():
    from genartifact.errors import TargetNotReadableError
    from genartifact_http_put_target import PresignedHttpPutTarget, PresignedSettings

    t = PresignedHttpPutTarget(PresignedSettings.parse({"allowed_hosts": ["b.example.com"]}))
    for call in (t.open("id", 10), t.exists("id"), t.delete("id", "0" * 64)):
        with pytest.raises(TargetNotReadableError, match="write-only"):
            asyncio.run(call)
