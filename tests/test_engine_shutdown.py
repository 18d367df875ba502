"""Shutting an engine down under requests still running (issue 13's attacker): every in-flight request ends
(vLLM's ``EngineDeadError``) instead of waiting forever for an output that cannot come. vLLM's own
``AsyncLLM.shutdown`` cancels its output handler without failing the requests' queues; with a worker busy at that
moment (here: a capture's ``end_step`` made to sleep) the engine core's death was never reported to them either,
and a run hung in 2-3 of 5 tries. Each case needs its own engine (shutdown ends it)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from deploy_helpers import start_engine
from engine_helpers import TEXTS, settings, spec

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


def _slow_end_step(worker, seconds: float, every: int) -> bool:
    """Runs in the worker (``collective_rpc``): the route capture's end_step sleeps every ``every``-th step."""
    import time as _t

    cap = worker._genartifact_runtime.captures["moe_routes"]
    orig = type(cap).end_step

    def end_step(step):
        if step.index % every == 0:
            _t.sleep(seconds)
        return orig(cap, step)

    cap.end_step = end_step
    return True


@pytest.mark.fault("engine", "shutdown while requests run and a worker is busy")
@pytest.mark.parametrize("caller", ["event loop", "another thread"])
async def test_shutdown_ends_every_request_still_running(host, qwen_model, tmp_path, monkeypatch, caller):
    from vllm.v1.engine.exceptions import EngineDeadError

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # to send _slow_end_step to the worker
    eng = await start_engine(host, qwen_model, seed=0)
    try:
        await eng.llm.collective_rpc(_slow_end_step, args=(20.0, 5))
        ids = eng.tokenizer(TEXTS[2])["input_ids"]
        jobs = [asyncio.ensure_future(eng.run(ids + [5] * i, {"max_tokens": 1500, "temperature": 0.0,
                                                              "ignore_eos": True}, spec(), settings(tmp_path)))
                for i in range(2)]
        await asyncio.sleep(3.0)
        t0 = time.monotonic()
        if caller == "event loop":
            eng.shutdown()
        else:
            th = threading.Thread(target=eng.shutdown)
            th.start()
            while th.is_alive():
                await asyncio.sleep(0.1)
        done, pending = await asyncio.wait(jobs, timeout=30)
        assert not pending, f"{len(pending)} request(s) still waiting {time.monotonic() - t0:.0f} s after shutdown"
        for j in done:
            assert isinstance(j.exception(), EngineDeadError), j.exception() or j.result()
    finally:
        eng.shutdown()
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
