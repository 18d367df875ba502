"""Step-time model fit (engine-free): recovery of a known law, holdout errors, selection, schema, predict, CLI."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest
from genartifact_fpm_bench import fit as fitmod
from genartifact_fpm_bench.artifact import write_once
from genartifact_fpm_bench.fit import FitError, StepModel, fit, predict


def write(tmp_path, name, doc):
    p = tmp_path / name
    write_once(p, doc)
    return p


def test_recovers_a_known_law_with_small_holdout_error(tmp_path, synth):
    train = write(tmp_path, "grid.json", synth.artifact(synth.GRID, noise=0.005))
    hold = write(tmp_path, "off.json", synth.artifact(synth.OFF, noise=0.005, run_id="run2", digest="g2", seed=1))
    doc = fit([train], [hold])
    assert doc["schema"] == "genartifact.fpm_bench.step_model" and doc["schema_version"] == 1
    assert doc["source"]["grid_digest"] == "g" and doc["source"]["engine_identity"]
    assert doc["source"]["holdout"][0]["grid_digest"] == "g2"
    for phase, truth in (("prefill", synth.PRE), ("decode", synth.DEC)):
        m = doc["phases"][phase]
        coef = np.array(m["linear"]["coefficients"])
        assert (coef >= 0).all()
        assert np.allclose(coef, truth, rtol=0.15, atol=2e-4 * truth[0])
        for kind in ("linear", "interpolate"):
            for basis in ("loo", "off_grid"):
                e = m["holdout"][kind][basis]
                assert e["all"]["n"] > 0 and e["all"]["mape_pct"] < 5, (phase, kind, basis, e)
                assert e["all"]["max_error_pct"] >= e["all"]["mape_pct"]
        # the data are exactly linear in the features: the linear model wins off the grid
        assert m["selected"] == "linear" and m["selected_by"].startswith("off_grid")
        assert m["holdout"]["linear"]["off_grid"]["all"]["mape_pct"] < 1.5
    model = StepModel(doc)
    for pt in synth.OFF:
        sh = synth.shape_of({"tokens": 0, "kv": 0, "context": 0, **pt})
        assert model.predict(sh) == pytest.approx(synth.law(sh), rel=0.03)
        assert model.in_domain(sh)


def test_interpolation_wins_on_a_nonlinear_law_and_is_exact_on_the_grid(tmp_path, synth):
    def curved(shape):  # step time ~ sqrt of the linear law: not linear in the features
        return 0.01 * (synth.law(shape) / 1e-3) ** 0.5

    doc0 = synth.artifact(synth.GRID, noise=0.0)
    for r in doc0["points"]:
        sh = r["raw_samples"][0]["scheduled"]
        for s in r["raw_samples"]:
            s["timing"]["wall_time"] = curved(sh)
        r["estimate"]["wall_time"] = curved(sh)
    train = write(tmp_path, "grid.json", doc0)
    doc = fit([train])
    m = doc["phases"]["decode"]
    assert m["selected_by"].startswith("loo")
    assert m["holdout"]["interpolate"]["loo"]["all"]["mape_pct"] < m["holdout"]["linear"]["loo"]["all"]["mape_pct"]
    assert m["selected"] == "interpolate"
    model = StepModel(doc)
    for r in doc0["points"]:
        sh = r["raw_samples"][0]["scheduled"]
        if fitmod.phase_of(sh) == "decode":
            assert model.predict(sh, kind="interpolate") == pytest.approx(curved(sh), rel=1e-9)


def test_outside_the_grid_interpolation_falls_back_to_linear_and_mixed_passes_add(tmp_path, synth):
    doc = fit([write(tmp_path, "grid.json", synth.artifact(synth.GRID, noise=0.0))])
    model = StepModel(doc)
    far = {"num_decode_requests": 64, "sum_decode_kv_tokens": 64 * 4000}
    assert not model.in_domain(far)
    assert model.predict(far, kind="interpolate") == pytest.approx(model.predict(far, kind="linear"))
    mixed = {"num_prefill_requests": 1, "sum_prefill_tokens": 200, "num_decode_requests": 3, "sum_decode_kv_tokens": 300}
    pre = model.predict({k: v for k, v in mixed.items() if "prefill" in k}, kind="linear")
    dec = model.predict({k: v for k, v in mixed.items() if "decode" in k}, kind="linear")
    c = doc["phases"]
    one = min(c["prefill"]["linear"]["coefficients"][0], c["decode"]["linear"]["coefficients"][0])
    assert model.predict(mixed) == pytest.approx(pre + dec - one)
    with pytest.raises(ValueError, match="neither prefill nor decode"):
        model.predict({})
    with pytest.raises(ValueError, match="kind"):
        model.predict(far, kind="cubic")


def test_model_file_round_trip_and_predict_helper(tmp_path, synth):
    doc = fit([write(tmp_path, "grid.json", synth.artifact(synth.GRID))])
    out = fitmod.write_model(doc, tmp_path / "model.json")
    with pytest.raises(FileExistsError):
        fitmod.write_model(doc, out)
    sh = {"num_prefill_requests": 2, "sum_prefill_tokens": 300}
    v = predict(out, sh)
    assert v > 0 and v == pytest.approx(StepModel(doc).predict(sh))
    bad = copy.deepcopy(doc)
    bad["schema_version"] = 2
    with pytest.raises(FitError, match="v1"):
        StepModel(bad)


def test_ranks_pooled_cv_recomputed_and_identity_checked(tmp_path, synth):
    a = write(tmp_path, "r0.json", synth.artifact(synth.GRID, rank=0))
    b = write(tmp_path, "r1.json", synth.artifact(synth.GRID, rank=1, scale=1.1, seed=3))
    doc = fit([a, b])
    g = doc["phases"]["decode"]["grid"][0]
    assert set(g["ranks"]) == {"0", "1"} and g["y"] == pytest.approx(np.mean(list(g["ranks"].values())))
    # CV comes from the raw samples, not the stored estimate
    noisy = synth.artifact(synth.GRID, noise=0.3, seed=5)
    for r in noisy["points"]:
        r["estimate"]["cv"], r["estimate"]["noisy"] = 0.0, False
    d2 = fit([write(tmp_path, "noisy.json", noisy)])
    assert max(x["cv"] for x in d2["phases"]["decode"]["grid"]) > 0.1
    other = write(tmp_path, "other_engine.json", synth.artifact(synth.OFF, run_id="x", digest="y",
                                                          engine={"model": {"model": "bigger"}}))
    with pytest.raises(FitError, match="model.model"):
        fit([a], [other])
    with pytest.raises(FitError, match="differ in run_id"):
        fit([a, other])
    with pytest.raises(FitError, match="not a genartifact.fpm_bench.rank"):
        fit([write(tmp_path, "junk.json", {"schema": "x"})])
    with pytest.raises(FitError, match="no phase has at least 2"):
        fit([write(tmp_path, "one.json", synth.artifact(synth.GRID[:1]))])


def test_bench_fit_cli(tmp_path, synth):
    train = write(tmp_path, "grid.json", synth.artifact(synth.GRID))
    hold = write(tmp_path, "off.json", synth.artifact(synth.OFF, run_id="r2", digest="g2", seed=2))
    out = tmp_path / "model.json"
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "bench", "fit", str(train), "--holdout", str(hold),
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "prefill" in proc.stdout and "off_grid" in proc.stdout and "(selected)" in proc.stdout
    assert json.loads(out.read_text())["phases"]["decode"]["holdout"]["linear"]["off_grid"]["all"]["n"] == len(
        [p for p in synth.OFF if p["phase"] == "decode"])
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "bench", "fit", str(train), "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "exists" in proc.stderr


def test_same_run_holdout_points_are_never_trained_on(tmp_path, synth):
    both = write(tmp_path, "both.json", synth.artifact(synth.GRID + synth.OFF, noise=0.005))
    pts = tmp_path / "off_points.json"
    pts.write_text(json.dumps({"points": synth.OFF}))
    out = tmp_path / "model.json"
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "bench", "fit", str(both), "--holdout-points",
                           str(pts), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    off_keys = {synth.key({"tokens": 0, "kv": 0, "context": 0, **p}) for p in synth.OFF}
    assert set(doc["source"]["holdout_keys"]) == off_keys
    for m in doc["phases"].values():
        assert not {g["key"] for g in m["grid"]} & off_keys
        assert {g["key"] for g in m["off_grid"]} <= off_keys and m["holdout"]["linear"]["off_grid"]["all"]["n"] > 0
    with pytest.raises(FitError, match="holdout points not completed"):
        fit([both], holdout_keys=["decode:b99:c7"])


def test_rounds_pool_samples_and_recompute_the_estimate():
    from genartifact_fpm_bench.runner import combine_rounds

    def rec(walls, status="completed"):
        smp = [{"sample_index": i, "role": "measure", "timing": {"wall_time": w}} for i, w in enumerate(walls)]
        r = {"key": "decode:b1:c16", "point": {}, "dp_rank": 0, "status": status, "raw_samples": smp}
        if status == "completed":
            r["estimate"] = {"raw_sample_indices": list(range(len(walls))), "wall_time": float(np.median(walls))}
        else:
            r["error"] = "RuntimeError: boom"
        return r

    c = combine_rounds([rec([1.0, 1.0, 9.0]), rec([2.0, 2.0, 2.0])])
    assert c["status"] == "completed" and c["estimate"]["wall_time"] == 2.0
    assert [s["sample_index"] for s in c["raw_samples"]] == list(range(6))
    assert [s["round"] for s in c["raw_samples"]] == [0, 0, 0, 1, 1, 1]
    assert c["estimate"]["raw_sample_indices"] == list(range(6)) and c["estimate"]["noisy"]
    f = combine_rounds([rec([1.0]), rec([], status="failed")])
    assert f["status"] == "failed" and "boom" in f["error"] and f["rounds"][1]["status"] == "failed"


@pytest.mark.parametrize("content, reason", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("x" * (2 << 20), "larger than 1048576 bytes"),
    (b"\xff\xfe{}", "UnicodeDecodeError"),
])
def test_hostile_json_inputs_are_fit_errors_with_a_bounded_read(tmp_path, monkeypatch, content, reason):
    """Artifacts, models and points files are read at most MAX_JSON_BYTES + 1 bytes (``bench fit /dev/zero``
    used to read until the OOM killer came) and never raise RecursionError (was exit 3)."""
    from genartifact_fpm_bench import artifact as artmod
    from genartifact_fpm_bench.grid import GridError, Limits, load_points
    from genartifact_fpm_bench.report import report

    monkeypatch.setattr(artmod, "MAX_JSON_BYTES", 1 << 20)
    p = tmp_path / "in.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(FitError, match=f"cannot read artifact \\({reason}"):
        fitmod.load_artifact(p)
    with pytest.raises(FitError, match=f"cannot read model \\({reason}"):
        StepModel.load(p)
    with pytest.raises(FitError, match=reason):
        report(p, tmp_path / "out")
    with pytest.raises(GridError, match=reason):
        load_points(p, Limits(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, kv_capacity_tokens=1024,
                              block_size=16, prefix_caching=False))


def test_bench_fit_on_a_device_file_is_refused():
    import sys

    # the interpreter running the tests, not a `genartifact` on PATH (CI runs .venv/bin/python -m pytest)
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "bench", "fit", "/dev/zero", "--out",
                           "/nonexistent/m.json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "larger than" in proc.stderr, proc.stderr


def test_report_of_a_foreign_json_is_a_clean_error(tmp_path):
    p = tmp_path / "a.json"
    p.write_text("[1, 2]")
    from genartifact_fpm_bench.report import report

    with pytest.raises(FitError, match="not a genartifact.fpm_bench.rank"):
        report(p, tmp_path / "out")
