"""A loopback HTTP server for fault injection that records exactly what arrived on the wire."""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class Seen:
    method: str
    raw_path: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class FaultServer:
    server: ThreadingHTTPServer
    requests: list[Seen] = field(default_factory=list)
    store: dict[str, bytes] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def authority(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def url(self, path: str) -> str:
        return f"http://{self.authority}{path}"


# 403 bodies as S3 sends them (verified against SeaweedFS, see /work/shared/reference/README.md)
ERROR_BODIES = {
    "s403expired": b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
                   b"<Message>Request has expired</Message><Resource>/b/k</Resource></Error>",
    "s403signature": b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SignatureDoesNotMatch</Code><Message>The '
                     b"request signature we calculated does not match the signature you provided.</Message></Error>",
    "s403": b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>",
}


def make_handler(state: FaultServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def finish(self):  # the reset mode closed the streams already
            if not self.wfile.closed:
                super().finish()

        def do_PUT(self):
            path = self.path.split("?", 1)[0]
            mode = path.strip("/").split("/", 1)[0]
            n = state.counters[path] = state.counters.get(path, 0) + 1
            if mode == "reset":
                # abortive close (RST): drop every reference to the socket with SO_LINGER 0
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.rfile.close()
                self.wfile.close()
                self.connection.close()
                return
            if mode == "slowheaders":
                time.sleep(2.0)
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            state.requests.append(Seen("PUT", self.path, list(self.headers.items()), body))
            if mode == "slow":
                time.sleep(2.0)
            status = 200
            if mode == "s503" and n == 1:
                status = 503
            elif mode == "s429" and n == 1:
                status = 429
            elif mode == "s500store" and n == 1:  # committed the bytes, then failed to answer
                state.store[path] = body
                status = 500
            elif mode == "always503":
                status = 503
            elif mode == "redirect":
                status = 307
            elif mode == "s413":
                status = 413
            elif mode.startswith("code") and mode[4:].isdigit():
                status = int(mode[4:])
            elif mode in ("s403", "s403expired", "s403signature"):
                status = 403
            elif mode == "s400":
                status = 400
            elif status == 200 and self.headers.get("If-None-Match") == "*" and path in state.store:
                status = 412
            if status == 200:
                state.store[path] = body
            self.send_response(status)
            if status == 307:
                self.send_header("Location", state.url("/ok/redirected"))
            reply = ERROR_BODIES.get(mode, b"")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            try:
                self.wfile.write(reply)
            except OSError:  # the client hung up first (it reads at most 4 KiB of a 403, none of a 3xx)
                self.close_connection = True

    return Handler


@pytest.fixture
def fault_server():
    state = FaultServer(server=None)  # type: ignore[arg-type]
    srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    srv.daemon_threads = True
    state.server = srv
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    yield state
    srv.shutdown()
    srv.server_close()
