"""A fault in code a content plants inside vLLM's own calls (the router capture callback, run inside the
forward) is that step's requests' fault, not the engine's: on the real vLLM-CPU engine, a router callback that
raises once fails the artifacts of the requests flagged in that step (``internal_error``: a plugin fault; generation
complete),
the engine runs on, and the next requests' artifacts are ready and exact (``WorkerStep.guard``)."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from deploy_helpers import start_engine
from engine_helpers import TEXTS, read, settings, spec

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


def _break_router_callback_once(worker) -> bool:
    """Runs in the worker (``collective_rpc``): the route recorder's next ``on_layer`` raises, once."""
    cap = worker._genartifact_runtime.captures["moe_routes"]
    rec = cap.recorder
    orig = rec.on_layer

    def on_layer(layer_id, rows):
        rec.on_layer = orig
        raise RuntimeError("a plugin bug inside the forward")

    rec.on_layer = on_layer
    return True


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fault_engine(host, qwen_model):
    import os

    saved = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # to send _break_router_callback_once to the worker
    eng = await start_engine(host, qwen_model, seed=0)
    try:
        yield eng
    finally:
        eng.shutdown()
        if saved is None:
            os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
        else:
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = saved


@pytest.mark.fault("worker", "a content's callback raises inside vLLM's forward")
async def test_a_router_callback_fault_fails_that_steps_requests_and_the_engine_runs_on(fault_engine, tmp_path):
    eng = fault_engine
    ids = [eng.tokenizer(TEXTS[i])["input_ids"] for i in range(3)]
    sampling = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    assert (await eng.llm.collective_rpc(_break_router_callback_once)) == [True]
    res = await asyncio.wait_for(asyncio.gather(*(eng.run(i, sampling, spec(), settings(tmp_path)) for i in ids)), 120)
    assert all(len(r.completion_token_ids) == 8 for r in res)  # generation itself is untouched
    states = [(r.receipt["state"], r.receipt.get("error_code")) for r in res]
    assert ("failed", "internal_error") in states, states  # the requests of the broken step: a plugin's fault
    assert {s for s in states if s[0] != "ready"} == {("failed", "internal_error")}, states
    after = await asyncio.wait_for(eng.run(ids[0], sampling, spec(), settings(tmp_path)), 60)
    art = read(tmp_path, after.receipt)  # the engine ran on; a later request's artifact is ready and whole
    assert art.routes().shape[0] == len(ids[0]) + 8 - 1
    assert after.completion_token_ids == res[0].completion_token_ids  # greedy: same tokens as before the fault
    stats = await eng.worker_call("moe_routes.stats")
    assert [s["requests"] for s in stats if s is not None] == [0]
