"""Delivery journal and `genartifact reconcile`: a process killed between upload and receipt leaves an
object nobody was told about; reconcile lists it and deletes it (only if the bytes are ours)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from genartifact.cli import main
from genartifact.journal import DeliveryJournal

CRASHER = textwrap.dedent('''
    import asyncio, os, sys
    from genartifact.host import PluginHost
    from genartifact.journal import DeliveryJournal
    from genartifact.session import ArtifactSession
    from genartifact.spec import parse_request
    from genartifact.types import Delta, ModelInfo
    import genartifact_fsspec_target as ft

    root, journal = sys.argv[1], sys.argv[2]
    orig = ft.ManagedFsspecTarget.deliver

    async def deliver_then_die(self, target, data, sha256):
        await orig(self, target, data, sha256)
        os._exit(9)  # worker crash after the upload, before any receipt

    ft.ManagedFsspecTarget.deliver = deliver_then_die
    host = PluginHost({"contents": ["selected_logprobs"], "targets": ["managed_fsspec"]})
    spec = {"format": "generation_artifact_v1", "contents": ["selected_logprobs"], "delivery": {"mode": "object_store",
            "target": {"kind": "managed_fsspec", "profile": "local", "object_key": "runs/crash.gart"}}}
    settings = {"managed_fsspec": {"profiles": {"local": {"url": root, "allowed_prefixes": ["runs/"]}}}}
    s = ArtifactSession.for_request(host, parse_request(spec), ModelInfo("m", {}), settings, DeliveryJournal(journal))
    s.admit(1, 1)
    s.record(Delta([1], [2], [{2: -1.0}], finished=True))
    asyncio.run(s.finalize())
''')


@pytest.mark.fault("journal", "crash after upload, before the outcome")
def test_crash_leaves_orphan_that_reconcile_lists_and_deletes(tmp_path, capsys):
    root, journal = tmp_path / "store", tmp_path / "journal.jsonl"
    proc = subprocess.run([sys.executable, "-c", CRASHER, str(root), str(journal)], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert (root / "runs/crash.gart").exists()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[plugins]\ntargets = ["managed_fsspec"]\n[targets.managed_fsspec.profiles.local]\n'
                   f'url = "{root}"\nallowed_prefixes = ["runs/"]\n[journal]\npath = "{journal}"\n')
    assert main(["reconcile", "--config", str(cfg), "--json"]) == 0  # default age guard: still in flight
    rows = json.loads(capsys.readouterr().out)["deliveries"]
    assert [(r["status"], r["object_id"]) for r in rows] == [("in_flight", "local:runs/crash.gart")]
    assert main(["reconcile", "--config", str(cfg), "--delete", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deliveries"][0]["status"] == "in_flight"
    assert (root / "runs/crash.gart").exists()  # the age guard protects an upload that may still be running
    assert main(["reconcile", "--config", str(cfg), "--json", "--older-than", "0"]) == 0
    rows = json.loads(capsys.readouterr().out)["deliveries"]
    assert [(r["status"], r["object_id"], r["last_state"]) for r in rows] == [("orphan", "local:runs/crash.gart", None)]
    assert main(["reconcile", "--config", str(cfg), "--delete", "--json", "--older-than", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["deliveries"][0]["status"] == "deleted"
    assert not (root / "runs/crash.gart").exists()
    assert main(["reconcile", "--config", str(cfg), "--json", "--older-than", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["deliveries"] == []


@pytest.mark.fault("journal", "foreign bytes at a journaled key")
def test_foreign_object_is_never_deleted(tmp_path, capsys):
    root, jpath = tmp_path / "store", tmp_path / "j.jsonl"
    (root / "runs").mkdir(parents=True)
    (root / "runs/x.gart").write_bytes(b"someone else's bytes")
    j = DeliveryJournal(jpath)
    did = j.intent(kind="managed_fsspec", object_id="local:runs/x.gart", ref={"profile": "local", "key": "runs/x.gart"},
                   sha256="0" * 64, byte_count=3)
    j.outcome(did, "failed", "object_exists")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[targets.managed_fsspec.profiles.local]\nurl = "{root}"\nallowed_prefixes = ["runs/"]\n'
                   f'[journal]\npath = "{jpath}"\n')
    assert main(["reconcile", "--config", str(cfg), "--delete", "--json", "--older-than", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["deliveries"] == []  # object_exists: nothing of ours was stored
    did = j.intent(kind="managed_fsspec", object_id="local:runs/x.gart", ref={"profile": "local", "key": "runs/x.gart"},
                   sha256="0" * 64, byte_count=3)  # a crash: no outcome at all
    assert main(["reconcile", "--config", str(cfg), "--delete", "--json", "--older-than", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["deliveries"][0]["status"] == "foreign"
    assert (root / "runs/x.gart").read_bytes() == b"someone else's bytes"


@pytest.mark.fault("journal", "torn last journal line")
def test_journal_never_holds_secrets_and_survives_torn_last_line(tmp_path):
    j = DeliveryJournal(tmp_path / "j.jsonl")
    j.intent(kind="presigned_http_put", object_id="caller-id", ref={"host": "bucket.example.com"}, sha256="a" * 64,
             byte_count=1)
    with open(tmp_path / "j.jsonl", "a") as f:
        f.write('{"event": "outc')  # crash mid-append
    (row,) = j.unresolved()
    with open(tmp_path / "j.jsonl", "a") as f:
        f.write("\n\n")  # blank lines after the torn one: it is still the last record
    (row,) = j.unresolved()
    assert row["ref"] == {"host": "bucket.example.com"} and row["last_state"] is None


@pytest.mark.fault("journal", "a full disk mid-append, then more appends")
def test_a_failed_append_leaves_no_torn_line_and_a_torn_tail_is_cut_off(tmp_path, monkeypatch):
    """An append that fails or comes up short (ENOSPC) is cut back off; a torn tail left by a writer that died
    mid-line is cut off before the next record, which starts on its own line: the journal stays readable (a
    record glued to a torn line read as "not JSON" and stopped every later reconcile and resume)."""

    from genartifact import journal as jmod

    path = tmp_path / "j.jsonl"
    j = DeliveryJournal(path)
    first = j.intent(kind="k", object_id="o1", ref={}, sha256="a" * 64, byte_count=1)
    before = path.read_bytes()
    real_write = jmod._write

    def short(fd, data):  # the disk fills mid-record
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(jmod, "_write", short)
    with pytest.raises(OSError):
        j.intent(kind="k", object_id="o2", ref={}, sha256="b" * 64, byte_count=1)

    def enospc(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jmod, "_write", enospc)
    with pytest.raises(OSError):
        j.outcome(first, "ready")
    monkeypatch.setattr(jmod, "_write", real_write)
    assert path.read_bytes() == before  # nothing of either record stayed
    with open(path, "ab") as f:
        f.write(b'{"byte_count":798,"event":"intent","sha256":')  # a writer that died mid-line
    j.outcome(first, "ready")
    second = j.intent(kind="k", object_id="o3", ref={}, sha256="c" * 64, byte_count=1)
    assert path.read_bytes().count(b"\n") == 3 and b"798" not in path.read_bytes()
    assert [(d["id"], d["last_state"]) for d in j.deliveries()] == [(first, "ready"), (second, None)]
    path.write_bytes(b'{"torn')  # a single torn line: the file is cut to nothing before the record
    j.intent(kind="k", object_id="o4", ref={}, sha256="d" * 64, byte_count=1)
    assert [d["object_id"] for d in j.deliveries()] == ["o4"]


def _cfg(tmp_path, root, jpath):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[targets.managed_fsspec.profiles.local]\nurl = "{root}"\nallowed_prefixes = ["runs/"]\n'
                   f'[journal]\npath = "{jpath}"\n')
    return str(cfg)


def _store(root, key, data):
    import hashlib

    (root / key).parent.mkdir(parents=True, exist_ok=True)
    (root / key).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _reconcile(capsys, cfg, *extra):
    assert main(["reconcile", "--config", cfg, "--json", "--older-than", "0", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.fault("journal", "duplicate request with the same object key")
def test_duplicate_request_never_deletes_the_first_ready_object(tmp_path, capsys):
    """Issue 10 case 1: two identical requests -> first ready, second object_exists; reconcile --delete must
    keep the first request's object (identical bytes)."""
    root, jpath = tmp_path / "store", tmp_path / "j.jsonl"
    sha = _store(root, "runs/same.gart", b"identical artifact bytes")
    j = DeliveryJournal(jpath)
    ref = {"profile": "local", "key": "runs/same.gart"}
    first = j.intent(kind="managed_fsspec", object_id="local:runs/same.gart", ref=ref, sha256=sha, byte_count=24)
    second = j.intent(kind="managed_fsspec", object_id="local:runs/same.gart", ref=ref, sha256=sha, byte_count=24)
    assert first != second  # each delivery has its own id
    j.outcome(first, "ready")
    j.outcome(second, "failed", "object_exists")
    cfg = _cfg(tmp_path, root, jpath)
    assert _reconcile(capsys, cfg, "--delete")["deliveries"] == []
    assert (root / "runs/same.gart").exists()
    # the second one crashed instead (no outcome): still vouched by the first's ready outcome
    third = j.intent(kind="managed_fsspec", object_id="local:runs/same.gart", ref=ref, sha256=sha, byte_count=24)
    out = _reconcile(capsys, cfg, "--delete")["deliveries"]
    assert [(r["id"], r["status"]) for r in out] == [(third, "vouched")]
    assert (root / "runs/same.gart").exists()
    assert _reconcile(capsys, cfg)["deliveries"] == []  # verdict journaled


@pytest.mark.fault("journal", "re-run with the same run id")
def test_rerun_with_same_run_id_keeps_earlier_runs_objects(tmp_path, capsys):
    """A re-run journal (earlier run ready, re-run failed with timeout = ambiguous) plus a ready receipt file
    from a run whose journal was lost: nothing vouched for is an orphan."""
    root, jpath = tmp_path / "store", tmp_path / "j.jsonl"
    j = DeliveryJournal(jpath)
    shas = {}
    for i in range(3):
        key = f"runs/r/{i:04d}.gart"
        shas[i] = _store(root, key, b"row %d" % i)
        ref = {"profile": "local", "key": key}
        if i < 2:  # journaled ready in run 1
            j.outcome(j.intent(kind="managed_fsspec", object_id=f"local:{key}", ref=ref, sha256=shas[i],
                               byte_count=5), "ready")
        j.outcome(j.intent(kind="managed_fsspec", object_id=f"local:{key}", ref=ref, sha256=shas[i], byte_count=5),
                  "failed", "timeout")  # run 2: ambiguous failure
    receipts = tmp_path / "receipts.jsonl"
    receipts.write_text(json.dumps({"row": 2, "generation_artifact": {"state": "ready", "object_id":
                                    "local:runs/r/0002.gart", "sha256": shas[2]}}) + "\n")
    cfg = _cfg(tmp_path, root, jpath)
    out = _reconcile(capsys, cfg, "--delete", "--receipts", str(receipts))["deliveries"]
    assert sorted(r["status"] for r in out) == ["vouched"] * 3
    assert all((root / f"runs/r/{i:04d}.gart").exists() for i in range(3))


@pytest.mark.fault("journal", "upload still in flight during reconcile")
def test_age_guard_keeps_in_flight_upload(tmp_path, capsys):
    root, jpath = tmp_path / "store", tmp_path / "j.jsonl"
    j = DeliveryJournal(jpath)
    j.intent(kind="managed_fsspec", object_id="local:runs/slow.gart", ref={}, sha256="1" * 64, byte_count=3)
    cfg = _cfg(tmp_path, root, jpath)
    assert main(["reconcile", "--config", cfg, "--json", "--delete"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["deliveries"]
    assert row["status"] == "in_flight"  # not "absent": it may land any second
    sha = _store(root, "runs/slow.gart", b"abc")  # ... and it lands
    assert sha != "1" * 64
    assert main(["reconcile", "--config", cfg, "--older-than", "-1"]) == 2  # bad guard value: error, exit 2


def test_outcome_for_every_intent_and_ambiguous_codes(tmp_path):
    from genartifact.journal import NOT_STORED_CODES

    j = DeliveryJournal(tmp_path / "j.jsonl")
    ids = {code: j.intent(kind="k", object_id=code, ref={}, sha256="0" * 64, byte_count=1)
           for code in ("object_exists", "expired", "timeout", "delivery_failed")}
    for code, did in ids.items():
        j.outcome(did, "failed", code)
    crashed = j.intent(kind="k", object_id="crashed", ref={}, sha256="0" * 64, byte_count=1)
    interrupted = j.intent(kind="k", object_id="cancelled", ref={}, sha256="0" * 64, byte_count=1)
    j.outcome(interrupted, "interrupted")
    left = {d["object_id"] for d in j.unresolved()}
    assert left == {"timeout", "delivery_failed", "crashed", "cancelled"}
    assert {"object_exists", "expired"} <= NOT_STORED_CODES and crashed


@pytest.mark.fault("journal", "crash temp files seen by reconcile")
def test_reconcile_reports_and_removes_crash_temp_files(tmp_path, capsys):
    import os

    root, jpath = tmp_path / "store", tmp_path / "j.jsonl"
    (root / "runs").mkdir(parents=True)
    tmp = root / "runs/.genartifact-tmp-crashed"
    tmp.write_bytes(b"half an artifact")
    os.utime(tmp, (1, 1))
    cfg = _cfg(tmp_path, root, jpath)
    out = _reconcile(capsys, cfg)
    assert [(x["status"], x["path"]) for x in out["leftovers"]] == [("leftover", str(tmp))]
    assert tmp.exists()
    out = _reconcile(capsys, cfg, "--delete")
    assert [x["status"] for x in out["leftovers"]] == ["removed"] and not tmp.exists()


@pytest.mark.fault("journal", "an object key named like the target's temp files")
def test_temp_like_keys_are_refused_and_a_vouched_one_is_never_removed(tmp_path, capsys):
    """`reconcile --delete` removes `.genartifact-tmp-*` files as crash leftovers: such a key is refused at
    validation, and an object stored under one before (a ready receipt vouches for it) is reported and kept."""
    import os

    from genartifact.errors import TargetError
    from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles

    root, jpath = tmp_path / "store", tmp_path / "j.jsonl"
    t = ManagedFsspecTarget(parse_profiles({"profiles": {"local": {"url": str(root), "allowed_prefixes": ["runs/"]}}}))
    for key in ("runs/.genartifact-tmp-victim.gart", "runs/.genartifact-tmp-d/x.gart"):
        with pytest.raises(TargetError, match="reserved for the target's temp files"):
            t.validate({"kind": "managed_fsspec", "profile": "local", "object_key": key})
    t.validate({"kind": "managed_fsspec", "profile": "local", "object_key": "runs/.genartifact-tm.gart"})
    sha = _store(root, "runs/.genartifact-tmp-victim.gart", b"a stored artifact")
    os.utime(root / "runs/.genartifact-tmp-victim.gart", (1, 1))
    receipts = tmp_path / "r.jsonl"
    receipts.write_text(json.dumps({"state": "ready", "object_id": "local:runs/.genartifact-tmp-victim.gart",
                                    "sha256": sha}) + "\n")
    cfg = _cfg(tmp_path, root, jpath)
    out = _reconcile(capsys, cfg, "--delete", "--receipts", str(receipts))
    assert [x["status"] for x in out["leftovers"]] == ["vouched"]
    assert (root / "runs/.genartifact-tmp-victim.gart").read_bytes() == b"a stored artifact"
    out = _reconcile(capsys, cfg, "--delete")  # without the receipt nothing vouches for it: a leftover
    assert [x["status"] for x in out["leftovers"]] == ["removed"]


@pytest.mark.fault("journal", "presigned delivery that cannot be read back")
def test_presigned_deliveries_are_unverifiable_not_deleted(tmp_path, capsys):
    jpath = tmp_path / "j.jsonl"
    j = DeliveryJournal(jpath)
    j.intent(kind="presigned_http_put", object_id="caller-id", ref={"host": "b.example.com"}, sha256="a" * 64,
             byte_count=1)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[targets.presigned_http_put]\nallowed_hosts = ["b.example.com"]\n[journal]\npath = "{jpath}"\n')
    out = _reconcile(capsys, str(cfg), "--delete")["deliveries"]
    assert [r["status"] for r in out] == ["unverifiable"]


@pytest.mark.fault("journal", "malformed journal lines")
def test_journal_line_rules(tmp_path):
    """A malformed line that is not the last is an error naming it; unknown events are ignored; the file is
    private (0600); only ready receipts with an id and a digest vouch."""
    import os
    import stat

    import pytest
    from genartifact.errors import ConfigError
    from genartifact.journal import vouchers

    j = DeliveryJournal(tmp_path / "j.jsonl")
    did = j.intent(kind="k", object_id="o", ref={}, sha256="a" * 64, byte_count=1)
    assert stat.S_IMODE(os.stat(tmp_path / "j.jsonl").st_mode) == 0o600
    with open(tmp_path / "j.jsonl", "a") as f:
        f.write(json.dumps({"event": "note", "id": did, "state": "ready"}) + "\n")
    (d,) = j.deliveries()
    assert d["last_state"] is None and d["kind"] == "k" and d["object_id"] == "o"  # neither outcome nor intent
    with open(tmp_path / "j.jsonl", "a") as f:
        f.write("{torn\n")
    j.outcome(did, "ready")
    with pytest.raises(ConfigError, match=r"j.jsonl:3 is not JSON"):
        j.deliveries()
    v = vouchers([], [{"state": "failed", "object_id": "o", "sha256": "b" * 64},
                      {"state": "ready", "object_id": "o"}, {"state": "ready", "sha256": "c" * 64},
                      {"state": "ready", "object_id": "o", "sha256": "d" * 64}])
    assert v == {"o": {"d" * 64}}
    assert vouchers([{"last_state": "failed", "object_id": "o", "sha256": "e" * 64},
                     {"last_state": "ready", "object_id": "p", "sha256": "f" * 64}]) == {"p": {"f" * 64}}
