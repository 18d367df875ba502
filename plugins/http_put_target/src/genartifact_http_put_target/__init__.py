"""``presigned_http_put``: deliver an artifact with one HTTP PUT to a caller-supplied presigned URL (httpx).

Request target::

    {"kind": "presigned_http_put", "url": "https://bucket.s3.example/key?X-Amz-...", "expires_at":
     "2026-12-01T10:00:00Z", "max_bytes": 67108864, "required_headers": {"if-none-match": "*"},
     "object_id": "opaque-id-for-the-receipt"}

Server-side settings (config ``[targets.presigned_http_put]``)::

    allowed_hosts = ["bucket.s3.example"]   # exact host or host:port (port omitted = scheme default)
    max_ttl_s = 3600                        # expires_at may be at most this far in the future
    insecure_http_hosts = []                # TESTS ONLY: exact loopback host:port allowed over http
    connect_timeout_s = 5.0, read_timeout_s = 30.0, write_timeout_s = 30.0, total_timeout_s = 60.0
    max_attempts = 3, backoff_base_s = 0.2, backoff_max_s = 2.0

Security model: the URL (with its query string), and every required-header value are secrets. They are kept
in objects whose ``repr`` redacts them and never appear in logs, errors, receipts or tracebacks (exceptions
from httpx are replaced, ``from None``). Validation is side-effect free apart from a DNS lookup: HTTPS only
(unless the escape hatch names that exact loopback authority), no userinfo or fragment, ASCII-printable and
length limits, valid percent escapes, host on the allowlist and resolving only to globally routable addresses
(SSRF), ``expires_at`` timezone-aware, in the future and within the TTL, header count/size/character limits,
a denylist of headers a client must never set, and ``if-none-match: *`` (create-only; S3 conditional write).
When the URL names its signed headers (SigV4 ``X-Amz-SignedHeaders``, GCS ``X-Goog-SignedHeaders``), the
grant's headers must be exactly those (besides ``host`` and ``content-length``, which the client always sends):
a missing or unsigned extra header is refused naming the header names (never values). Paths with ``.``/``..``
segments, raw or percent-encoded, are refused, and the URL must reach the wire byte-for-byte as given (the
HTTP client's normalised form is compared with the original), so the PUT always goes to the signed key.

Sending: expiry rechecked before every attempt; one PUT of the exact bytes with an explicit Content-Length
(never chunked); exactly the required headers plus Host and Content-Length (httpx's defaults removed); no
redirects; explicit connect/read/write timeouts and a whole-delivery deadline; any 2xx is success; retries with
exponential backoff only on connect errors, 429 and 5xx, rebuilding the request each time and never past
expiry; 412 means the object exists (``object_exists``), except after an attempt that got a 5xx, when the object
may hold this delivery's own bytes (``delivery_failed``: ambiguous, so reconcile lists it); 403 is final and classified by its body (at most 4 KiB read; S3/GCS XML
``<Code>``/``<Message>``): ``expired`` only when the store says the request expired, ``signature_mismatch``
for ``SignatureDoesNotMatch``, else ``forbidden``. ``max_attempts`` counts PUTs sent by this client (httpx
never resends on its own).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import httpx
import pluggy
import structlog
from genartifact.errors import ConfigError, DeliveryError, TargetError, TargetNotReadableError
from genartifact.format import MAX_DECODED_BYTES, encoded_size_bound
from genartifact.types import ValidatedTarget

hookimpl = pluggy.HookimplMarker("genartifact")
KIND = "presigned_http_put"
__version__ = "0.1.0"
log = structlog.get_logger("genartifact.http_put_target")
# httpx and httpcore log every request line (URL with its signed query string) at INFO/DEBUG: keep them quiet
for _name in ("httpx", "httpcore"):
    logging.getLogger(_name).setLevel(logging.WARNING)

MAX_URL_CHARS = 8192
MAX_HEADERS = 16
MAX_HEADER_NAME = 256
MAX_HEADER_VALUE = 4096
MAX_OBJECT_ID = 512
MAX_OBJECT_BYTES = encoded_size_bound(MAX_DECODED_BYTES)
EXPIRY_MARGIN_S = 1.0
_TARGET_KEYS = {"kind", "url", "expires_at", "max_bytes", "required_headers", "object_id"}
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
DENIED_HEADERS = frozenset({
    "host", "authorization", "proxy-authorization", "content-length", "transfer-encoding", "te", "trailer",
    "connection", "keep-alive", "upgrade", "expect", "cookie", "cookie2", "set-cookie", "forwarded", "via",
    "x-real-ip", "x-http-method-override", "x-http-method", "x-method-override", "content-encoding", "range",
    "x-amz-copy-source", "x-amz-copy-source-range", "x-goog-copy-source", "origin", "referer",
})
DENIED_PREFIXES = ("proxy-", "x-forwarded-", "sec-", "x-amz-copy-source")
DENIED_SUFFIXES = ("-copy-source",)


def _float(settings: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = settings.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise ConfigError(f"[targets.presigned_http_put].{key}={v!r}; allowed: number {lo}..{hi}")
    return float(v)


def _authority(host: str, port: int | None, scheme: str) -> str:
    default = 443 if scheme == "https" else 80
    h = f"[{host}]" if ":" in host else host
    return h if port in (None, default) else f"{h}:{port}"


def _host_of(authority: str) -> str:
    return urlsplit(f"//{authority}").hostname or ""


def _is_loopback_name(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class PresignedSettings:
    """Validated server-side settings (seconds for times, bytes for sizes)."""

    allowed_hosts: frozenset[str]
    max_ttl_s: float = 3600.0
    insecure_http_hosts: frozenset[str] = frozenset()
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    total_timeout_s: float = 60.0
    max_attempts: int = 3
    backoff_base_s: float = 0.2
    backoff_max_s: float = 2.0
    max_bytes: int = MAX_OBJECT_BYTES
    resolver: Callable[..., Any] = field(default=socket.getaddrinfo, repr=False, compare=False)

    @classmethod
    def parse(cls, settings: Mapping[str, Any], resolver: Callable[..., Any] | None = None) -> PresignedSettings:
        """Validate the config table. Raises :class:`ConfigError` naming the key and allowed values."""
        allowed = {"allowed_hosts", "max_ttl_s", "insecure_http_hosts", "connect_timeout_s", "read_timeout_s",
                   "write_timeout_s", "total_timeout_s", "max_attempts", "backoff_base_s", "backoff_max_s",
                   "max_bytes", "base_dir"}
        extra = set(settings) - allowed
        if extra:
            raise ConfigError(f"[targets.presigned_http_put]: unknown key(s) {sorted(extra)}; allowed: {sorted(allowed - {'base_dir'})}")
        hosts = settings.get("allowed_hosts", [])
        insecure = settings.get("insecure_http_hosts", [])
        for name, lst in (("allowed_hosts", hosts), ("insecure_http_hosts", insecure)):
            if not isinstance(lst, list) or not all(isinstance(h, str) and h and h == h.strip().lower() for h in lst):
                raise ConfigError(f"[targets.presigned_http_put].{name} must be a list of lowercase host[:port] strings")
        for h in insecure:
            if not _is_loopback_name(_host_of(h)) or ":" not in h.rsplit("]", 1)[-1]:
                raise ConfigError(
                    f"[targets.presigned_http_put].insecure_http_hosts entry {h!r} must be an exact loopback host:port "
                    f"(127.0.0.0/8, ::1 or localhost); it exists for tests only"
                )
        attempts = settings.get("max_attempts", 3)
        if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= 10:
            raise ConfigError(f"[targets.presigned_http_put].max_attempts={attempts!r}; allowed: integer 1..10")
        mb = settings.get("max_bytes", MAX_OBJECT_BYTES)
        if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= MAX_OBJECT_BYTES:
            raise ConfigError(f"[targets.presigned_http_put].max_bytes={mb!r}; allowed: integer 1..{MAX_OBJECT_BYTES}")
        return cls(
            allowed_hosts=frozenset(hosts),
            max_ttl_s=_float(settings, "max_ttl_s", 3600.0, 1.0, 7 * 86400),
            insecure_http_hosts=frozenset(insecure),
            connect_timeout_s=_float(settings, "connect_timeout_s", 5.0, 0.01, 600),
            read_timeout_s=_float(settings, "read_timeout_s", 30.0, 0.01, 3600),
            write_timeout_s=_float(settings, "write_timeout_s", 30.0, 0.01, 3600),
            total_timeout_s=_float(settings, "total_timeout_s", 60.0, 0.01, 7200),
            max_attempts=attempts,
            backoff_base_s=_float(settings, "backoff_base_s", 0.2, 0.0, 60),
            backoff_max_s=_float(settings, "backoff_max_s", 2.0, 0.0, 600),
            max_bytes=mb,
            resolver=resolver or socket.getaddrinfo,
        )


@dataclass(frozen=True)
class Grant:
    """A validated presigned PUT grant. ``url`` and ``headers`` are secrets: excluded from ``repr``."""

    url: str = field(repr=False)
    headers: tuple[tuple[str, str], ...] = field(repr=False)
    host: str
    port: int
    expires_at: float  # POSIX seconds
    max_bytes: int
    object_id: str = field(repr=False)
    insecure: bool = False


def _check_addresses(settings: PresignedSettings, host: str, port: int) -> None:
    """Every address ``host`` resolves to must be globally routable (SSRF). Raises :class:`TargetError`."""
    try:
        ip = ipaddress.ip_address(host)
        addrs = [ip]
    except ValueError:
        try:
            infos = settings.resolver(host, port, type=socket.SOCK_STREAM)
        except OSError:
            raise TargetError("presigned_http_put target.url host does not resolve") from None
        addrs = [ipaddress.ip_address(i[4][0].split("%", 1)[0]) for i in infos]
        if not addrs:
            raise TargetError("presigned_http_put target.url host does not resolve") from None
    for a in addrs:
        embedded = [getattr(a, "ipv4_mapped", None), getattr(a, "sixtofour", None)]
        teredo = getattr(a, "teredo", None)
        if teredo:
            embedded.append(teredo[1])
        for inner in [x for x in embedded if x is not None]:
            if not inner.is_global or inner.is_private or inner.is_loopback or inner.is_link_local:
                raise TargetError(
                    "presigned_http_put target.url host resolves to an address embedding a non-global IPv4 address")
        if not a.is_global or a.is_multicast or a.is_reserved or a.is_private or a.is_loopback or a.is_link_local \
                or getattr(a, "is_site_local", False):
            raise TargetError(
                "presigned_http_put target.url host resolves to a non-global address (private, loopback, link-local "
                "or reserved); only globally routable addresses are allowed"
            )


def validate_grant(spec: Mapping[str, Any], settings: PresignedSettings, now: float | None = None) -> Grant:
    """Validate a request's target object. Raises :class:`TargetError` naming the field (never its value)."""
    extra = set(spec) - _TARGET_KEYS
    if extra:
        raise TargetError(f"presigned_http_put target: unknown key(s) {sorted(map(str, extra))}; allowed: {sorted(_TARGET_KEYS)}")
    missing = _TARGET_KEYS - set(spec)
    if missing:
        raise TargetError(f"presigned_http_put target: missing key(s) {sorted(missing)}")
    now = time.time() if now is None else now
    url = spec["url"]
    if not isinstance(url, str) or not url:
        raise TargetError("presigned_http_put target.url must be a non-empty string")
    if len(url) > MAX_URL_CHARS:
        raise TargetError(f"presigned_http_put target.url is longer than {MAX_URL_CHARS} characters")
    if not all(0x21 <= ord(c) <= 0x7E for c in url):
        raise TargetError("presigned_http_put target.url must be printable ASCII without spaces (IDN hosts must be punycode)")
    if "#" in url:
        raise TargetError("presigned_http_put target.url must not contain a fragment")
    if _BAD_ESCAPE.search(url):
        raise TargetError("presigned_http_put target.url has an invalid percent escape")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise TargetError("presigned_http_put target.url is not a valid URL (bad host or port)") from None
    if "@" in parts.netloc:
        raise TargetError("presigned_http_put target.url must not contain userinfo")
    port = parts.port
    host = (parts.hostname or "").lower()
    if not host:
        raise TargetError("presigned_http_put target.url has no host")
    scheme = parts.scheme.lower()
    authority = _authority(host, port, scheme)
    insecure = False
    if scheme == "http" and authority in settings.insecure_http_hosts:
        insecure = True  # test-only escape hatch: exact loopback authority, no SSRF check
    elif scheme != "https":
        raise TargetError("presigned_http_put target.url must use https")
    if not insecure:
        if host == "localhost" or host.endswith((".localhost", ".local", ".internal")):
            raise TargetError("presigned_http_put target.url host is a local name; only public hosts are allowed")
        if authority not in settings.allowed_hosts:
            raise TargetError("presigned_http_put target.url host is not on the allowed_hosts list")
    exp = spec["expires_at"]
    if not isinstance(exp, str) or len(exp) > 64:
        raise TargetError("presigned_http_put target.expires_at must be an RFC 3339 string with a timezone")
    try:
        dt = datetime.fromisoformat(exp)
    except ValueError:
        raise TargetError("presigned_http_put target.expires_at must be an RFC 3339 string with a timezone") from None
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise TargetError("presigned_http_put target.expires_at needs a timezone (e.g. 'Z' or '+00:00')")
    try:
        expires = dt.astimezone(UTC).timestamp()
    except (OverflowError, ValueError):
        raise TargetError("presigned_http_put target.expires_at is out of range") from None
    if expires <= now + EXPIRY_MARGIN_S:
        raise TargetError("presigned_http_put target.expires_at is in the past")
    if expires > now + settings.max_ttl_s:
        raise TargetError(f"presigned_http_put target.expires_at is more than max_ttl_s={settings.max_ttl_s:g} s ahead")
    _check_path(url, parts)
    mb = spec["max_bytes"]
    if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= settings.max_bytes:
        raise TargetError(f"presigned_http_put target.max_bytes must be an integer in 1..{settings.max_bytes}")
    headers = _validate_headers(spec["required_headers"])
    _check_signed_headers(parts.query, headers)
    oid = spec["object_id"]
    if not isinstance(oid, str) or not oid or len(oid.encode()) > MAX_OBJECT_ID or not oid.isprintable():
        raise TargetError(f"presigned_http_put target.object_id must be 1..{MAX_OBJECT_ID} bytes of printable text")
    if not insecure:
        _check_addresses(settings, host, port or 443)
    return Grant(url=url, headers=headers, host=host, port=port or (443 if scheme == "https" else 80),
                 expires_at=expires, max_bytes=mb, object_id=oid, insecure=insecure)


SIGNED_HEADER_PARAMS = ("x-amz-signedheaders", "x-goog-signedheaders")
ALWAYS_SENT = frozenset({"host", "content-length"})


def _check_path(url: str, parts: Any) -> None:
    """Refuse dot segments (raw or percent-encoded: ``.``, ``..``, ``%2e``, ``.%2E``...) and any URL the HTTP
    client would not send byte-for-byte (its normalised target must equal the given path and query)."""
    for seg in parts.path.split("/"):
        if unquote(seg) in (".", ".."):
            raise TargetError("presigned_http_put target.url path has a '.' or '..' segment (raw or percent-encoded); "
                              "the client would send another key than the one signed")
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        sent = httpx.URL(url).raw_path.decode("ascii")
    except (httpx.InvalidURL, UnicodeDecodeError, ValueError):
        raise TargetError("presigned_http_put target.url is not a valid URL") from None
    if sent != (target or "/"):
        raise TargetError("presigned_http_put target.url would not be sent as given (the HTTP client normalises its "
                          "path or query); pass the URL exactly as signed, in normalised form")


def _check_signed_headers(query: str, headers: tuple[tuple[str, str], ...]) -> None:
    """The grant's header names must equal the URL's signed-header list (minus host/content-length)."""
    signed_lists = [v for k, v in parse_qsl(query, keep_blank_values=True) if k.lower() in SIGNED_HEADER_PARAMS]
    if not signed_lists:
        return  # not a SigV4/GCS-v4 URL: nothing to compare against
    if len(signed_lists) > 1:
        raise TargetError("presigned_http_put target.url names its signed headers more than once")
    signed = {h.strip().lower() for h in signed_lists[0].split(";") if h.strip()}
    given = {name for name, _ in headers}
    missing = sorted(signed - given - ALWAYS_SENT)
    extra = sorted(given - signed)
    if missing or extra:
        parts = ([f"missing {missing} (signed by the URL)"] if missing else []) + \
                ([f"not signed {extra} (the store would refuse or ignore them)"] if extra else [])
        raise TargetError("presigned_http_put target.required_headers do not match the URL's signed headers: "
                          + "; ".join(parts))


def _validate_headers(raw: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, Mapping):
        raise TargetError("presigned_http_put target.required_headers must be an object of name -> value")
    if len(raw) > MAX_HEADERS:
        raise TargetError(f"presigned_http_put target.required_headers has {len(raw)} headers; at most {MAX_HEADERS}")
    out: dict[str, str] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not _TOKEN.fullmatch(name) or len(name) > MAX_HEADER_NAME:
            raise TargetError(f"presigned_http_put target.required_headers: header names must be HTTP tokens of at most {MAX_HEADER_NAME} characters")
        low = name.lower()
        if low in DENIED_HEADERS or low.startswith(DENIED_PREFIXES) or low.endswith(DENIED_SUFFIXES):
            raise TargetError(f"presigned_http_put target.required_headers: header {low!r} must not be set by a client")
        if low in out:
            raise TargetError(f"presigned_http_put target.required_headers: header {low!r} given twice")
        if not isinstance(value, str) or len(value.encode("utf-8", "surrogatepass")) > MAX_HEADER_VALUE:
            raise TargetError(f"presigned_http_put target.required_headers[{low!r}] must be a string of at most {MAX_HEADER_VALUE} bytes")
        if any(ord(c) < 0x20 and c != "\t" or ord(c) == 0x7F or ord(c) > 0x7E for c in value):
            raise TargetError(f"presigned_http_put target.required_headers[{low!r}] contains control or non-ASCII characters")
        if value != value.strip(" \t"):
            raise TargetError(f"presigned_http_put target.required_headers[{low!r}] has leading or trailing whitespace")
        out[low] = value
    if out.get("if-none-match") != "*":
        raise TargetError("presigned_http_put target.required_headers must include 'if-none-match: *' (create-only)")
    return tuple(sorted(out.items()))


class PresignedHttpPutTarget:
    """The ``presigned_http_put`` storage target."""

    kind = KIND

    def __init__(self, settings: PresignedSettings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self._transport = transport  # tests may inject; default: a fresh connection pool per delivery

    def __repr__(self) -> str:
        return f"PresignedHttpPutTarget(allowed_hosts={sorted(self.settings.allowed_hosts)})"

    def validate(self, spec: Mapping[str, Any]) -> ValidatedTarget:
        g = validate_grant(spec, self.settings)
        return ValidatedTarget(kind=KIND, max_bytes=g.max_bytes, object_id=g.object_id, detail=g)

    def describe(self, target: ValidatedTarget) -> dict[str, Any]:
        """Non-secret reference for the delivery journal: the upload host only (never URL or headers)."""
        return {"host": target.detail.host}

    async def deliver(self, target: ValidatedTarget, data: bytes, sha256: str) -> str:
        """One PUT (with bounded retries). Raises :class:`DeliveryError` with codes ``expired``,
        ``signature_mismatch``, ``forbidden``, ``object_exists``, ``too_large``, ``redirect_refused``,
        ``timeout`` or ``delivery_failed``."""
        g: Grant = target.detail
        if len(data) > g.max_bytes:
            raise DeliveryError("artifact exceeds the presigned grant's max_bytes", "too_large")
        s = self.settings
        try:
            async with asyncio.timeout(s.total_timeout_s):
                await self._put(g, data)
        except TimeoutError:
            raise DeliveryError("presigned artifact PUT timed out", "timeout") from None
        return g.object_id

    async def open(self, object_id: str, max_bytes: int) -> bytes:
        """Not offered: a presigned PUT grant is write-only. Raises :class:`TargetNotReadableError`."""
        raise TargetNotReadableError(
            "presigned_http_put targets are write-only (the grant allows one PUT); read the object from the store "
            "that issued the URL")

    async def exists(self, object_id: str) -> bool:
        """Not offered (write-only grant). Raises :class:`TargetNotReadableError`."""
        raise TargetNotReadableError("presigned_http_put targets are write-only; existence cannot be checked")

    async def delete(self, object_id: str, sha256: str) -> bool:
        """Not offered (write-only grant). Raises :class:`TargetNotReadableError`."""
        raise TargetNotReadableError("presigned_http_put targets are write-only; objects cannot be deleted by "
                                     "genartifact (the grant's issuer owns the key)")

    async def _put(self, g: Grant, data: bytes) -> None:
        s = self.settings
        timeout = httpx.Timeout(connect=s.connect_timeout_s, read=s.read_timeout_s, write=s.write_timeout_s,
                                pool=s.connect_timeout_s)
        async with httpx.AsyncClient(transport=self._transport, follow_redirects=False, trust_env=False,
                                     timeout=timeout) as client:
            client.headers.clear()  # send exactly the required headers (+ Host, Content-Length)
            # an earlier attempt got a 5xx: the store may have committed our bytes before it failed to answer, so a
            # later 412 may be answering our own write (ambiguous, not proof that nothing of ours was stored)
            maybe_stored = False
            for attempt in range(1, s.max_attempts + 1):
                if time.time() >= g.expires_at - EXPIRY_MARGIN_S:
                    raise DeliveryError("presigned grant expired before upload", "expired")
                if not g.insecure:  # re-check resolution right before connecting (DNS rebinding)
                    try:
                        await asyncio.to_thread(_check_addresses, s, g.host, g.port)
                    except TargetError:
                        raise DeliveryError("presigned artifact host failed the address check", "target_invalid") from None
                request = client.build_request("PUT", g.url, content=data, headers=dict(g.headers))
                retry = False
                body = b""
                try:
                    resp = await client.send(request, stream=True)
                    try:
                        if resp.status_code == 403:
                            async for chunk in resp.aiter_raw():
                                body += chunk
                                if len(body) >= 4096:
                                    break
                    finally:
                        await resp.aclose()
                except (httpx.ConnectError, httpx.ConnectTimeout):
                    retry, status = True, None  # nothing was sent: safe to retry
                except httpx.TimeoutException:
                    raise DeliveryError("presigned artifact PUT timed out", "timeout") from None
                except httpx.HTTPError:
                    raise DeliveryError("presigned artifact PUT failed", "delivery_failed") from None
                else:
                    status = resp.status_code
                    if 200 <= status < 300:
                        log.info("presigned_put_ok", host=g.host, status=status, attempt=attempt, bytes=len(data))
                        return
                    retry = status == 429 or status >= 500
                    if status == 412 and maybe_stored:
                        log.warning("presigned_put_exists_after_resend", host=g.host, attempt=attempt)
                        raise DeliveryError("presigned artifact PUT answered 412 after a resend: the object may be "
                                            "this delivery's own earlier attempt", "delivery_failed")
                    if not retry:
                        raise _status_error(status, body[:4096])
                    maybe_stored = maybe_stored or status >= 500
                log.warning("presigned_put_retry", host=g.host, status=status, attempt=attempt)
                if attempt == s.max_attempts:
                    break
                delay = min(s.backoff_max_s, s.backoff_base_s * 2 ** (attempt - 1))
                if time.time() + delay >= g.expires_at - EXPIRY_MARGIN_S:
                    raise DeliveryError("presigned grant would expire before the retry", "expired")
                await asyncio.sleep(delay)
            raise DeliveryError("presigned artifact PUT was not accepted after retries", "delivery_failed")


_XML_CODE = re.compile(rb"<Code>\s*([A-Za-z]{1,64})\s*</Code>")
_XML_MESSAGE = re.compile(rb"<Message>([^<]{0,512})</Message>")


def classify_403(body: bytes) -> str:
    """Receipt code for a 403 from its body (S3 and GCS XML errors): ``expired`` only when the store says so
    (``<Code>ExpiredToken</Code>``/``RequestExpired`` or "expired" in the message, e.g. S3's AccessDenied
    "Request has expired"), ``signature_mismatch`` for ``SignatureDoesNotMatch``, else ``forbidden``."""
    code = _XML_CODE.search(body)
    msg = _XML_MESSAGE.search(body)
    c = code.group(1).decode() if code else ""
    m = msg.group(1).decode("ascii", "replace").lower() if msg else ""
    if c in ("ExpiredToken", "RequestExpired", "TokenExpired") or "expired" in m:
        return "expired"
    if c == "SignatureDoesNotMatch":
        return "signature_mismatch"
    return "forbidden"


def _status_error(status: int, body: bytes = b"") -> DeliveryError:
    if status == 412:
        return DeliveryError("presigned artifact object already exists", "object_exists")
    if status == 403:
        code = classify_403(body)
        return DeliveryError({"expired": "presigned artifact PUT was refused: the grant expired",
                              "signature_mismatch": "presigned artifact PUT was refused: signature mismatch",
                              "forbidden": "presigned artifact PUT was refused (403)"}[code], code)
    if status == 413:
        return DeliveryError("presigned artifact PUT was refused as too large", "too_large")
    if 300 <= status < 400:
        return DeliveryError("presigned artifact PUT was redirected; redirects are not followed", "redirect_refused")
    return DeliveryError("presigned artifact PUT was not accepted", "delivery_failed")


@hookimpl
def genartifact_storage_target(kind: str, settings: Mapping[str, Any]) -> PresignedHttpPutTarget | None:
    if kind != KIND:
        return None
    return PresignedHttpPutTarget(PresignedSettings.parse(settings))
