"""Live check (engine-free part): every streamed pass classed and compared with the model's prediction."""

from __future__ import annotations

import pytest
from genartifact_fpm_bench.artifact import write_once
from genartifact_fpm_bench.fit import StepModel, fit
from genartifact_fpm_bench.fpm import FPM, ScheduledStats
from genartifact_fpm_bench.live import compare, mixed_workload, summary_lines


def fpm(i: int, wall: float, **shape) -> FPM:
    return FPM(version=1, dp_rank=0, counter_id=i, wall_time=wall, inter_output=None, t_schedule=0.0,
               t_output=wall, scheduled=ScheduledStats(**shape), queued=ScheduledStats())


def test_compare_classes_passes_and_measures_error(tmp_path, synth):
    art = tmp_path / "grid.json"
    write_once(art, synth.artifact(synth.GRID, noise=0.0))
    model = StepModel(fit([art]))
    inside = {"num_decode_requests": 4, "sum_decode_kv_tokens": 4 * 100}
    outside = {"num_decode_requests": 40, "sum_decode_kv_tokens": 40 * 100}
    pre = {"num_prefill_requests": 2, "sum_prefill_tokens": 300}
    mixed = {"num_prefill_requests": 1, "sum_prefill_tokens": 200, "num_decode_requests": 3, "sum_decode_kv_tokens": 90}
    truth_in = synth.law({**dict.fromkeys(("num_prefill_requests", "sum_prefill_tokens", "sum_prefill_kv_tokens"), 0),
                          **inside})
    fpms = [fpm(0, truth_in * 1.10, **inside), fpm(1, truth_in * 0.95, **inside),
            fpm(2, 0.05, **outside), fpm(3, 0.01, **pre), fpm(4, 0.02, **mixed)]
    out = compare(model, fpms)
    s = out["summary"]
    assert s["in_grid"]["decode"]["n"] == 2 and s["out_of_grid"]["decode"]["n"] == 1
    assert s["in_grid"]["prefill"]["n"] == 1 and s["mixed"]["n"] == 1
    # the model reproduces the law inside the grid, so the errors are the injected +10 % / -5 %
    assert s["in_grid"]["decode"]["mape_pct"] == pytest.approx((100 / 11 + 100 / 19) / 2, rel=0.05)
    assert s["in_grid"]["decode"]["max_error_pct"] == pytest.approx(100 / 11, rel=0.05)
    assert [p["counter_id"] for p in out["passes"]] == [0, 1, 2, 3, 4]
    assert all(p["predicted"] > 0 for p in out["passes"])
    lines = summary_lines({"summary": s})
    assert lines[1].startswith("in grid, decode") and "n=   2" in lines[1]


def test_mixed_workload_is_seeded_and_mixed():
    a, b = mixed_workload(24, seed=1), mixed_workload(24, seed=1)
    assert a == b and a != mixed_workload(24, seed=2)
    lens = [len(r["prompt"].split()) for r in a]
    outs = [r["max_tokens"] for r in a]
    assert min(lens) < 50 < 300 < max(lens) < 400 and min(outs) < 16 < 48 < max(outs)
