"""`genartifact generate` refuses bad input before the engine starts; CLI errors are clean (no engine)."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from genartifact import config as config_mod
from genartifact.cli import main
from genartifact.engine.job import read_prompts, run_generate, target_for
from genartifact.errors import RequestSpecError
from genartifact.spec import parse_request


@pytest.mark.parametrize(
    "row, match",
    [
        ({"prompt": "x", "max_tokens": "abc"}, "max_tokens=\"abc\" invalid; allowed: an integer"),
        ({"prompt": "x", "max_tokens": 2.9}, "max_tokens=2.9"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens=true"),
        ({"prompt": "x", "routed_experts_prompt_start": "2"}, "routed_experts_prompt_start"),
        ({"prompt": "x", "routed_experts_prompt_start": 2.7}, "routed_experts_prompt_start"),
        ({"prompt": "x", "routed_experts_prompt_start": True}, "routed_experts_prompt_start"),
        ({"prompt": "x", "temperature": None}, "temperature=null"),
        ({"prompt": "x", "logprobs": 100}, "logprobs=100 invalid; allowed: an integer 0..20"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "contents": []}, "contents"),
        ({"prompt": "x", "target": ["a"]}, "target"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "\ud800 lone surrogate"}, "prompt=.* invalid; allowed: a non-empty string of valid Unicode"),
        ({"prompt": "x", "n": 0}, "n=0 invalid; allowed: an integer 1..256"),
        ({"prompt": "x", "n": 257}, "n=257 invalid"),
        ({"prompt": "x", "n": True}, "n=true invalid"),
    ],
)
@pytest.mark.fault("generate", "prompt row field violations")
def test_prompt_rows_are_strict(tmp_path, row, match):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(RequestSpecError, match=match):
        read_prompts(f)


@pytest.mark.parametrize("target", [
    "http://127.0.0.1:1/ok/x?X-Amz-Signature=SECRETSIG",
    [{"kind": "presigned_http_put", "url": "http://127.0.0.1:1/ok/obj99?X-Amz-Signature=SECRETSIG",
      "headers": {"x-amz-meta-k": "HDRSECRET"}}],
])
@pytest.mark.fault("generate", "a row's target of the wrong shape is never echoed")
def test_a_malformed_row_target_is_not_echoed(tmp_path, target):
    """A presigned grant in the wrong shape (a bare URL string, a list around the object) is refused naming the
    field and its allowed values, without its URL, host or signed values (a rejected receipt carries this text)."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "x", "target": target}) + "\n")
    with pytest.raises(RequestSpecError) as e:
        read_prompts(f)
    err = e.value
    assert "target=<a JSON " in str(err) and "allowed: a target object" in str(err)
    for secret in ("SECRETSIG", "HDRSECRET", "127.0.0.1", "X-Amz", "obj99"):
        assert secret not in str(err), str(err)


def test_row_values_in_errors_are_redacted_and_short(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "x", "seed": "http://h/x?token=SECRETTOK" + "y" * 500}) + "\n")
    with pytest.raises(RequestSpecError) as e:
        read_prompts(f)
    err = e.value
    assert "SECRETTOK" not in str(err) and "seed=" in str(err) and len(str(err)) < 300


@pytest.mark.fault("generate", "NaN and non-UTF-8 prompt files")
def test_nan_and_non_utf8_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x", "temperature": NaN}\n')
    with pytest.raises(RequestSpecError, match="NaN is not valid JSON"):
        read_prompts(f)
    f.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(RequestSpecError, match="not UTF-8"):
        read_prompts(f)


def test_target_template_placeholders():
    t = target_for('{"kind": "managed_fsspec", "profile": "p", "object_key": "runs/{run_id}/{index}.gart"}', "r1", 3)
    assert t["object_key"] == "runs/r1/00003.gart"
    with pytest.raises(RequestSpecError, match="placeholders"):
        target_for('{"kind": "managed_fsspec", "profile": "p", "object_key": "runs/{foo}.gart"}', "r", 0)


@pytest.mark.parametrize("key", ["runs/{index:>3000000000}.gart",   # a format spec: a 3 GB string per row
                                 "runs/{run_id.__class__.__mro__}",  # attribute access
                                 "runs/{run_id[0]}", "runs/{run_id!r}", "runs/{}", "runs/{0}", "runs/{"])
def test_target_template_allows_bare_placeholders_only(key):
    with pytest.raises(RequestSpecError, match="object_key: only the placeholders"):
        target_for(json.dumps({"kind": "managed_fsspec", "profile": "p", "object_key": key}), "r", 0)
    assert target_for('{"kind": "k", "a": "{{x}}-{index}-{run_id}"}', "r", 7)["a"] == "{x}-00007-r"


def test_spec_normalizes_and_rejects_names():
    assert parse_request({"format": "generation_artifact_v1", "contents": ["moe-routes"],
                          "delivery": {"mode": "object_store", "target": {"kind": "k"}}}).contents == ("moe_routes",)
    for contents, match in (([" moe_routes "], "invalid"), (["moe_routes", "moe-routes"], "duplicates")):
        with pytest.raises(RequestSpecError, match=match):
            parse_request({"format": "generation_artifact_v1", "contents": contents,
                           "delivery": {"mode": "object_store", "target": {"kind": "k"}}})
    with pytest.raises(RequestSpecError, match="codec"):
        parse_request({"format": "generation_artifact_v1", "contents": ["a"], "codec": ["zstd"],
                       "delivery": {"mode": "object_store", "target": {"kind": "k"}}})
    with pytest.raises(RequestSpecError, match="n=1"):
        parse_request({"format": "generation_artifact_v1", "contents": ["a"],
                       "delivery": {"mode": "object_store", "target": {"kind": "k"}}}, n=1.0)


@pytest.mark.fault("generate", "invalid rows before the engine")
def test_invalid_rows_are_rejected_without_starting_the_engine(tmp_path):
    cfg = config_mod.parse(config_mod.DEFAULT_TOML, source="d", base_dir=tmp_path)
    rows = [{"prompt": "a", "contents": ["moe_route"]},
            {"prompt": "b", "target": {"kind": "managed_fsspec", "profile": "local", "object_key": "../x"}},
            {"prompt": "c", "target": {"kind": "managed_fsspec", "profile": "nope", "object_key": "runs/x"}}]
    t0 = time.monotonic()
    receipts = asyncio.run(run_generate(model="/nonexistent", prompts=rows, cfg=cfg, contents=["selected_logprobs"],
                                        target="managed_fsspec:local", max_tokens=4, run_id="r", engine_kwargs={},
                                        progress=False))
    assert time.monotonic() - t0 < 5  # no engine start
    assert [r["error_code"] for r in receipts] == ["request_invalid"] * 3
    assert "did you mean 'moe_routes'" in receipts[0]["error"]
    assert "normalized" in receipts[1]["error"] and "'nope' unknown" in receipts[2]["error"]
    assert not (tmp_path / "artifacts").exists()


def test_group_rows_preflight_each_derived_key_and_are_refused_with_replicas(tmp_path):
    from genartifact.engine.job import check_target_tables, preflight_row

    cfg = config_mod.parse(config_mod.DEFAULT_TOML, source="d", base_dir=tmp_path)
    host = cfg.host()
    targets = check_target_tables(cfg, host)
    row = {"prompt": "x", "n": 3}
    spec = preflight_row(host, targets, row, ["moe_routes"], "managed_fsspec:local", "r", 4)
    assert spec["delivery"]["target"]["object_key"] == "runs/r/00004.gart"
    with pytest.raises(RequestSpecError, match="not supported with --replicas"):
        preflight_row(host, targets, row, ["moe_routes"], "managed_fsspec:local", "r", 4, allow_groups=False)
    # a sample key outside the profile's allowed prefixes is refused before the engine starts
    bad = {**row, "target": {"kind": "managed_fsspec", "profile": "local", "object_key": "runs"}}
    with pytest.raises(Exception, match="allowed prefixes"):
        preflight_row(host, targets, bad, ["moe_routes"], "managed_fsspec:local", "r", 4)


def _generate(tmp_path, *extra, prompts='{"prompt": "x"}\n'):
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m/config.json").write_text("{}")
    p = tmp_path / "p.jsonl"
    p.write_text(prompts)
    return main(["generate", "--model", str(tmp_path / "m"), "--prompts", str(p), *extra])


@pytest.mark.fault("generate", "bad generate arguments")
def test_generate_preflight_errors_exit_2_fast(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cases = [
        (("--run-id", "../../escape"), "--run-id '../../escape' invalid"),
        (("--out", str(tmp_path)), "already exists"),
        (("--target", '{"kind": '), "--target is not valid JSON"),
        (("--target", "managed_fsspec:nosuch"), "--target is refused by its target: managed_fsspec target.profile "
                                                "'nosuch' unknown; configured: ['local']"),
        (("--contents", "moe_route"), "did you mean 'moe_routes'"),  # a typo fails before any receipt
        (("--max-inflight", "0"), "--max-inflight 0 invalid"),  # was ignored without --replicas
        (("--max-inflight", "-1"), "--max-inflight -1 invalid"),
        (("--replicas", "0"), "--replicas 0 invalid"),  # was checked after the receipts directory was made
    ]
    for extra, match in cases:
        assert _generate(tmp_path, *extra) == 2
        assert match in capsys.readouterr().err
    assert not (tmp_path / "artifacts").exists()  # nothing written for any of them
    (tmp_path / "artifacts/runs/r1").mkdir(parents=True)
    (tmp_path / "artifacts/runs/r1/receipts.jsonl").write_text("precious\n")
    assert _generate(tmp_path, "--run-id", "r1") == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "artifacts/runs/r1/receipts.jsonl").read_text() == "precious\n"
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert "not a model directory" in capsys.readouterr().err
    monkeypatch.setenv("GENARTIFACT_PIPELINE_CONCURRENCY", "abc")
    assert _generate(tmp_path, "--run-id", "r2") == 2
    assert "GENARTIFACT_PIPELINE_CONCURRENCY" in capsys.readouterr().err
    monkeypatch.delenv("GENARTIFACT_PIPELINE_CONCURRENCY")
    monkeypatch.setenv("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY", "0")
    assert _generate(tmp_path, "--run-id", "r3") == 2
    assert "GENARTIFACT_PIPELINE_SMALL_CONCURRENCY=0 out of range; allowed: 1..1024" in capsys.readouterr().err


@pytest.mark.fault("generate", "unknown target table in the config")
def test_unknown_target_table_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[plugins]\ncontents = ["selected_logprobs"]\ntargets = ["managed_fsspec"]\n'
                   '[targets.managed_fsspec.profiles.local]\nurl = "./a"\nallowed_prefixes = ["runs/"]\n'
                   '[targets.ftp_upload]\nhost = "x"\n')
    assert _generate(tmp_path, "--config", str(cfg), "--run-id", "r3") == 2
    assert "[targets.ftp_upload] names no installed target kind" in capsys.readouterr().err
    assert not (tmp_path / "artifacts").exists()  # refused before anything was created


@pytest.mark.fault("generate", "no --target with a config that does not enable managed_fsspec")
def test_default_target_needs_managed_fsspec_enabled(tmp_path, capsys, monkeypatch):
    """The default ``--target managed_fsspec:local`` under a config enabling only another target kind: the error
    names the enabled kinds and what to pass (it read as if managed_fsspec were asked for and "not enabled")."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[plugins]\ncontents = ["selected_logprobs"]\ntargets = ["presigned_http_put"]\n')
    assert _generate(tmp_path, "--config", str(cfg), "--run-id", "r4") == 2
    err = capsys.readouterr().err
    assert "--target not given" in err and "enabled targets: ['presigned_http_put']" in err, err
    assert "pass --target KIND:VALUE" in err
    assert not (tmp_path / "artifacts").exists()  # refused before anything was created


@pytest.mark.parametrize("ref, match", [(".", "is a directory"), ("memory://nothing/here", "cannot be read"),
                                        ("file:///nonexistent/x", "cannot be read"), ("local:runs/missing.gart", "KIND:OBJECT_ID"),
                                        ("managed_fsspec:local:runs/missing.gart", "managed_fsspec"),
                                        ("/dev/zero", "larger than the largest valid artifact")])
def test_inspect_clean_errors(tmp_path, capsys, monkeypatch, ref, match):
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", ref]) == 2
    assert match in capsys.readouterr().err


def test_inspect_escapes_control_characters(tmp_path, capsys):
    import numpy as np
    from genartifact import format as fmt

    inp = fmt.ArtifactInput(np.arange(3, dtype=np.uint32), 2, ["selected_logprobs"],
                            {"selected_logprobs": {"token_start": 2}},
                            [fmt.TensorPart("selected_logprobs.logprobs", np.array([-1.0], np.float32))],
                            header={"model": {"name": "\x1b[31mevil\r\x1b[2Kfake line"}})
    p = tmp_path / "a.gart"
    p.write_bytes(fmt.encode(inp).data)
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\\x1b[31mevil" in out


def test_verify_receipts_counts_bad_lines(tmp_path, capsys):
    r = tmp_path / "r.jsonl"
    r.write_text('not json\n[1]\n{"state": "ready"}\n{"state": "ready", "object_id": "/nope", "sha256": "x"}\n')
    assert main(["verify", "--receipts", str(r)]) == 1
    out = capsys.readouterr().out
    assert "0/4 receipts verified" in out


def test_verify_receipts_cuts_hostile_long_fields(tmp_path, capsys):
    r = tmp_path / "r.jsonl"
    r.write_text(json.dumps({"state": "ready", "target": "managed_fsspec", "object_id": "local:runs/" + "k" * 5000,
                             "sha256": "a" * 64}) + "\n")
    assert main(["verify", "--receipts", str(r)]) == 1
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).splitlines()
    assert lines and max(map(len, lines)) < 1400 and any("k..." in x for x in lines), lines


def test_verify_receipts_after_resume_the_last_line_of_an_index_wins(tmp_path, capsys):
    """``generate --resume`` appends: an index's earlier receipt is superseded by its later one, not a failure."""
    from genartifact import format as fmt

    data = fmt.encode(fmt.ArtifactInput(np.arange(4, dtype=np.uint32), 2, [], {}, [])).data
    (tmp_path / "o.gart").write_bytes(data)
    import hashlib

    ready = {"index": 0, "state": "ready", "target": "managed_fsspec", "object_id": "local:o.gart",
             "sha256": hashlib.sha256(data).hexdigest(), "byte_count": len(data)}
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[plugins]\ncontents = []\ntargets = ["managed_fsspec"]\n'
                   f'[targets.managed_fsspec.profiles.local]\nurl = "{tmp_path}"\nallowed_prefixes = [""]\n')
    r = tmp_path / "r.jsonl"
    r.write_text(json.dumps({"index": 0, "state": "failed", "error_code": "interrupted"}) + "\n"
                 + json.dumps({"index": 1, "state": "rejected", "error_code": "request_invalid"}) + "\n"
                 + json.dumps(ready) + "\n")
    assert main(["verify", "--receipts", str(r), "--config", str(cfg)]) == 1  # index 1 is still not ready
    out = capsys.readouterr().out
    assert "#0: superseded by line 3" in out and "1/2 receipts verified" in out


def test_verify_sha_format_and_decode_only(tmp_path, capsys):
    import numpy as np
    from genartifact import format as fmt

    p = tmp_path / "a.gart"
    inp = fmt.ArtifactInput(np.arange(2, dtype=np.uint32), 2, ["selected_logprobs"],
                            {"selected_logprobs": {"token_start": 2}},
                            [fmt.TensorPart("selected_logprobs.logprobs", np.zeros(0, np.float32))])
    p.write_bytes(fmt.encode(inp).data)
    assert main(["verify", str(p)]) == 0
    assert main(["verify", str(p), "--sha256", " abc"]) == 2
    assert "64 hexadecimal" in capsys.readouterr().err


def test_make_tiny_model_refuses_existing(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["make-tiny-model", str(f)]) == 2
    assert "pass --force" in capsys.readouterr().err


@pytest.mark.parametrize("n", ["4", 1e9, None, [3], 2**63, 10**9, -1, 0, True],
                         ids=["str", "float", "null", "list", "2^63", "1e9-int", "neg", "zero", "bool"])
@pytest.mark.fault("generate", "hostile n in rows given through the API")
def test_run_generate_api_rows_with_hostile_n_are_rejected_not_crashed(tmp_path, n):
    """Rows handed to run_generate directly (not read from a file) are checked like file rows: a bad "n" is
    a rejected receipt naming the field, never a TypeError for the whole run nor a 2**63-long sample list."""
    cfg = config_mod.parse(config_mod.DEFAULT_TOML, source="d", base_dir=tmp_path)
    rows = [{"prompt": "x", "n": n}, {"prompt": "y", "bogus": 1}, {"prompt": "z", "n": 2, "contents": ["moe_route"]}]
    t0 = time.monotonic()
    receipts = asyncio.run(run_generate(model="/nonexistent", prompts=rows, cfg=cfg, contents=["selected_logprobs"],
                                        target="managed_fsspec:local", max_tokens=4, run_id="r", engine_kwargs={},
                                        progress=False))
    assert time.monotonic() - t0 < 5  # no engine start, no huge sample list
    assert [(r["index"], r["state"], r["error_code"]) for r in receipts] == [(i, "rejected", "request_invalid")
                                                                            for i in range(3)]
    assert receipts[0]["error"].startswith("row 0: n=") and "allowed: an integer 1..256" in receipts[0]["error"]
    assert "unknown key(s) ['bogus']" in receipts[1]["error"]
    assert "did you mean 'moe_routes'" in receipts[2]["error"]
    assert not (tmp_path / "artifacts").exists()
