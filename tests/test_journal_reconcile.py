"""Delivery journal and `genartifact reconcile`: a process killed between upload and receipt leaves an
object nobody was told about; reconcile lists it and deletes it (only if the bytes are ours)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

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


def test_crash_leaves_orphan_that_reconcile_lists_and_deletes(tmp_path, capsys):
    root, journal = tmp_path / "store", tmp_path / "journal.jsonl"
    proc = subprocess.run([sys.executable, "-c", CRASHER, str(root), str(journal)], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert (root / "runs/crash.gart").exists()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[plugins]\ntargets = ["managed_fsspec"]\n[targets.managed_fsspec.profiles.local]\n'
                   f'url = "{root}"\nallowed_prefixes = ["runs/"]\n[journal]\npath = "{journal}"\n')
    assert main(["reconcile", "--config", str(cfg), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["status"], r["object_id"], r["last_state"]) for r in rows] == [("orphan", "local:runs/crash.gart", None)]
    assert main(["reconcile", "--config", str(cfg), "--delete", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["status"] == "deleted"
    assert not (root / "runs/crash.gart").exists()
    assert main(["reconcile", "--config", str(cfg), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


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
    assert main(["reconcile", "--config", str(cfg), "--delete", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["status"] == "foreign"
    assert (root / "runs/x.gart").read_bytes() == b"someone else's bytes"


def test_journal_never_holds_secrets_and_survives_torn_last_line(tmp_path):
    j = DeliveryJournal(tmp_path / "j.jsonl")
    j.intent(kind="presigned_http_put", object_id="caller-id", ref={"host": "bucket.example.com"}, sha256="a" * 64,
             byte_count=1)
    with open(tmp_path / "j.jsonl", "a") as f:
        f.write('{"event": "outc')  # crash mid-append
    (row,) = j.unresolved()
    assert row["ref"] == {"host": "bucket.example.com"} and row["last_state"] is None
