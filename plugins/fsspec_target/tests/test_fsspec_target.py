"""managed_fsspec: profile/key validation, create-only all-or-nothing writes on file:// and memory://."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import os

import fsspec
import pytest
from genartifact.errors import ConfigError, DeliveryError, TargetError
from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles, validate_key


def target(tmp_path, **extra):
    return ManagedFsspecTarget(parse_profiles({"profiles": {
        "disk": {"url": f"file://{tmp_path}", "allowed_prefixes": ["runs/", "other/x"], **extra},
        "mem": {"url": "memory://fs-target-tests", "allowed_prefixes": [""]},
    }}))


def test_entry_point_declared():
    eps = {ep.name: ep for ep in md.entry_points(group="genartifact.targets")}
    assert eps["managed_fsspec"].dist.name == "genartifact-fsspec-target"


def test_relative_url_resolves_against_base_dir(tmp_path):
    prof = parse_profiles({"profiles": {"p": {"url": "./art", "allowed_prefixes": ["a/"]}}}, tmp_path)["p"]
    assert prof.url == f"file://{tmp_path}/art"


@pytest.mark.parametrize(
    "profiles, match",
    [
        ({"bad name": {"url": "memory://x", "allowed_prefixes": [""]}}, "profile name"),
        ({"p": {"url": "memory://x"}}, "allowed_prefixes"),
        ({"p": {"url": "memory://x", "allowed_prefixes": []}}, "non-empty list"),
        ({"p": {"url": "memory://x", "allowed_prefixes": ["../up"]}}, "normalized"),
        ({"p": {"url": "memory://x", "allowed_prefixes": [""], "max_bytes": 0}}, "max_bytes"),
        ({"p": {"url": "http://127.0.0.1:1/root", "allowed_prefixes": [""]}}, "protocol 'http' unsupported"),
        ({"p": {"url": "simplecache::memory://x", "allowed_prefixes": [""]}}, "unsupported"),
        ({"p": {"url": "memory://x", "allowed_prefixes": [""], "password": "hunter2"}}, r"unknown key\(s\) \['password'\]"),
    ],
)
def test_bad_profiles(profiles, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_profiles({"profiles": profiles})
    assert "hunter2" not in str(e.value)


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a/./b", "a//b", "a\\b", "a/b/", "é/x", "a b"])
def test_bad_keys(key):
    with pytest.raises(TargetError):
        validate_key(key)


def test_prefix_boundary(tmp_path):
    t = target(tmp_path)
    assert t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "other/x/y"}).object_id == "disk:other/x/y"
    with pytest.raises(TargetError, match="outside"):
        t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "other/xy"})
    for key in ("runs", "other/x"):  # the prefix itself is a directory, never an object
        with pytest.raises(TargetError, match="outside"):
            t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": key})


def test_storage_options_never_in_repr(tmp_path):
    prof = parse_profiles({"profiles": {"p": {"url": "memory://x", "allowed_prefixes": [""],
                                              "storage_options": {"secret": "hunter2"}}}})["p"]
    assert "hunter2" not in repr(prof) and "hunter2" not in repr(ManagedFsspecTarget({"p": prof}))


def test_local_create_only_atomic_no_temp_left(tmp_path):
    t = target(tmp_path)
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/a/b.gart"})
    assert asyncio.run(t.deliver(v, b"first", "x")) == "disk:runs/a/b.gart"
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"second", "x"))
    assert e.value.code == "object_exists"
    assert (tmp_path / "runs/a/b.gart").read_bytes() == b"first"
    assert os.listdir(tmp_path / "runs/a") == ["b.gart"]
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "runs/a/b.gart").stat().st_mode & 0o777 == 0o666 & ~mask  # readable by a trainer


def test_local_write_failure_leaves_nothing(tmp_path):
    t = target(tmp_path)
    (tmp_path / "runs").write_text("a file where a directory is needed")
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/a.gart"})
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"data", "x"))
    assert e.value.code == "delivery_failed" and str(tmp_path) not in str(e.value)


def test_memory_create_only():
    t = target("/unused")
    v = t.validate({"kind": "managed_fsspec", "profile": "mem", "object_key": "k1"})
    asyncio.run(t.deliver(v, b"one", "x"))
    with pytest.raises(DeliveryError, match="already exists"):
        asyncio.run(t.deliver(v, b"two", "x"))
    assert fsspec.filesystem("memory").cat_file("/fs-target-tests/k1") == b"one"


def test_over_max_bytes_refused_before_write(tmp_path):
    t = target(tmp_path, max_bytes=4)
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/big"})
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"12345", "x"))
    assert e.value.code == "too_large" and not (tmp_path / "runs/big").exists()
