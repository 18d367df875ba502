"""A request whose engine died under it (vLLM's EngineDeadError after a worker was killed) gets a receipt that
says so, not one blaming a signal nobody sent. A stand-in engine (no vLLM start) pins the receipt logic fast;
the real kill -9 of a worker is the manual check in the atk2 report (same receipts)."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from genartifact import config as config_mod
from genartifact.engine import vllm_adapter
from genartifact.engine.job import ReceiptsWriter, run_generate


class EngineDeadError(Exception):
    """Stands in for vllm.v1.engine.exceptions.EngineDeadError (raised by AsyncLLM.generate once the engine
    core died)."""


class DeadEngine:
    """An engine whose every request fails as vLLM's do after its worker process was killed (-9)."""

    def __init__(self, host, model, **kw):
        self.llm = object()
        self.model_info = types.SimpleNamespace(engine_options={})
        self.tokenizer = lambda text: {"input_ids": [1, 2, 3]}
        self.shut = False

    async def start(self):
        return self

    def prepare(self, *a, **kw):
        return types.SimpleNamespace(session=types.SimpleNamespace(release=lambda: None))

    async def execute(self, prep, stream=True):
        await asyncio.sleep(0)
        raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        yield  # an async generator, as VllmEngine.execute

    def shutdown(self):
        self.shut = True


@pytest.mark.fault("generate", "engine died under the requests")
def test_requests_of_a_dead_engine_say_engine_failed_not_signal(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_adapter, "VllmEngine", DeadEngine)
    cfg = config_mod.parse(config_mod.DEFAULT_TOML, source="d", base_dir=tmp_path)
    rows = [{"prompt": "a"}, {"prompt": "b", "n": 3}, {"prompt": "c", "n": 0}]
    writer = ReceiptsWriter(tmp_path / "receipts.jsonl")
    stop: dict = {}
    receipts = asyncio.run(run_generate(model="/m", prompts=rows, cfg=cfg, contents=["selected_logprobs"],
                                        target="managed_fsspec:local", max_tokens=4, run_id="r", engine_kwargs={},
                                        progress=False, writer=writer, stop=stop))
    writer.close()
    assert stop == {}  # no signal was involved
    keys = [(r["index"], r.get("sample")) for r in receipts]
    assert keys == [(0, None), (1, 0), (1, 1), (1, 2), (2, None)]
    failed = [r for r in receipts if r["index"] != 2]
    assert {r["error_code"] for r in failed} == {"engine_failed"}, receipts
    assert all("EngineDeadError" in r["error"] and "signal" not in r["error"] for r in failed), failed
    assert receipts[-1]["error_code"] == "request_invalid"
    lines = [json.loads(x) for x in (tmp_path / "receipts.jsonl").read_text().splitlines()]
    assert sorted((r["index"], r.get("sample", -1)) for r in lines) == [(0, -1), (1, 0), (1, 1), (1, 2), (2, -1)]
