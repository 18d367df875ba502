"""replay-check without an engine: artifacts built from the HF oracle itself pass exactly; tampered routes,
logprobs, wrong checkpoints and unreadable inputs are caught with the documented exit codes."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact_route_capture import replay_check as rc


def oracle_artifact(oracle: rc.HFOracle, tokens: np.ndarray, p: int, start: int = 0) -> bytes:
    seen, logits = oracle.run(tokens[:-1])
    layers = sorted(seen)
    routes = np.stack([seen[i][0] for i in layers], 0)[:, start:].astype(np.uint8)  # [routers, rows, k]
    lp = rc._log_softmax(logits.astype(np.float64))[np.arange(p - 1, len(tokens) - 1), tokens[p:]].astype(np.float32)
    experts = [int(oracle.routers[i].weight.shape[0]) for i in layers]
    inp = fmt.ArtifactInput(
        tokens.astype(np.uint32), p, ["moe_routes", "selected_logprobs"],
        {"moe_routes": {"token_start": start, "router_ids": layers, "expert_counts": experts,
                        "top_k": int(routes.shape[2]), "layout": "router_major", "source": "test"},
         "selected_logprobs": {"token_start": p}},
        [fmt.TensorPart("moe_routes.expert_ids", routes), fmt.TensorPart("selected_logprobs.logprobs", lp)],
        {"sampling": {"logprobs_mode": "raw_logprobs"}})
    return fmt.encode(inp).data


def args(model, refs, **kw):
    ns = argparse.ArgumentParser()
    rc.add_arguments(ns)
    extra = [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return ns.parse_args(["--model", str(model), *map(str, refs), *extra])


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek"])
def family(request):
    from conftest import tiny_model

    model = tiny_model(request.param)
    return request.param, model, rc.HFOracle(model)


def test_oracle_built_artifacts_pass_exactly(family, tmp_path, capsys):
    name, model, oracle = family
    tokens = np.random.default_rng(0).integers(5, 200, 40).astype(np.uint32)
    f = tmp_path / "a.gart"
    f.write_bytes(oracle_artifact(oracle, tokens, p=30, start=3))
    assert rc.run(args(model, [f], json="-")) == 0
    doc = json.loads(capsys.readouterr().out)
    rep = doc["artifacts"][0]
    assert doc["pass"] and rep["pass"] and rep["logprobs"]["max_abs_diff"] < 1e-5
    expect_layers = [1, 2, 3] if name == "deepseek" else sorted(oracle.routers)
    assert [x["layer"] for x in rep["layers"]] == expect_layers  # DeepSeek: dense layer 0 is absent
    assert all(x["set_agreement"] == 1.0 and x["order_agreement"] == 1.0 and x["rows"] == 39 - 3
               for x in rep["layers"])


def test_tampered_routes_and_logprobs_fail(family, tmp_path, capsys):
    _, model, oracle = family
    tokens = np.random.default_rng(1).integers(5, 200, 30).astype(np.uint32)
    art = fmt.decode(oracle_artifact(oracle, tokens, p=20))
    routes = np.array(art.tensors["moe_routes.expert_ids"])
    k, experts = routes.shape[2], art.manifest["sections"]["moe_routes"]["expert_counts"][0]
    for r in range(10):  # replace rows 0..9 of the first router by experts outside the true set
        routes[0, r] = [e for e in range(experts) if e not in routes[0, r]][:k]
    lp = np.array(art.selected_logprobs())
    lp[2] -= 0.5
    sec = art.manifest["sections"]
    bad = fmt.encode(fmt.ArtifactInput(art.token_ids, art.prompt_token_count, art.contents, sec,
                                       [fmt.TensorPart("moe_routes.expert_ids", routes),
                                        fmt.TensorPart("selected_logprobs.logprobs", lp)], art.manifest["header"]))
    f = tmp_path / "bad.gart"
    f.write_bytes(bad.data)
    out = tmp_path / "r.json"
    assert rc.run(args(model, [f], json=out)) == 1
    table = capsys.readouterr().out
    assert "FAIL" in table and "agreement" in table and "max |diff|" in table
    rep = json.loads(out.read_text())["artifacts"][0]
    first = rep["layers"][0]
    assert first["mismatches"] + first["near_ties"] == 10 and first["set_agreement"] == pytest.approx(19 / 29)
    assert rep["logprobs"]["max_abs_diff"] == pytest.approx(0.5, abs=1e-5)
    # a huge tie tolerance turns every flipped row into a near tie; logprobs still fail
    assert rc.run(args(model, [f], tie_tol=1e9, max_logprob_diff=1.0)) == 0


def test_wrong_checkpoint_and_unreadable_inputs(tmp_path, capsys):
    from conftest import tiny_model

    qwen, ds = tiny_model("qwen3_moe"), tiny_model("deepseek")
    tokens = np.arange(5, 25, dtype=np.uint32)
    f = tmp_path / "ds.gart"
    f.write_bytes(oracle_artifact(rc.HFOracle(ds), tokens, p=10))
    junk = tmp_path / "junk.gart"
    junk.write_bytes(b"not an artifact")
    assert rc.run(args(qwen, [f, junk])) == 2
    out = capsys.readouterr().out
    assert "not the model's MoE layers" in out and ("bad magic" in out or "truncated" in out)
    with pytest.raises(rc.ReplayCheckError, match="min-agreement"):
        rc.run(args(qwen, [f], min_agreement=1.5))
    with pytest.raises(rc.ReplayCheckError, match="checkpoint directory"):
        rc.run(args(tmp_path, [f]))


def test_cli_subcommand(tmp_path):
    """``genartifact replay-check`` through the CLI's plugin-command hook (entry point of genartifact-route-capture)."""
    import subprocess
    import sys

    from conftest import tiny_model

    model = tiny_model("qwen3_moe")
    f = tmp_path / "a.gart"
    f.write_bytes(oracle_artifact(rc.HFOracle(model), np.arange(5, 30, dtype=np.uint32), p=20))
    cmd = [sys.executable, "-c", "from genartifact.cli import main; raise SystemExit(main())", "replay-check",
           "--model", str(model), str(f), "--json", str(tmp_path / "r.json")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "pass" in run.stdout and json.loads((tmp_path / "r.json").read_text())["pass"] is True
    run = subprocess.run(cmd[:4] + ["--model", str(model), str(tmp_path / "missing.gart")], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and "not found" in run.stdout


def test_receipts_file_through_the_configured_target(tmp_path, capsys):
    """A generate-style receipts .jsonl read through loaders.open_target (the config's managed_fsspec profile):
    SHA-256 checked, failed receipts listed as skipped, a tampered object reported as unreadable (exit 2)."""
    import hashlib

    from conftest import tiny_model

    model = tiny_model("qwen3_moe")
    store = tmp_path / "store"
    (store / "runs").mkdir(parents=True)
    data = oracle_artifact(rc.HFOracle(model), np.arange(5, 30, dtype=np.uint32), p=20)
    (store / "runs" / "a.gart").write_bytes(data)
    cfg = tmp_path / "g.toml"
    cfg.write_text(f"""[plugins]\ncontents = ["moe_routes", "selected_logprobs"]\ntargets = ["managed_fsspec"]
[targets.managed_fsspec.profiles.p]\nurl = "{store}"\nallowed_prefixes = ["runs/"]\n""")
    good = {"state": "ready", "object_id": "p:runs/a.gart", "byte_count": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "format": "generation_artifact_v1", "index": 0}
    failed = {"state": "failed", "error_code": "timeout", "index": 1}
    receipts = tmp_path / "receipts.jsonl"
    receipts.write_text(json.dumps(good) + "\n" + json.dumps(failed) + "\n")
    assert rc.run(args(model, [receipts], config=cfg, json="-")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [a.get("pass", a.get("skipped")) for a in doc["artifacts"]] == [
        True, "receipt state 'failed', no object to check"]
    receipts.write_text(json.dumps({**good, "sha256": "0" * 64}) + "\n")
    assert rc.run(args(model, [receipts], config=cfg)) == 2
    assert "sha256" in capsys.readouterr().out
    receipts.write_text(json.dumps(failed) + "\n")
    with pytest.raises(rc.ReplayCheckError, match="no artifact to check"):
        rc.run(args(model, [receipts], config=cfg))


def test_route_weights_agreement_reported_and_checked(family, tmp_path, capsys):
    """An artifact whose moe_route_weights are the oracle router's own weights (scaled down by an output_scale
    the section declares) passes with |diff| ~0; tampered weights fail --max-weight-diff (exit 1)."""
    name, model, oracle = family
    tokens = np.random.default_rng(2).integers(5, 200, 30).astype(np.uint32)
    art = fmt.decode(oracle_artifact(oracle, tokens, p=20, start=2))
    seen, _ = oracle.run(tokens[:-1])
    layers = sorted(seen)
    w = np.stack([seen[i][2] for i in layers], 0)[:, 2:].astype(np.float32) / 2.0  # router weights; output x2

    def with_weights(weights):
        sec = dict(art.manifest["sections"])
        sec["moe_route_weights"] = {"token_start": 2, "router_ids": layers, "top_k": int(w.shape[2]), "dtype": "f32",
                                    "layout": "router_major", "router_scale": [1.0] * len(layers),
                                    "output_scale": [2.0] * len(layers)}
        parts = [fmt.TensorPart(n, np.array(t)) for n, t in art.tensors.items() if n != "token_ids"]
        f = tmp_path / f"w{len(list(tmp_path.iterdir()))}.gart"
        f.write_bytes(fmt.encode(fmt.ArtifactInput(art.token_ids, art.prompt_token_count,
                                                   [*art.contents, "moe_route_weights"], sec,
                                                   [*parts, fmt.TensorPart("moe_route_weights.weights", weights)],
                                                   art.manifest["header"])).data)
        return f

    good = with_weights(w)
    assert rc.run(args(model, [good], json="-", max_weight_diff=1e-6)) == 0
    rep = json.loads(capsys.readouterr().out)["artifacts"][0]
    assert all(x["weight_rows"] == x["rows"] == 27 and x["weight_max_abs_diff"] < 1e-6 for x in rep["layers"])
    bad_w = w.copy()
    bad_w[0, 5] *= 0.5  # one row not renormalised (its weights sum to 0.5)
    bad = with_weights(bad_w)
    assert rc.run(args(model, [bad], max_weight_diff=0.01)) == 1
    out = capsys.readouterr().out
    assert f"layer {layers[0]}: route weights max |diff|" in out and "FAIL" in out
