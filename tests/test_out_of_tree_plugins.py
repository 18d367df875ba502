"""Proof that the host is open: out-of-tree plugins built here as real distributions (pip-installed into a temp
dir, found through their entry points) — a create-only SQLite target, the per-token-timestamp content of
``examples/plugin-template`` and a content that faults — pass the kit's conformance suites, run through
``generate`` on the real engine next to the built-ins, and read back with ``verify --receipts`` and ``inspect
--json``; the faulting plugin costs only its own requests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SQLITE_PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "genartifact-sqlite-target"
version = "0.3.0"
requires-python = ">=3.11"
dependencies = ["genartifact"]

[project.entry-points."genartifact.targets"]
sqlite = "genartifact_sqlite_target"

[tool.setuptools]
py-modules = ["genartifact_sqlite_target"]

[tool.pytest.ini_options]
addopts = ["--import-mode=importlib"]
"""

SQLITE_SRC = '''
"""A create-only SQLite target: one row per object (PRIMARY KEY = the name), inserted in one transaction."""
import asyncio
import hashlib
import sqlite3
from pathlib import Path

import pluggy
from genartifact.errors import ConfigError, DeliveryError, ObjectNotFoundError, ObjectTooLargeError, TargetError
from genartifact.types import ValidatedTarget

hookimpl = pluggy.HookimplMarker("genartifact")
KIND = "sqlite"


class SqliteTarget:
    kind = KIND

    def __init__(self, path, max_bytes):
        self.path, self.max_bytes = Path(path), max_bytes

    def __repr__(self):
        return f"SqliteTarget({self.path.name})"

    def _db(self):
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("CREATE TABLE IF NOT EXISTS objects (name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, data BLOB NOT NULL)")
        return db

    def validate(self, spec):
        extra = set(spec) - {"kind", "name"}
        if extra:
            raise TargetError(f"sqlite target: unknown key(s) {sorted(extra)}; allowed: ['kind', 'name']")
        name = spec.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= 256:
            raise TargetError("sqlite target.name must be a string of 1..256 characters")
        return ValidatedTarget(kind=KIND, max_bytes=self.max_bytes, object_id=name)

    def describe(self, target):
        return {"name": target.object_id}

    async def deliver(self, target, data, sha256):
        if len(data) > self.max_bytes:
            raise DeliveryError("artifact exceeds the sqlite target's max_bytes", "too_large")

        def insert():
            with self._db() as db:  # one transaction: all or nothing
                db.execute("INSERT INTO objects (name, sha256, data) VALUES (?, ?, ?)",
                           (target.object_id, sha256, bytes(data)))
        try:
            await asyncio.to_thread(insert)
        except sqlite3.IntegrityError:
            raise DeliveryError("an object with this name exists", "object_exists") from None
        except sqlite3.Error as e:
            raise DeliveryError(f"sqlite error {type(e).__name__}", "delivery_failed") from None
        return target.object_id

    async def open(self, object_id, max_bytes):
        def read():
            row = self._db().execute("SELECT length(data), data FROM objects WHERE name = ?", (object_id,)).fetchone()
            if row is None:
                raise ObjectNotFoundError(f"sqlite object {object_id!r} not found")
            if row[0] > max_bytes:
                raise ObjectTooLargeError(f"sqlite object {object_id!r} is larger than {max_bytes} bytes")
            return bytes(row[1])
        return await asyncio.to_thread(read)

    async def exists(self, object_id):
        return await asyncio.to_thread(lambda: self._db().execute(
            "SELECT 1 FROM objects WHERE name = ?", (object_id,)).fetchone() is not None)

    async def delete(self, object_id, sha256):
        def rm():
            with self._db() as db:
                return db.execute("DELETE FROM objects WHERE name = ? AND sha256 = ? AND "
                                  "length(data) <= ?", (object_id, sha256, self.max_bytes)).rowcount == 1
        return await asyncio.to_thread(rm)


@hookimpl
def genartifact_storage_target(kind, settings):
    if kind != KIND:
        return None
    extra = set(settings) - {"path", "max_bytes", "base_dir"}
    if extra or not isinstance(settings.get("path"), str):
        raise ConfigError("[targets.sqlite] takes path (string, relative to the config) and max_bytes")
    return SqliteTarget(Path(settings["base_dir"]) / settings["path"], int(settings.get("max_bytes", 8 << 20)))


@hookimpl
def genartifact_target_shorthand(kind, value, run_id, index):
    if kind != KIND:
        return None
    return {"kind": KIND, "name": f"{value}/{run_id}/{index:05d}"}
'''

SQLITE_TESTS = '''
from genartifact.testing.conformance import TargetConformance
from genartifact_sqlite_target import SqliteTarget
import pytest


class TestSqliteConformance(TargetConformance):
    @pytest.fixture(autouse=True)
    def _db(self, tmp_path):
        self.path = tmp_path / "o.db"

    def make_target(self):
        return SqliteTarget(self.path, 4096)

    def target_spec(self, key):
        return {"kind": "sqlite", "name": key}

    def small_target_spec(self, key):
        return self.target_spec(key)

    def bad_specs(self):
        return [({"kind": "sqlite"}, "name"), ({"kind": "sqlite", "name": "x", "url": "u"}, "unknown key")]
'''

FAULTY_PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "genartifact-faulty-content"
version = "6.6.6"
requires-python = ">=3.11"

[project.entry-points."genartifact.contents"]
faulty = "genartifact_faulty_content"
faulty_worker = "genartifact_faulty_worker"

[tool.setuptools]
py-modules = ["genartifact_faulty_content", "genartifact_faulty_worker"]
"""

FAULTY_WORKER_SRC = '''
"""A worker content whose worker setup has a bug (its genartifact_worker_capture raises on every worker): the
engine still starts, its requests fail at admission, nothing else."""
import pluggy
from genartifact_faulty_content import Faulty

hookimpl = pluggy.HookimplMarker("genartifact")


class FaultyWorker(Faulty):  # (the same dist's minimal producer, whose on_delta is not reached here)
    name = "faulty_worker"
    consumes_deltas = False


@hookimpl
def genartifact_content_producer(name, model):
    return FaultyWorker() if name == "faulty_worker" else None


@hookimpl
def genartifact_worker_capture(worker, settings):
    raise RuntimeError("faulty_worker cannot find the model's layers (setup bug): token=s3cr3t-init")
'''

FAULTY_SRC = '''
"""A content whose on_delta has a bug (raises ValueError): its requests fail with internal_error, nothing else."""
import pluggy

hookimpl = pluggy.HookimplMarker("genartifact")


class Faulty:
    name = "faulty"

    def admit(self, ctx):
        return 0

    def sampling_overrides(self, params):
        pass

    def on_delta(self, delta):
        raise ValueError("faulty plugin bug: token=s3cr3t-value")

    async def collect(self, final):
        pass

    def finalize(self, final):
        return {}, []

    def retained_bytes(self):
        return 0

    def release(self):
        pass


@hookimpl
def genartifact_content_producer(name, model):
    return Faulty() if name == "faulty" else None
'''


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory holding the three distributions, installed by pip from their sources (wheel build)."""
    base = tmp_path_factory.mktemp("out-of-tree")
    sqlite = _write(base / "sqlite", {"pyproject.toml": SQLITE_PYPROJECT, "genartifact_sqlite_target.py": SQLITE_SRC,
                                      "tests/test_sqlite.py": SQLITE_TESTS})
    faulty = _write(base / "faulty", {"pyproject.toml": FAULTY_PYPROJECT, "genartifact_faulty_content.py": FAULTY_SRC,
                                      "genartifact_faulty_worker.py": FAULTY_WORKER_SRC})
    template = base / "plugin-template"  # a copy: building leaves build/ and *.egg-info next to the sources
    shutil.copytree(ROOT / "examples" / "plugin-template", template,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
    site = base / "site"
    for src in (template, sqlite, faulty):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(site), str(src)], check=True, capture_output=True, timeout=300)
    site.joinpath(".sources").write_text(json.dumps([str(template), str(sqlite)]))
    return site


def _env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def _cli(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "genartifact.cli", *argv], cwd=cwd, env=_env(site),
                          capture_output=True, text=True, timeout=900)


def test_installed_distributions_are_found_and_checked(site, tmp_path):
    r = _cli(site, tmp_path, "plugins", "--check", "--json")
    rows = {(p["kind"], p["name"]): p for p in json.loads(r.stdout)["plugins"]}
    assert rows[("targets", "sqlite")]["dist"] == "genartifact-sqlite-target"
    assert rows[("targets", "sqlite")]["hooks"] == ["genartifact_storage_target", "genartifact_target_shorthand"]
    assert rows[("contents", "token_timestamps")]["version"] == "0.1.0"
    assert r.returncode == 0, r.stdout  # every installed plugin imports and validates


def test_template_and_sqlite_suites_pass_against_the_kit(site):
    """The plugins' own test suites (the kit's conformance classes), run as their authors would."""
    for folder in map(Path, json.loads(site.joinpath(".sources").read_text())):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=folder,
                           env=_env(site), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:]
        assert " passed" in r.stdout and " failed" not in r.stdout


@pytest.mark.engine
def test_generate_verify_inspect_with_out_of_tree_plugins(site, qwen_model, tmp_path):
    (tmp_path / "config.toml").write_text(
        '[plugins]\ncontents = ["moe_routes", "selected_logprobs", "token_timestamps", "faulty", "faulty_worker"]\n'
        'targets = ["managed_fsspec", "sqlite"]\n'
        '[targets.managed_fsspec.profiles.local]\nurl = "./artifacts"\nallowed_prefixes = ["runs/"]\n'
        '[targets.sqlite]\npath = "objects.db"\n'
        '[journal]\npath = "journal.jsonl"\n')
    rows = [{"prompt": "one two three", "max_tokens": 6},
            {"prompt": "a faulty plugin only costs its own request", "max_tokens": 4,
             "contents": ["faulty", "selected_logprobs"]},
            {"prompt": "four five six seven", "max_tokens": 5},
            {"prompt": "eight", "max_tokens": 3},
            {"prompt": "a worker plugin whose setup failed only costs its own requests", "max_tokens": 3,
             "contents": ["faulty_worker", "moe_routes"]}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = _cli(site, tmp_path, "generate", "--model", str(qwen_model), "--prompts", "prompts.jsonl", "--config",
             "config.toml", "--contents", "moe_routes,selected_logprobs,token_timestamps", "--target", "sqlite:runs",
             "--run-id", "oot", "--out", "receipts.jsonl", "--max-model-len", "512")
    assert r.returncode == 1, r.stderr[-3000:]  # two rows failed (the faulty plugins), the others are ready
    receipts = {x["index"]: x for x in map(json.loads, (tmp_path / "receipts.jsonl").read_text().splitlines())}
    assert sorted(receipts) == [0, 1, 2, 3, 4]  # receipts.jsonl is complete
    assert receipts[1]["state"] == "failed" and receipts[1]["error_code"] == "internal_error"
    # the engine started although a worker capture's setup raised on the worker: only that content's row failed
    assert receipts[4]["state"] == "failed" and receipts[4]["error_code"] == "internal_error", receipts[4]
    assert "worker_capture_unavailable" in r.stderr and "genartifact_worker_capture" in r.stderr
    assert "s3cr3t-init" not in r.stderr
    for i in (0, 2, 3):
        assert receipts[i]["state"] == "ready" and receipts[i]["target"] == "sqlite", receipts[i]
        assert receipts[i]["object_id"] == f"runs/oot/{i:05d}"
    assert "plugin_fault" in r.stderr and "genartifact-faulty-content" in r.stderr and "6.6.6" in r.stderr
    assert "on_delta" in r.stderr and "s3cr3t-value" not in r.stderr
    v = _cli(site, tmp_path, "verify", "--receipts", "receipts.jsonl", "--config", "config.toml")
    assert v.returncode == 1 and "3/5 receipts verified" in v.stdout, v.stdout + v.stderr
    assert "#1: failed internal_error" in v.stdout
    ins = _cli(site, tmp_path, "inspect", "sqlite:runs/oot/00000", "--config", "config.toml", "--json")
    assert ins.returncode == 0, ins.stderr
    s = json.loads(ins.stdout)
    assert s["contents"] == ["moe_routes", "selected_logprobs", "token_timestamps"]
    ts = s["token_timestamps"]
    assert ts["count"] == s["completion_token_count"] == receipts[0]["completion_tokens"]
    assert ts["first_token_ms"] > 0 and ts["last_token_ms"] > ts["first_token_ms"]
    assert ts["mean_inter_token_ms"] > 0  # per-step deltas: tokens arrived at distinct times (final-only gives 0)
    assert s["moe_routes"]["rows"] == s["prompt_token_count"] + s["completion_token_count"] - 1
    text = _cli(site, tmp_path, "inspect", "sqlite:runs/oot/00002", "--config", "config.toml")
    assert "token_timestamps: " in text.stdout and "tokens, first at" in text.stdout
