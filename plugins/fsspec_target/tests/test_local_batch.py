"""managed_fsspec file:// batch writer: deliveries of one event-loop turn share one writer-thread hop and one
directory fsync per directory (group commit), each with exactly the result it would get alone."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import threading
from pathlib import Path

import genartifact_fsspec_target as ft
import pytest
from genartifact.errors import DeliveryError
from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles


def target(tmp_path, **extra):
    return ManagedFsspecTarget(parse_profiles({"profiles": {
        "disk": {"url": f"file://{tmp_path}", "allowed_prefixes": ["runs/"], **extra}}}))


def spec(key):
    return {"kind": "managed_fsspec", "profile": "disk", "object_key": key}


def test_one_loop_turn_is_one_batch_with_one_directory_fsync(tmp_path, sync_events):
    """Eight deliveries asked for in one loop turn: one batch (one hop to the writer thread), eight files written
    and fsynced (at once, from the sync threads), then linked, then the key directory synced once, after the last
    link — every object's bytes durable before its name, every key durable before any result."""
    t = target(tmp_path)
    (tmp_path / "runs").mkdir()
    events = sync_events(tmp_path)

    async def main():
        vs = [t.validate(spec(f"runs/{i}.gart")) for i in range(8)]
        out = await asyncio.gather(*(t.deliver(v, b"x%d" % i, "s") for i, v in enumerate(vs)))
        return out, ft._local_writer(f"file://{tmp_path}")

    out, writer = asyncio.run(main())
    assert out == [f"disk:runs/{i}.gart" for i in range(8)]
    assert (writer.batches, writer.objects) == (1, 8)
    assert events == ["fsync_file"] * 8 + ["link"] * 8 + [("fsync_dir", "runs")]
    assert events.synced_before_linked()
    assert sorted(os.listdir(tmp_path / "runs")) == sorted(f"{i}.gart" for i in range(8))
    assert (tmp_path / "runs/5.gart").read_bytes() == b"x5"


def test_deliveries_arriving_during_a_batch_go_together_as_the_next(tmp_path, monkeypatch):
    """Group commit under load: while the writer is busy with a batch, the deliveries asked for meanwhile wait
    and are written as one next batch."""
    t = target(tmp_path)
    gate = __import__("threading").Event()
    real = ft._write_local_batch

    def slow_batch(jobs, *a):
        gate.wait(5)
        return real(jobs, *a)

    monkeypatch.setattr(ft, "_write_local_batch", slow_batch)

    async def main():
        first = asyncio.ensure_future(t.deliver(t.validate(spec("runs/first.gart")), b"1", "s"))
        await asyncio.sleep(0.05)  # the first batch (one object) is in the thread, held by the gate
        rest = [asyncio.ensure_future(t.deliver(t.validate(spec(f"runs/{i}.gart")), b"2", "s")) for i in range(5)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(first, *rest)
        return ft._local_writer(f"file://{tmp_path}")

    writer = asyncio.run(main())
    assert (writer.batches, writer.objects) == (2, 6)
    assert len(os.listdir(tmp_path / "runs")) == 6


@pytest.mark.fault("managed", "batch of file:// writes with an existing key and a blocked directory")
def test_batch_results_are_independent(tmp_path):
    """One batch: an existing key (object_exists, the stored bytes untouched), a key whose directory is blocked
    by a file (delivery_failed), and good keys in two directories (stored) — each gets the result it would get
    alone."""
    (tmp_path / "runs/a").mkdir(parents=True)
    (tmp_path / "runs/a/taken.gart").write_bytes(b"old")
    (tmp_path / "runs/blocked").write_text("a file where a directory is needed")
    jobs = [(tmp_path / "runs/a/ok1.gart", b"1"), (tmp_path / "runs/a/taken.gart", b"new"),
            (tmp_path / "runs/blocked/x.gart", b"2"), (tmp_path / "runs/b/ok2.gart", b"3")]
    res = ft._write_local_batch(jobs)
    assert res[0] is None and res[3] is None
    assert isinstance(res[1], DeliveryError) and res[1].code == "object_exists"
    assert isinstance(res[2], DeliveryError) and res[2].code == "delivery_failed"
    assert (tmp_path / "runs/a/taken.gart").read_bytes() == b"old"
    assert (tmp_path / "runs/a/ok1.gart").read_bytes() == b"1" and (tmp_path / "runs/b/ok2.gart").read_bytes() == b"3"
    assert sorted(os.listdir(tmp_path / "runs/a")) == ["ok1.gart", "taken.gart"]  # no temp left


@pytest.mark.fault("managed", "directory fsync failing in a batch of file:// writes")
def test_batch_directory_sync_failure_fails_exactly_that_directorys_keys(tmp_path, monkeypatch):
    """The fsync of one key directory fails (EIO): every key linked into it in this batch is removed again and
    fails; keys of the batch in another directory are stored."""
    (tmp_path / "runs/bad").mkdir(parents=True)
    (tmp_path / "runs/good").mkdir()
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode) and os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "runs/bad"):
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    jobs = [(tmp_path / "runs/bad/1.gart", b"1"), (tmp_path / "runs/good/2.gart", b"2"),
            (tmp_path / "runs/bad/3.gart", b"3")]
    res = ft._write_local_batch(jobs)
    assert [r.code if r else None for r in res] == ["delivery_failed", None, "delivery_failed"]
    assert os.listdir(tmp_path / "runs/bad") == []
    assert os.listdir(tmp_path / "runs/good") == ["2.gart"]


def test_new_directories_synced_once_per_parent_in_a_batch(tmp_path, sync_events):
    """Two keys under two new directories with a new common parent: both key directories are synced, and each
    new directory's parent once (``runs`` holds both new names), after every link."""
    events = sync_events(tmp_path)
    res = ft._write_local_batch([(tmp_path / "runs/a/1.gart", b"1"), (tmp_path / "runs/b/2.gart", b"2")])
    assert res == [None, None]
    assert events == ["fsync_file", "fsync_file", "link", "link", ("fsync_dir", "runs/a"), ("fsync_dir", "runs"),
                      ("fsync_dir", "."), ("fsync_dir", "runs/b")]
    assert events.synced_before_linked()


def test_a_batch_fsyncs_its_files_at_once(tmp_path, monkeypatch):
    """The files of a batch are fsynced concurrently (from the sync threads), not one after another: here each
    file fsync waits until two are in flight at once, which one-by-one fsyncs never reach (the barrier breaks after
    5 s, failing its jobs). Every object is stored."""
    barrier = threading.Barrier(2, timeout=5)
    real = os.fsync
    threads = set()

    def fsync(fd):
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            threads.add(threading.get_ident())
            barrier.wait()
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    res = ft._write_local_batch([(tmp_path / f"runs/{i}.gart", b"%d" % i) for i in range(4)],
                                ft._LocalWriter.sync_pool())
    assert res == [None] * 4
    assert len(threads) >= 2
    assert sorted(os.listdir(tmp_path / "runs")) == [f"{i}.gart" for i in range(4)]


def test_a_batch_holds_at_most_a_sync_group_of_files_open(tmp_path, monkeypatch, sync_events):
    """A batch larger than LOCAL_SYNC_GROUP goes group by group (each group's files fsynced, then linked), so it
    never holds more than a group's descriptors of unnamed files; one directory fsync after the last link."""
    monkeypatch.setattr(ft, "LOCAL_SYNC_GROUP", 4)
    (tmp_path / "runs").mkdir()
    events = sync_events(tmp_path)
    res = ft._write_local_batch([(tmp_path / f"runs/{i}.gart", b"%d" % i) for i in range(10)])
    assert res == [None] * 10
    assert events == (["fsync_file"] * 4 + ["link"] * 4) * 2 + ["fsync_file"] * 2 + ["link"] * 2 + [
        ("fsync_dir", "runs")]
    assert events.synced_before_linked()


def test_a_batch_is_written_in_its_own_thread_when_no_sync_thread_can_be_had(tmp_path, monkeypatch):
    """The sync threads take no work (the interpreter is shutting down: submit refuses before it queues): the
    batch's files are written and fsynced one after another in the batch's own thread, every object stored."""

    class Refusing:
        def submit(self, *a, **kw):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    res = ft._write_local_batch([(tmp_path / f"runs/{i}.gart", b"%d" % i) for i in range(3)], Refusing())
    assert res == [None] * 3
    assert sorted(os.listdir(tmp_path / "runs")) == ["0.gart", "1.gart", "2.gart"]


@pytest.mark.fault("managed", "file:// delivery cancelled before its batch is sent")
def test_delivery_abandoned_before_its_batch_is_sent_is_never_written(tmp_path):
    """A delivery whose caller stops waiting in the same loop turn (cancelled before the batch goes to the writer
    thread) is dropped from the batch: nothing is written, and the writer is idle again (the next delivery goes
    through)."""
    t = target(tmp_path)

    async def main():
        task = asyncio.ensure_future(t.deliver(t.validate(spec("runs/late.gart")), b"x", "s"))
        await asyncio.sleep(0)  # the delivery is queued; the batch goes out after this turn
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await t.deliver(t.validate(spec("runs/next.gart")), b"y", "s")
        return ft._local_writer(f"file://{tmp_path}")

    writer = asyncio.run(main())
    assert os.listdir(tmp_path / "runs") == ["next.gart"]
    assert (writer.batches, writer.objects) == (1, 1)


def test_large_objects_bypass_the_batch_writer(tmp_path, monkeypatch):
    """Objects above LOCAL_BATCH_MAX_BYTES get a thread of their own (they must not queue behind each other)."""
    monkeypatch.setattr(ft, "LOCAL_BATCH_MAX_BYTES", 4)
    t = target(tmp_path)

    async def main():
        await t.deliver(t.validate(spec("runs/big.gart")), b"12345", "s")
        await t.deliver(t.validate(spec("runs/small.gart")), b"1234", "s")
        return ft._local_writer(f"file://{tmp_path}")

    writer = asyncio.run(main())
    assert (writer.batches, writer.objects) == (1, 1)
    assert sorted(os.listdir(tmp_path / "runs")) == ["big.gart", "small.gart"]


def test_forked_child_gets_its_own_writer_thread(tmp_path):
    """The writer thread is per process: a child forked after the parent wrote through it writes through its own
    (the parent's thread does not exist in the child; reusing its executor would wait forever)."""
    t = target(tmp_path)

    async def one(key):
        await t.deliver(t.validate(spec(key)), b"z", "s")

    asyncio.run(one("runs/parent.gart"))
    pid = os.fork()
    if pid == 0:  # child: exit status 0 only if the delivery completed
        code = 1
        try:
            asyncio.run(asyncio.wait_for(one("runs/child.gart"), 10))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sorted(os.listdir(tmp_path / "runs")) == ["child.gart", "parent.gart"]
    assert Path(tmp_path / "runs/child.gart").read_bytes() == b"z"
