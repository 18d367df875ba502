"""Findings of a third-party plugin author (issue 9 follow-up), one test per kind of defect: the kit configures
plugins exactly as the CLI does (base_dir, keyed settings), the embedded default and README agree, global
options before the subcommand, one over-admission rule (tensors + section), ``plugins --check`` builds content
producers too, ``inspect`` isolates reader faults, and the conformance suites' diagnostics and new checks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from genartifact import cli
from genartifact.config import DEFAULT_TOML, Config, parse
from genartifact.errors import ConfigError, PluginFault
from genartifact.format import TensorPart
from genartifact.testing import hookimpl, make_host, run_session

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))  # the sibling test module's well-behaved Echo content


class Spy:
    """A content + target plugin that records the settings its factories receive."""

    def __init__(self, seen):
        self.seen = seen

    @hookimpl
    def genartifact_content_producer(self, name, model, settings):
        self.seen["content"] = dict(settings)
        return None

    @hookimpl
    def genartifact_storage_target(self, kind, settings):
        if kind != "spy_target":
            return None
        self.seen["target"] = dict(settings)
        return None


def kit_and_cli_settings(tmp_path, **kit):
    seen: dict = {}
    host = make_host(contents={"spy": Spy(seen)}, targets={"spy_target": Spy(seen)}, base_dir=tmp_path, **kit)
    host.hooks.content_producer(name="spy", model=None, settings=host.content_settings["spy"])
    host.hooks.storage_target(kind="spy_target", settings=host.target_settings["spy_target"])
    return seen


# ------------------------------------------------------------------------------------------ 1, 2: kit = CLI
def test_kit_hands_factories_the_same_settings_as_the_cli_base_dir_included(tmp_path):
    cfg = parse('[plugins]\ncontents = ["spy"]\ntargets = ["spy_target"]\n[contents.spy]\nx = 1\n'
                '[targets.spy_target]\ndir = "out"\n', source="t", base_dir=tmp_path)
    kit = kit_and_cli_settings(tmp_path, content_settings={"spy": {"x": 1}},
                               target_settings={"spy_target": {"dir": "out"}})
    assert kit["content"] == cfg.content_settings()["spy"] == {"x": 1, "base_dir": str(tmp_path)}
    assert kit["target"] == cfg.target_settings()["spy_target"] == {"dir": "out", "base_dir": str(tmp_path)}
    # no tables at all: base_dir still arrives, as the hookspec promises
    bare = kit_and_cli_settings(tmp_path)
    assert bare == {"content": {"base_dir": str(tmp_path)}, "target": {"base_dir": str(tmp_path)}}


def test_run_session_target_settings_reach_the_factory_keyed_by_kind_with_base_dir(tmp_path):
    from genartifact.testing import MemoryTarget

    seen = {}

    class Mem:
        @hookimpl
        def genartifact_storage_target(self, kind, settings):
            if kind != "mem2":
                return None
            seen.update(settings)
            t = MemoryTarget(int(settings["max_bytes"]))
            t.kind = "mem2"
            return t

    from test_plugin_contract import echo_plugin

    host = make_host(contents={"echo": echo_plugin()}, targets={"mem2": Mem()}, base_dir=tmp_path)
    res = run_session(host, ["echo"], [1, 2], [3], target={"kind": "mem2", "object_key": "a"},
                      target_settings={"mem2": {"max_bytes": 1 << 20}})
    assert res.receipt["state"] == "ready", res.receipt
    assert seen == {"max_bytes": 1 << 20, "base_dir": str(tmp_path)}


@pytest.mark.parametrize("bad, text", [
    ({"dir": "/tmp/x"}, r"keyed by enabled name .*key 'dir' is not one of the enabled names \['memory', 'spy_target'\]"),
    ({"spy_target": 3}, r"target_settings\['spy_target'\] must be a settings table"),
    ({"spy_target": {"base_dir": "x"}}, r"base_dir is reserved"),
    (["spy_target"], r"must be a mapping of name -> settings table"),
])
def test_wrongly_shaped_settings_are_refused_naming_the_key(bad, text):
    spy = Spy({})
    with pytest.raises(ConfigError, match=text):
        make_host(targets={"spy_target": spy}, target_settings=bad)
    host = make_host(contents={"spy": Spy({})}, targets={"spy_target": spy})
    with pytest.raises(ConfigError, match=text):
        run_session(host, ["spy"], [1], [2], target_settings=bad)
    with pytest.raises(ConfigError, match=r"content_settings must be keyed by enabled name"):
        make_host(contents={"spy": spy}, content_settings={"x": 1})


# ------------------------------------------------------------------------------------------ 3: default
def test_readme_shows_the_embedded_default_plugin_lists():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```toml\n\[plugins\].*?```", readme, re.S).group(0)
    for key in ("contents", "targets", "probes"):
        shown = re.search(rf"^{key} = (\[.*?\])", block, re.M).group(1)
        real = re.search(rf"^{key} = (\[.*?\])", DEFAULT_TOML, re.M).group(1)
        assert json.loads(shown) == json.loads(real), f"README's {key} differs from config.DEFAULT_TOML"


def test_embedded_default_enables_only_installed_plugins_and_notes_the_rest(tmp_path):
    from genartifact.config import installed_default

    cfg = parse(DEFAULT_TOML, source="<embedded default>", base_dir=tmp_path)
    have = {"genartifact.contents": ["moe_routes"], "genartifact.targets": ["managed_fsspec"]}

    class EP:
        def __init__(self, name):
            self.name, self.value, self.dist = name, f"m_{name}", None

    out = installed_default(cfg, source=lambda group: [EP(n) for n in have.get(group, [])])
    assert out.plugins["contents"] == ["moe_routes"]
    assert out.not_installed["contents"] == [n for n in cfg.plugins["contents"] if n != "moe_routes"]
    assert "targets" not in out.not_installed
    # a config file is literal: a missing plugin stays a problem (checked by plugins' survey)
    assert parse('[plugins]\ncontents = ["nope"]\n', source="f", base_dir=tmp_path).plugins["contents"] == ["nope"]


# ------------------------------------------------------------------------------------------ 4: global options
def test_config_is_accepted_before_and_after_the_subcommand(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[plugins]\ncontents = []\ntargets = []\n')
    rows = []
    for argv in (["--config", str(cfg), "plugins", "--json"], [f"--config={cfg}", "plugins", "--json"],
                 ["plugins", "--config", str(cfg), "--json"]):
        assert cli.main(argv) == 0
        rows.append({r["name"]: r["enabled"] for r in json.loads(capsys.readouterr().out)["plugins"]
                     if r["kind"] == "contents"})
    assert rows[0] == rows[1] == rows[2] and not any(rows[0].values())
    other = tmp_path / "d.toml"
    other.write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(["--config", str(cfg), "plugins", "--config", str(other)])
    assert e.value.code == 2 and "--config given twice" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ 8: one rule
class BigSection:
    """Admits 64 bytes, returns a tiny tensor but a ~100 KB manifest section."""

    name = "bigsec"

    def admit(self, ctx):
        return 64

    def sampling_overrides(self, params):
        pass

    def on_delta(self, delta):
        pass

    async def collect(self, final):
        pass

    def finalize(self, final):
        return {"blob": "x" * 100_000}, [TensorPart("bigsec.v", np.zeros(2, "<u4"))]

    def retained_bytes(self):
        return 0

    def release(self):
        pass


def test_manifest_section_counts_against_admitted_bytes_as_a_named_plugin_fault():
    import structlog

    class P:
        @hookimpl
        def genartifact_content_producer(self, name, model):
            return BigSection() if name == "bigsec" else None

    host = make_host(contents={"bigsec": P()})
    with structlog.testing.capture_logs() as logs:
        res = run_session(host, ["bigsec"], [1, 2], [3])
    assert res.receipt["state"] == "failed" and res.receipt["error_code"] == "internal_error"
    fault = next(e for e in logs if e["event"] == "plugin_fault")
    assert fault["plugin"] == "bigsec" and fault["method"] == "finalize"
    assert "manifest section" in fault["error"] and "admit() declared at most 64" in fault["error"]


# ------------------------------------------------------------------------------------------ 9: --check
def test_plugins_check_builds_every_enabled_content_producer_from_its_settings(tmp_path, monkeypatch):
    class Strict:
        @hookimpl
        def genartifact_content_producer(self, name, model, settings):
            extra = set(settings) - {"base_dir", "window"}
            if extra:
                raise ConfigError(f"[contents.strict]: unknown key(s) {sorted(extra)}; allowed: ['window']")
            return None

    def host(self, **kw):
        from genartifact.host import PluginHost

        return PluginHost(self.plugins, objects={"contents": {"strict": Strict()}}, source=lambda g: [],
                          content_settings=self.content_settings())

    monkeypatch.setattr(Config, "host", host)
    bad = parse('[plugins]\ncontents = ["strict"]\ntargets = []\n[contents.strict]\nfoo = 1\n', source="c",
                base_dir=tmp_path)
    problems = cli.check_settings(bad)
    assert problems and "[contents.strict]" in problems[0] and "unknown key(s) ['foo']" in problems[0]
    good = parse('[plugins]\ncontents = ["strict"]\ntargets = []\n[contents.strict]\nwindow = 2\n', source="c",
                 base_dir=tmp_path)
    assert cli.check_settings(good) == []
    typo = parse('[plugins]\ncontents = ["strict"]\ntargets = []\n[contents.strikt]\nwindow = 2\n', source="c",
                 base_dir=tmp_path)
    assert any("[contents.strikt] configures a content that is not enabled" in p for p in cli.check_settings(typo))


# ------------------------------------------------------------------------------------------ 12: inspect
def test_inspect_isolates_a_broken_reader_summary_and_prints_the_other_sections(tmp_path):
    """Real CLI in a subprocess with two in-process-registered contents: one reader's summary_text raises."""
    script = tmp_path / "run.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_plugin_contract import echo_plugin, EchoReader
from genartifact.readers import register_reader
from genartifact.testing import make_host, run_session
from genartifact import cli

class Broken(EchoReader):
    def summary_text(self, summary):
        return summary["missing"]

host = make_host(contents={{"echo": echo_plugin()}})
res = run_session(host, ["echo"], [1, 2], [3, 4])
open({str(tmp_path / 'a.gart')!r}, "wb").write(res.data)
register_reader("echo", Broken())
code = cli.main(["inspect", {str(tmp_path / 'a.gart')!r}])
print("EXIT", code)
""")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "EXIT 1" in p.stdout, p.stdout + p.stderr
    assert "tokens: prompt 2 + completion 2" in p.stdout  # the envelope still prints
    assert "echo: plugin fault:" in p.stdout and "KeyError in summary_text" in p.stdout
    assert "unexpected" not in p.stderr and "error: content 'echo'" in p.stderr


def test_artifact_summary_faults_name_the_plugin_and_completion_token_count(tmp_path):
    from genartifact.readers import register_reader, unregister_reader
    from test_plugin_contract import EchoReader, echo_plugin

    host = make_host(contents={"echo": echo_plugin()})
    art = run_session(host, ["echo"], [1, 2], [3, 4, 5]).artifact
    assert art.completion_token_count == 3 and art.prompt_token_count == 2

    class Bad(EchoReader):
        def summary(self, manifest, section, tensors):
            return {"x": float("nan")}

    register_reader("echo", Bad())
    try:
        from genartifact.format import decode

        art2 = decode(art_bytes := run_session(host, ["echo"], [1], [2]).data)
        assert art_bytes
        with pytest.raises(PluginFault, match="summary"):
            art2.content_summary("echo")
    finally:
        unregister_reader("echo")


# ------------------------------------------------------------------------------------------ 10, 11, gaps
def run_suite(tmp_path, source: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_suite.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


CONTENT_SUITE = '''
import sys
sys.path.insert(0, {here!r})
from test_plugin_contract import echo_plugin, Echo
from genartifact.testing import make_host, hookimpl
from genartifact.testing.conformance import ContentConformance

class Failing(Echo):
    def finalize(self, final):
        from genartifact.errors import CaptureError
        raise CaptureError("finalize refused")

class P:
    @hookimpl
    def genartifact_content_producer(self, name, model):
        return Failing(name) if name == "echo" else None
    @hookimpl
    def genartifact_content_reader(self, name):
        from test_plugin_contract import EchoReader
        return EchoReader()

class TestFailing(ContentConformance):
    content = "echo"
    def make_host(self):
        return make_host(contents={{"echo": P()}})
'''


def test_content_suite_failures_show_the_receipt_code_and_never_attributeerror(tmp_path):
    p = run_suite(tmp_path, CONTENT_SUITE.format(here=str(Path(__file__).parent)))
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "error_code 'capture_invalid'" in out
    assert "AttributeError" not in out


TARGET_SUITE = '''
from genartifact.errors import ObjectNotFoundError
from genartifact.testing import MemoryTarget
from genartifact.testing.conformance import TargetConformance

SECRET = "sk-live-{secret}"

class Leaky(MemoryTarget):
    async def open(self, object_id, max_bytes):
        if object_id not in self.objects:
            raise ObjectNotFoundError(f"not found with credential {{SECRET}}")
        return await super().open(object_id, max_bytes)

class TestLeaky(TargetConformance):
    secrets = [SECRET]
    def make_target(self):
        return Leaky()
    def target_spec(self, key):
        return {{"kind": "memory", "object_key": key}}
'''


def test_secret_leak_fails_without_printing_the_secret(tmp_path):
    secret = "0123456789abcdef" * 2
    p = run_suite(tmp_path, TARGET_SUITE.format(secret=secret), "-k", "missing")
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "leaked" in out, out
    assert secret not in out


DIR_TARGET_SUITE = '''
import hashlib, os
from pathlib import Path
from genartifact.errors import DeliveryError, TargetError
from genartifact.types import ValidatedTarget
from genartifact.testing.conformance import TargetConformance

class DirTarget:
    kind = "dir_t"
    def __init__(self, root, atomic, mkdir_in_validate):
        self.root, self.atomic, self.mkdir_in_validate = Path(root), atomic, mkdir_in_validate
    def validate(self, spec):
        p = self.root / spec["key"]
        if self.mkdir_in_validate:
            p.parent.mkdir(parents=True, exist_ok=True)
        return ValidatedTarget(kind="dir_t", max_bytes=1 << 20, object_id=spec["key"])
    def _write(self, f, data):
        f.write(data[:10]); f.flush(); f.write(data[10:])
    async def deliver(self, vt, data, sha):
        p = self.root / vt.object_id
        if p.exists():
            raise DeliveryError("exists", "object_exists")
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp") if self.atomic else p
        try:
            with open(tmp, "wb") as f:
                self._write(f, data)
        except OSError:
            if self.atomic:
                tmp.unlink(missing_ok=True)
            raise DeliveryError("write failed", "target_unavailable")
        if self.atomic:
            os.link(tmp, p); tmp.unlink()
        return vt.object_id
    async def open(self, oid, max_bytes):
        p = self.root / oid
        if not p.exists():
            raise TargetError("missing")
        return p.read_bytes()[: max_bytes + 1] if p.stat().st_size <= max_bytes else (_ for _ in ()).throw(TargetError("big"))
    async def exists(self, oid):
        return (self.root / oid).exists()
    async def delete(self, oid, sha):
        p = self.root / oid
        if p.exists() and hashlib.sha256(p.read_bytes()).hexdigest() == sha:
            p.unlink(); return True
        return False

class Base(TargetConformance):
    atomic = True
    mkdir_in_validate = False
    def setup_method(self):
        import tempfile
        self.root = Path(tempfile.mkdtemp())
    def make_target(self):
        return DirTarget(self.root, self.atomic, self.mkdir_in_validate)
    def target_spec(self, key):
        return {{"kind": "dir_t", "key": "sub/" + key}}
    def target_root(self):
        return self.root
    def fail_during_write(self, target, monkeypatch):
        def broken(f, data):
            f.write(data[:10]); f.flush()
            raise OSError("disk full")
        monkeypatch.setattr(target, "_write", broken)
        return DeliveryError

class Test{name}(Base):
    atomic = {atomic}
    mkdir_in_validate = {mkdir}
'''


@pytest.mark.parametrize("name, atomic, mkdir, failing", [
    ("Good", True, False, None),
    ("InPlace", False, False, "test_failure_mid_write_leaves_nothing"),
    ("MkdirInValidate", True, True, "test_validate_is_side_effect_free"),
])
def test_target_suite_catches_validate_side_effects_and_non_atomic_writes(tmp_path, name, atomic, mkdir, failing):
    p = run_suite(tmp_path, DIR_TARGET_SUITE.format(name=name, atomic=atomic, mkdir=mkdir))
    out = p.stdout + p.stderr
    if failing is None:
        assert p.returncode == 0, out
    else:
        assert p.returncode == 1, out
        failed = re.findall(r"FAILED \S+::(test_\w+)", out)
        assert failed and all(f.startswith(failing) for f in failed), out


UNBOUNDED_SUITE = '''
import sys
sys.path.insert(0, {here!r})
from test_plugin_contract import Echo, EchoReader
from genartifact.testing import make_host, hookimpl
from genartifact.testing.conformance import ContentConformance

class Unbounded(Echo):
    def on_delta(self, delta):
        self.vals.extend(delta.new_token_ids)  # never checks max_tokens

class P:
    @hookimpl
    def genartifact_content_producer(self, name, model):
        return Unbounded(name) if name == "echo" else None
    @hookimpl
    def genartifact_content_reader(self, name):
        return EchoReader()

class TestUnbounded(ContentConformance):
    content = "echo"
    def make_host(self):
        return make_host(contents={{"echo": P()}})
'''


def test_content_suite_catches_recording_past_max_tokens(tmp_path):
    p = run_suite(tmp_path, UNBOUNDED_SUITE.format(here=str(Path(__file__).parent)), "-k", "past_max_tokens")
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "retained_bytes" in out, out


# ------------------------------------------------------------------------------------------ worker contents
WORKER_SUITE = '''
import os, sys
sys.path.insert(0, {here!r})
from test_plugin_contract import Echo, EchoReader
from genartifact.testing import FakeEngine, make_host, hookimpl
from genartifact.testing.conformance import ContentConformance

KEY = "echo_capture_id"

class Worker(Echo):
    """echo, its capture id handed to the workers and its rows discarded when not fetched (a correct worker
    content); the variants below each break one rule."""
    cid = None
    fetched = False
    def sampling_overrides(self, params):
        self.cid = self.new_id()
        extra = dict(params.get("extra_args") or {{}})
        extra[KEY] = self.cid
        params["extra_args"] = self.extra(extra, params)
    def new_id(self):
        return os.urandom(16).hex()
    def on_delta(self, delta):  # bounded: never more than the admitted tokens
        self.vals.extend(delta.new_token_ids[: max(0, self.max - len(self.vals))])
    def extra(self, extra, params):
        return extra
    async def collect(self, final):
        self.fetched = True
    async def discard(self, engine):
        if self.cid is not None and not self.fetched and engine is not None:
            await engine.worker_call("echo.discard", self.cid)

class Replaces(Worker):
    def extra(self, extra, params):
        return {{KEY: extra[KEY]}}

class OneId(Worker):
    def new_id(self):
        return "same-for-all"

class BadId(Worker):
    def new_id(self):
        return "has space/and.dot"

class NoDiscard(Worker):
    async def discard(self, engine):
        return None

def plugin(cls):
    class P:
        @hookimpl
        def genartifact_content_producer(self, name, model):
            return cls(name) if name == "echo" else None
        @hookimpl
        def genartifact_content_reader(self, name):
            return EchoReader()
    return P()

class Base(ContentConformance):
    content = "echo"
    capture_key = KEY
    cls = Worker
    def make_host(self):
        return make_host(contents={{"echo": plugin(self.cls)}})
    def engine(self, prompt, completion):
        return FakeEngine({{"echo.discard": lambda cid: True}})

class Test{name}(Base):
    cls = {name}
'''


@pytest.mark.parametrize("name, failing", [
    ("Worker", None),
    ("Replaces", "test_extra_args_of_others_are_kept"),
    ("OneId", "test_capture_id_is_per_request_and_one_the_workers_accept"),
    ("BadId", "test_capture_id_is_per_request_and_one_the_workers_accept"),
    ("NoDiscard", "test_a_request_ending_unfetched_discards_its_worker_rows"),
])
def test_worker_content_rules_catch_each_broken_variant(tmp_path, name, failing):
    """A worker content must add its capture id to ``extra_args`` (never replace the dict), use a new id of the form
    workers accept per request, and discard rows it did not fetch: each variant that breaks one rule fails exactly
    that test of the suite; the correct one passes every test."""
    p = run_suite(tmp_path, WORKER_SUITE.format(here=str(Path(__file__).parent), name=name))
    out = p.stdout + p.stderr
    if failing is None:
        assert p.returncode == 0, out[-3000:]
    else:
        assert p.returncode == 1, out[-3000:]
        failed = [ln for ln in out.splitlines() if ln.startswith("FAILED")]
        assert len(failed) == 1 and failing in failed[0], failed
