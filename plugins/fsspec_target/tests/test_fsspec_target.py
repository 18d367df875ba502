"""managed_fsspec: profile/key validation, create-only all-or-nothing writes on file:// and memory://."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import os

import fsspec
import pytest
from genartifact.errors import ConfigError, DeliveryError, TargetError
from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles, validate_key


@pytest.fixture
def mem_root():
    """An isolated memory:// root per test (the memory store is process-global); removed afterwards."""
    import uuid

    root = f"/fs-target-tests-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["unnamed", "named"])
def write_path(request, monkeypatch):
    """Both ways a file:// object is written: unnamed (``O_TMPFILE`` + ``linkat``, the default on Linux) and the
    named-temp fallback for filesystems without ``O_TMPFILE`` (forced here by hiding the flag)."""
    import genartifact_fsspec_target as ft

    if request.param == "named":
        monkeypatch.setattr(ft, "_O_TMPFILE", 0)
    else:
        assert ft._O_TMPFILE, "this Linux box has O_TMPFILE"
    return request.param


def target(tmp_path, mem_root="/fs-target-tests-unused", **extra):
    return ManagedFsspecTarget(parse_profiles({"profiles": {
        "disk": {"url": f"file://{tmp_path}", "allowed_prefixes": ["runs/", "other/x"], **extra},
        "mem": {"url": f"memory://{mem_root}", "allowed_prefixes": [""]},
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
@pytest.mark.fault("managed", "bad profile settings")
def test_bad_profiles(profiles, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_profiles({"profiles": profiles})
    assert "hunter2" not in str(e.value)


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a/./b", "a//b", "a\\b", "a/b/", "é/x", "a b"])
@pytest.mark.fault("managed", "bad object keys")
def test_bad_keys(key):
    with pytest.raises(TargetError):
        validate_key(key)


@pytest.mark.fault("managed", "key outside the allowed prefixes")
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


@pytest.mark.fault("managed", "second write to a file:// key")
def test_local_create_only_atomic_no_temp_left(write_path, tmp_path):
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


@pytest.mark.fault("managed", "a symbolic link planted in the store")
def test_local_keys_never_pass_a_link_out_of_the_root(write_path, tmp_path):
    """Keys are checked lexically; a directory (or, to read, an object) below the root that is a symbolic link
    would carry a write, read or delete out of the store: refused, nothing written outside."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    (store / "runs").mkdir(parents=True)
    outside.mkdir()
    (store / "runs/evil").symlink_to(outside, target_is_directory=True)
    (outside / "secret").write_bytes(b"not the store's")
    (store / "runs/leak.gart").symlink_to(outside / "secret")
    t = target(store)
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/evil/pwn.gart"})
    with pytest.raises(TargetError, match="symbolic link"):
        asyncio.run(t.deliver(v, b"artifact", "x"))
    assert os.listdir(outside) == ["secret"]
    for oid in ("disk:runs/evil/secret", "disk:runs/leak.gart"):
        with pytest.raises(TargetError, match="symbolic link"):
            asyncio.run(t.open(oid, 100))
    with pytest.raises(TargetError, match="symbolic link"):
        asyncio.run(t.delete("disk:runs/leak.gart", "0" * 64))
    assert (outside / "secret").read_bytes() == b"not the store's"
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/real/ok.gart"})
    assert asyncio.run(t.deliver(v, b"artifact", "x")) == "disk:runs/real/ok.gart"  # a real new directory: fine


@pytest.mark.fault("managed", "write failing half-way (file://)")
def test_local_write_failure_leaves_nothing(write_path, tmp_path):
    t = target(tmp_path)
    (tmp_path / "runs").write_text("a file where a directory is needed")
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/a.gart"})
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"data", "x"))
    assert e.value.code == "delivery_failed" and str(tmp_path) not in str(e.value)


def test_local_write_syncs_the_file_then_the_directory_after_publishing(write_path, tmp_path, sync_events):
    """The receipt must not outrun the disk: the object's bytes are fsynced before the link, and the directory
    (holding the new name) after it, so a power loss right after ``ready`` cannot lose the key. Directories made
    for the key have their own names synced too (each new directory's parent); existing ones are not synced."""
    events = sync_events(tmp_path)
    t = target(tmp_path / "root")
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/a/b.gart"})
    asyncio.run(t.deliver(v, b"bytes", "x"))
    # runs/a holds the key; runs/a, runs and the profile root itself were made: their names are in their parents
    assert events == ["fsync_file", "link", ("fsync_dir", "root/runs/a"), ("fsync_dir", "root/runs"),
                      ("fsync_dir", "root"), ("fsync_dir", ".")]
    assert os.listdir(tmp_path / "root/runs/a") == ["b.gart"]
    events.clear()
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/a/c.gart"})
    asyncio.run(t.deliver(v, b"bytes", "x"))
    assert events == ["fsync_file", "link", ("fsync_dir", "root/runs/a")]  # nothing new above the key


@pytest.mark.parametrize("failing", [
    pytest.param(None, id="key-directory",
                 marks=pytest.mark.fault("managed", "directory fsync failing after the publish (file://)")),
    pytest.param("runs", id="new-parent",
                 marks=pytest.mark.fault("managed", "new parent directory's sync failing after the publish (file://)")),
])
def test_local_directory_sync_failure_leaves_no_key(write_path, tmp_path, monkeypatch, failing):
    """A directory sync after the publish fails (EIO): the key's own directory (every directory sync fails), or
    only a directory made for the key (``runs``, synced through its parent while the key's directory syncs). No
    receipt, so no key either, and no temp file."""
    import errno
    import stat

    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode) and (
                failing is None or os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / failing)):
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    t = target(tmp_path)
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/a/b.gart"})
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"bytes", "x"))
    assert e.value.code == "delivery_failed" and str(tmp_path) not in str(e.value)
    assert os.listdir(tmp_path / "runs/a") == []


@pytest.mark.fault("managed", "file:// object read while being written; writer killed -9 mid-write")
def test_local_write_never_shows_a_partial_object_and_leaves_nothing_after_kill_9(write_path, tmp_path):
    """A writer process stopped in the middle of writing a 4 MiB object, then killed with SIGKILL: while it is
    stopped the key does not exist (a reader never sees a partial object); afterwards the unnamed path leaves
    nothing at all (the kernel frees an unnamed file with its last descriptor), the named fallback at most its
    hidden temp file, which ``leftovers`` lists."""
    import signal
    import subprocess
    import sys
    import time

    script = f"""
import asyncio, os, signal, sys
from pathlib import Path
import genartifact_fsspec_target as ft
if {write_path == "named"!r}:
    ft._O_TMPFILE = 0
real_write = os.write
def write(fd, data):
    n = real_write(fd, data[: len(data) // 2])  # half the object is on disk ...
    print("half", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # ... when the test looks, then kills this process
    return n
os.write = write
ft._write_local_create_only(Path({str(tmp_path)!r}) / "runs/a/b.gart", b"x" * (4 << 20))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "half"
        deadline = time.monotonic() + 10
        while open(f"/proc/{proc.pid}/stat").read().split(") ")[1][0] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        names = os.listdir(tmp_path / "runs/a")
        if write_path == "unnamed":
            assert names == []  # not even a temp name
        else:
            assert len(names) == 1 and names[0].startswith(".genartifact-tmp-")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    left = os.listdir(tmp_path / "runs/a")
    if write_path == "unnamed":
        assert left == []
    else:
        assert len(left) == 1 and left[0].startswith(".genartifact-tmp-")
        os.utime(tmp_path / "runs/a" / left[0], (1, 1))
        found = asyncio.run(target(tmp_path).leftovers(older_than_s=60))
        assert [f["path"] for f in found] == [str(tmp_path / "runs/a" / left[0])]


@pytest.mark.parametrize("err", ["EOPNOTSUPP", "EISDIR", "EINVAL"])
@pytest.mark.fault("managed", "filesystem without O_TMPFILE (file://)")
def test_local_write_falls_back_to_a_named_temp_when_the_filesystem_has_no_o_tmpfile(tmp_path, monkeypatch, err):
    """``open(dir, O_TMPFILE)`` refused the way a filesystem or kernel without it refuses (``open(2)``): the object
    is still written create-only, through a named temp file that is gone afterwards; other open errors (EACCES)
    are delivery failures, not fallbacks."""
    import errno

    import genartifact_fsspec_target as ft

    real_open = os.open
    opened = []

    def fake_open(path, flags, *a, **kw):
        if flags & ft._O_TMPFILE == ft._O_TMPFILE:
            opened.append("tmpfile")
            raise OSError(getattr(errno, err), os.strerror(getattr(errno, err)))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    t = target(tmp_path)
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/a/b.gart"})
    assert asyncio.run(t.deliver(v, b"payload", "x")) == "disk:runs/a/b.gart"
    assert opened == ["tmpfile"]
    assert (tmp_path / "runs/a/b.gart").read_bytes() == b"payload"
    assert os.listdir(tmp_path / "runs/a") == ["b.gart"]
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"again", "x"))
    assert e.value.code == "object_exists"

    def denied(path, flags, *a, **kw):
        if flags & ft._O_TMPFILE == ft._O_TMPFILE:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", denied)
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/a/c.gart"})
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"payload", "x"))
    assert e.value.code == "delivery_failed"
    assert os.listdir(tmp_path / "runs/a") == ["b.gart"]


@pytest.mark.fault("managed", "second write to a memory:// key")
def test_memory_create_only(mem_root):
    t = target("/unused", mem_root)
    v = t.validate({"kind": "managed_fsspec", "profile": "mem", "object_key": "k1"})
    asyncio.run(t.deliver(v, b"one", "x"))
    with pytest.raises(DeliveryError, match="already exists"):
        asyncio.run(t.deliver(v, b"two", "x"))
    assert fsspec.filesystem("memory").cat_file(f"{mem_root}/k1") == b"one"


@pytest.mark.parametrize("profile", ["mem", "disk"])
@pytest.mark.fault("managed", "32 concurrent writers to one key")
def test_concurrent_writers_exactly_one_ready(tmp_path, mem_root, profile, monkeypatch):
    """Create-only is atomic: 32 writers racing on one key (threads and tasks) -> exactly one succeeds and the
    stored bytes are the winner's. The memory store's existence check is slowed to widen any race window."""
    import threading
    import time

    from fsspec.implementations.memory import MemoryFileSystem

    orig_exists = MemoryFileSystem.exists

    def slow_exists(self, path, **kw):
        r = orig_exists(self, path, **kw)
        time.sleep(0.005)
        return r

    monkeypatch.setattr(MemoryFileSystem, "exists", slow_exists)

    t = target(tmp_path, mem_root)
    v = t.validate({"kind": "managed_fsspec", "profile": profile, "object_key": "runs/race.gart"})
    results: dict[int, str] = {}
    barrier = threading.Barrier(8)

    def writer(i):
        async def many():
            barrier.wait()
            return await asyncio.gather(*(t.deliver(v, b"w%d-%d" % (i, j), "x") for j in range(4)),
                                        return_exceptions=True)
        for j, r in enumerate(asyncio.run(many())):
            results[i * 4 + j] = "ready" if isinstance(r, str) else r.code

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    winners = [n for n, r in results.items() if r == "ready"]
    assert len(winners) == 1 and sorted(set(results.values())) == ["object_exists", "ready"]
    stored = asyncio.run(t.open(f"{profile}:runs/race.gart", 1 << 20))
    assert stored == b"w%d-%d" % divmod(winners[0], 4)


@pytest.mark.parametrize("profile", ["mem", "disk"])
def test_read_back_protocol(tmp_path, mem_root, profile):
    import hashlib

    from genartifact.errors import ObjectNotFoundError, ObjectTooLargeError

    t = target(tmp_path, mem_root)
    oid = f"{profile}:runs/rb.gart"
    assert asyncio.run(t.exists(oid)) is False
    with pytest.raises(ObjectNotFoundError):
        asyncio.run(t.open(oid, 100))
    v = t.validate({"kind": "managed_fsspec", "profile": profile, "object_key": "runs/rb.gart"})
    asyncio.run(t.deliver(v, b"0123456789", "x"))
    assert asyncio.run(t.exists(oid)) is True
    assert asyncio.run(t.open(oid, 10)) == b"0123456789"
    with pytest.raises(ObjectTooLargeError):
        asyncio.run(t.open(oid, 9))
    assert asyncio.run(t.delete(oid, hashlib.sha256(b"other").hexdigest())) is False  # not our bytes: kept
    assert asyncio.run(t.open(oid, 10)) == b"0123456789"
    assert asyncio.run(t.delete(oid, hashlib.sha256(b"0123456789").hexdigest())) is True
    assert asyncio.run(t.exists(oid)) is False
    assert asyncio.run(t.delete(oid, hashlib.sha256(b"0123456789").hexdigest())) is False
    for bad in ("nocolon", "ghost:runs/x", f"{profile}:../etc/passwd", "disk:elsewhere/x"):
        with pytest.raises(TargetError):
            asyncio.run(t.open(bad, 10))
    with pytest.raises(TargetError, match="sha256"):
        asyncio.run(t.delete(oid, "XYZ"))


@pytest.mark.fault("managed", "conditional delete of an object over max_bytes")
def test_conditional_delete_never_reads_past_max_bytes(tmp_path):
    import hashlib

    t = target(tmp_path, max_bytes=8)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs/big").write_bytes(b"A" * 100)
    assert asyncio.run(t.delete("disk:runs/big", hashlib.sha256(b"A" * 100).hexdigest())) is False
    assert (tmp_path / "runs/big").exists()


@pytest.mark.fault("managed", "temp files left by a crash")
def test_crash_temp_files_listed_and_removed_with_age_guard(tmp_path):
    t = target(tmp_path)
    (tmp_path / "runs/sub").mkdir(parents=True)
    old = tmp_path / "runs/sub/.genartifact-tmp-abc"
    old.write_bytes(b"partial")
    os.utime(old, (1, 1))
    fresh = tmp_path / "runs/.genartifact-tmp-new"
    fresh.write_bytes(b"in flight")
    (tmp_path / "runs/.tmp-not-ours").write_bytes(b"x")
    found = asyncio.run(t.leftovers(older_than_s=60))
    assert [f["path"] for f in found] == [str(old)]
    assert asyncio.run(t.remove_leftover(found[0])) is True
    assert not old.exists() and fresh.exists() and (tmp_path / "runs/.tmp-not-ours").exists()
    with pytest.raises(TargetError):
        asyncio.run(t.remove_leftover({"profile": "disk", "path": str(tmp_path / "runs/.tmp-not-ours")}))


@pytest.mark.fault("managed", "object over the profile's max_bytes")
def test_over_max_bytes_refused_before_write(tmp_path):
    t = target(tmp_path, max_bytes=4)
    v = t.validate({"kind": "managed_fsspec", "profile": "disk", "object_key": "runs/big"})
    with pytest.raises(DeliveryError) as e:
        asyncio.run(t.deliver(v, b"12345", "x"))
    assert e.value.code == "too_large" and not (tmp_path / "runs/big").exists()


def test_hook_serves_only_its_kind_and_profile_defaults_and_bounds():
    """Pinned for mutation survivors: the hook answers only ``managed_fsspec``; documented defaults; the
    attempts range 1..10."""
    from genartifact_fsspec_target import genartifact_storage_target

    for other in ("presigned_http_put", "aaa", "zzz", "managed_fsspeC"):
        assert genartifact_storage_target(kind=other, settings={}) is None
    assert genartifact_storage_target(kind="managed_fsspec", settings={}) is not None
    p = parse_profiles({"profiles": {"p": {"url": "memory://x", "allowed_prefixes": [""]}}})["p"]
    assert (p.timeout_s, p.connect_timeout_s, p.read_timeout_s, p.max_attempts, p.checksum) == \
        (60.0, 5.0, 30.0, 3, "when_required")
    for ok in (1, 10):
        parse_profiles({"profiles": {"p": {"url": "memory://x", "allowed_prefixes": [""], "max_attempts": ok}}})
    for bad in (0, 11, True):
        with pytest.raises(ConfigError, match="max_attempts"):
            parse_profiles({"profiles": {"p": {"url": "memory://x", "allowed_prefixes": [""], "max_attempts": bad}}})


# ---- pinned for mutation survivors (issue 10) ----------------------------------------------------------------


def _sha(b):
    import hashlib

    return hashlib.sha256(b).hexdigest()


@pytest.mark.parametrize("race", ["replaced", "removed", "none"])
@pytest.mark.fault("managed", "file replaced or removed while hashed for delete")
def test_local_conditional_delete_keeps_a_file_replaced_while_hashing(tmp_path, monkeypatch, race):
    """The file checked is the file deleted: replaced (other inode, even with the same bytes) or removed between
    the hash and the unlink -> False, the new file is kept; untouched -> deleted."""
    import genartifact_fsspec_target as ft

    t = target(tmp_path)
    (tmp_path / "runs").mkdir()
    path = tmp_path / "runs/x"
    path.write_bytes(b"same bytes")
    real = ft._read_capped_fileobj

    def racing(f, size, max_bytes, h=None):
        out = real(f, size, max_bytes, h)
        if race == "replaced":
            (tmp_path / "runs/x.new").write_bytes(b"same bytes")
            os.replace(tmp_path / "runs/x.new", path)
        elif race == "removed":
            path.unlink()
        return out

    monkeypatch.setattr(ft, "_read_capped_fileobj", racing)
    got = asyncio.run(t.delete("disk:runs/x", _sha(b"same bytes")))
    assert got is (race == "none")
    assert path.exists() is (race == "replaced")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == (["x"] if race == "replaced" else [])


def test_target_shorthand_serves_only_its_kind():
    from genartifact_fsspec_target import genartifact_target_shorthand

    assert genartifact_target_shorthand(kind="managed_fsspec", value="s3", run_id="r1", index=7) == \
        {"kind": "managed_fsspec", "profile": "s3", "object_key": "runs/r1/00007.gart"}
    for other in ("presigned_http_put", "aaa", "zzz", "managed_fsspeC", ""):
        assert genartifact_target_shorthand(kind=other, value="s3", run_id="r1", index=7) is None


def _s3_profile(**so):
    return parse_profiles({"profiles": {"s3": {"url": "s3://b/p", "allowed_prefixes": ["runs/"], "max_attempts": 2,
                                               "connect_timeout_s": 1.5, "read_timeout_s": 7.0,
                                               "storage_options": so}}})["s3"]


def test_client_kwargs_take_credentials_endpoint_and_config_from_storage_options():
    from genartifact_fsspec_target import _client_kwargs

    kw = _client_kwargs(_s3_profile(key="K", secret="S", token="T", endpoint_url="http://127.0.0.1:9",
                                    client_kwargs={"region_name": "eu-west-9"},
                                    config_kwargs={"max_pool_connections": 3, "connect_timeout": 99}))
    cfg = kw.pop("config")
    assert kw == {"aws_access_key_id": "K", "aws_secret_access_key": "S", "aws_session_token": "T",
                  "endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-9"}
    assert cfg.max_pool_connections == 3  # the user's config_kwargs are kept...
    assert (cfg.connect_timeout, cfg.read_timeout) == (1.5, 7.0)  # ...the profile's timeouts win
    assert cfg.retries == {"total_max_attempts": 2, "mode": "standard"}
    assert cfg.request_checksum_calculation == "when_required"
    for so in ({}, {"config_kwargs": None}, {"key": None}):  # nothing given: nothing passed, no error
        kw = _client_kwargs(_s3_profile(**so))
        assert set(kw) == {"config"} and kw["config"].connect_timeout == 1.5


def test_s3_filesystem_keeps_config_kwargs_and_profile_settings():
    pytest.importorskip("s3fs")
    from genartifact_fsspec_target import s3_filesystem

    fs = s3_filesystem(_s3_profile(key="K", secret="S", config_kwargs={"max_pool_connections": 3}))
    assert fs.config_kwargs["max_pool_connections"] == 3
    assert fs.config_kwargs["connect_timeout"] == 1.5 and fs.retries == 1
    assert s3_filesystem(_s3_profile(key="K", secret="S")).config_kwargs["read_timeout"] == 7.0


class _ClientError(Exception):
    def __init__(self, status, code, retries=0):
        super().__init__(code)
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status, "RetryAttempts": retries},
                         "Error": {"Code": code}}


@pytest.mark.parametrize("status, code, absent", [
    (404, "", True), (None, "NoSuchKey", True), (None, "NotFound", True), (None, "404", True),
    (403, "AccessDenied", False), (400, "BadRequest", False), (405, "MethodNotAllowed", False),
    (410, "Gone", False), (500, "InternalError", False), (None, "", False)])
@pytest.mark.fault("s3", "read-back error classified")
def test_read_back_404_means_absent_other_errors_do_not(status, code, absent):
    from genartifact_fsspec_target import _is_not_found

    assert _is_not_found(_ClientError(status, code)) is absent


@pytest.mark.parametrize("status, code, retries, matches, outcome", [
    (412, "PreconditionFailed", 1, True, "idempotent"),  # a resend: an earlier attempt of ours landed
    (412, "PreconditionFailed", 2, False, "object_exists"),
    (None, "PreconditionFailed", 1, False, "object_exists"),
    (412, "PreconditionFailed", 0, True, "object_exists"),  # first PUT: there before us, even if identical
    (412, "", 1, True, "idempotent"),  # the status alone decides (a store that sends no error code)
    (409, "", 1, True, "object_exists"),
    (409, "ConditionalRequestConflict", 1, True, "object_exists"),  # a concurrent conditional write: never ours
    (None, "ConditionalRequestConflict", 1, False, "object_exists"),
    (400, "BadDigest", 1, True, "delivery_failed"),
    (403, "AccessDenied", 0, True, "delivery_failed"),
    (411, "MissingContentLength", 1, True, "delivery_failed"),
])
@pytest.mark.fault("s3", "conditional PutObject answer")
def test_s3_conditional_put_outcomes(monkeypatch, status, code, retries, matches, outcome):
    """A 412 on a resent PUT is checked by read-back (ours -> success, else object_exists); on the first PUT and
    for 409 it is object_exists without a read; any other 4xx is delivery_failed."""
    import genartifact_fsspec_target as ft

    checked = []

    class Client:
        async def put_object(self, **kw):
            raise _ClientError(status, code, retries)

    async def fake_client(prof):
        return Client()

    async def fake_matches(client, prof, key, sha256, size):
        checked.append(size)
        return matches

    monkeypatch.setattr(ft, "s3_client", fake_client)
    monkeypatch.setattr(ft, "_s3_matches", fake_matches)
    prof = _s3_profile(key="K", secret="S")
    if outcome == "idempotent":
        asyncio.run(ft._write_s3_create_only(prof, "runs/x", b"abc", _sha(b"abc")))
    else:
        with pytest.raises(DeliveryError) as e:
            asyncio.run(ft._write_s3_create_only(prof, "runs/x", b"abc", _sha(b"abc")))
        assert e.value.code == ("object_exists" if outcome == "object_exists" else "delivery_failed")
    # read back (size first) only for a failed precondition on a resend that is not a 409
    reads = status != 409 and retries > 0 and (status == 412 or code in ("PreconditionFailed",
                                                                         "ConditionalRequestConflict"))
    assert checked == ([3] if reads else [])


@pytest.mark.fault("managed", "object larger than one read chunk or one byte over max_bytes")
def test_read_back_across_chunks_and_at_the_size_limit(tmp_path):
    """Objects over the 1 MiB read chunk come back whole (file:// through open() and through the streaming
    open_object()); exactly max_bytes is accepted, one byte more is ObjectTooLargeError, never truncated."""
    from genartifact.errors import ObjectTooLargeError
    from genartifact_fsspec_target import _read_capped_fileobj, open_object

    size = (1 << 20) + (1 << 19) + 7
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs/big").write_bytes(data)
    t = target(tmp_path, max_bytes=size)
    assert asyncio.run(t.open("disk:runs/big", size)) == data
    assert open_object(t.profiles["disk"], "runs/big") == data
    small = target(tmp_path, max_bytes=size - 1)
    with pytest.raises(ObjectTooLargeError):
        open_object(small.profiles["disk"], "runs/big")  # no size known up front: streamed, stopped at +1
    with pytest.raises(ObjectTooLargeError):
        asyncio.run(small.open("disk:runs/big", size - 1))
    import io

    for cap in (size, size - 1, 10):  # unknown size: never more than cap + 1 bytes read
        f = io.BytesIO(data)
        got = _read_capped_fileobj(f, None, cap)
        assert got == (data if cap >= size else None)
        assert f.tell() <= cap + 1


def test_profile_dataclass_defaults_match_the_documented_ones():
    """docs/storage.md: timeouts 60 s whole / 5 s connect / 30 s read, 3 attempts, checksum when_required."""
    import dataclasses

    from genartifact_fsspec_target import Profile

    d = {f.name: f.default for f in dataclasses.fields(Profile)}
    assert (d["timeout_s"], d["connect_timeout_s"], d["read_timeout_s"], d["max_attempts"], d["checksum"]) == \
        (60.0, 5.0, 30.0, 3, "when_required")


def test_target_reused_only_for_the_same_unchanged_settings(tmp_path, monkeypatch):
    from genartifact_fsspec_target import ENV_PROFILES, genartifact_storage_target

    monkeypatch.delenv(ENV_PROFILES, raising=False)
    settings = {"profiles": {"a": {"url": f"file://{tmp_path}", "allowed_prefixes": ["runs/"]}}}
    t1 = genartifact_storage_target("managed_fsspec", settings)
    assert genartifact_storage_target("managed_fsspec", settings) is t1  # same object, unchanged: reused
    settings["profiles"]["a"]["allowed_prefixes"] = ["other/"]  # mutated in place: parsed again
    t2 = genartifact_storage_target("managed_fsspec", settings)
    assert t2 is not t1 and list(t2.profiles["a"].allowed_prefixes) == ["other/"]
    equal_copy = {"profiles": {"a": {"url": f"file://{tmp_path}", "allowed_prefixes": ["other/"]}}}
    assert genartifact_storage_target("managed_fsspec", equal_copy) is not t2  # another object: parsed
    monkeypatch.setenv(ENV_PROFILES, '{"b": {"url": "memory://x", "allowed_prefixes": [""]}}')
    t3 = genartifact_storage_target("managed_fsspec", equal_copy)
    assert sorted(t3.profiles) == ["a", "b"]  # the environment's profiles count too


@pytest.mark.fault("managed", "target cache: settings changed in place to an equal value of another type")
def test_target_cache_compares_types_not_just_equality(monkeypatch):
    """``1 == True == 1.0``: a setting changed in place from 1 to True (or 1.0) is invalid and must be refused,
    not served from the target parsed before the change."""
    from genartifact_fsspec_target import ENV_PROFILES, genartifact_storage_target

    monkeypatch.delenv(ENV_PROFILES, raising=False)
    settings = {"profiles": {"a": {"url": "memory://x", "allowed_prefixes": ["runs/"], "max_attempts": 1}}}
    t1 = genartifact_storage_target("managed_fsspec", settings)
    assert genartifact_storage_target("managed_fsspec", settings) is t1
    for bad in (True, 1.0):
        settings["profiles"]["a"]["max_attempts"] = bad
        with pytest.raises(ConfigError, match="max_attempts"):
            genartifact_storage_target("managed_fsspec", settings)


@pytest.mark.fault("managed", "target cache: settings changed in place to equal values of other types or order")
@pytest.mark.parametrize("change", ["list_to_tuple", "int_to_float", "reordered", "str_subclass", "same_again"])
def test_target_cache_reparses_any_change_the_pickle_shows(monkeypatch, change):
    """Plain settings (the usual TOML table) are compared by their pickle: every in-place change that ``_same``
    would catch (a list made an equal tuple, an int an equal float, keys reordered, a str subclass) parses again;
    writing back an identical value keeps the target."""
    import genartifact_fsspec_target as mod

    monkeypatch.delenv(mod.ENV_PROFILES, raising=False)
    prof = {"url": "memory://x", "allowed_prefixes": ["runs/"], "timeout_s": 60}
    settings = {"profiles": {"a": prof}}
    t1 = mod.genartifact_storage_target("managed_fsspec", settings)
    assert mod._LAST_TARGET is not None and mod._LAST_TARGET[2] is not None  # the plain snapshot's pickle is kept
    assert mod.genartifact_storage_target("managed_fsspec", settings) is t1

    class S(str):
        pass

    if change == "list_to_tuple":
        prof["allowed_prefixes"] = ("runs/",)
    elif change == "int_to_float":
        prof["timeout_s"] = 60.0
    elif change == "reordered":
        settings["profiles"]["a"] = {k: prof[k] for k in reversed(list(prof))}
    elif change == "str_subclass":
        prof["url"] = S("memory://x")
    else:
        prof["allowed_prefixes"] = ["runs/"]  # a new, equal list: same bytes
    if change == "list_to_tuple":  # parsed again, and refused: the parse wants a list
        with pytest.raises(ConfigError, match="allowed_prefixes must be a non-empty list"):
            mod.genartifact_storage_target("managed_fsspec", settings)
        return
    t2 = mod.genartifact_storage_target("managed_fsspec", settings)
    assert (t2 is t1) == (change == "same_again")
    assert sorted(t2.profiles) == ["a"]


def test_target_cache_of_settings_that_are_not_plain_compares_by_walking(monkeypatch):
    """A snapshot holding other types (here bytes in storage_options) keeps no pickle: ``_same`` decides."""
    import genartifact_fsspec_target as mod

    monkeypatch.delenv(mod.ENV_PROFILES, raising=False)
    settings = {"profiles": {"a": {"url": "memory://x", "allowed_prefixes": ["runs/"],
                                   "storage_options": {"k": b"3"}}}}
    t1 = mod.genartifact_storage_target("managed_fsspec", settings)
    assert mod._LAST_TARGET is not None and mod._LAST_TARGET[2] is None
    assert mod.genartifact_storage_target("managed_fsspec", settings) is t1
    settings["profiles"]["a"]["storage_options"]["k"] = b"4"
    assert mod.genartifact_storage_target("managed_fsspec", settings) is not t1


@pytest.mark.fault("managed", "target cache: working directory changed (relative profile url)")
def test_target_cache_follows_the_working_directory(tmp_path, monkeypatch):
    from genartifact_fsspec_target import ENV_PROFILES, genartifact_storage_target

    monkeypatch.delenv(ENV_PROFILES, raising=False)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    settings = {"profiles": {"a": {"url": "store", "allowed_prefixes": ["runs/"]}}}
    monkeypatch.chdir(tmp_path / "one")
    t1 = genartifact_storage_target("managed_fsspec", settings)
    monkeypatch.chdir(tmp_path / "two")
    t2 = genartifact_storage_target("managed_fsspec", settings)
    assert t1.profiles["a"].url == f"file://{tmp_path / 'one' / 'store'}"
    assert t2.profiles["a"].url == f"file://{tmp_path / 'two' / 'store'}"  # as an uncached parse resolves it


@pytest.mark.fault("managed", "target cache: settings whose comparison raises or is ambiguous")
def test_target_cache_survives_settings_that_cannot_be_compared(monkeypatch):
    """Comparing the cached copy must never turn a good configuration into a failing one: an ``__eq__`` that
    raises, or a numpy array (ambiguous truth value) among the settings, just means parsing again."""
    import numpy as np
    from genartifact_fsspec_target import ENV_PROFILES, genartifact_storage_target

    monkeypatch.delenv(ENV_PROFILES, raising=False)

    class Touchy(dict):
        def __eq__(self, other):
            raise RuntimeError("no comparing")

        __hash__ = None

    for settings in (Touchy({"profiles": {"a": {"url": "memory://x", "allowed_prefixes": ["runs/"]}}}),
                     {"profiles": {"a": {"url": "memory://x", "allowed_prefixes": ["runs/"],
                                         "storage_options": {"v": np.arange(3)}}}}):
        for _ in range(3):
            assert sorted(genartifact_storage_target("managed_fsspec", settings).profiles) == ["a"]


@pytest.mark.fault("managed", "target cache: settings or environment changed while being parsed")
def test_target_cache_pairs_the_target_with_what_was_parsed(monkeypatch):
    """Another thread changing the settings object (or GENARTIFACT_STORAGE_PROFILES) while the profiles are being
    parsed must not leave a cached target that stands for other settings than the ones it was built from."""
    import genartifact_fsspec_target as m

    monkeypatch.delenv(m.ENV_PROFILES, raising=False)
    settings = {"profiles": {"a": {"url": "memory://x", "allowed_prefixes": ["runs/"]}}}
    real_parse = m.parse_profiles
    during = []

    def parse(*a, **kw):
        for f in during:
            f()
        return real_parse(*a, **kw)

    monkeypatch.setattr(m, "parse_profiles", parse)
    during[:] = [lambda: settings["profiles"]["a"].__setitem__("allowed_prefixes", ["other/"])]
    t1 = m.genartifact_storage_target("managed_fsspec", settings)  # settings now say other/
    during.clear()
    t2 = m.genartifact_storage_target("managed_fsspec", settings)
    assert t2.profiles["a"].allowed_prefixes == ("other/",), (t1.profiles["a"].allowed_prefixes, t2.profiles)
    # the environment flips to another value during the parse and back: the target must be the unflipped one's
    extra = '{"b": {"url": "memory://y", "allowed_prefixes": [""]}}'
    # through monkeypatch, so that the variable is removed again at teardown (set behind monkeypatch's back and then
    # deleted with delenv, teardown would "restore" it: it once leaked into every later test and subprocess)
    during[:] = [lambda: monkeypatch.setenv(m.ENV_PROFILES, extra)]
    settings2 = {"profiles": {"a": {"url": "memory://x", "allowed_prefixes": ["runs/"]}}}
    m.genartifact_storage_target("managed_fsspec", settings2)
    during.clear()
    monkeypatch.delenv(m.ENV_PROFILES)
    assert sorted(m.genartifact_storage_target("managed_fsspec", settings2).profiles) == ["a"]
