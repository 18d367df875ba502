"""`genartifact generate` never loses a receipt: bad rows, per-request receipts, SIGINT drain, --resume with
read-back recognition, SIGTERM during engine start-up, disk-full receipts (issue 10 cases 4, 5, 9, 10)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from genartifact import config as config_mod
from genartifact.engine.job import ReceiptsWriter, read_prompt_rows, read_receipts, run_generate
from genartifact.errors import RequestSpecError


@pytest.mark.fault("generate", "U+2028 / U+0085 inside a JSON string")
def test_jsonl_is_split_on_newline_only(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "a\u2028b"}, {"prompt": "c\u0085d\u2029e\x1cf\x1dg\x1eh\x0bi\x0cj"}, {"prompt": "crlf"}]
    f.write_bytes((json.dumps(rows[0], ensure_ascii=False) + "\n" + json.dumps(rows[1], ensure_ascii=False)
                   + "\n" + json.dumps(rows[2]) + "\r\n\n").encode())
    assert read_prompt_rows(f) == rows


@pytest.mark.fault("generate", "bad prompt rows among good ones")
def test_bad_rows_become_errors_and_the_rest_stay(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\nnot json\n{"prompt": "\xff"}\n{"prompt": "x", "colour": 1}\n'
                  b'{"prompt": "x", "max_tokens": 0}\n' + b"[" * 100000 + b"\n{\"prompt\": \"last\"}\n")
    rows = read_prompt_rows(f)
    assert rows[0] == {"prompt": "ok"} and rows[-1] == {"prompt": "last"}
    errs = [str(r) for r in rows[1:-1]]
    assert all(isinstance(r, RequestSpecError) for r in rows[1:-1])
    assert ":2: not JSON" in errs[0] and ":3: not UTF-8" in errs[1] and "colour" in errs[2]
    assert "max_tokens=0" in errs[3] and ":6: not JSON" in errs[4]


@pytest.mark.fault("generate", "every row bad: rejected receipts, no engine")
def test_bad_rows_get_rejected_receipts_without_engine(tmp_path):
    cfg = config_mod.parse(config_mod.DEFAULT_TOML, source="d", base_dir=tmp_path)
    f = tmp_path / "p.jsonl"
    f.write_text('not json\n{"prompt": "b", "contents": ["nope"]}\n')
    out = tmp_path / "r.jsonl"
    w = ReceiptsWriter(out)
    receipts = __import__("asyncio").run(run_generate(
        model="/nonexistent", prompts=read_prompt_rows(f), cfg=cfg, contents=["selected_logprobs"],
        target="managed_fsspec:local", max_tokens=4, run_id="r", engine_kwargs={}, progress=False, writer=w))
    w.close()
    assert [(r["index"], r["state"], r["error_code"]) for r in receipts] == [(0, "rejected", "request_invalid"),
                                                                            (1, "rejected", "request_invalid")]
    assert [json.loads(x)["index"] for x in out.read_text().splitlines()] == [0, 1]  # written as they were known


@pytest.mark.fault("generate", "existing receipts file without --resume")
def test_receipts_writer_create_only_and_resume(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text("precious\n")
    with pytest.raises(RequestSpecError, match="already exists"):
        ReceiptsWriter(out)
    assert out.read_text() == "precious\n"
    with pytest.raises(RequestSpecError, match="does not exist"):
        ReceiptsWriter(tmp_path / "missing.jsonl", resume=True)


@pytest.mark.fault("disk", "ENOSPC half-way through a receipt line")
def test_disk_full_keeps_every_other_receipt_and_names_the_lost_ones(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.jsonl"
    w = ReceiptsWriter(out)
    real_write = os.write
    calls = {"n": 0}

    def flaky(fd, data):
        calls["n"] += 1
        if calls["n"] == 2:  # the disk fills up half-way through the second line
            real_write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", flaky)
    ready = {"index": 1, "state": "ready", "object_id": "local:runs/x/00001.gart", "sha256": "ab" * 32,
             "byte_count": 10}
    assert w.write({"index": 0, "state": "ready"}) is True
    assert w.write(ready) is False
    assert w.write({"index": 2, "state": "failed", "error_code": "timeout"}) is True
    w.close()
    monkeypatch.setattr(os, "write", real_write)
    lines = out.read_text().splitlines()
    assert [json.loads(x)["index"] for x in lines] == [0, 2]  # no torn line, later receipts still written
    w.report_unwritten()
    err = capsys.readouterr().err
    assert "local:runs/x/00001.gart is stored" in err and "ab" * 32 in err
    assert [p.name for p in tmp_path.iterdir()] == ["r.jsonl"]  # no temp files


@pytest.mark.fault("generate", "torn last receipts line")
def test_read_receipts_last_wins_and_torn_tail(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text('{"index": 0, "state": "failed"}\n{"index": 1, "state": "ready"}\n{"index": 0, "state": "ready"}\n'
                 '{"index": 2, "sta')
    got = read_receipts(f)
    assert {i: r["state"] for i, r in got.items()} == {0: "ready", 1: "ready"}


@pytest.mark.fault("generate", "receipts line nested past the recursion limit")
def test_read_receipts_line_nested_too_deeply(tmp_path):
    """A damaged receipts line nested past the recursion limit is a RequestSpecError naming the line (was an
    unexpected RecursionError); as the last line it is a torn tail, ignored."""
    f = tmp_path / "r.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    f.write_text(f'{deep}\n{{"index": 1, "state": "ready"}}\n')
    with pytest.raises(RequestSpecError, match="line 1 is not JSON"):
        read_receipts(f)
    f.write_text(f'{{"index": 1, "state": "ready"}}\n{deep}')
    assert list(read_receipts(f)) == [1]


# ---------------------------------------------------------------- real engine

def _cfg(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[plugins]\ncontents = ["moe_routes", "selected_logprobs"]\ntargets = ["managed_fsspec"]\n'
                   f'[targets.managed_fsspec.profiles.local]\nurl = "{tmp_path}/store"\nallowed_prefixes = ["runs/"]\n'
                   f'[journal]\npath = "{tmp_path}/journal.jsonl"\n')
    return cfg


def _cmd(model, cfg, prompts, *extra):
    return [sys.executable, "-m", "genartifact.cli", "generate", "--model", str(model), "--config", str(cfg),
            "--prompts", str(prompts), *extra]


def _receipts(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.engine
@pytest.mark.fault("generate", "SIGINT mid-run, then --resume")
def test_sigint_drains_writes_every_receipt_and_resume_completes(qwen_model, tmp_path):
    cfg = _cfg(tmp_path)
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"short {i}", "max_tokens": 2} for i in range(3)]
    rows += [{"prompt": f"long {i}", "max_tokens": 1900} for i in range(3)]
    rows.insert(2, {"prompt": "bad", "max_tokens": "many"})  # README: a bad row gets a rejected receipt
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "receipts.jsonl"
    proc = subprocess.Popen(_cmd(qwen_model, cfg, prompts, "--out", str(out), "--run-id", "sig"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and len(_receipts(out)) >= 4:  # rejected row + 3 short ones: appended as they ended
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    log = proc.communicate(timeout=90)[0].decode()
    assert proc.returncode == 130, log[-3000:]
    assert time.time() - t0 < 60
    got = {r["index"]: r for r in _receipts(out)}
    assert sorted(got) == list(range(7))  # every row has a receipt
    assert got[2]["state"] == "rejected" and got[2]["error_code"] == "request_invalid"
    assert all(got[i]["state"] == "ready" for i in (0, 1, 3))
    # the long rows were generating at SIGINT; one may still have ended first (the tiny model can emit EOS
    # early), so each is interrupted or ready, and at least one was interrupted
    assert all(got[i]["state"] == "ready" or got[i]["error_code"] == "interrupted" for i in (4, 5, 6))
    assert any(got[i].get("error_code") == "interrupted" for i in (4, 5, 6))
    assert "--resume" in log
    assert not [p for p in (tmp_path / "store").rglob(".genartifact-tmp-*")]
    # resume: only the interrupted rows run again; nothing fails with object_exists
    r2 = subprocess.run(_cmd(qwen_model, cfg, prompts, "--out", str(out), "--run-id", "sig", "--resume"),
                        capture_output=True, text=True, cwd=tmp_path, timeout=400)
    final = read_receipts(out)
    assert r2.returncode == 1, r2.stderr[-2000:]  # the bad row stays rejected
    assert [final[i]["state"] for i in range(7)] == ["ready"] * 2 + ["rejected"] + ["ready"] * 4
    # a crash after upload, before the receipt: drop two ready receipts; --resume recognises the stored
    # objects by read-back against the journaled SHA-256 (no engine start, no object_exists)
    keep = [r for r in _receipts(out) if r["index"] not in (0, 5)]
    out.write_text("".join(json.dumps(r) + "\n" for r in keep))
    t0 = time.time()
    r3 = subprocess.run(_cmd(qwen_model, cfg, prompts, "--out", str(out), "--run-id", "sig", "--resume"),
                        capture_output=True, text=True, cwd=tmp_path, timeout=400)
    final = read_receipts(out)
    assert [final[i]["state"] for i in range(7)] == ["ready"] * 2 + ["rejected"] + ["ready"] * 4, r3.stderr[-2000:]
    assert final[0].get("recovered") == "read_back" and final[5].get("recovered") == "read_back"
    assert final[0]["sha256"] == got[0]["sha256"]
    assert time.time() - t0 < 20  # recovered without starting the engine
    v = subprocess.run([sys.executable, "-m", "genartifact.cli", "verify", "--config", str(cfg), "--receipts", str(out)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert v.returncode in (0, 1) and "verified" in v.stdout


@pytest.mark.engine
@pytest.mark.fault("generate", "SIGTERM during engine start-up")
def test_sigterm_during_engine_startup_is_prompt(qwen_model, tmp_path):
    import psutil

    cfg = _cfg(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "receipts.jsonl"
    proc = subprocess.Popen(_cmd(qwen_model, cfg, prompts, "--out", str(out)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=tmp_path)
    me = psutil.Process(proc.pid)
    deadline = time.time() + 120
    while time.time() < deadline and not me.children(recursive=True):  # engine core process spawned
        time.sleep(0.1)
    time.sleep(1.0)
    kids = me.children(recursive=True)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=60)[0].decode()
    took = time.time() - t0
    assert proc.returncode == 143, log[-3000:]
    assert took < 10, f"SIGTERM during start-up took {took:.1f} s"
    assert [r["error_code"] for r in _receipts(out)] == ["interrupted", "interrupted"]
    gone, alive = psutil.wait_procs(kids, timeout=15)
    assert not alive, f"engine processes left behind: {alive}"


@pytest.mark.engine
@pytest.mark.fault("serve", "SIGTERM during serve start-up")
def test_serve_sigterm_during_engine_startup_is_prompt(qwen_model, tmp_path):
    import psutil

    cfg = _cfg(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "genartifact.cli", "serve", "--model", str(qwen_model), "--config",
                             str(cfg), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    me = psutil.Process(proc.pid)
    deadline = time.time() + 120
    while time.time() < deadline and not me.children(recursive=True):
        time.sleep(0.1)
    time.sleep(1.0)
    kids = me.children(recursive=True)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=60)[0].decode()
    took = time.time() - t0
    assert proc.returncode == 143, log[-3000:]
    assert took < 10, f"SIGTERM during serve start-up took {took:.1f} s"
    assert "stopped by SIGTERM during engine start-up" in log
    gone, alive = psutil.wait_procs(kids, timeout=15)
    assert not alive, f"engine processes left behind: {alive}"
