"""A request whose engine died under it (vLLM's EngineDeadError after a worker was killed) gets a receipt that
says so, not one blaming a signal nobody sent. A stand-in engine (no vLLM start) pins the receipt logic fast;
the real kill -9 of a worker is the manual check in the atk2 report (same receipts)."""

from __future__ import annotations

import asyncio
import json

import pytest
from genartifact import config as config_mod
from genartifact.engine import vllm_adapter
from genartifact.engine.job import ReceiptsWriter, run_generate
from stand_in_engine import DeadEngine


@pytest.mark.fault("generate", "engine died under the requests")
def test_requests_of_a_dead_engine_say_engine_failed_not_signal(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_adapter, "VllmEngine", DeadEngine)
    cfg = config_mod.parse(config_mod.DEFAULT_TOML, source="d", base_dir=tmp_path)
    rows = [{"prompt": "a"}, {"prompt": "b", "n": 3}, {"prompt": "c", "n": 0}]
    writer = ReceiptsWriter(tmp_path / "receipts.jsonl")
    stop: dict = {}
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        receipts = asyncio.run(run_generate(model="/m", prompts=rows, cfg=cfg, contents=["selected_logprobs"],
                                            target="managed_fsspec:local", max_tokens=4, run_id="r", engine_kwargs={},
                                            progress=False, writer=writer, stop=stop))
    writer.close()
    # each engine_failed receipt says "the log has the cause": the row's line is there, naming the exception
    assert any(e["event"] == "request_failed" and e["index"] == 0 and e["error_type"] == "EngineDeadError"
               for e in logs), logs
    # a rejected row is on the console too, not only in receipts.jsonl
    assert any(e["event"] == "generate_row_rejected" and e["index"] == 2 and e["error_code"] == "request_invalid"
               for e in logs), logs
    assert stop == {}  # no signal was involved
    keys = [(r["index"], r.get("sample")) for r in receipts]
    assert keys == [(0, None), (1, 0), (1, 1), (1, 2), (2, None)]
    failed = [r for r in receipts if r["index"] != 2]
    assert {r["error_code"] for r in failed} == {"engine_failed"}, receipts
    assert all("EngineDeadError" in r["error"] and "signal" not in r["error"] for r in failed), failed
    assert receipts[-1]["error_code"] == "request_invalid"
    lines = [json.loads(x) for x in (tmp_path / "receipts.jsonl").read_text().splitlines()]
    assert sorted((r["index"], r.get("sample", -1)) for r in lines) == [(0, -1), (1, 0), (1, 1), (1, 2), (2, -1)]


def _key(key):
    return {"kind": "managed_fsspec", "profile": "local", "object_key": key}


@pytest.mark.fault("generate", "two artifacts of a run with one object key")
def test_rows_sharing_an_object_key_are_refused_before_the_engine_even_on_resume(tmp_path, monkeypatch):
    """A row whose object (or one of its samples') is an earlier row's is refused before inference: otherwise it
    fails object_exists after inference, and --resume reads the earlier row's object back as its own (the
    journaled SHA-256 matches) and reports it ready. A row ready in an earlier run still owns its keys."""
    monkeypatch.setattr(vllm_adapter, "VllmEngine", DeadEngine)
    cfg = config_mod.parse(config_mod.DEFAULT_TOML, source="d", base_dir=tmp_path)
    rows = [{"prompt": "a", "n": 2},  # samples at runs/r/00000.s000.gart and .s001.gart
            {"prompt": "b", "target": _key("runs/r/00000.s001.gart")},  # = row 0's sample 1
            {"prompt": "c", "target": _key("runs/r/x.gart")},
            {"prompt": "d", "target": _key("runs/r/x.gart")},  # = row 2's
            {"prompt": "e", "n": 2, "target": _key("runs/r/y")}]  # runs/r/y.s000, runs/r/y.s001: its own

    def run(done=None):
        return asyncio.run(run_generate(model="/m", prompts=rows, cfg=cfg, contents=["selected_logprobs"],
                                        target="managed_fsspec:local", max_tokens=4, run_id="r", engine_kwargs={},
                                        progress=False, done=done))

    by = {(r["index"], r.get("sample")): r for r in run()}
    refused = {k for k, r in by.items() if r["error_code"] == "request_invalid"}
    assert refused == {(1, None), (3, None)}
    assert "row 2" in by[(3, None)]["error"]
    assert "runs/r/00000.s001.gart" in by[(1, None)]["error"] and "row 0 sample 1" in by[(1, None)]["error"]
    assert {by[(4, 0)]["error_code"], by[(4, 1)]["error_code"]} == {"engine_failed"}
    # --resume where row 2 was ready: a row aiming at its object is refused, never recovered as its own
    by = {(r["index"], r.get("sample")): r for r in run(done={2: {"index": 2, "state": "ready"}})}
    assert (2, None) not in by
    assert by[(3, None)]["error_code"] == "request_invalid" and "row 2" in by[(3, None)]["error"]
