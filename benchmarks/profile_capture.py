"""Where the capture overhead goes: py-spy samples of all three processes (driver/API process, engine core,
worker) while the engine serves capture-on requests, then capture-off requests, on the same engine.

    .venv/bin/python benchmarks/profile_capture.py --model .models/tiny-qwen3-moe --seconds 20 [--rpc]

Needs ``py-spy`` (requirements-dev.txt) and permission to ptrace the process's own children (a container may
need ``--cap-add SYS_PTRACE``). For each phase it records ``py-spy record --subprocesses --format raw`` of this
process for ``--seconds`` while a sustained load runs (the same load as ``bench_capture_overhead.py``), then
prints per process: samples, share of time not idle, and the top frames by inclusive samples that belong to
genartifact, vLLM's output path or msgpack/zmq. ``--out DIR`` keeps the raw collapsed stacks (flamegraph input).
It also prints CPU milliseconds (user + system, ``psutil``) per 1000 generated tokens of each process and phase,
and their on / off ratio; vLLM's engine core and workers busy-poll their message queues, so on a loaded machine
those include spinning. ``--rpc`` fetches worker rows by ``collective_rpc`` (the path before out-of-band
handover) for a before/after comparison on the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_capture_overhead as bco  # noqa: E402
from common import add_smoke, load_line, product_logging  # noqa: E402

IDLE = ("select", "poll", "epoll", "wait (threading", "_wait_for_tstate_lock", "recv_multipart", "acquire_read",
        "dequeue", "busy_loop", "_run_once (asyncio", "get (queue", "sleep")
WATCH = ("genartifact", "msgpack", "zmq", "collective_rpc", "output_processor", "fsync", "zstd", "sha256",
         "encode", "call_utility", "process_outputs", "execute_model", "sample_tokens", "update_from_output",
         "schedule (vllm")


def summarize(raw: Path) -> list[str]:
    """Per-process totals from py-spy's raw (collapsed) output: ``process N:"cmd";...;frame;frame count`` where
    the leading ``process`` frames are the process chain (driver, engine core, worker)."""
    per: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    tot: collections.Counter[str] = collections.Counter()
    busy: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        frames = [f for f in frames if not f.startswith("process ")]
        if not procs or not frames:
            continue
        name = procs[-1]
        role = "engine core" if "EngineCore" in name else "worker" if "Worker" in name else "driver"
        c = int(n)
        tot[role] += c
        if not any(k in frames[-1] for k in IDLE):
            busy[role] += c
            for f in set(frames):
                if any(k in f for k in WATCH):
                    per[role][f] += c
    out = []
    for role in ("driver", "engine core", "worker"):
        out.append(f"  {role:12s} samples {tot[role]:6d}  busy {busy[role] / max(1, tot[role]):6.1%}")
        for f, c in per[role].most_common(14):
            out.append(f"      {c / max(1, tot[role]):6.1%}  {f[:150]}")
    return out


def cpu_by_role() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process (driver), its children (engine core) and their
    children (workers)."""
    import psutil

    me = psutil.Process()
    out = {"driver": sum(me.cpu_times()[:2]), "engine core": 0.0, "worker": 0.0}
    for core in me.children():
        try:
            out["engine core"] += sum(core.cpu_times()[:2])
            for w in core.children(recursive=True):
                out["worker"] += sum(w.cpu_times()[:2])
        except psutil.Error:
            pass
    return out


async def main_async(args: argparse.Namespace) -> None:
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.host import PluginHost

    host = PluginHost({"contents": ["moe_routes", "selected_logprobs"], "targets": ["managed_fsspec"]})
    root = Path(tempfile.mkdtemp(prefix="ga-prof-"))
    out = Path(args.out or tempfile.mkdtemp(prefix="ga-prof-out-"))
    out.mkdir(parents=True, exist_ok=True)
    eng = await VllmEngine(host, args.model, seed=0, tensor_parallel_size=args.tensor_parallel_size).start()
    ids_list = [eng.tokenizer(bco.PROMPTS[i % len(bco.PROMPTS)])["input_ids"] for i in range(args.requests)]
    if args.rpc:  # the fallback path: worker rows fetched by collective_rpc
        await eng.set_handover(False)
    await bco.round_(eng, ids_list, 8, True, root)
    await bco.round_(eng, ids_list, 8, False, root)
    me = os.getpid()
    # the venv's own py-spy (requirements-dev.txt) when the venv is not on PATH (`.venv/bin/python benchmarks/...`)
    beside = Path(sys.executable).parent / "py-spy"
    spy_bin = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
    cpu_per_ktok: dict[str, dict[str, float]] = {}
    try:
        for phase, on in (("on", True), ("off", False)):
            raw = out / f"capture-{phase}.txt"
            spy = None
            if spy_bin and not args.no_spy:
                spy = subprocess.Popen([spy_bin, "record", "--pid", str(me), "--subprocesses", "--nonblocking",
                                        "--rate", str(args.rate), "--duration", str(args.seconds), "--format", "raw",
                                        "--output", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            t_end = time.monotonic() + args.seconds + 1
            rates = []
            cpu0 = cpu_by_role()
            while time.monotonic() < t_end or (spy is not None and spy.poll() is None):
                rates.append((await bco.round_(eng, ids_list, args.max_tokens, on, root))[0])
                if time.monotonic() > t_end + 60:
                    break
            cpu1 = cpu_by_role()
            err = spy.communicate(timeout=60)[1].decode(errors="replace") if spy is not None else "not run"
            toks = len(rates) * args.requests * args.max_tokens
            cpu_per_ktok[phase] = {r: 1e6 * (cpu1[r] - cpu0.get(r, 0.0)) / toks for r in cpu1}
            print(f"capture {phase}: CPU ms per 1000 generated tokens: " + ", ".join(
                f"{r} {v:.0f}" for r, v in cpu_per_ktok[phase].items()))
            print(f"capture {phase}: {len(rates)} rounds, median {statistics.median(rates):.1f} tok/s "
                  f"({'under py-spy' if spy is not None else 'no py-spy'}); {load_line()}")
            if spy is None or not raw.exists():
                print(f"  no stacks (py-spy {'missing' if not spy_bin else 'failed'}): {err[-500:]}")
                continue
            print("\n".join(summarize(raw)))
    finally:
        eng.shutdown()
        shutil.rmtree(root, ignore_errors=True)  # the rounds' objects (the stacks stay in `out`)
    on, off = (sum(cpu_per_ktok[p].values()) for p in ("on", "off"))
    print(f"RATIO capture on / off CPU per generated token (driver + engine core + worker, "
          f"{'RPC fetch' if args.rpc else 'out-of-band handover'}): {on / off:.3f}")
    print(f"raw stacks in {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/tiny-qwen3-moe")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=20, help="py-spy record duration per phase")
    ap.add_argument("--rate", type=int, default=200, help="samples per second")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--out", default="", help="keep the raw collapsed stacks here")
    ap.add_argument("--rpc", action="store_true", help="fetch worker rows by collective_rpc (no out-of-band handover)")
    ap.add_argument("--summarize", default="", help="only print the summary of the raw stacks in this folder")
    ap.add_argument("--no-spy", action="store_true", help="CPU times only, no py-spy stacks")
    add_smoke(ap)
    args = ap.parse_args()
    product_logging()
    if args.smoke:
        args.requests, args.max_tokens, args.seconds = 4, 4, 2
    if args.summarize:
        for phase in ("on", "off"):
            print(f"capture {phase}:")
            print("\n".join(summarize(Path(args.summarize) / f"capture-{phase}.txt")))
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
