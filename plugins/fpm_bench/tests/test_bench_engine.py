"""Two data-parallel ranks for real (two engine processes, ranks 0 and 1), merged and reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.engine

ACME_PROBES = """
import pluggy

hookimpl = pluggy.HookimplMarker("genartifact")


class HostNote:
    @hookimpl
    def genartifact_collect_provenance(self, context):
        engine = context["engine"]

        async def ask():
            replies = await engine.worker_call("fpm.probe")  # the built-in worker probe's verb: one per worker
            return {"model_type": engine.model_info.hf_config["model_type"], "workers": len(replies)}

        return {"name": "host_note", "data": ask()}


class BadNote:
    @hookimpl
    def genartifact_collect_provenance(self, context):
        return {"note": "no name, no data"}


host_note, bad_note = HostNote(), BadNote()
"""


def test_two_ranks_run_merge_report(tmp_path, tiny_model, free_port):
    model_path, base = tiny_model, free_port
    points = tmp_path / "points.json"
    points.write_text(json.dumps({"points": [{"phase": "prefill", "batch": 2, "tokens": 128},
                                             {"phase": "prefill", "batch": 1, "tokens": 64, "kv": 128},
                                             {"phase": "decode", "batch": 2, "context": 64},
                                             # 8 × 511 prompt tokens need >= 4 admission passes of 1024 tokens
                                             {"phase": "decode", "batch": 8, "context": 512}]}))
    run_id = uuid.uuid4().hex
    # a third-party distribution with two probes, enabled by the config: one good, one answering wrongly
    site = tmp_path / "site"
    site.mkdir()
    (site / "acme_probes.py").write_text(ACME_PROBES)
    di = site / "acme_probes-2.0.dist-info"
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-probes\nVersion: 2.0\n")
    (di / "entry_points.txt").write_text("[genartifact.probes]\nhost_note = acme_probes:host_note\n"
                                         "bad_note = acme_probes:bad_note\n")
    cfg = tmp_path / "bench.toml"
    cfg.write_text('[plugins]\nprobes = ["host_note", "bad_note"]\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-m", "genartifact.cli", "--config", str(cfg), "bench", "run",
                               "--model", str(model_path),
                               "--points", str(points), "--out", str(tmp_path), "--dp-rank", str(r), "--dp-size", "2",
                               "--run-id", run_id, "--port-base", str(base), "--repeats", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) for r in (0, 1)]
    for p in procs:
        out = p.communicate(timeout=600)[0].decode()
        assert p.returncode == 0, out[-3000:]
    ranks = [json.loads((tmp_path / f"fpm_rank{r}.json").read_text()) for r in (0, 1)]
    for r, d in enumerate(ranks):
        assert d["dp"] == {"rank": r, "size": 2} and d["coverage"]["completed_points"] == 4, d["coverage"]
        assert d["capture_errors"] == {} and d["stream"]["gaps"] == 0
        # the config's probes ran on the started engine; the wrong one is its own error, nothing else's
        assert d["provenance"] == {"host_note": {"model_type": "qwen3_moe", "workers": 1}}, d["provenance"]
        assert "expected None or {'name': 'bad_note'" in d["provenance_errors"]["bad_note"]
        assert d["engine"]["versions"]["distributions"]["acme-probes"] == "2.0"
        assert all(x["dp_rank"] == r for x in d["points"])
        assert d["engine"]["worker_probe"]["responses"][0]["attention_backends"]
        kinds = [e["kind"] for e in d["warmup_evidence"]]
        assert kinds[0] == "global" and kinds.count("shape_replica") == 4
        assert all(e["status"] == "completed" and e["forward_range"] for e in d["warmup_evidence"])
    # same coordinates, different ranks -> different prompt content
    assert ranks[0]["points"][0]["prompts"]["sha256"] != ranks[1]["points"][0]["prompts"]["sha256"]
    kvpt = next(x for x in ranks[0]["points"] if x["point"]["kv"])
    measured = [kvpt["raw_samples"][i] for i in kvpt["estimate"]["raw_sample_indices"]]
    assert all(s["scheduled"]["sum_prefill_kv_tokens"] == 128 for s in measured)  # the prefix cache was hit
    big = next(x for x in ranks[0]["points"] if x["key"] == "decode:b8:c512")
    roles = [s["role"] for s in big["raw_samples"]]
    assert roles.count("admission") >= 2 * 4  # admitted over several passes, in both executions
    measured = [big["raw_samples"][i]["scheduled"] for i in big["estimate"]["raw_sample_indices"]]
    assert len(measured) == 2 and all(s["num_decode_requests"] == 8 and s["num_prefill_requests"] == 0
                                      for s in measured)
    assert all(8 * 511 <= s["sum_decode_kv_tokens"] <= 8 * 511 + 8 * 8 for s in measured)
    merged = tmp_path / "merged.json"
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "bench", "merge", str(tmp_path / "fpm_rank0.json"),
                           str(tmp_path / "fpm_rank1.json"), "--out", str(merged)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(merged.read_text())
    assert m["dp"]["source_ranks"] == [0, 1] and len(m["points"]) == 8
    assert (tmp_path / m["worker_probe_path"]).exists()
    assert m["provenance"] == {r: {"host_note": {"model_type": "qwen3_moe", "workers": 1}} for r in ("0", "1")}
    assert set(m["provenance_errors"]) == {"0", "1"}
    model = tmp_path / "model.json"
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "bench", "fit", str(merged), "--out", str(model)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    fitted = json.loads(model.read_text())
    assert fitted["source"]["grid_digest"] == m["grid_digest"] and fitted["source"]["engine_identity"]
    assert set(fitted["phases"]) == {"prefill", "decode"}
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "bench", "report", str(merged), "--model", str(model),
                           "--out", str(tmp_path / "report")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "report" / "decode_residuals.png").stat().st_size > 1000
    assert "data:image/png;base64," in (tmp_path / "report" / "report.html").read_text()
    assert (tmp_path / "report" / "prefill.png").stat().st_size > 1000
    assert (tmp_path / "report" / "decode.png").stat().st_size > 1000
    assert "decode:b2:c64" in (tmp_path / "report" / "report.md").read_text()


def test_live_check_on_generate(tmp_path, tiny_model, free_port, synth):
    """generate (capture + store + receipts) with the FPM stream; every pass is compared with a model (fitted
    here on a synthetic grid covering the workload's shapes: this checks the plumbing, not the accuracy)."""
    from genartifact_fpm_bench.artifact import write_once
    from genartifact_fpm_bench.fit import fit, write_model

    art = tmp_path / "grid.json"
    write_once(art, synth.artifact(synth.GRID, noise=0.0))
    model = tmp_path / "model.json"
    write_model(fit([art]), model)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(["river stone"] * (40 + 30 * i)), "max_tokens": 12 + 2 * i})
                               + "\n" for i in range(6)))
    live = tmp_path / "live.json"
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "bench", "live", "--model", str(tiny_model),
                           "--fit", str(model), "--prompts", str(prompts), "--port-base", str(free_port),
                           "--out", str(live)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lv = json.loads(live.read_text())
    assert lv["receipts"] == {"ready": 6} and lv["not_ready"] == [] and lv["stream_gaps"] == 0
    assert lv["contents"] == ["moe_routes", "selected_logprobs"] and lv["passes_observed"] > 6
    s = lv["summary"]
    classes = [s["in_grid"]["prefill"], s["in_grid"]["decode"], s["out_of_grid"]["prefill"],
               s["out_of_grid"]["decode"], s["mixed"]]
    assert sum(c["n"] for c in classes) == len(lv["passes"]) == lv["passes_observed"]
    assert s["in_grid"]["decode"]["n"] > 0 and s["in_grid"]["decode"]["mape_pct"] is not None
    assert all(p["predicted"] > 0 and p["wall_time"] > 0 for p in lv["passes"])
    assert "in grid, decode" in proc.stdout
    assert len(list((tmp_path / "artifacts").rglob("*.gart"))) == 6  # generate really stored the artifacts
