"""Reproducible inputs, grid, rank artifacts and merge rules (no engine)."""

from __future__ import annotations

import copy
import hashlib
import json
import random
import subprocess
import sys

import numpy as np
import pytest
from genartifact_fpm_bench import content
from genartifact_fpm_bench.artifact import MergeError, engine_diff, merge, write_once
from genartifact_fpm_bench.grid import GridError, Limits, Point, build_grid, grid_digest, load_points

LIMITS = Limits(max_num_batched_tokens=1024, max_num_seqs=16, max_model_len=2048, kv_capacity_tokens=262144,
                block_size=128, prefix_caching=True)
P = Point("prefill", 2, tokens=128)


def test_content_depends_only_on_seed_point_rank_slot():
    a = content.make_batch(P, 0, [64, 64], (4, 512), seed="0")
    b = content.make_batch(P, 0, [64, 64], (4, 512), seed="0")
    assert a.hashes == b.hashes and a.aggregate == b.aggregate
    assert a.hashes[0] != a.hashes[1]  # slots differ
    assert content.make_batch(P, 1, [64, 64], (4, 512), seed="0").hashes != a.hashes  # ranks differ
    assert content.make_batch(P, 0, [64, 64], (4, 512), seed="1").hashes != a.hashes  # seeds differ
    assert content.make_batch(Point("prefill", 2, tokens=256), 0, [64, 64], (4, 512), seed="0").hashes != a.hashes
    toks = a.prompts[0]
    assert toks.dtype == np.uint32 and toks.min() >= 4 and toks.max() < 512
    assert a.hashes[0] == hashlib.sha256(toks.astype("<u4").tobytes()).hexdigest()


def test_content_identical_across_processes_and_grid_subsets():
    code = ("import sys; from genartifact_fpm_bench import content; from genartifact_fpm_bench.grid import Point;"
            "pts=[Point('decode',4,context=c) for c in (64,128,256)];"
            "order=list(reversed(pts)) if sys.argv[1]=='rev' else pts[1:];"
            "print({p.key(): content.make_batch(p,0,[p.context-1]*p.batch,(4,512),seed='7').aggregate for p in order})")
    outs = [eval(subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, check=True).stdout)
            for arg in ("rev", "subset")]
    for k in outs[1]:
        assert outs[0][k] == outs[1][k]


def test_seeding_work_is_linear_in_batch_size(monkeypatch):
    calls = []
    real = hashlib.sha256

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(content.hashlib, "sha256", counting)
    for b in (1, 8, 64):
        calls.clear()
        content.make_batch(Point("decode", b, context=16), 0, [15] * b, (4, 512))
        # 1 batch digest + per slot (seed digest + prompt hash) + 1 aggregate
        assert len(calls) == 1 + 2 * b + 1


def test_grid_is_bounded_and_digest_stable():
    g = build_grid(LIMITS, "agg")
    assert g and all(LIMITS.check(p) is None for p in g)
    assert {p.phase for p in g} == {"prefill", "decode"}
    assert grid_digest(g) == grid_digest(list(g)) != grid_digest(g[1:])
    assert len(build_grid(LIMITS, "agg", max_points=10)) <= 10


@pytest.mark.parametrize("pt, match", [
    ({"phase": "prefill", "batch": 2, "tokens": 4096}, "max_num_batched_tokens"),
    ({"phase": "prefill", "batch": 3, "tokens": 128}, "multiple of batch"),
    ({"phase": "prefill", "batch": 1, "tokens": 64, "kv": 100}, "block_size"),
    ({"phase": "decode", "batch": 64, "context": 64}, "max_num_seqs"),
    ({"phase": "decode", "batch": 1, "context": 4000}, "max_model_len"),
    ({"phase": "train", "batch": 1}, "phase"),
    ({"phase": "decode", "batch": 1, "context": 64, "colour": 1}, "keys"),
])
def test_points_file_rejects_infeasible(tmp_path, pt, match):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"points": [pt]}))
    with pytest.raises(GridError, match=match):
        load_points(f, LIMITS)


def _points(names):
    """A decode point per name (distinct contexts), as a rank's grid would hold them."""
    return [Point("decode", batch=1 + i, context=64 + sum(map(ord, n))) for i, n in enumerate(names)]


def rank_doc(rank, size=2, run_id="r1", engine=None, errors=None, points=("a", "b")):
    pts = _points(points)
    return {"schema": "genartifact.fpm_bench.rank", "schema_version": 1, "artifact_type": "rank", "run_id": run_id,
            "grid_digest": grid_digest(pts), "mode": "agg", "dp": {"rank": rank, "size": size},
            "protocol": {"content_seed": "0"}, "limits": {"max_num_seqs": 16},
            "coverage": {"expected_points": len(points), "completed_points": len(points), "failed_points": 0},
            "points": [{"key": p.key(), "point": p.as_dict(), "dp_rank": rank, "status": "completed",
                        "estimate": {"wall_time": 0.01 * (i + 1), "cv": 0.02}} for i, p in enumerate(pts)],
            "warmup_evidence": [], "engine": engine if engine is not None else
            {"model": {"model": "m"}, "parallel": {"data_parallel_rank": rank}, "worker_probe": {"rank": rank}},
            "capture_errors": errors or {}}


def write_ranks(tmp_path, docs):
    paths = []
    for i, d in enumerate(docs):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(d))
        paths.append(p)
    return paths


def test_merge_happy_path_and_sidecar(tmp_path):
    paths = write_ranks(tmp_path, [rank_doc(0), rank_doc(1)])
    m = merge(paths, tmp_path / "merged.json")
    assert m["dp"]["source_ranks"] == [0, 1] and len(m["points"]) == 4
    side = json.loads((tmp_path / "merged_worker_probe.json").read_text())
    assert m["worker_probe_path"] == "merged_worker_probe.json" and side["schema"] == "genartifact.fpm_bench.worker_probe"
    assert side["ranks"] == {"0": {"rank": 0}, "1": {"rank": 1}}
    assert m["engine"]["parallel"]["data_parallel_rank"] is None and "worker_probe" not in m["engine"]
    with pytest.raises(MergeError, match="written once"):
        merge(paths, tmp_path / "merged.json")


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d[1].update(run_id="other"), "differ in run_id"),
    (lambda d: d.__setitem__(1, rank_doc(1, points=("x", "y"))), "differ in grid_digest"),
    (lambda d: d[1].update(protocol={"content_seed": "9"}), "differ in protocol"),
    (lambda d: d[1]["coverage"].update(completed_points=1), "differ in coverage"),
    (lambda d: d[1]["dp"].update(rank=0), "duplicate DP ranks"),
    (lambda d: d[1]["points"].append(copy.deepcopy(d[1]["points"][0])), "do not hash to its grid_digest"),
    (lambda d: d[1]["engine"]["model"].update(model="other"), "engine provenance differs.*model.model"),
    (lambda d: d[1].update(schema_version=0), "legacy or foreign"),
    (lambda d: d[1]["points"][0].update(dp_rank=0), "dp_rank differs"),
])
def test_merge_rejections(tmp_path, mutate, match):
    docs = [rank_doc(0), rank_doc(1)]
    mutate(docs)
    with pytest.raises(MergeError, match=match):
        merge(write_ranks(tmp_path, docs), tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()


def test_merge_missing_rank(tmp_path):
    with pytest.raises(MergeError, match="do not cover"):
        merge(write_ranks(tmp_path, [rank_doc(0, size=3), rank_doc(2, size=3)]), tmp_path / "m.json")


def test_a_rank_with_capture_errors_is_compared_on_what_it_captured(tmp_path):
    """A rank whose capture partly failed is listed in capture_errors and compared on the fields it did capture: a
    version mismatch there is refused, not merged silently (it was excluded from the comparison altogether)."""
    partial = rank_doc(1, engine={"model": {"model": "m"}, "parallel": {"data_parallel_rank": 1}},
                       errors={"kv_cache_spec": "RuntimeError: x"})
    m = merge(write_ranks(_mk(tmp_path / "a"), [rank_doc(0), partial]), tmp_path / "m.json")
    assert m["capture_errors"] == {"1": {"kv_cache_spec": "RuntimeError: x"}} and m["unverified_ranks"] == []
    other = rank_doc(1, engine={"model": {"model": "different"}}, errors={"kv_cache_spec": "RuntimeError: x"})
    with pytest.raises(MergeError, match="capture errors on one side; the fields both captured are compared.*model.model"):
        merge(write_ranks(_mk(tmp_path / "b"), [rank_doc(0), other]), tmp_path / "n.json")
    assert not (tmp_path / "n.json").exists() and not (tmp_path / "n_worker_probe.json").exists()
    # the same when the rank with capture errors comes first (it was then compared with no one)
    first = rank_doc(0, engine={"model": {"model": "different"}}, errors={"kv_cache_spec": "RuntimeError: x"})
    with pytest.raises(MergeError, match="capture errors on one side; the fields both captured are compared.*model.model"):
        merge(write_ranks(_mk(tmp_path / "c"), [first, rank_doc(1)]), tmp_path / "o.json")


def test_a_rank_without_engine_provenance_is_named_unverified(tmp_path, capsys):
    from genartifact.cli import main

    bare = rank_doc(1, errors={"engine_config": "RuntimeError: x"})
    bare["engine"] = None
    paths = write_ranks(tmp_path, [rank_doc(0), bare])
    assert main(["bench", "merge", *map(str, paths), "--out", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["unverified_ranks"] == [1]
    assert "warning: ranks [1] carry no engine provenance" in capsys.readouterr().err


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["points"][0]["point"].update(batch=99), r"points\[0\]: key .* does not match its point"),
    (lambda d: d["points"][0]["estimate"].update(wall_time=-5), r"points\[0\].estimate.wall_time must be"),
    (lambda d: d["points"][0]["estimate"].update(cv="x"), r"points\[0\].estimate.cv must be"),
    (lambda d: d["points"][0]["point"].update(phase=[1]), r"points\[0\]: key|points\[0\].point must be"),
    (lambda d: d["points"][0]["point"].update(bogus=1), r"points\[0\].point must be a bench point"),
    (lambda d: d["points"].__setitem__(0, "x"), r"points\[0\] must be"),
    (lambda d: d.pop("dp"), "field dp must be an object"),
    (lambda d: d.pop("points"), "field points must be a list"),
    (lambda d: d.pop("limits"), "field limits must be an object"),
    (lambda d: d.update(run_id=["r"]), "field run_id must be a string"),
    (lambda d: d["dp"].update(size="2"), "field dp.size must be an integer 1..4096"),
    (lambda d: d["dp"].update(size=5 * 10**7), "field dp.size must be an integer 1..4096"),
    (lambda d: d["dp"].update(rank=1.0), "field dp.rank must be an integer"),
    (lambda d: d["dp"].update(rank=True), "field dp.rank must be an integer"),
    (lambda d: d.update(schema_version=True), "legacy or foreign"),
    (lambda d: d.update(engine=[1]), "field engine must be an object or null"),
])
def test_a_malformed_or_forged_rank_is_refused_naming_the_field(tmp_path, mutate, match):
    """Malformed rank files are a MergeError naming the file and field (they crashed with KeyError/TypeError), and
    forged point records (a point that is not its key's, a negative estimate) are refused, never fitted on."""
    bad = rank_doc(1)
    mutate(bad)
    with pytest.raises(MergeError, match=match):
        merge(write_ranks(tmp_path, [rank_doc(0), bad]), tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "m_worker_probe.json").exists()


def test_nan_is_refused_and_a_failed_merge_leaves_nothing_behind(tmp_path):
    """NaN is not JSON: a rank holding one is refused on reading (it was read, then failed the merged file's write
    after the sidecar had been written, and that orphan sidecar blocked every rerun)."""
    docs = [rank_doc(0), rank_doc(1)]
    paths = write_ranks(tmp_path, docs)
    paths[1].write_text(paths[1].read_text().replace('"cv": 0.02', '"cv": NaN', 1))
    with pytest.raises(MergeError, match="NaN is not a JSON number"):
        merge(paths, tmp_path / "m.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r0.json", "r1.json"]
    paths = write_ranks(tmp_path, docs)  # fixed: the rerun merges
    assert merge(paths, tmp_path / "m.json")["dp"]["source_ranks"] == [0, 1]


def test_merge_property_random_rank_sets(tmp_path):
    rng = random.Random(0)
    for trial in range(40):
        size = rng.randint(1, 6)
        docs = [rank_doc(r, size=size, points=("p1", "p2", "p3")) for r in range(size)]
        drop = rng.random() < 0.3 and size > 1
        dup = rng.random() < 0.2
        if drop:
            docs.pop(rng.randrange(size))
        if dup:
            docs.append(copy.deepcopy(docs[0]))
        rng.shuffle(docs)
        out = tmp_path / f"m{trial}.json"
        d = tmp_path / f"t{trial}"
        d.mkdir()
        if drop or dup:
            with pytest.raises(MergeError):
                merge(write_ranks(d, docs), out)
            assert not out.exists()
        else:
            m = merge(write_ranks(d, docs), out)
            assert m["dp"]["source_ranks"] == list(range(size)) and len(m["points"]) == 3 * size
            assert [p["dp_rank"] for p in m["points"]] == sorted(p["dp_rank"] for p in m["points"])


def test_engine_diff_ignores_rank_and_probe_fields():
    a = {"parallel": {"data_parallel_rank": 0, "tp": 1}, "worker_probe": {"x": 1}, "model": {"dtype": "f32"}}
    b = {"parallel": {"data_parallel_rank": 1, "tp": 1}, "worker_probe": {"x": 2}, "model": {"dtype": "bf16"}}
    assert engine_diff(a, b) == ["model.dtype"]


def test_write_once(tmp_path):
    write_once(tmp_path / "a.json", {"x": 1})
    with pytest.raises(FileExistsError):
        write_once(tmp_path / "a.json", {"x": 2})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_decode_admission_needs_many_passes_and_fits_or_is_excluded_before_running():
    from genartifact_fpm_bench.grid import plan_grid

    p = Point("decode", 16, context=512)  # the point that used to fail: 16 × 511 prompt tokens, 1024 per pass
    adm = LIMITS.decode_admission_passes(p)
    assert adm >= 8 + 1  # at least ceil(8176 / 1024) passes, +1 for a trailing chunk
    assert LIMITS.decode_max_tokens(p, 3) == adm + 3 + 1
    LIMITS.check(p, 3)
    # a KV cache that holds 16 × 511 prompt tokens but not the tokens decoded over admission + measurement
    tight = Limits(max_num_batched_tokens=1024, max_num_seqs=16, max_model_len=2048,
                   kv_capacity_tokens=16 * 512, block_size=16, prefix_caching=True)
    with pytest.raises(GridError, match="KV cache"):
        tight.check(p, 3)
    plan = plan_grid(tight, "decode")
    assert all(tight.check(q, 3) is None for q in plan.points)
    reasons = dict((q.key(), r) for q, r in plan.excluded)
    assert "decode:b16:c512" in reasons and "KV cache" in reasons["decode:b16:c512"]
    assert plan.excluded_dicts()[0].keys() == {"key", "reason"}
    # thinning is said too, never silent
    thin = plan_grid(LIMITS, "agg", max_points=10)
    full = plan_grid(LIMITS, "agg", max_points=1000)
    assert len(thin.points) == 10 and len(thin.points) + len(thin.excluded) == len(full.points) + len(full.excluded)
    assert any("max_points=10" in r for _, r in thin.excluded)
    # decode context + generated tokens must fit max_model_len
    with pytest.raises(GridError, match="max_model_len"):
        LIMITS.check(Point("decode", 1, context=2046), 3)


def test_taken_fpm_port_is_one_error_line_before_the_engine(tmp_path, capsys):
    """Issue 10: a taken FPM port is one ``error:`` line naming the port and the fix, before any engine start
    (the model directory does not even exist, so reaching the engine would fail differently)."""
    import socket

    from genartifact.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        rc = main(["bench", "run", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"),
                   "--port-base", str(port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith(f"error: FPM port 127.0.0.1:{port} is already in use"), err
    assert "--port-base" in err[0]


def test_an_unknown_config_probe_is_one_error_line_before_the_engine(tmp_path, capsys, free_port):
    """A probe the config enables but no distribution provides fails fast, naming it, before any engine start (the
    model directory does not exist: reaching the engine would fail differently)."""
    from genartifact.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text('[plugins]\nprobes = ["no_such_probe"]\n')
    rc = main(["--config", str(cfg), "bench", "run", "--model", str(tmp_path / "no-model"), "--out",
               str(tmp_path / "out"), "--port-base", str(free_port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no_such_probe" in err[0], err
    assert not (tmp_path / "out").exists()


def test_bench_probes_are_the_builtins_then_the_configs_own():
    from genartifact_fpm_bench.run import PROBES, bench_probes

    assert bench_probes() == PROBES
    assert bench_probes(["host-note", "worker_probe", "other"]) == [*PROBES, "host_note", "other"]


class _Hooks:
    def __init__(self, impls):
        self.impls = impls

    def provenance_impls(self):
        return self.impls


def _probe(name, answer):
    def fn(context):
        if isinstance(answer, BaseException):
            raise answer
        return answer(name) if callable(answer) else answer
    return (f"probes:{name}", fn)


async def test_collect_records_a_wrong_answer_as_that_probes_error_and_keeps_the_others():
    """Each probe's answer is checked (its own name, ``data`` present, JSON-compatible, bounded, awaited under the
    timeout); a wrong one is that probe's error, naming what was expected, and never a KeyError or a rank artifact
    that cannot be written after the whole run."""
    import asyncio
    from types import SimpleNamespace as NS

    from genartifact_fpm_bench import probes

    async def slow():
        await asyncio.sleep(10)

    async def fine():
        return {"x": 1}

    impls = [
        _probe("good", lambda n: {"name": n, "data": {"cpus": 2}}),
        _probe("host_note", lambda n: {"name": "host-note", "data": 1}),  # its entry-point spelling: the same name
        _probe("later", lambda n: {"name": n, "data": fine()}),
        _probe("none", None),
        _probe("nodata", lambda n: {"name": n, "block": 1}),
        _probe("thief", lambda n: {"name": "engine_config", "data": {"forged": True}}),
        _probe("nan", lambda n: {"name": n, "data": {"v": float("nan")}}),
        _probe("object", lambda n: {"name": n, "data": {"v": object()}}),
        _probe("huge", lambda n: {"name": n, "data": "x" * (probes.MAX_BLOCK_BYTES + 1)}),
        _probe("list", lambda n: [n]),
        _probe("raises", RuntimeError("boom")),
        _probe("slow", lambda n: {"name": n, "data": slow()}),
    ]
    blocks, errors = await probes.collect(NS(hooks=_Hooks(impls)), {"engine": None}, timeout_s=0.2)
    assert blocks == {"good": {"cpus": 2}, "host_note": 1, "later": {"x": 1}}
    assert sorted(errors) == ["huge", "list", "nan", "nodata", "object", "raises", "slow", "thief"]
    assert "expected None or {'name': 'nodata', 'data'" in errors["nodata"]
    assert "name='engine_config'" in errors["thief"] and "engine_config" not in blocks
    assert "not JSON-compatible" in errors["nan"] and "not JSON-compatible" in errors["object"]
    assert "limit" in errors["huge"] and len(errors["huge"]) < 400
    assert errors["raises"] == "RuntimeError: boom" and errors["slow"].startswith("TimeoutError")


def test_merge_carries_the_configs_own_probes_per_rank_and_never_compares_them(tmp_path):
    """Third-party blocks differ per rank (a host's CPU, a worker's clock) and may fail on one rank: the merge
    carries them per rank, and their faults do not exclude the rank from the engine comparison."""
    a, b = rank_doc(0), rank_doc(1)
    a["provenance"], b["provenance"] = {"host_note": {"cpus": 2}}, {"host_note": {"cpus": 16}}
    b["provenance_errors"] = {"bad_note": "TypeError: probe 'bad_note' returned list"}
    b["engine"]["model"]["model"] = "other"  # an engine difference must still be caught
    with pytest.raises(MergeError, match="engine provenance differs"):
        merge(write_ranks(_mk(tmp_path / "x"), [a, b]), tmp_path / "x.json")
    b["engine"]["model"]["model"] = "m"
    m = merge(write_ranks(_mk(tmp_path / "y"), [a, b]), tmp_path / "m.json")
    assert m["provenance"] == {"0": {"host_note": {"cpus": 2}}, "1": {"host_note": {"cpus": 16}}}
    assert m["provenance_errors"] == {"1": {"bad_note": "TypeError: probe 'bad_note' returned list"}}
    assert m["capture_errors"] == {}


def test_runtime_versions_lists_every_plugin_distribution_whatever_its_name(tmp_path, monkeypatch):
    from types import SimpleNamespace as NS

    from genartifact_fpm_bench import probes

    ep = NS(group="genartifact.probes")
    dists = [NS(metadata={"Name": "acme-probes"}, version="3.1", entry_points=[ep]),
             NS(metadata={"Name": "unrelated"}, version="1.0", entry_points=[NS(group="console_scripts")]),
             NS(metadata={"Name": "genartifact"}, version="0.1.0", entry_points=[])]
    monkeypatch.setattr(probes.md, "distributions", lambda: dists)
    got = probes.RuntimeVersionsProbe().genartifact_collect_provenance(context={})
    assert got["data"]["distributions"] == {"acme-probes": "3.1", "genartifact": "0.1.0"}


def _mk(p):
    p.mkdir(parents=True, exist_ok=True)
    return p
