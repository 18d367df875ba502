"""The kit's S3 test server never outlives the process that started it, even one killed with SIGKILL."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

pytest.importorskip("boto3")

CHILD = r"""
import os, sys
from genartifact.testing.s3server import SeaweedS3
s = SeaweedS3("lifetime").start()
print(s.proc.pid, s.dir, flush=True)
sys.stdin.read()  # wait to be killed
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_with_a_sigkilled_parent():
    from genartifact.testing.s3server import weed_binary

    try:
        weed_binary()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"weed binary not installed: {e}")
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    data_dir = ""
    try:
        pid, data_dir = child.stdout.readline().decode().split(maxsplit=1)
        weed_pid, data_dir = int(pid), data_dir.strip()
        assert "ga-seaweed-" in data_dir
        os.kill(weed_pid, 0)  # running
        child.kill()
        child.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(weed_pid, 0)
            except ProcessLookupError:
                break
            # a zombie (reaped by init shortly) still answers kill(0): check its state
            try:
                with open(f"/proc/{weed_pid}/stat") as f:
                    if f.read().split(") ", 1)[1].startswith("Z"):
                        break
            except FileNotFoundError:
                break
            time.sleep(0.2)
        else:
            os.kill(weed_pid, 9)
            pytest.fail("the S3 test server outlived its SIGKILLed parent")
    finally:
        if child.poll() is None:
            child.kill()
        if data_dir:  # a SIGKILLed parent never ran its clean-up: its data directory is this test's to remove
            shutil.rmtree(data_dir, ignore_errors=True)
