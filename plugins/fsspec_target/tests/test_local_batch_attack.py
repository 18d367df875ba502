"""managed_fsspec file:// batch writer under hostile inputs and injected faults: duplicate keys in one batch, keys
under new directories, directories replaced mid-batch, errors of every kind from the system calls, a writer
that cannot take work, closed and forgotten event loops, forks, and very large batches. Each delivery must get
exactly the result it would get alone, nothing partial is ever visible, and nothing hangs."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import resource
import signal
import stat
import threading
import time
import weakref

import genartifact_fsspec_target as ft
import pytest
from genartifact.errors import DeliveryError
from genartifact.testing import wait_child
from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles


def target(tmp_path, **extra):
    return ManagedFsspecTarget(parse_profiles({"profiles": {
        "disk": {"url": f"file://{tmp_path}", "allowed_prefixes": ["runs/"], **extra}}}))


def spec(key):
    return {"kind": "managed_fsspec", "profile": "disk", "object_key": key}


def codes(results):
    return [r.code if r is not None else None for r in results]


def dir_path(fd):
    return os.readlink(f"/proc/self/fd/{fd}")


@contextlib.contextmanager
def spare_descriptors(n):
    """RLIMIT_NOFILE set so that exactly ``n`` descriptor numbers are free below it: every free number up to the
    highest one in use is taken first (``/dev/null``), since a limit above that alone leaves the holes free too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(x) for x in os.listdir("/proc/self/fd"))
    fillers = []
    while (fd := os.open(os.devnull, os.O_RDONLY)) <= top:
        fillers.append(fd)
    os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1 + n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fillers:
            os.close(fd)


def all_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


# ---------------------------------------------------------------------------------------- duplicate keys


@pytest.mark.parametrize("path", ["unnamed", "named"])
@pytest.mark.fault("managed", "two deliveries of one key in one file:// batch")
def test_same_key_twice_in_one_batch_one_wins(tmp_path, monkeypatch, path):
    """Two jobs with the same key in one batch: the first is stored with its bytes intact, the second is
    object_exists, and no temp file is left (both write paths)."""
    if path == "named":
        monkeypatch.setattr(ft, "_O_TMPFILE", 0)
    dest = tmp_path / "runs/k.gart"
    res = ft._write_local_batch([(dest, b"first"), (dest, b"second"), (dest, b"third")])
    assert codes(res) == [None, "object_exists", "object_exists"]
    assert dest.read_bytes() == b"first"
    assert all_files(tmp_path) == ["runs/k.gart"]


def test_same_key_in_one_loop_turn_through_deliver(tmp_path):
    """The same key asked for twice in one loop turn (one batch): exactly one delivery wins."""
    t = target(tmp_path)

    async def main():
        v = t.validate(spec("runs/same.gart"))
        return await asyncio.gather(*(t.deliver(v, b"v%d" % i, "s") for i in range(4)), return_exceptions=True)

    out = asyncio.run(main())
    assert out[0] == "disk:runs/same.gart"
    assert [e.code for e in out[1:]] == ["object_exists"] * 3
    assert (tmp_path / "runs/same.gart").read_bytes() == b"v0"


def test_same_key_from_two_event_loops_at_once(tmp_path):
    """Two event loops in two threads deliver the same keys at the same moment: every key is won exactly once,
    with the winner's bytes intact."""
    t = target(tmp_path)
    barrier = threading.Barrier(2)
    outs: dict[int, list] = {}

    def run(n):
        async def main():
            vs = [t.validate(spec(f"runs/{i}.gart")) for i in range(20)]
            barrier.wait()
            return await asyncio.gather(*(t.deliver(v, b"%d-%d" % (n, i), "s") for i, v in enumerate(vs)),
                                        return_exceptions=True)

        outs[n] = asyncio.run(main())

    ths = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(10)
    for i in range(20):
        won = [n for n in range(2) if outs[n][i] == f"disk:runs/{i}.gart"]
        lost = [n for n in range(2) if isinstance(outs[n][i], DeliveryError) and outs[n][i].code == "object_exists"]
        assert len(won) == 1 and len(lost) == 1, (i, outs[0][i], outs[1][i])
        assert (tmp_path / f"runs/{i}.gart").read_bytes() == b"%d-%d" % (won[0], i)


@pytest.mark.fault("managed", "directory fsync failing after a duplicate key in one file:// batch")
def test_duplicate_of_a_key_removed_by_a_failed_directory_sync_is_not_object_exists(tmp_path, monkeypatch):
    """Job 0 links a key, job 1 (same key) meets it; the key directory's fsync then fails and job 0's key is
    removed. Job 1 must not read as object_exists (there is no object): it fails like the directory it needed."""
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(os, "fsync", fsync)
    dest = tmp_path / "runs/k.gart"
    res = ft._write_local_batch([(dest, b"a"), (dest, b"b")])
    assert codes(res) == ["delivery_failed", "delivery_failed"]
    assert os.listdir(tmp_path / "runs") == []


# ---------------------------------------------------------------------------------------- new directories


def test_many_keys_under_new_nested_directories_in_one_batch(tmp_path):
    """Keys under new nested directories of several depths, sharing parents, in one batch: all stored."""
    jobs = [(tmp_path / f"runs/{a}/{b}/{c}.gart", b"%d%d%d" % (a, b, c))
            for a in range(3) for b in range(3) for c in range(2)]
    res = ft._write_local_batch(jobs)
    assert res == [None] * len(jobs)
    for dest, data in jobs:
        assert dest.read_bytes() == data


@pytest.mark.fault("managed", "first new directory's only job failing in a file:// batch")
def test_parent_of_a_shared_new_directory_is_synced_even_when_the_first_job_fails(tmp_path, monkeypatch):
    """``runs/new/a/1`` (fails: ENOSPC) and ``runs/new/b/2`` (stored) in one batch, ``runs/new`` made for the
    first: the stored key is durable only once ``runs/new``'s name is, so ``runs`` must be synced even though the
    job that made ``runs/new`` failed."""
    (tmp_path / "runs").mkdir()
    real_write, real_fsync = os.write, os.fsync
    synced: list[str] = []

    def write(fd, data):
        if bytes(data) == b"fail":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced.append(os.path.relpath(dir_path(fd), tmp_path))
        return real_fsync(fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    res = ft._write_local_batch([(tmp_path / "runs/new/a/1.gart", b"fail"), (tmp_path / "runs/new/b/2.gart", b"ok")])
    assert codes(res) == ["delivery_failed", None]
    assert "runs/new/b" in synced and "runs/new" in synced and "runs" in synced


@pytest.mark.parametrize("how", ["replaced", "removed"])
@pytest.mark.fault("managed", "key directory replaced or removed between jobs of one file:// batch")
def test_directory_replaced_between_jobs_of_one_batch(tmp_path, monkeypatch, how):
    """``runs/d`` is moved away (and replaced by a new directory, or not) after the batch's first job linked
    into it: the second job of ``runs/d`` is stored at its key's path, as it would be alone, not in the directory
    that moved away."""
    (tmp_path / "runs/d").mkdir(parents=True)
    real = ft._link_unnamed
    calls = []

    def link(fd, dir_fd, name):  # both files were written (in runs/d) before the first link
        ok = real(fd, dir_fd, name)
        calls.append(name)
        if len(calls) == 1:
            os.rename(tmp_path / "runs/d", tmp_path / "runs/moved")
            if how == "replaced":
                (tmp_path / "runs/d").mkdir()
        return ok

    monkeypatch.setattr(ft, "_link_unnamed", link)
    res = ft._write_local_batch([(tmp_path / "runs/d/1.gart", b"1"), (tmp_path / "runs/d/2.gart", b"2")])
    assert res == [None, None]
    assert (tmp_path / "runs/d/2.gart").read_bytes() == b"2"
    assert (tmp_path / "runs/moved/1.gart").read_bytes() == b"1"  # linked before the move: it moved with it


# ---------------------------------------------------------------------------------------- injected errors


@pytest.mark.parametrize("path", ["unnamed", "named"])
@pytest.mark.parametrize("call, err", [("write", errno.ENOSPC), ("write", errno.EIO), ("fsync", errno.EIO),
                                       ("fsync", errno.ENOSPC), ("link", errno.ENOSPC), ("link", errno.EIO)])
@pytest.mark.fault("managed", "os.write/fsync/link errors inside a file:// batch")
def test_system_call_error_fails_only_its_job_and_leaves_nothing(tmp_path, monkeypatch, path, call, err):
    """One job's os.write, file fsync or link fails (ENOSPC/EIO): that job is delivery_failed with no key and no
    temp file, the batch's other jobs are stored."""
    if path == "named":
        monkeypatch.setattr(ft, "_O_TMPFILE", 0)
    (tmp_path / "runs").mkdir()
    real = getattr(os, call)
    real_write = os.write
    bad: set[int] = set()  # inodes of files written with b"bad" (the batch's files are written from several threads)

    def write(fd, data):
        if bytes(data) == b"bad":
            bad.add(os.fstat(fd).st_ino)
            if call == "write":
                raise OSError(err, os.strerror(err))
        return real_write(fd, data)

    def faulty(*a, **kw):  # fsync(fd) or link(src, dst): of a file written with b"bad" (once: inodes are reused)
        ino = (os.fstat(a[0]) if call == "fsync" else os.stat(a[0])).st_ino
        if ino in bad:
            bad.discard(ino)
            raise OSError(err, os.strerror(err))
        return real(*a, **kw)

    monkeypatch.setattr(os, "write", write)
    if call != "write":
        monkeypatch.setattr(os, call, faulty)
    res = ft._write_local_batch([(tmp_path / "runs/1.gart", b"1"), (tmp_path / "runs/2.gart", b"bad"),
                                 (tmp_path / "runs/3.gart", b"3")])
    assert codes(res) == [None, "delivery_failed", None]
    assert sorted(os.listdir(tmp_path / "runs")) == ["1.gart", "3.gart"]


@pytest.mark.parametrize("where", ["write", "dir_fsync"])
@pytest.mark.fault("managed", "non-OSError exception inside a file:// batch")
def test_non_oserror_inside_a_batch_leaves_no_key_and_no_busy_writer(tmp_path, monkeypatch, where):
    """A non-OSError (here RuntimeError) in one job's write, or in a directory fsync: no delivery is told it
    failed while its key stays, every waiting delivery gets a result (no hang), and the writer takes the next
    delivery."""
    (tmp_path / "runs").mkdir()
    real_write, real_fsync = os.write, os.fsync

    def write(fd, data):
        if where == "write" and bytes(data) == b"boom":
            raise RuntimeError("not an OSError")
        return real_write(fd, data)

    def fsync(fd):
        if where == "dir_fsync" and stat.S_ISDIR(os.fstat(fd).st_mode):
            raise RuntimeError("not an OSError")
        return real_fsync(fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    t = target(tmp_path, timeout_s=5)

    async def main():
        keys = ["runs/1.gart", "runs/2.gart", "runs/3.gart"]
        out = await asyncio.wait_for(asyncio.gather(
            *(t.deliver(t.validate(spec(k)), b"boom" if k == "runs/2.gart" else b"ok", "s") for k in keys),
            return_exceptions=True), 2)
        monkeypatch.setattr(os, "write", real_write)
        monkeypatch.setattr(os, "fsync", real_fsync)
        after = await asyncio.wait_for(t.deliver(t.validate(spec("runs/after.gart")), b"a", "s"), 2)
        return out, after

    out, after = asyncio.run(main())
    assert after == "disk:runs/after.gart"
    stored = set(os.listdir(tmp_path / "runs")) - {"after.gart"}
    for k, r in zip(["1.gart", "2.gart", "3.gart"], out, strict=True):
        if isinstance(r, DeliveryError):
            assert r.code == "delivery_failed" and k not in stored, (k, r)
        else:
            assert r == f"disk:runs/{k}" and k in stored
    if where == "write":
        assert [isinstance(r, DeliveryError) for r in out] == [False, True, False]


@pytest.mark.fault("managed", "file:// writer thread refusing work")
def test_writer_that_cannot_take_work_fails_deliveries_instead_of_hanging(tmp_path, monkeypatch):
    """The writer's executor refuses the batch (RuntimeError, as after interpreter shutdown began): the waiting
    deliveries fail at once with delivery_failed (not a timeout), and the writer is not left busy."""
    from concurrent.futures import ThreadPoolExecutor

    dead = ThreadPoolExecutor(max_workers=1)
    dead.shutdown()
    real = ft._LocalWriter.executor
    monkeypatch.setattr(ft._LocalWriter, "executor", classmethod(lambda cls, root: dead))
    t = target(tmp_path, timeout_s=1.5)

    async def main():
        t0 = time.monotonic()
        out = await asyncio.gather(*(t.deliver(t.validate(spec(f"runs/{i}.gart")), b"x", "s") for i in range(3)),
                                   return_exceptions=True)
        took = time.monotonic() - t0
        monkeypatch.setattr(ft._LocalWriter, "executor", real)
        after = await t.deliver(t.validate(spec("runs/after.gart")), b"y", "s")
        return out, took, after, ft._local_writer(f"file://{tmp_path}")

    out, took, after, writer = asyncio.run(main())
    assert [e.code for e in out] == ["delivery_failed"] * 3 and took < 1
    assert len({id(e) for e in out}) == 3  # one exception object per delivery (tracebacks are per raise)
    assert after == "disk:runs/after.gart" and not writer.busy
    assert os.listdir(tmp_path / "runs") == ["after.gart"]


# ---------------------------------------------------------------------------------------- loops and processes


@pytest.mark.fault("managed", "event loop closed while its file:// batch is in the writer thread")
def test_loop_closed_while_a_batch_is_in_the_thread(tmp_path, monkeypatch):
    """The loop ends (its tasks cancelled, the loop closed) while its batch is held in the writer thread: the batch
    still completes (objects whole and durable), nothing raises in the thread, and a new loop delivers."""
    gate = threading.Event()
    entered = threading.Event()
    real = ft._write_local_batch

    def slow(jobs, *a):
        entered.set()
        gate.wait(5)
        return real(jobs, *a)

    monkeypatch.setattr(ft, "_write_local_batch", slow)
    t = target(tmp_path)
    loop = asyncio.new_event_loop()
    task = loop.create_task(t.deliver(t.validate(spec("runs/held.gart")), b"h", "s"))
    loop.run_until_complete(asyncio.sleep(0.01))
    assert entered.wait(2)
    task.cancel()
    loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    loop.close()
    gate.set()
    monkeypatch.setattr(ft, "_write_local_batch", real)
    assert asyncio.run(t.deliver(t.validate(spec("runs/next.gart")), b"n", "s")) == "disk:runs/next.gart"
    assert (tmp_path / "runs/held.gart").read_bytes() == b"h"


def test_finished_event_loops_are_not_kept_alive_by_their_writer(tmp_path):
    """An event loop that delivered a file:// object and was closed can be garbage-collected (the per-loop writer
    table is weak on the loop; the writer must not hold its loop strongly)."""
    t = target(tmp_path)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(t.deliver(t.validate(spec("runs/x.gart")), b"x", "s"))
    loop.close()
    ref = weakref.ref(loop)
    del loop
    gc.collect()
    assert ref() is None


@pytest.mark.fault("managed", "kill -9 of a process in the middle of a file:// batch")
def test_kill_9_mid_batch_leaves_only_whole_objects_and_no_temp(tmp_path):
    """A child is killed (SIGKILL) while its batch is writing the second object (after its file fsync, before
    its link): the first object is whole, the second is absent, and no temp file exists (O_TMPFILE path)."""
    (tmp_path / "runs").mkdir()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r)
            real_link = os.link
            n = [0]

            def link(*a, **kw):
                n[0] += 1
                if n[0] == 2:
                    os.write(w, b"!")
                    time.sleep(30)
                return real_link(*a, **kw)

            os.link = link
            ft._write_local_batch([(tmp_path / "runs/1.gart", b"1" * 5000), (tmp_path / "runs/2.gart", b"2" * 5000)])
        finally:
            os._exit(1)
    os.close(w)
    assert os.read(r, 1) == b"!"
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    assert all_files(tmp_path) == ["runs/1.gart"]
    assert (tmp_path / "runs/1.gart").read_bytes() == b"1" * 5000


@pytest.mark.fault("managed", "fork while a file:// batch is in flight")
def test_fork_while_a_batch_is_in_flight(tmp_path, monkeypatch):
    """The parent's batch is held in its writer thread when the process forks: the child delivers through a writer
    of its own at once, and the parent's batch completes."""
    gate, entered = threading.Event(), threading.Event()
    real = ft._write_local_batch

    def slow(jobs, *a):
        if any(d.name == "parent.gart" for d, _ in jobs):
            entered.set()
            gate.wait(5)
        return real(jobs, *a)

    monkeypatch.setattr(ft, "_write_local_batch", slow)
    t = target(tmp_path)

    def parent_side():
        asyncio.run(t.deliver(t.validate(spec("runs/parent.gart")), b"p", "s"))

    th = threading.Thread(target=parent_side)
    th.start()
    assert entered.wait(2)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            asyncio.run(asyncio.wait_for(t.deliver(t.validate(spec("runs/child.gart")), b"c", "s"), 2))
            code = 0
        finally:
            os._exit(code)
    assert wait_child(pid, 1.5) == 0
    gate.set()
    th.join(5)
    assert sorted(os.listdir(tmp_path / "runs")) == ["child.gart", "parent.gart"]


@pytest.mark.fault("managed", "fork after the file:// sync threads were started")
def test_forked_child_writes_a_batch_with_sync_threads_of_its_own(tmp_path):
    """The parent's sync threads exist (a batch of two went through them) when the process forks; they are not in
    the child, whose batch of two is fsynced by threads of its own at once (no wait for threads that are gone)."""
    jobs = [(tmp_path / "runs/p1.gart", b"1"), (tmp_path / "runs/p2.gart", b"2")]
    assert ft._write_local_batch(jobs, ft._LocalWriter.sync_pool()) == [None] * 2
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            res = ft._write_local_batch([(tmp_path / "runs/c1.gart", b"1"), (tmp_path / "runs/c2.gart", b"2")],
                                        ft._LocalWriter.sync_pool())
            code = 0 if res == [None, None] else 2
        finally:
            os._exit(code)
    assert wait_child(pid, 5) == 0
    assert sorted(os.listdir(tmp_path / "runs")) == ["c1.gart", "c2.gart", "p1.gart", "p2.gart"]


@pytest.mark.fault("managed", "fork while another thread holds the file:// writer table lock")
def test_fork_while_another_thread_holds_the_writer_table_lock(tmp_path):
    """A fork that happens while another thread is inside the writer table's lock (looking up its executor): the
    child's own lookup must not wait forever on a lock whose holder does not exist in the child."""
    t = target(tmp_path)
    held, release = threading.Event(), threading.Event()

    def holder():
        with ft._LocalWriter._lock:
            held.set()
            release.wait(5)

    th = threading.Thread(target=holder)
    th.start()
    assert held.wait(2)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                asyncio.run(t.deliver(t.validate(spec("runs/child.gart")), b"c", "s"))
                code = 0
            finally:
                os._exit(code)
        assert wait_child(pid, 1.5) == 0
    finally:
        release.set()
        th.join(5)
    assert os.listdir(tmp_path / "runs") == ["child.gart"]


# ---------------------------------------------------------------------------------------- sizes and volume


def test_thousands_of_deliveries_in_one_loop_turn(tmp_path, monkeypatch):
    """2000 small deliveries asked for in one loop turn, some of them to keys already taken: each gets its own
    result (stored or object_exists), nothing hangs, nothing is left over, and they go in batches of at most
    LOCAL_BATCH_MAX_JOBS (fsync is a no-op here: this is about scheduling, not durability)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    (tmp_path / "runs/d0").mkdir(parents=True)
    for i in range(0, 2000, 100):
        (tmp_path / f"runs/d{i % 7}").mkdir(exist_ok=True)
        (tmp_path / f"runs/d{i % 7}/{i}.gart").write_bytes(b"old")
    t = target(tmp_path)

    async def main():
        vs = [t.validate(spec(f"runs/d{i % 7}/{i}.gart")) for i in range(2000)]
        out = await asyncio.wait_for(asyncio.gather(*(t.deliver(v, b"%d" % i, "s") for i, v in enumerate(vs)),
                                                    return_exceptions=True), 30)
        return out, ft._local_writer(f"file://{tmp_path}")

    out, writer = asyncio.run(main())
    assert writer.objects == 2000 and writer.batches == -(-2000 // ft.LOCAL_BATCH_MAX_JOBS)
    for i, r in enumerate(out):
        if i % 100 == 0:
            assert isinstance(r, DeliveryError) and r.code == "object_exists"
            assert (tmp_path / f"runs/d{i % 7}/{i}.gart").read_bytes() == b"old"
        else:
            assert r == f"disk:runs/d{i % 7}/{i}.gart"
            assert (tmp_path / f"runs/d{i % 7}/{i}.gart").read_bytes() == b"%d" % i
    assert len(all_files(tmp_path)) == 2000


@pytest.mark.fault("managed", "one file:// batch with more new directories than free file descriptors")
def test_batch_with_more_directories_than_free_descriptors(tmp_path):
    """One loop turn of deliveries into more distinct directories than the process may hold descriptors for
    at once: each is stored as it would be alone (one batch must not hold a descriptor per directory until its
    end and run out: EMFILE would fail deliveries that alone succeed)."""
    t = target(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    n = 300

    async def main():
        vs = [t.validate(spec(f"runs/{i}/x.gart")) for i in range(n)]
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 100, hard))
        try:
            return await asyncio.gather(*(t.deliver(v, b"%d" % i, "s") for i, v in enumerate(vs)),
                                        return_exceptions=True)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    ft._LocalWriter.executor(f"file://{tmp_path}")  # its thread exists before the limit is lowered
    out = asyncio.run(main())
    assert out == [f"disk:runs/{i}/x.gart" for i in range(n)]


@pytest.mark.parametrize("extra, batched", [(0, True), (1, False)])
def test_objects_at_and_above_the_batch_limit(tmp_path, extra, batched):
    """An object of exactly LOCAL_BATCH_MAX_BYTES goes through the batch writer, one byte more through its own
    thread; both are stored whole."""
    t = target(tmp_path)
    data = os.urandom(ft.LOCAL_BATCH_MAX_BYTES + extra)

    async def main():
        await t.deliver(t.validate(spec("runs/edge.gart")), data, "s")
        return ft._LOCAL_WRITERS.get(asyncio.get_running_loop(), {}).get(f"file://{tmp_path}")

    writer = asyncio.run(main())
    assert (writer is not None and writer.objects == 1) is batched
    assert (tmp_path / "runs/edge.gart").read_bytes() == data


# ---------------------------------------------------------------------------------------- the sync threads


class QueuesThenRefuses:
    """A sync executor that, like ``ThreadPoolExecutor.submit`` when a thread cannot be started (EAGAIN at a pid
    limit), queues the work item and then raises, from its ``refuse_from``-th submit on; its queued items run only
    when :meth:`run_stale` says (a thread started later, for a later batch)."""

    def __init__(self, refuse_from: int) -> None:
        self.refuse_from, self.items = refuse_from, []

    def submit(self, fn, *a):
        self.items.append((fn, a))
        if len(self.items) >= self.refuse_from:
            raise RuntimeError("can't start new thread")
        return None

    def run_stale(self) -> None:
        items, self.items = self.items, []
        for fn, a in items:
            fn(*a)


@pytest.mark.parametrize("refuse_from", [1, 2])
@pytest.mark.fault("managed", "a file:// sync thread cannot be started (submit queued the item, then raised)")
def test_a_sync_thread_that_cannot_start_never_writes_twice_or_into_another_file(tmp_path, refuse_from):
    """The sync executor queues a job and raises (no thread): the batch writes that job itself, and when the stale
    item runs later (a thread started for the next batch) it leaves the descriptor alone: no object holds its bytes
    twice, and a file that got the descriptor number meanwhile is untouched."""
    sync = QueuesThenRefuses(refuse_from)
    res = ft._write_local_batch([(tmp_path / f"runs/{i}.gart", b"%d" % i * 1000) for i in range(4)], sync)
    assert res == [None] * 4
    others = [open(tmp_path / f"other{k}.txt", "wb") for k in range(8)]  # the numbers of the batch's descriptors
    try:
        sync.run_stale()
    finally:
        for f in others:
            f.close()
    assert all((tmp_path / f"other{k}.txt").read_bytes() == b"" for k in range(8))
    for i in range(4):
        assert (tmp_path / f"runs/{i}.gart").read_bytes() == b"%d" % i * 1000


@pytest.mark.fault("managed", "one file:// root's filesystem stuck in fsync")
def test_a_stuck_root_does_not_hold_another_roots_batches(tmp_path, monkeypatch):
    """Root A's fsyncs hang (a stuck mount) with its batch on every sync thread: a batch of root B is still written
    at once, by B's own writer thread (it takes the jobs no sync thread has started); A's completes when its
    filesystem comes back."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    stuck = threading.Event()
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "a")):
            stuck.wait(10)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ta, tb = target(tmp_path / "a"), target(tmp_path / "b")

    async def main():
        a = [asyncio.ensure_future(ta.deliver(ta.validate(spec(f"runs/{i}.gart")), b"a", "s")) for i in range(16)]
        await asyncio.sleep(0.1)  # root A's batch is in its threads, stuck
        t0 = time.monotonic()
        b = await asyncio.wait_for(asyncio.gather(*(tb.deliver(tb.validate(spec(f"runs/{i}.gart")), b"b", "s")
                                                    for i in range(4))), 5)
        took = time.monotonic() - t0
        assert not any(f.done() for f in a)
        stuck.set()
        return took, b, await asyncio.gather(*a)

    took, b, a = asyncio.run(main())
    assert took < 2 and len(b) == 4 and len(a) == 16
    assert len(os.listdir(tmp_path / "a/runs")) == 16 and len(os.listdir(tmp_path / "b/runs")) == 4


@pytest.mark.parametrize("fsync_fails", [False, True])
@pytest.mark.fault("managed", "close of a file:// batch's file fails (EIO)")
def test_a_close_error_fails_no_other_job(tmp_path, monkeypatch, fsync_fails):
    """Closing job 1's file raises EIO (after its link; or after its fsync failed too, as NFS may report): the other
    jobs are stored and their directory synced. A linked file's bytes were fsynced before its link, so job 1 is
    stored too; when its fsync failed it is delivery_failed and absent."""
    (tmp_path / "runs").mkdir()
    real_close, real_fsync, real_write = os.close, os.fsync, os.write
    bad: set[int] = set()
    dir_syncs = []

    def write(fd, data):
        if bytes(data) == b"bad":
            bad.add(os.fstat(fd).st_ino)
        return real_write(fd, data)

    def fsync(fd):
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            dir_syncs.append(fd)
        elif fsync_fails and st.st_ino in bad:
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    def close(fd):
        try:
            hit = os.fstat(fd).st_ino in bad
        except OSError:
            hit = False
        real_close(fd)
        if hit:
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "close", close)
    res = ft._write_local_batch([(tmp_path / f"runs/{i}.gart", b"bad" if i == 1 else b"ok") for i in range(4)],
                                ft._LocalWriter.sync_pool())
    assert codes(res) == [None, "delivery_failed" if fsync_fails else None, None, None]
    assert sorted(os.listdir(tmp_path / "runs")) == [f"{i}.gart" for i in range(4) if not (fsync_fails and i == 1)]
    assert len(dir_syncs) == 1


@pytest.mark.parametrize("again_s", [0, 0.05])
@pytest.mark.fault("managed", "exception in the thread waiting for a file:// batch's fsyncs")
def test_interrupted_batch_never_writes_into_another_file(tmp_path, monkeypatch, again_s):
    """The thread waiting for the batch's fsyncs is interrupted (a signal handler raises; ``again_s``: again every so
    often, as repeated Ctrl-C's) while sync threads are in slow writes: the exception comes out at once, and no job's
    bytes ever reach a file opened afterwards (it may get a number the batch used): a job not started never runs,
    and a running one closes its own descriptor when it is done."""
    (tmp_path / "runs").mkdir()
    real_write = os.write

    def write(fd, data):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        return real_write(fd, data)

    class Interrupt(Exception):
        pass

    def handler(*_):
        raise Interrupt

    monkeypatch.setattr(os, "write", write)
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.1, again_s)
    t0 = time.monotonic()
    try:
        with pytest.raises(Interrupt):
            try:
                ft._write_local_batch([(tmp_path / f"runs/{i}.gart", b"JOB%02d" % i) for i in range(16)],
                                      ft._LocalWriter.sync_pool())
            finally:
                while True:  # (a repeated interrupt may land in here too)
                    try:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                        break
                    except Interrupt:
                        pass
    finally:
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t0 < 0.3  # did not wait for the slow writes
    mine = [open(tmp_path / f"other{k}.txt", "wb", buffering=0) for k in range(16)]
    time.sleep(0.8)  # every running job is done by now
    for f in mine:
        f.close()
    assert [p.name for p in tmp_path.glob("other*") if p.read_bytes()] == []
    assert os.listdir(tmp_path / "runs") == []  # no object: nothing was linked


@pytest.mark.fault("managed", "interrupt between a file:// sync job's claim and its run")
def test_interrupt_right_after_a_claim_does_not_hang_the_batch(tmp_path, monkeypatch):
    """The batch's own thread is interrupted just after it claimed a job, before the job ran (a signal handler
    raising as the claim's lock is released): the exception comes out; the batch does not wait for a job that
    no one will ever finish."""

    class Lock:  # threading.Lock whose first release raises, as a signal handler would at that point
        fired = False

        def __init__(self):
            self.lock = threading.Lock()

        def __enter__(self):
            self.lock.__enter__()

        def __exit__(self, *a):
            self.lock.__exit__(*a)
            if not Lock.fired:
                Lock.fired = True
                raise KeyboardInterrupt

    real_init = ft._SyncJob.__init__

    def init(self, fd, data):
        real_init(self, fd, data)
        self._lock = Lock()

    monkeypatch.setattr(ft._SyncJob, "__init__", init)
    fds = [os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT) for i in range(2)]
    out = {}

    def batch():
        try:
            ft._write_and_sync_all({i: (fd, b"x") for i, fd in enumerate(fds)}, QueuesThenRefuses(1))  # (no thread)
            out["r"] = "returned"
        except KeyboardInterrupt:
            out["r"] = "interrupted"

    th = threading.Thread(target=batch, daemon=True)
    th.start()
    th.join(3)
    assert out.get("r") == "interrupted"
    for fd in fds:  # closed by the interrupted call (its contract), so closing again fails
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_key_under_an_earlier_jobs_key_meets_it_in_job_order(tmp_path):
    """Jobs ``runs/a`` then ``runs/a/b`` in one batch: as one after the other, the first is stored (a file) and the
    second cannot have ``runs/a`` as its directory (delivery_failed); the second's directory is not made before the
    first is linked."""
    (tmp_path / "runs").mkdir()
    res = ft._write_local_batch([(tmp_path / "runs/a", b"1"), (tmp_path / "runs/a/b", b"2")], ft._LocalWriter.sync_pool())
    assert codes(res) == [None, "delivery_failed"]
    assert (tmp_path / "runs/a").read_bytes() == b"1"


def test_sync_thread_count_changed_at_runtime(monkeypatch):
    """LOCAL_SYNC_THREADS set anew takes effect for the next batch (a new pool of that size; 1: none)."""
    for n in (2, 5):
        monkeypatch.setattr(ft, "LOCAL_SYNC_THREADS", n)
        assert ft._LocalWriter.sync_pool()._max_workers == n
    monkeypatch.setattr(ft, "LOCAL_SYNC_THREADS", 1)
    assert ft._LocalWriter.sync_pool() is None


@pytest.mark.parametrize("spare", [17, 18, 19, 24])
@pytest.mark.fault("managed", "few descriptors left (EMFILE) at a key directory's open in a file:// batch")
def test_a_batch_short_of_descriptors_for_its_directories_writes_the_rest_as_alone(tmp_path, spare):
    """16 jobs, each in a directory of its own, with ``spare`` descriptors to spare: the group runs out at a
    directory's open or a file's (odd and even spares); the jobs from there on are written one by one, as alone:
    every object stored. (A batch keeps each key directory open until its group commit, so 16 directories need
    17 descriptors at least, as before files were fsynced at once.)"""
    for i in range(16):
        (tmp_path / f"runs/d{i}").mkdir(parents=True)
    sync = ft._LocalWriter.sync_pool()
    assert ft._write_local_batch([(tmp_path / "runs/w1", b"w"), (tmp_path / "runs/w2", b"w")], sync) == [None] * 2
    with spare_descriptors(spare):
        res = ft._write_local_batch([(tmp_path / f"runs/d{i}/o.gart", b"%d" % i) for i in range(16)], sync)
    assert res == [None] * 16
    assert all((tmp_path / f"runs/d{i}/o.gart").read_bytes() == b"%d" % i for i in range(16))


@pytest.mark.fault("managed", "few descriptors left (EMFILE) for a file:// batch")
def test_a_batch_short_of_descriptors_writes_the_rest_as_alone(tmp_path):
    """Five descriptors to spare (RLIMIT_NOFILE): a group of 16 cannot hold its files open at once; the jobs from the
    first refused open on are written one by one once the others are closed, every object stored, as each would
    be alone."""
    (tmp_path / "runs").mkdir()
    sync = ft._LocalWriter.sync_pool()
    assert ft._write_local_batch([(tmp_path / "runs/w1", b"w"), (tmp_path / "runs/w2", b"w")], sync) == [None] * 2
    with spare_descriptors(5):
        res = ft._write_local_batch([(tmp_path / f"runs/{i}.gart", b"%d" % i) for i in range(16)], sync)
    assert res == [None] * 16
    assert all((tmp_path / f"runs/{i}.gart").read_bytes() == b"%d" % i for i in range(16))


@pytest.mark.fault("managed", "interrupt right after a file:// batch closes a staged file to write it again")
def test_interrupt_after_a_close_never_closes_that_number_twice(tmp_path, monkeypatch):
    """The key directory moves while the group's files are fsynced, so the link step closes the staged file to write
    the job again; an interrupt lands right after that close, when another thread has just opened a file under the
    same number: that file stays open (the number is not closed a second time)."""
    d = tmp_path / "runs/d"
    d.mkdir(parents=True)
    real_fsync, real_close = os.fsync, os.close
    state = {"moved": False, "armed": False, "app": None}

    def fsync(fd):
        r = real_fsync(fd)
        if not state["moved"] and "(deleted)" in os.readlink(f"/proc/self/fd/{fd}"):
            state["moved"] = state["armed"] = True  # a concurrent rename of the key directory
            os.rename(d, tmp_path / "runs/moved")
            d.mkdir()
        return r

    def close(fd):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}") if state["armed"] else ""
        except OSError:
            target = ""
        real_close(fd)
        if "moved" in target and "(deleted)" in target:
            state["armed"] = False
            state["app"] = os.open(tmp_path / "app.log", os.O_WRONLY | os.O_CREAT, 0o644)  # the number just freed
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "close", close)
    with pytest.raises(KeyboardInterrupt):
        ft._write_local_batch([(d / "k0", b"job0"), (d / "k1", b"job1")], None)
    monkeypatch.undo()
    assert state["app"] is not None
    os.fstat(state["app"])  # still open
    os.close(state["app"])


def test_a_busy_pool_keeps_no_bytes_of_finished_batches(tmp_path, monkeypatch):
    """Root A's batch holds every sync thread (its fsyncs hang); root B's batches are written by B's own thread and
    leave their never-started items in the shared queue: those items hold no object bytes (memory stays bounded
    while a mount hangs)."""
    stuck, real = threading.Event(), os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "a")):
            stuck.wait(10)
        return real(fd)

    jobs, real_init = [], ft._SyncJob.__init__

    def init(self, fd, data):
        real_init(self, fd, data)
        jobs.append(self)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(ft._SyncJob, "__init__", init)
    sync = ft._LocalWriter.sync_pool()
    a = threading.Thread(target=ft._write_local_batch,
                         args=([(tmp_path / f"a/{i}", b"a") for i in range(ft.LOCAL_SYNC_THREADS + 1)], sync))
    a.start()
    try:
        time.sleep(0.2)
        del jobs[:]
        for n in range(3):
            res = ft._write_local_batch([(tmp_path / f"b/{n}-{i}", b"B" * 65536) for i in range(16)], sync)
            assert res == [None] * 16
        assert len(jobs) == 48 and sum(len(j.data) for j in jobs) == 0  # (queued items still refer to them)
    finally:
        stuck.set()
        a.join(10)


@pytest.mark.parametrize("where", ["building", "abandoning"])
@pytest.mark.fault("managed", "interrupt while a file:// batch sets up or abandons its sync jobs")
def test_interrupt_while_setting_up_or_abandoning_leaves_no_file_open(tmp_path, monkeypatch, where):
    """An interrupt while the jobs are made, or a second one while an interrupted batch abandons them: every
    descriptor of the group is still closed (none left open for the life of the process)."""
    fds = [os.open(tmp_path, os.O_WRONLY | ft._O_TMPFILE, 0o600) for _ in range(6)]
    real_init, real_abandon = ft._SyncJob.__init__, ft._SyncJob.abandon
    made = []

    def init(self, fd, data):
        real_init(self, fd, data)
        made.append(self)
        if len(made) == 3:
            raise KeyboardInterrupt

    def abandon(self):
        real_abandon(self)
        if self is made[0]:
            raise KeyboardInterrupt  # the second interrupt, inside the clean-up

    monkeypatch.setattr(ft._SyncJob, "__init__", init)
    if where == "abandoning":
        monkeypatch.setattr(ft._SyncJob, "abandon", abandon)
    with pytest.raises(KeyboardInterrupt):
        ft._write_and_sync_all({i: (fd, b"x") for i, fd in enumerate(fds)}, QueuesThenRefuses(1))  # (no thread)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.fault("managed", "interrupt while a file:// batch writes its files in its own thread")
def test_interrupt_while_writing_without_sync_threads_leaves_no_file_open(tmp_path, monkeypatch):
    """No sync threads (``sync`` None: every lone delivery): an interrupt while the second of three files is written
    comes out, and every descriptor is closed (the caller must not close them again)."""
    fds = [os.open(tmp_path, os.O_WRONLY | ft._O_TMPFILE, 0o600) for _ in range(3)]
    real, n = ft._write_all, []

    def write_all(fd, data):
        n.append(fd)
        if len(n) == 2:
            raise KeyboardInterrupt
        return real(fd, data)

    monkeypatch.setattr(ft, "_write_all", write_all)
    with pytest.raises(KeyboardInterrupt):
        ft._write_and_sync_all({i: (fd, b"x") for i, fd in enumerate(fds)}, None)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
