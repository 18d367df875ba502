"""Tensor parallel: a ``tensor_parallel_size=2`` engine (mp executor) on the real vLLM-CPU engine. Only TP rank
0 captures and answers fetches; rank 1 loads the same plugins, reports them, and binds nothing. Every artifact
ready and oracle-exact. (On a 2-core box vLLM-CPU needs ``VLLM_CPU_OMP_THREADS_BIND='0|1'``, else "Not enough
allowed NUMA nodes".)"""

from __future__ import annotations

import os

import pytest
import pytest_asyncio
from deploy_helpers import check, run_six, start_engine

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tp_engine(host, qwen_model):
    saved = dict(os.environ)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    eng = await start_engine(host, qwen_model, tensor_parallel_size=2, seed=0)
    try:
        yield eng
    finally:
        eng.shutdown()
        os.environ.clear()
        os.environ.update(saved)


async def test_tp2_one_rank_records_and_artifacts_exact(tp_engine, qwen_model, tmp_path):
    ws = sorted(tp_engine.workers, key=lambda w: w["tp_rank"])
    assert [(w["tp_rank"], w["capturing"], w["captures"]) for w in ws] == [
        (0, True, ["moe_route_weights", "moe_routes", "selected_logprobs"]), (1, False, [])]
    enabled = [p.name for p in tp_engine.host.enabled["contents"]]
    assert all(w["enabled"]["contents"] == enabled for w in ws)  # rank 1 loaded the same plugins, binds nothing
    res = await run_six(tp_engine, tmp_path)
    got = check(res, qwen_model, tmp_path)
    print("tp2", {k: v for k, v in got.items() if k != "failures"}, "start_s", round(tp_engine.start_seconds, 1))
    assert got["ready"] == 6, got["failures"]
    assert got["route_agreement_min"] >= 0.97 and got["logprob_max_abs_err"] < 1e-4 and got["logprobs_equal_engine"]
    stats = await tp_engine.worker_call("moe_routes.stats")
    assert len(stats) == 2 and sum(s is None for s in stats) == 1  # rank 1 holds and sends nothing
    rank0 = next(s for s in stats if s is not None)
    assert rank0["tp_rank"] == 0 and rank0["steps"] > 0 and rank0["requests"] == 0
    # rank 0 handed the rows over out of band (no fetch RPC reached either rank); the RPC fallback gives the same
    assert tp_engine.handover is not None and rank0["handover"] and rank0["handed_over"] >= 12
    assert tp_engine.handover.files() == []
    await tp_engine.set_handover(False)
    try:
        got = check(await run_six(tp_engine, tmp_path), qwen_model, tmp_path)
        assert got["ready"] == 6 and got["route_agreement_min"] >= 0.97, got["failures"]
    finally:
        await tp_engine.set_handover(True)
