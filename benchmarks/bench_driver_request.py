"""The driver's CPU per artifact request without an engine, against the bare work of the same bytes (issue 13).

    .venv/bin/python benchmarks/bench_driver_request.py [--model .models/tiny-qwen3-moe] [--wave 16] [--waves 40]
                                                        [--rounds 8] [--max-tokens 64] [--just-waves N]

On the engine, a request's driver work is hidden in the noise of a 2-core box (paired rounds spread 0.7-1.3), so
this measures it alone, on the real code: the host with the real ``moe_routes`` + ``selected_logprobs`` plugins and
a ``managed_fsspec`` ``file://`` profile in a temp dir, and a stand-in engine that has only what the driver path
touches (``model_info`` from the model's ``config.json``, a real :class:`~genartifact.engine.worker_ext.Handover`).
Each wave is ``--wave`` requests finishing together, as at the end of a wave of the engine benchmark:
``VllmEngine.prepare`` (spec parsing, admission, sampling overrides) of each, one handover step file with every
request's answers written as a capturing worker writes it (msgpack; its bytes are made before the timer), then
every request's completion recorded once, ``finalize`` (collect from the step file, encode, durable ``file://``
write, receipt) and ``aclose`` concurrently on the loop.

Two sides, alternated per round, CPU time of the whole process (``time.process_time``: loop, writer thread, zstd)
per request:

* "artifact path": the above;
* "bare": the same bytes with nothing around them: for each request ``zstd`` level 1 (one shot) and SHA-256 of
  its artifact's body, then the object written create-only and durable (``O_TMPFILE`` + write + fsync + link),
  one directory fsync per wave.

The ratio artifact path ÷ bare is the host's overhead over the work the bytes need (1.0 would be none). It also
prints the artifact path's main-thread CPU per request (what competes with vLLM's output processing on the loop),
and a store probe before and after the rounds (``common.store_probe``: a small durable create's cost on that
filesystem then; on the project's VMs it sets much of the bare side).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, product_logging, ratio_line, rotation, side_line, store_probe  # noqa: E402

PROMPT = list(range(1, 13))  # 12 prompt tokens, as the engine benchmark's prompts


def stand_in_engine(host, model_dir: str):
    """A ``VllmEngine`` that was never started: ``model_info`` as ``_setup`` builds it for a worker-capture engine
    of this model (CPU, no prefix caching), and a real handover folder for both contents."""
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.engine.worker_ext import Handover
    from genartifact.types import ModelInfo

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    eng = VllmEngine(host, model_dir)
    eng.model_info = ModelInfo(
        name=Path(model_dir).name, hf_config=hf, engine_name="vllm", engine_version="0.32.0",
        engine_options={"enable_prefix_caching": False, "worker_rpc": True, "worker_capture": True,
                        "worker_captures": ["moe_routes", "selected_logprobs"], "native_routed_experts": False,
                        "logprobs_mode": "raw_logprobs", "max_model_len": 2048, "device": "cpu",
                        "chunked_prefill": True, "tensor_parallel_size": 1, "data_parallel_size": 1, "seed": 0},
        config_sha256=hashlib.sha256(json.dumps(hf, sort_keys=True).encode()).hexdigest())
    eng.handover = Handover()
    eng.handover.contents = {"moe_routes", "selected_logprobs"}
    return eng


class Driver:
    """Waves of artifact requests through the real driver path (see the module docstring)."""

    def __init__(self, model_dir: str, root: Path, max_tokens: int) -> None:
        import numpy as np
        from genartifact.host import PluginHost
        from genartifact_route_capture.layout import resolve_layout

        self.host = PluginHost({"contents": ["moe_routes", "selected_logprobs"], "targets": ["managed_fsspec"]})
        self.eng = stand_in_engine(self.host, model_dir)
        self.lay = resolve_layout(self.eng.model_info.hf_config)
        self.settings = {"managed_fsspec": {"profiles": {"b": {"url": f"file://{root}", "allowed_prefixes": ["runs/"]}}}}
        self.max_tokens = max_tokens
        self.rng = np.random.default_rng(0)
        self.n = 0
        #: per wave, each request's receipt time (seconds after its completion was recorded), sorted
        self.receipt_times: list[list[float]] = []

    def spec(self) -> dict:
        self.n += 1
        return {"format": "generation_artifact_v1", "contents": ["moe_routes", "selected_logprobs"],
                "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "b",
                                                                "object_key": f"runs/{self.n:08d}.gart"}}}

    def answers(self, preps, completion) -> bytes:
        """One worker step file holding every request's two answers, as ``WorkerRuntime._write_handover``
        writes them (``encode_step_file``)."""
        import numpy as np
        from genartifact.engine.worker_ext import encode_step_file
        from genartifact_logprobs.answer import worker_answer
        from genartifact_logprobs.worker import CAPTURE_KEY as LOGPROBS_KEY
        from genartifact_route_capture import CAPTURE_KEY as ROUTES_KEY

        lay, rows, c = self.lay, len(PROMPT) + len(completion) - 1, len(completion)
        where = {"dp_rank": 0, "tp_rank": 0, "rank": 0}
        out = {}
        for p in preps:
            ea = p.sampling["extra_args"]
            ids = self.rng.integers(0, lay.num_experts, (lay.routers, rows, lay.top_k), dtype=np.uint8)
            out[f"moe_routes.{ea[ROUTES_KEY]}"] = {"found": {"shape": list(ids.shape), "dtype": "|u1",
                                                             "data": ids.tobytes(), "missing": None}, **where}
            out[f"selected_logprobs.{ea[LOGPROBS_KEY]}"] = {"found": worker_answer(
                range(len(PROMPT), len(PROMPT) + c), completion, -self.rng.random(c)), **where}
        return encode_step_file(out)

    def stage(self, size: int) -> tuple[list[Any], list[int], str]:
        """``size`` requests prepared (``VllmEngine.prepare``: spec, admission, sampling overrides) and their
        worker step file written under a temporary name: ``(prepared, completion, path)``; renaming
        ``path + ".tmp"`` to ``path`` is the worker's hand-over."""
        completion = [int(x) for x in self.rng.integers(4, 500, self.max_tokens)]
        sampling = {"max_tokens": self.max_tokens, "temperature": 1.0, "ignore_eos": True}
        preps = [self.eng.prepare(PROMPT, sampling, self.spec(), self.settings) for _ in range(size)]
        data = self.answers(preps, completion)  # the worker's work: not the driver's, but cheap next to it
        path = os.path.join(self.eng.handover.dir, f"step.1.{self.n}")
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        return preps, completion, path

    async def finish(self, preps: list[Any], completion: list[int]) -> list[dict]:
        """Every staged request's completion recorded once, then ``finalize`` (collect from the step file, encode,
        durable write, receipt) and ``aclose`` concurrently; the receipts (SystemExit if one is not ready)."""
        from genartifact.types import Delta

        t0 = time.perf_counter()
        done_at: list[float] = []

        async def one(p):
            s = p.session
            s.record_or_fail(Delta(PROMPT, completion, finished=True, finish_reason="length"))
            try:
                receipt = await s.finalize(self.eng)
                done_at.append(time.perf_counter() - t0)
                return receipt
            finally:
                await s.aclose(self.eng)

        receipts = await asyncio.gather(*(one(p) for p in preps))
        self.receipt_times.append(sorted(done_at))
        bad = [r for r in receipts if r.get("state") != "ready"]
        if bad:
            raise SystemExit(f"artifact path failed: {bad[0]}")
        return receipts

    async def wave(self, size: int) -> list[dict]:
        preps, completion, path = self.stage(size)
        os.replace(path + ".tmp", path)
        return await self.finish(preps, completion)

    def close(self) -> None:
        self.eng.handover.close()


def bare_wave(bodies: list[bytes], d: Path, start: int) -> None:
    """zstd-1 + SHA-256 of each body, then each written create-only and durable; one directory fsync."""
    import zstandard
    from common import durable_unnamed_write

    cctx = zstandard.ZstdCompressor(level=1)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, body in enumerate(bodies):
            data = cctx.compress(body)
            hashlib.sha256(data).hexdigest()
            durable_unnamed_write(dfd, f"{start + i:08d}.bare", data)
        os.fsync(dfd)
    finally:
        os.close(dfd)


async def main_async(args) -> None:
    import zstandard
    from genartifact.format import PRELUDE

    root = Path(tempfile.mkdtemp(prefix="ga-bench-driver-"))
    bare_dir = root / "bare"
    bare_dir.mkdir()
    drv = Driver(args.model, root, args.max_tokens)
    try:
        if args.just_waves:  # the artifact path only, untimed and silent: for an instruction count (see --help)
            for _ in range(args.just_waves):
                await drv.wave(args.wave)
            return
        # warm-up, and the bodies the bare side compresses: those of real artifacts of this size
        await drv.wave(args.wave)
        stored = next((root / "runs").iterdir()).read_bytes()  # prelude + zstd frame of the body
        body = zstandard.ZstdDecompressor().decompress(stored[PRELUDE.size:])
        bodies = [body] * args.wave
        sides = ["artifact path", "bare"]
        cpu: dict[str, list[float]] = {s: [] for s in sides}
        main_cpu: list[float] = []
        probes = [store_probe(root)]  # the store's filesystem before and after the rounds
        k = 0
        for r in range(args.rounds):
            for side in rotation(sides, r):
                c0, t0 = time.process_time(), time.thread_time()
                for _ in range(args.waves):
                    if side == "bare":
                        bare_wave(bodies, bare_dir, k)
                        k += len(bodies)
                    else:
                        await drv.wave(args.wave)
                n = args.waves * args.wave
                cpu[side].append((time.process_time() - c0) / n * 1e6)
                if side == "artifact path":
                    main_cpu.append((time.thread_time() - t0) / n * 1e6)
        probes.append(store_probe(root))
    finally:
        drv.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"waves of {args.wave} requests finishing together, {args.waves} waves per round, {args.rounds} rounds "
          f"alternated; {len(PROMPT)} prompt + {args.max_tokens} completion tokens, moe_routes + selected_logprobs "
          f"({len(body)} body bytes), file:// in {tempfile.gettempdir()}; {load_line()}")
    for side in sides:
        print(side_line(f"{side} CPU per request", cpu[side], "us", higher_is_better=False))
    print(side_line("artifact path main-thread CPU per request", main_cpu, "us", higher_is_better=False))
    # when each request of a wave gets its receipt: the first, the middle and the last (median over waves); a
    # closed-loop client (the engine benchmarks) sends its next request only then
    waves = drv.receipt_times[1:]  # not the warm-up wave
    ranks = [0, (args.wave - 1) // 2, args.wave - 1]
    at = [statistics.median(w[k] for w in waves) * 1e3 for k in ranks]
    print(f"  receipts within a wave of {args.wave} (median over {len(waves)} waves): first {at[0]:.2f} ms, "
          f"middle {at[1]:.2f} ms, last {at[2]:.2f} ms after the completions were recorded")
    print(f"  before the rounds, {probes[0]}\n  after the rounds, {probes[1]}")
    print(ratio_line("driver CPU per request, artifact path / bare zstd-1 + SHA-256 + durable write of the same "
                     "bytes", cpu["artifact path"], cpu["bare"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".models/tiny-qwen3-moe", help="model folder (only its config.json is read)")
    ap.add_argument("--wave", type=int, default=16, help="requests finishing together")
    ap.add_argument("--waves", type=int, default=40, help="waves per side and round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--just-waves", type=int, default=0, metavar="N",
                    help="run N waves of the artifact path only, untimed and silent, for an instruction count: "
                         "valgrind --tool=callgrind of --just-waves 40 minus --just-waves 4, over 36 waves of "
                         "--wave requests, is the driver's per-request count without the start-up's")
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.wave, args.waves, args.rounds, args.max_tokens = 2, 2, 1, 4
    product_logging()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
