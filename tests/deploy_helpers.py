"""Shared by the deployment tests (data parallel, tensor parallel, Ray, coexistence): run the standard 6
requests through an engine and check every artifact against the teacher-forced HF transformers oracle."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from engine_helpers import TEXTS, agreement, hf_topk, read, settings, spec

_lm_cache: dict = {}


def hf_logprobs(model_dir: Path, token_ids: np.ndarray, prompt_len: int) -> np.ndarray:
    """Oracle: ``float32 [completion]`` log-softmax of HF's logits at each completion token (teacher-forced on
    the final sequence; position ``t`` is predicted from tokens ``< t``), i.e. vLLM's ``raw_logprobs``."""
    import torch
    from transformers import AutoModelForCausalLM

    m = _lm_cache.get(model_dir)
    if m is None:
        m = _lm_cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(token_ids[None].astype(np.int64))
    with torch.no_grad():
        logits = m(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    tgt = ids[0, prompt_len:]
    return lp[prompt_len - 1 : -1].gather(1, tgt[:, None])[:, 0].numpy()


async def run_six(engine: Any, root: Path, max_tokens: int = 8) -> list[Any]:
    """The 6 standard prompts, concurrently, both contents; temperature 1 (sampled tokens, exact logprobs)."""
    jobs = [engine.run(engine.tokenizer(t)["input_ids"], {"max_tokens": max_tokens + i, "temperature": 1.0,
                                                         "logprobs": 1}, spec(), settings(root))
            for i, t in enumerate(TEXTS)]
    return await asyncio.gather(*jobs)


def check(results: list[Any], model_dir: Path, root: Path) -> dict[str, Any]:
    """Per configuration: ready/total, worst route agreement with HF, worst |logprob - HF|, and whether the
    stored logprobs equal the engine's own reported ones bit for bit."""
    ready, agree, lp_err, engine_exact = 0, [], [], True
    for res in results:
        if res.receipt is None or res.receipt.get("state") != "ready":
            continue
        ready += 1
        art = read(root, res.receipt)
        p, c = len(res.prompt_token_ids), len(res.completion_token_ids)
        assert art.token_ids.tolist() == res.prompt_token_ids + res.completion_token_ids
        routes = art.routes()
        assert routes.shape[0] == p + c - 1
        agree.append(agreement(routes, hf_topk(model_dir, art.token_ids[:-1])))
        got = art.selected_logprobs()
        lp_err.append(float(np.abs(got - hf_logprobs(model_dir, art.token_ids, p)).max()) if c else 0.0)
        expect = [res.logprobs[j][t] for j, t in enumerate(res.completion_token_ids)]
        engine_exact = engine_exact and got.tolist() == expect
    failures = [r.receipt for r in results if r.receipt is None or r.receipt.get("state") != "ready"]
    return {"ready": ready, "total": len(results), "route_agreement_min": min(agree) if agree else None,
            "logprob_max_abs_err": max(lp_err) if lp_err else None, "logprobs_equal_engine": engine_exact,
            "failures": failures}


class Deadline:
    """A bounded wait for heavy engine tests: if the block runs past ``seconds`` the process prints every
    thread's stack and exits (``faulthandler``), so a hung multi-process engine cannot hang the suite
    (engine start is a blocking call that ``asyncio.wait_for`` could not interrupt)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> Deadline:
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(self.seconds, exit=True, file=sys.stderr)
        return self

    def __exit__(self, *exc: Any) -> None:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()


async def start_engine(host: Any, model: Path, seconds: float = 900, **kw: Any) -> Any:
    """``VllmEngine(host, model, **kw).start()`` under a :class:`Deadline`."""
    from genartifact.engine.vllm_adapter import VllmEngine

    with Deadline(seconds):
        return await VllmEngine(host, model, **kw).start()


async def worker_steps(engine: Any) -> list[tuple[int, int, int]]:
    """``(dp_rank, tp_rank, steps)`` of every capturing worker (``moe_routes.stats``)."""
    stats = await engine.worker_call("moe_routes.stats")
    return [(s["dp_rank"], s["tp_rank"], s["steps"]) for s in stats if s is not None]
