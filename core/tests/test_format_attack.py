"""The encoder's compressor cache under faults found by an attacker (issue 13 review): a frame abandoned part-way,
a traceback kept after a failed encode, and a process forked from inside a frame. Each case runs in its own
Python process, because the failures they pin are a SIGSEGV or a process that never ends, which would take pytest
down with them; the parent waits with a timeout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_PRELUDE = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_format import multi_job_input, GOLDEN_MULTI_JOB_SHA256
from genartifact import format as fmt
from genartifact.errors import ArtifactFormatError
from genartifact.testing import wait_child

RealSink = fmt._HashingSink

def with_sink(on_write):
    # every later frame's output pieces go through on_write(n) first (n = 1, 2, ...); the sink class is swapped,
    # not _frame_pieces wrapped: a wrapper's frame would hold the compressor in a kept traceback itself
    class Sink(RealSink):
        n = 0
        def write(self, piece):
            self.n += 1
            on_write(self.n)
            return super().write(piece)
    fmt._HashingSink = Sink

def unpatch():
    fmt._HashingSink = RealSink
"""


def _run(body: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PRELUDE + body], capture_output=True, text=True, timeout=timeout)


@pytest.mark.fault("encoder", "multi-threaded frame abandoned after part of its input, then the next encode")
def test_the_encode_after_a_frame_abandoned_mid_input_gives_the_pinned_bytes():
    """A sink write that raises after the first output piece abandons the frame with input still to come.
    libzstd's multi-threaded context, reused after that, crashed in the next frame (SIGSEGV, exit -11): such a
    compressor must never come back to the cache."""
    r = _run("""
class Boom(Exception):
    pass
def on_write(n):
    if n == 1:
        raise Boom()
with_sink(on_write)
for _ in range(3):
    try:
        fmt.encode(multi_job_input())
        sys.exit(3)  # the fault did not fire
    except Boom:
        pass
unpatch()
for _ in range(3):
    assert fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256
print("ok")
""")
    assert (r.returncode, r.stdout.strip()) == (0, "ok"), (r.returncode, r.stderr[-2000:])


@pytest.mark.fault("encoder", "traceback of a failed encode kept, then fork: the child drops it and exits normally")
def test_a_kept_traceback_does_not_carry_the_compressor_into_a_forked_child():
    """An exception kept after a failed encode (``sys.last_exc``, a logged error, a future) holds its traceback's
    frames. Were the compressor among their locals, the child of a later fork would free it when dropping the
    exception, joining zstd workers the child does not have: it would never end."""
    r = _run("""
class Boom(Exception):
    pass
def on_write(n):
    if n == 2:
        raise Boom()
with_sink(on_write)
try:
    fmt.encode(multi_job_input())
    sys.exit(3)
except Boom as e:
    kept = e
unpatch()
pid = os.fork()
if pid == 0:
    del kept  # the child frees the traceback's frames, then ends through interpreter shutdown
    ok = fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256
    sys.exit(0 if ok else 4)
code = wait_child(pid, 30.0)
assert fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256
print(code)
""")
    assert (r.returncode, r.stdout.strip()) == (0, "0"), (r.returncode, r.stdout, r.stderr[-2000:])


@pytest.mark.fault("encoder", "process forked by code running inside a multi-threaded frame (a validator)")
def test_a_child_forked_inside_a_frame_fails_that_encode_instead_of_hanging():
    """Code that runs during a frame (here a content reader's validation, after all input went to zstd's workers)
    forks. The child has the compressor but not its worker threads: finishing the frame there would wait forever.
    The child's encode raises ``RuntimeError`` instead; the parent's gives the pinned bytes."""
    r = _run("""
real_validate = fmt._validate_contents
children = []
def forking_validate(*a, **k):
    pid = os.fork()
    if pid == 0:
        children.append("me")
    else:
        children.append(pid)
    return real_validate(*a, **k)
fmt._validate_contents = forking_validate
try:
    sha = fmt.encode(multi_job_input()).sha256
except RuntimeError as e:
    if children == ["me"]:
        os._exit(5 if "forked in the middle of a zstd frame" in str(e) else 6)
    raise
except BaseException:
    if children == ["me"]:
        os._exit(7)
    raise
if children == ["me"]:
    os._exit(8)  # the child finished the frame: it must not
code = wait_child(children[0], 30.0)
fmt._validate_contents = real_validate
assert sha == GOLDEN_MULTI_JOB_SHA256
assert fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256
print(code)
""")
    assert (r.returncode, r.stdout.strip()) == (0, "5"), (r.returncode, r.stdout, r.stderr[-2000:])


@pytest.mark.fault("encoder", "process forked between two output pieces of a multi-threaded frame")
def test_a_child_forked_between_output_pieces_fails_that_encode_instead_of_hanging():
    """Like the validator case, with the fork just before an output piece reaches the object (a signal handler
    or finalizer running there): the child's next sink write raises; the parent's frame is intact."""
    r = _run("""
children = []
def on_write(n):
    if n == 2 and not children:
        pid = os.fork()
        children.append("me" if pid == 0 else pid)
with_sink(on_write)
try:
    sha = fmt.encode(multi_job_input()).sha256
except RuntimeError as e:
    if children == ["me"]:
        os._exit(5 if "forked in the middle of a zstd frame" in str(e) else 6)
    raise
except BaseException:
    if children == ["me"]:
        os._exit(7)
    raise
if children == ["me"]:
    os._exit(8)
code = wait_child(children[0], 30.0)
unpatch()
assert sha == GOLDEN_MULTI_JOB_SHA256
assert fmt.encode(multi_job_input()).sha256 == GOLDEN_MULTI_JOB_SHA256
print(code)
""")
    assert (r.returncode, r.stdout.strip()) == (0, "5"), (r.returncode, r.stdout, r.stderr[-2000:])
