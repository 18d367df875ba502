"""DeepSeek-style model with a dense first layer (MLA attention, noaux_tc routing) on the real engine.

The dense layer must be absent from the router axis (never reported as expert 0); rows are checked
against HF transformers' own routing decisions for the same checkpoint and tokens.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import pytest_asyncio
from genartifact import format as fmt
from genartifact_route_capture.replay_check import HFOracle, compare, verdict

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ds_engine(host, deepseek_model):
    from genartifact.engine.vllm_adapter import VllmEngine

    # vLLM-CPU forces chunked prefill off for MLA models, so no max_num_batched_tokens here
    eng = await VllmEngine(host, deepseek_model, seed=0).start()
    yield eng
    eng.shutdown()


async def test_dense_first_layer_routes(ds_engine, deepseek_model, tmp_path):
    ids = ds_engine.tokenizer("Once upon a time, in a small village near the mountains, there lived an old woman "
                              "who kept bees and counted the flowers in the field every morning.")["input_ids"]
    assert len(ids) > 32
    spec = {"format": "generation_artifact_v1", "contents": ["moe_routes", "selected_logprobs"],
            "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "t",
                                                            "object_key": f"runs/{uuid.uuid4().hex}"}}}
    settings = {"managed_fsspec": {"profiles": {"t": {"url": f"file://{tmp_path}", "allowed_prefixes": ["runs/"]}}}}
    res = await ds_engine.run(ids, {"max_tokens": 10, "temperature": 1.0}, spec, settings, routes_start=3)
    assert res.receipt["state"] == "ready", res.receipt
    art = fmt.decode((tmp_path / res.receipt["object_id"].split(":", 1)[1]).read_bytes())
    sec = art.manifest["sections"]["moe_routes"]
    assert sec["router_ids"] == [1, 2, 3] and sec["expert_counts"] == [8, 8, 8] and sec["token_start"] == 3
    routes = art.routes()
    assert routes.shape == (len(ids) + len(res.completion_token_ids) - 1 - 3, 3, 2)
    hf = HFOracle(deepseek_model)  # HF's DeepseekV3TopkRouter decisions and selection scores per MoE layer
    oracle, _ = hf.run(art.token_ids[:-1])
    assert sorted(oracle) == [1, 2, 3]
    want = np.stack([oracle[i][0] for i in (1, 2, 3)], 1)[3:]
    scores = np.stack([oracle[i][1] for i in (1, 2, 3)], 1)[3:]  # [rows, routers, experts]
    same = (np.sort(routes, -1) == np.sort(want, -1)).all(-1)
    assert same.mean() >= 0.9, same.mean()
    # vLLM's DeepSeek path differs from HF by ~1e-3 numerically, so a disagreement is allowed only where
    # HF's k-th and (k+1)-th selection scores are a near-tie; anything else is a mis-attributed row.
    top = -np.sort(-scores, -1)
    gap = top[..., 1] - top[..., 2]  # top_k = 2
    assert (gap[~same] < 0.01).all(), sorted(gap[~same])[-5:]
    # replay-check agrees: every flipped row is a near tie at the same tolerance, and the logprobs match
    rep = compare(art, hf, tie_tol=0.01)
    print("deepseek replay-check:", rep["layers"], rep["logprobs"])
    assert not verdict(rep, 1.0, 0.05), rep


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ds_scaled(host, deepseek_model, tmp_path_factory):
    """The tiny DeepSeek checkpoint with ``routed_scaling_factor = 2.5`` (the shipped tiny model has 1.0, which
    cannot tell where the factor is applied), served by its own engine."""
    import json
    import shutil

    from genartifact.engine.vllm_adapter import VllmEngine

    d = tmp_path_factory.mktemp("ds-scaled") / "model"
    shutil.copytree(deepseek_model, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["routed_scaling_factor"] = 2.5
    (d / "config.json").write_text(json.dumps(cfg))
    eng = await VllmEngine(host, d, seed=0).start()
    yield eng, d
    eng.shutdown()


async def test_route_weights_deepseek_scaling_and_hf_router(ds_scaled, tmp_path):
    """moe_route_weights on DeepSeek-V3 routing (sigmoid + e_score_correction_bias, norm_topk_prob): the stored
    weights are the router's (unbiased scores of the selected experts, renormalised: rows sum to 1) *without*
    routed_scaling_factor (vLLM applies it to the MoE output: router_scale 1.0, output_scale 2.5), and
    weights x output_scale equal HF's DeepseekV3TopkRouter weights (which include the factor) expert by expert.
    Tolerance 6e-3 on the scaled weights (2.4e-3 of a unit weight): vLLM's MLA path differs from HF's by ~1e-3
    in the hidden states reaching the router (see test_dense_first_layer_routes; measured max 2.7e-3 scaled =
    1.1e-3 unscaled); a misplaced factor would differ by 1.5 x the weight (> 0.5), a missing renormalisation
    by tens of percent."""
    eng, model = ds_scaled
    ids = eng.tokenizer("Once upon a time, in a small village near the mountains, there lived an old woman "
                        "who kept bees and counted the flowers in the field every morning.")["input_ids"]
    spec = {"format": "generation_artifact_v1", "contents": ["moe_routes", "moe_route_weights"],
            "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "t",
                                                            "object_key": f"runs/{uuid.uuid4().hex}"}}}
    settings = {"managed_fsspec": {"profiles": {"t": {"url": f"file://{tmp_path}", "allowed_prefixes": ["runs/"]}}}}
    res = await eng.run(ids, {"max_tokens": 10, "temperature": 1.0}, spec, settings, routes_start=2)
    assert res.receipt["state"] == "ready", res.receipt
    art = fmt.decode((tmp_path / res.receipt["object_id"].split(":", 1)[1]).read_bytes())
    sec = art.manifest["sections"]["moe_route_weights"]
    assert sec["router_ids"] == [1, 2, 3] and sec["token_start"] == 2 and sec["dtype"] == "f32"
    assert sec["router_scale"] == [1.0] * 3 and sec["output_scale"] == [2.5] * 3
    w = art.content("moe_route_weights")
    assert w.shape == art.routes().shape == (len(ids) + len(res.completion_token_ids) - 1 - 2, 3, 2)
    assert np.abs(w.sum(-1) - 1).max() < 1e-5
    rep = compare(art, HFOracle(model), tie_tol=0.01)
    worst = max(x["weight_max_abs_diff"] for x in rep["layers"])
    print("deepseek (routed_scaling_factor 2.5) route weights vs HF:", worst, [x["weight_rows"] for x in rep["layers"]])
    assert all(x["weight_rows"] >= 0.9 * x["rows"] for x in rep["layers"])
    assert not verdict(rep, 1.0, 0.05, 6e-3), rep
