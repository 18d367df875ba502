"""moe_route_weights end to end on the real engine: `genartifact generate` with ``[contents.moe_route_weights]
dtype = "bf16"`` (verify, inspect, replay-check with weights, loaders), and `genartifact serve` through the
artifact request field (tests/test_serve_e2e.py runs the server; its test for this content is there).

bf16 tolerance against HF's fp32 router: rounding to bf16 moves a weight in [0, 1) by at most half a bf16 ulp,
2**-9 (8 significant bits), plus the fp32 engine-vs-HF difference (< 1e-5, tests/test_route_weights_engine.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact import loaders as ld

pytestmark = [pytest.mark.engine]
BF16_TOL = 2.0**-9 + 1e-5


def test_generate_bf16_weights_verify_inspect_replay_check_and_loaders(genartifact_generate, qwen_model):
    cfg = """
[plugins]
contents = ["moe_routes", "selected_logprobs", "moe_route_weights"]
targets = ["managed_fsspec"]

[contents.moe_route_weights]
dtype = "bf16"

[targets.managed_fsspec.profiles.local]
url = "./store"
allowed_prefixes = ["runs/"]
"""
    prompts = [{"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 8},
               {"prompt": "Once upon a time, in a small village near the mountains", "max_tokens": 12,
                "routed_experts_prompt_start": 4},
               {"prompt": "Numbers such as 1, 2, 3.", "max_tokens": 6, "contents": ["moe_routes", "selected_logprobs"]}]
    receipts, proc = genartifact_generate(qwen_model, prompts, cfg, "--target", "managed_fsspec:local",
                                          "--run-id", "w")
    assert proc.returncode == 0, proc.stderr[-3000:]
    receipts.sort(key=lambda r: r["index"])
    assert [r["state"] for r in receipts] == ["ready"] * 3, receipts
    assert receipts[0]["contents"] == ["moe_route_weights", "moe_routes", "selected_logprobs"]
    cwd = genartifact_generate.cwd
    cli = [sys.executable, "-m", "genartifact.cli"]
    v = subprocess.run([*cli, "verify", "--config", "config.toml", "--receipts", "receipts.jsonl"], cwd=cwd,
                       capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr
    files = [cwd / "store" / r["object_id"].split(":", 1)[1] for r in receipts]
    ins = subprocess.run([*cli, "inspect", str(files[1]), "--json"], capture_output=True, text=True, timeout=120)
    assert ins.returncode == 0, ins.stderr
    summary = json.loads(ins.stdout)["moe_route_weights"]
    assert summary["dtype"] == "bf16" and summary["token_start"] == 4 and summary["top_k"] == 2
    assert abs(summary["row_sum_min"] - 1) < 0.01 and abs(summary["row_sum_max"] - 1) < 0.01

    arts = [fmt.decode(f.read_bytes()) for f in files]
    assert arts[0].tensors["moe_route_weights.weights"].dtype == np.uint16  # bf16 bit patterns
    assert "moe_route_weights" not in arts[2].contents  # a row may ask for fewer contents
    for a in arts[:2]:
        w = a.content("moe_route_weights")
        assert w.shape == a.routes().shape and w.dtype == np.float32
        assert np.abs(w.sum(-1) - 1).max() <= 2 * 2.0**-9  # norm_topk_prob rows, each weight rounded once
    # replay-check on the receipts: routes, logprobs and the weights against HF's fp32 router
    out = cwd / "replay.json"
    rc = subprocess.run([*cli, "replay-check", "--config", "config.toml", "--model", str(qwen_model),
                         "receipts.jsonl", "--max-weight-diff", str(BF16_TOL), "--json", str(out)], cwd=cwd,
                        capture_output=True, text=True, timeout=600)
    assert rc.returncode == 0, rc.stdout + rc.stderr
    assert "w max" in rc.stdout
    doc = json.loads(out.read_text())
    with_w = [a for a in doc["artifacts"] if "weight_max_abs_diff" in a["layers"][0]]  # receipts file order
    assert len(doc["artifacts"]) == 3 and len(with_w) == 2  # the row without the content reports no weights
    worst = max(x["weight_max_abs_diff"] for a in with_w for x in a["layers"])
    assert 0 < worst <= BF16_TOL
    print(f"generate bf16: replay-check max |w - hf| = {worst:.3g} (tolerance {BF16_TOL:.3g})")
    # the same check fails when the tolerance is below what bf16 rounding alone costs
    strict = subprocess.run([*cli, "replay-check", "--config", "config.toml", "--model", str(qwen_model),
                             "receipts.jsonl", "--max-weight-diff", "1e-6"], cwd=cwd, capture_output=True, text=True,
                            timeout=600)
    assert strict.returncode == 1 and "route weights max |diff|" in strict.stdout
    # loaders from the receipts: raw + packed with weights aligned with the routes
    from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles

    target = ManagedFsspecTarget(parse_profiles({"profiles": {"local": {"url": str(cwd / "store"),
                                                                       "allowed_prefixes": ["runs/"]}}}))
    res = ld.load_batch(receipts[:2], target, layout="raw", weights=True)
    assert res.ok, res.errors
    for raw, a in zip(res.items, arts[:2], strict=True):
        assert np.array_equal(raw.array(), a.routes()) and np.array_equal(raw.weights(), a.content("moe_route_weights"))
    pk = ld.packed(arts[:2], weights=True)
    assert pk.weights.shape == pk.routes.shape
    o = int(pk.cu_seqlens[1])
    assert np.array_equal(pk.weights[o + 4 : o + 4 + arts[1].routes().shape[0]], arts[1].content("moe_route_weights"))
    assert not pk.weights[o : o + 4].any() and (pk.routes[o : o + 4] == -1).all()
