"""Preemption + recompute on the real engine: a KV cache of 4 blocks of 128 tokens for 6 requests that each
grow past one block forces vLLM to preempt and recompute; routes must still be complete and attributed to
the right positions (checked against the HF router oracle). The router weights (moe_route_weights) ride the
same recorder and must survive the same way (checked against the HF router's weights)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import pytest_asyncio
from engine_helpers import TEXTS, agreement, hf_topk, read, settings
from genartifact_route_capture.replay_check import HFOracle, compare

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def small_kv_engine(host, qwen_model):
    from genartifact.engine.vllm_adapter import VllmEngine

    eng = await VllmEngine(host, qwen_model, num_gpu_blocks_override=4, max_model_len=384, seed=0).start()
    yield eng
    eng.shutdown()


async def test_routes_survive_preemption_and_recompute(small_kv_engine, qwen_model, tmp_path):
    eng = small_kv_engine
    before = (await eng.worker_call("moe_routes.stats"))[0]["recomputed_positions"]
    w_before = (await eng.worker_call("moe_route_weights.stats"))[0]["recomputed_positions"]

    def spec():
        return {"format": "generation_artifact_v1", "contents": ["moe_routes", "selected_logprobs", "moe_route_weights"],
                "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "t",
                                                                "object_key": f"runs/{uuid.uuid4().hex}"}}}

    jobs = [eng.run(eng.tokenizer(t)["input_ids"], {"max_tokens": 140, "temperature": 1.0, "ignore_eos": True},
                    spec(), settings(tmp_path)) for t in TEXTS]
    results = await asyncio.gather(*jobs)
    after = (await eng.worker_call("moe_routes.stats"))[0]["recomputed_positions"]
    assert after > before, "the engine did not preempt; the test no longer exercises recompute"
    w_after = (await eng.worker_call("moe_route_weights.stats"))[0]["recomputed_positions"]
    assert w_after - w_before == after - before  # the weights saw exactly the same recomputed positions
    oracle = HFOracle(qwen_model)
    for res in results:
        art = read(tmp_path, res.receipt)
        assert art.routes().shape[0] == len(res.prompt_token_ids) + 140 - 1
        assert agreement(art.routes(), hf_topk(qwen_model, art.token_ids[:-1])) >= 0.97
        rep = compare(art, oracle)  # weights vs HF's, expert by expert, on the rows whose expert sets agree
        assert art.content("moe_route_weights").shape == art.routes().shape
        assert max(x["weight_max_abs_diff"] for x in rep["layers"]) <= 1e-5, rep["layers"]
