"""CPU per ``file://`` delivery of the managed_fsspec target: the unnamed write (``O_TMPFILE`` + ``linkat``, the
default on Linux) ÷ the named-temp fallback (``mkstemp``, link, unlink), same objects, same directory.

    .venv/bin/python benchmarks/bench_local_write.py [--objects 400] [--kib 64] [--rounds 8] [--wave 16] [--batch-kib 2]

Each round writes ``--objects`` new objects of ``--kib`` KiB through ``_write_local_create_only`` on each side (in a
rotating order, fresh directory per side and round, fsyncs included as in production) and records the process CPU
time (user + system, ``time.process_time``) and wall time per object. CPU is the figure that matters for the
engine's host: a delivery's fsync waits on the disk but leaves the CPU to the engine. Prints the median-of-rounds
and paired ratios (> 1: the unnamed write costs less).

Second comparison, the delivery path of an event loop (what ``ManagedFsspecTarget.deliver`` does for objects of at
most ``LOCAL_BATCH_MAX_BYTES``): waves of ``--wave`` deliveries asked for in one loop turn (as when requests finish in
the same engine step), each side writing the same objects: "batched" goes through the profile's batch writer
(``_LocalWriter``: one writer-thread hop per batch, one directory fsync per batch), "thread each" is the path before
it (``asyncio.to_thread(_write_local_create_only, ...)`` per object: a hop and a directory fsync each). Prints process
CPU and wall time per object and the ratio (> 1: batched costs less).

Third comparison, the group commit inside a batch (what the profile's writer thread runs, ``_write_local_batch``):
batches of ``--wave`` objects of ``--batch-kib`` KiB whose files are written and fsynced at once from the sync threads
(``LOCAL_SYNC_THREADS``, as shipped) against one after another (``LOCAL_SYNC_THREADS = 1``); wall time per object is
the figure (a batch's receipts wait for all of it). Prints the ratio (> 1: at once is faster).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, ratio_line, rotation, side_line  # noqa: E402


async def _waves(ft, d: Path, data: bytes, objects: int, wave: int, batched: bool) -> None:
    import asyncio

    writer = ft._local_writer(f"file://{d.parent}")

    async def one(i: int) -> None:
        dest = d / f"{i:05d}.gart"
        if batched:
            await writer.write(dest, data)
        else:
            await asyncio.to_thread(ft._write_local_create_only, dest, data)

    for w in range(0, objects, wave):
        await asyncio.gather(*(one(i) for i in range(w, min(w + wave, objects))))


def delivery_path(ft, root: Path, data: bytes, args) -> None:
    """The batch writer ÷ a thread per delivery, in waves of ``args.wave`` per loop turn (see the module doc)."""
    import asyncio

    sides = ["batched", "thread each"]
    cpu: dict[str, list[float]] = {s: [] for s in sides}
    wall: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in rotation(sides, r):
            d = root / f"path-{side.replace(' ', '-')}-{r}"
            d.mkdir()
            ft._write_local_create_only(d / "warm", data)
            c0, w0 = time.process_time(), time.perf_counter()
            asyncio.run(_waves(ft, d, data, args.objects, args.wave, side == "batched"))
            cpu[side].append((time.process_time() - c0) / args.objects)
            wall[side].append((time.perf_counter() - w0) / args.objects)
            assert len(os.listdir(d)) == args.objects + 1, f"{side}: objects missing"
            shutil.rmtree(d)
    print(f"delivery path: {args.objects} objects x {args.kib} KiB per side and round in waves of {args.wave} per "
          f"loop turn, {args.rounds} rounds; {load_line()}")
    report("file:// delivery", sides, cpu, wall)


def group_commit(ft, root: Path, args) -> None:
    """A batch's files fsynced at once (``LOCAL_SYNC_THREADS`` threads, as shipped) ÷ one after another
    (``LOCAL_SYNC_THREADS = 1``): batches of ``args.wave`` objects of ``args.batch_kib`` KiB through
    ``_write_local_batch`` (what the profile's writer thread runs), wall time per object (the receipts of a batch
    wait for all of it)."""
    threads = ft.LOCAL_SYNC_THREADS
    sides = ["at once", "one by one"]
    cpu: dict[str, list[float]] = {s: [] for s in sides}
    wall: dict[str, list[float]] = {s: [] for s in sides}
    data = os.urandom(args.batch_kib << 10)
    try:
        for r in range(args.rounds):
            for side in rotation(sides, r):
                ft.LOCAL_SYNC_THREADS = threads if side == "at once" else 1
                sync = ft._LocalWriter.sync_pool()  # (None: one by one)
                d = root / f"batch-{side.replace(' ', '-')}-{r}"
                ft._write_local_batch([(d / "warm-0", data), (d / "warm-1", data)], sync)  # directory made, threads up
                c0, w0 = time.process_time(), time.perf_counter()
                for w in range(0, args.objects, args.wave):
                    n = min(args.wave, args.objects - w)
                    res = ft._write_local_batch([(d / f"{w + i:05d}.gart", data) for i in range(n)], sync)
                    assert res == [None] * n, f"{side}: {res}"
                cpu[side].append((time.process_time() - c0) / args.objects)
                wall[side].append((time.perf_counter() - w0) / args.objects)
                shutil.rmtree(d)
    finally:
        ft.LOCAL_SYNC_THREADS = threads
    print(f"group commit: batches of {args.wave} objects x {args.batch_kib} KiB, {args.objects} objects per side and "
          f"round, {args.rounds} rounds, {threads} sync threads; {load_line()}")
    report("file:// batch", sides, cpu, wall)


def report(what: str, sides: list[str], cpu: dict[str, list[float]], wall: dict[str, list[float]]) -> None:
    """Per side CPU and wall µs per object, then the ratios ``sides[1]`` / ``sides[0]`` (> 1: ``sides[0]`` costs
    less)."""
    for side in sides:
        print(side_line(f"{side} CPU/object", [v * 1e6 for v in cpu[side]], "us", higher_is_better=False))
        print(side_line(f"{side} wall/object", [v * 1e6 for v in wall[side]], "us", higher_is_better=False))
    a, b = sides
    for kind, per in (("CPU", cpu), ("wall", wall)):
        print(ratio_line(f"{what} {kind} per object, {b} / {a}", per[a], per[b], higher_is_better=False))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=400)
    ap.add_argument("--kib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dir", default=None, help="parent directory for the objects (default: the system temp dir)")
    ap.add_argument("--wave", type=int, default=16,
                    help="deliveries per event-loop turn (delivery-path comparison), objects per batch (group commit)")
    ap.add_argument("--batch-kib", type=int, default=2,
                    help="object size of the group-commit comparison (a tiny-model request's artifact: ~1.4 KiB)")
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.objects, args.kib, args.rounds, args.wave, args.batch_kib = 5, 1, 1, 2, 1
    import genartifact_fsspec_target as ft

    if not ft._O_TMPFILE:
        sys.exit("this platform has no O_TMPFILE: only the named path exists here")
    data = os.urandom(args.kib << 10)
    real = ft._O_TMPFILE
    cpu: dict[str, list[float]] = {"unnamed": [], "named": []}
    wall: dict[str, list[float]] = {"unnamed": [], "named": []}
    root = Path(tempfile.mkdtemp(prefix="bench-local-write-", dir=args.dir))
    try:
        for r in range(args.rounds):
            for side in rotation(["unnamed", "named"], r):
                ft._O_TMPFILE = real if side == "unnamed" else 0
                d = root / f"{side}-{r}"
                d.mkdir()
                ft._write_local_create_only(d / "warm", data)  # directory made, caches warm
                c0, w0 = time.process_time(), time.perf_counter()
                for i in range(args.objects):
                    ft._write_local_create_only(d / f"{i:05d}.gart", data)
                cpu[side].append((time.process_time() - c0) / args.objects)
                wall[side].append((time.perf_counter() - w0) / args.objects)
                left = sorted(p.name for p in d.iterdir() if p.name.startswith(ft.TEMP_PREFIX))
                assert not left, f"{side}: temp files left: {left[:3]}"
                shutil.rmtree(d)
        ft._O_TMPFILE = real
        delivery_path(ft, root, data, args)
        group_commit(ft, root, args)
    finally:
        ft._O_TMPFILE = real
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.objects} objects x {args.kib} KiB per side and round, {args.rounds} rounds; {load_line()}")
    report("local write", ["unnamed", "named"], cpu, wall)


if __name__ == "__main__":
    main()
