"""Report (engine-free): one series per rank, p10–p90 from raw samples, y from zero, CV recomputed and the stored
flag checked, cross-rank disagreement flagged, model lines and residuals, self-contained HTML."""

from __future__ import annotations

import re

import matplotlib
import matplotlib.figure
import numpy as np
import pytest
from genartifact_fpm_bench.artifact import write_once
from genartifact_fpm_bench.fit import fit, write_model
from genartifact_fpm_bench.report import RANK_DISAGREEMENT, point_stats, report

matplotlib.use("Agg")


def merged_two_ranks(synth, slow: float = 2.0) -> dict:
    a = synth.artifact(synth.GRID, rank=0, noise=0.01)
    b = synth.artifact(synth.GRID, rank=1, noise=0.01, scale=slow, seed=9)
    doc = dict(a)
    doc["schema"], doc["artifact_type"] = "genartifact.fpm_bench.merged", "merged"
    doc["points"] = a["points"] + b["points"]
    doc["protocol"] = {**a["protocol"], "noisy_cv": 0.1}
    return doc


def test_point_stats_come_from_raw_samples():
    rec = {"raw_samples": [{"timing": {"wall_time": w}} for w in (1.0, 2.0, 3.0, 4.0, 100.0)],
           "estimate": {"raw_sample_indices": [0, 1, 2, 3], "wall_time": 2.5, "noisy": False}}
    s = point_stats(rec, 0.1)  # sample 4 is not a measured sample
    assert s["n"] == 4 and s["median"] == 2.5
    assert s["p10"] == pytest.approx(np.percentile([1, 2, 3, 4], 10))
    assert s["p90"] == pytest.approx(np.percentile([1, 2, 3, 4], 90))
    assert s["cv"] == pytest.approx(np.std([1, 2, 3, 4]) / 2.5)
    assert s["noisy"] and not s["stored_noisy"] and not s["flag_ok"]


def test_report_per_rank_series_flags_and_html(tmp_path, monkeypatch, synth):
    doc = merged_two_ranks(synth)
    doc["points"][0]["estimate"]["noisy"] = True  # stored flag contradicting the raw samples (CV ~ 0.01)
    art = tmp_path / "merged.json"
    write_once(art, doc)
    model = tmp_path / "model.json"
    write_model(fit([art]), model)

    seen = {}
    real = matplotlib.figure.Figure.savefig

    def spy(self, fname, *a, **kw):
        ax = self.axes[0]
        seen[str(fname).rsplit("/", 1)[-1]] = {
            "ylim0": ax.get_ylim()[0], "labels": [t.get_text() for t in ax.get_legend().get_texts()],
            "errorbars": len(ax.containers)}
        return real(self, fname, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    md_path = report(art, tmp_path / "rep", model=model)
    md = md_path.read_text()
    dec = seen["decode.png"]
    assert dec["ylim0"] == 0 and seen["prefill.png"]["ylim0"] == 0
    # one series per (rank, batch): 2 ranks x 5 decode batch sizes, never joined
    assert dec["errorbars"] == 10 and sum(lbl.startswith("rank 1,") for lbl in dec["labels"]) == 5
    assert {"decode_residuals.png", "prefill_residuals.png"} <= set(seen)
    # rank 1 runs 2x slower: every point is flagged with the named threshold
    assert f"more than {RANK_DISAGREEMENT:.0%}" in md
    assert re.search(r"`decode:b1:c16` 1\d\d%", md)
    assert "**mismatch**" in md and f"`{doc['points'][0]['key']}` rank 0 disagree" in md
    assert "| decode | linear |" in md and "LOO MAPE" in md
    html = (tmp_path / "rep" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and "<table>" in html and "src=\"decode.png\"" not in html
    for name in ("prefill.png", "decode.png", "prefill_residuals.png", "decode_residuals.png"):
        assert (tmp_path / "rep" / name).stat().st_size > 1000


def test_agreeing_ranks_are_not_flagged(tmp_path, synth):
    art = tmp_path / "merged.json"
    write_once(art, merged_two_ranks(synth, slow=1.0))
    md = report(art, tmp_path / "rep").read_text()
    assert "): none." in md and "all agree" in md and "Step-time model" not in md
