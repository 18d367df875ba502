"""Cost of per-step deltas in the batch job: generation tokens/s when every request streams one delta per engine
step (what a content with ``per_step_deltas = True`` causes, e.g. the template's ``token_timestamps``) ÷ tokens/s
with one final delta per request (vLLM ``FINAL_ONLY``, the job's default), both with moe_routes +
selected_logprobs captured and delivered to file://. Same engine, rounds alternate in a rotating order; both sides
report median and best round, the ratios also per round (paired).
Also prints the driver process's CPU time per token (the per-step cost is front-end output processing; CPU time
does not depend on other load on the machine).

    .venv/bin/python benchmarks/bench_per_step_deltas.py --model .models/tiny-qwen3-moe
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import add_smoke, load_line, product_logging, ratio_line, rotation, side_line  # noqa: E402

PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "Once upon a time, in a small village near the mountains, there lived an old woman who kept bees.",
           "Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in many sentences."]


async def round_(engine, ids_list, max_tokens, per_step: bool, root: Path, inflight: int) -> float:
    settings = {"managed_fsspec": {"profiles": {"b": {"url": f"file://{root}", "allowed_prefixes": ["runs/"]}}}}
    gate = asyncio.Semaphore(inflight)

    async def one(ids):
        spec = {"format": "generation_artifact_v1", "contents": ["moe_routes", "selected_logprobs"],
                "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "b",
                                                                "object_key": f"runs/{uuid.uuid4().hex}"}}}
        async with gate:
            return await engine.run(ids, {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True},
                                    spec, settings, stream=per_step)

    t0, c0 = time.perf_counter(), time.process_time()
    res = await asyncio.gather(*(one(ids) for ids in ids_list))
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert all(r.receipt["state"] == "ready" for r in res), [r.receipt for r in res]
    toks = sum(len(r.completion_token_ids) for r in res)
    return toks / dt, 1000 * cpu / toks * 1000  # tokens/s (wall), driver-process CPU µs per token


async def main_async(args) -> None:
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.host import PluginHost

    host = PluginHost({"contents": ["moe_routes", "selected_logprobs"], "targets": ["managed_fsspec"]})
    root = Path(tempfile.mkdtemp(prefix="ga-bench-steps-"))
    eng = await VllmEngine(host, args.model, seed=0).start()
    ids_list = [eng.tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(args.requests)]
    for mode in (False, True):  # warm-up
        await round_(eng, ids_list, 8, mode, root, args.inflight)
    res: dict[str, list[tuple[float, float]]] = {"final-only": [], "per-step": []}
    try:
        for r in range(args.rounds):
            for side in rotation(list(res), r):
                res[side].append(await round_(eng, ids_list, args.max_tokens, side == "per-step", root, args.inflight))
    finally:
        eng.shutdown()
        shutil.rmtree(root, ignore_errors=True)  # the rounds' objects
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.inflight} in flight, {args.rounds} rounds "
          f"alternated in rotating order; {load_line()}")
    for side, v in res.items():
        print(side_line(f"{side} tok/s", [x[0] for x in v], "tok/s"))
        print(side_line(f"{side} driver CPU", [x[1] for x in v], "us/token", higher_is_better=False))
    step, final = res["per-step"], res["final-only"]
    print(ratio_line("per-step / final-only tokens/s", [x[0] for x in step], [x[0] for x in final]))
    # CPU per token: lower is better; printed as per-step cost ÷ final-only cost (> 1: per-step costs more)
    print(ratio_line("per-step / final-only driver CPU per token", [x[1] for x in step], [x[1] for x in final]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/tiny-qwen3-moe")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    add_smoke(ap)
    args = ap.parse_args()
    product_logging()
    if args.smoke:
        args.requests, args.inflight, args.max_tokens, args.rounds = 4, 4, 4, 1
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
