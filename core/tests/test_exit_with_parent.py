"""vLLM's engine core and workers are multiprocessing children: when the process that started them is killed
(SIGKILL: no shutdown), they must end too instead of running on as orphans (a killed `generate` left
VLLM::EngineCore + VLLM::Worker holding ~2.4 GB). The mechanism, genartifact.engine.worker_ext.exit_with_parent
(armed by the vllm.general_plugins entry point in every vLLM process), checked here without an engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

STARTER = textwrap.dedent('''
    import multiprocessing, sys, time

    def child(path):
        from genartifact.engine.worker_ext import exit_with_parent
        armed = exit_with_parent()
        with open(path, "w") as f:
            f.write(f"{__import__('os').getpid()} {armed}")
        time.sleep(600)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context(sys.argv[2])
        ctx.Process(target=child, args=(sys.argv[1],)).start()
        time.sleep(600)
''')


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_child_ends_when_its_parent_is_sigkilled(tmp_path, method):
    script, marker = tmp_path / "starter.py", tmp_path / "child.pid"
    script.write_text(STARTER)
    parent = subprocess.Popen([sys.executable, str(script), str(marker), method])
    child = None
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (marker.exists() and marker.read_text().strip()):
            time.sleep(0.05)
        pid, armed = marker.read_text().split()
        child = int(pid)
        assert armed == "True"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.time() + 10
        while time.time() < deadline and _alive(child):
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_not_armed_in_a_process_without_a_multiprocessing_parent():
    out = subprocess.run([sys.executable, "-c", "from genartifact.engine.worker_ext import exit_with_parent; "
                          "import sys; sys.modules.get('vllm') and sys.exit(3); print(exit_with_parent())"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
