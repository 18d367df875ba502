"""Who freezes the start-up heap (issue 13, nineteenth pass): `genartifact serve` and `genartifact generate` do,
once their engine started, and unfreeze after its shutdown; the same code called in someone else's process
(``create_app`` / ``run_generate`` with their defaults, as fpm_bench's live check and the tests call them) does
not; an engine that never started freezes nothing. Stand-in engines: no vLLM start."""

from __future__ import annotations

import asyncio
import gc
import re

import pytest
from genartifact import config as config_mod
from genartifact.engine import server, vllm_adapter
from genartifact.engine.job import run_generate
from genartifact.engine.server import create_app
from stand_in_engine import DeadEngine
from starlette.testclient import TestClient


@pytest.fixture
def cfg(tmp_path):
    return config_mod.parse(config_mod.DEFAULT_TOML, source="d", base_dir=tmp_path)


@pytest.fixture(autouse=True)
def thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()  # never leave this test process frozen


class StubEngine(DeadEngine):
    """A started engine (its one request fails at once) that notes whether the heap was frozen at its shutdown, or
    one whose start fails."""

    def __init__(self, host, fail_start=False):
        super().__init__(host)
        self.fail_start = fail_start
        self.frozen_at_shutdown = None

    async def start(self):
        if self.fail_start:
            raise RuntimeError("engine start failed")
        return self

    def shutdown(self):
        super().shutdown()
        self.frozen_at_shutdown = gc.get_freeze_count()


def frozen_gauge(client) -> float:
    text = client.get("/metrics").text
    return float(re.search(r"^genartifact_gc_frozen_objects (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("freeze", [False, True])
def test_serve_freezes_only_when_told_and_unfreezes_after_shutdown(cfg, freeze, monkeypatch):
    engine = StubEngine(cfg.host())

    async def factory():
        return engine

    froze: list[int] = []
    monkeypatch.setattr(server, "freeze_startup_heap", lambda: froze.append(vllm_adapter.freeze_startup_heap())
                        or froze[-1])
    kw = {"freeze_heap": True} if freeze else {}
    with TestClient(create_app(factory, cfg, "m", drain_s=1, **kw)) as client:
        assert len(froze) == freeze and (gc.get_freeze_count() > 1000) == freeze
        calls = []
        real = gc.get_freeze_count
        monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append(1) or real())
        # the gauge holds the count taken at the freeze: a scrape never walks the frozen objects (~60 ms at 680k)
        assert frozen_gauge(client) == frozen_gauge(client) == (froze[0] if freeze else 0)
        assert calls == []
        monkeypatch.setattr(gc, "get_freeze_count", real)
    assert (engine.frozen_at_shutdown > 1000) == freeze  # still frozen while the engine shut down
    assert gc.get_freeze_count() == 0  # and thawed after it


def run(cfg, tmp_path, **kw):
    return asyncio.run(run_generate(model="/m", prompts=[{"prompt": "a"}], cfg=cfg, contents=["selected_logprobs"],
                                    target="managed_fsspec:local", max_tokens=4, run_id="r", engine_kwargs={},
                                    progress=False, **kw))


@pytest.mark.parametrize("freeze", [False, True])
def test_generate_freezes_only_when_told_and_unfreezes_after_shutdown(cfg, tmp_path, freeze, monkeypatch):
    engines: list[StubEngine] = []
    monkeypatch.setattr(vllm_adapter, "VllmEngine", lambda host, *a, **k: engines.append(StubEngine(host)) or engines[-1])
    receipts = run(cfg, tmp_path, **({"freeze_heap": True} if freeze else {}))
    assert [r["error_code"] for r in receipts] == ["engine_failed"]  # the run went through the engine
    at_shutdown = engines[0].frozen_at_shutdown
    assert (at_shutdown > 1000) if freeze else at_shutdown == 0
    assert gc.get_freeze_count() == 0


def test_generate_whose_engine_never_started_freezes_nothing(cfg, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_adapter, "freeze_startup_heap", lambda: calls.append(1) or 1)
    monkeypatch.setattr(vllm_adapter, "VllmEngine", lambda host, *a, **k: StubEngine(host, fail_start=True))
    with pytest.raises(RuntimeError, match="engine start failed"):
        run(cfg, tmp_path, freeze_heap=True)
    assert calls == [] and gc.get_freeze_count() == 0


def test_generate_whose_engine_never_started_says_so_in_every_receipt(cfg, tmp_path, monkeypatch):
    """Every row of a run whose engine did not start gets ``engine_failed`` saying the engine did not start (and the
    exception type), not ``interrupted``/"cancelled", which would send the user looking for a signal."""
    from genartifact.engine.job import ReceiptsWriter

    monkeypatch.setattr(vllm_adapter, "VllmEngine", lambda host, *a, **k: StubEngine(host, fail_start=True))
    out = tmp_path / "receipts.jsonl"
    writer = ReceiptsWriter(out)
    try:
        with pytest.raises(RuntimeError, match="engine start failed"):
            asyncio.run(run_generate(model="/m", prompts=[{"prompt": "a"}, {"prompt": "b"}], cfg=cfg,
                                     contents=["selected_logprobs"], target="managed_fsspec:local", max_tokens=4,
                                     run_id="r", engine_kwargs={}, progress=False, writer=writer))
    finally:
        writer.close()
    import json

    receipts = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["index"] for r in receipts) == [0, 1]
    for r in receipts:
        assert r["state"] == "failed" and r["error_code"] == "engine_failed", r
        assert r["error"].startswith("the engine did not start (RuntimeError;") and "--resume" in r["error"]
