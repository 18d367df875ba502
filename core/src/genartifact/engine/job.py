"""The main job: ``genartifact generate`` — prompts in, one artifact per request, ``receipts.jsonl`` out."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from genartifact import config as config_mod
from genartifact.errors import ConfigError, GenartifactError, RequestSpecError
from genartifact.host import PluginHost

log = structlog.get_logger("genartifact.job")

PROMPT_KEYS = {"prompt", "max_tokens", "contents", "routed_experts_prompt_start", "temperature", "top_p", "top_k",
               "seed", "logprobs", "target"}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "logprobs")


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Parse a prompts JSONL file: one object per line with ``prompt`` (str) and optional per-request
    ``max_tokens``, ``contents``, ``routed_experts_prompt_start``, sampling parameters and ``target`` (a full
    target object, e.g. a presigned URL grant for this request, overriding ``--target``).
    Raises :class:`RequestSpecError` naming the line and field."""
    rows = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise RequestSpecError(f"prompts file {str(path)!r} cannot be read: {e.strerror}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestSpecError(f"{path}:{i}: not JSON: {e.msg}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise RequestSpecError(f"{path}:{i}: needs a non-empty string 'prompt'")
        extra = set(obj) - PROMPT_KEYS
        if extra:
            raise RequestSpecError(f"{path}:{i}: unknown key(s) {sorted(extra)}; allowed: {sorted(PROMPT_KEYS)}")
        rows.append(obj)
    if not rows:
        raise RequestSpecError(f"prompts file {path} has no prompts")
    return rows


def target_for(arg: str, run_id: str, index: int) -> dict[str, Any]:
    """``--target``: ``managed_fsspec:PROFILE`` (key ``runs/<run_id>/<index>.gart``) or a JSON target object
    (``{object_key}`` may contain ``{run_id}`` and ``{index}`` placeholders)."""
    if arg.lstrip().startswith("{"):
        try:
            t = json.loads(arg)
        except json.JSONDecodeError as e:
            raise RequestSpecError(f"--target is not valid JSON: {e.msg}") from None
        if not isinstance(t, dict):
            raise RequestSpecError("--target JSON must be an object")
        return {k: (v.format(run_id=run_id, index=f"{index:05d}") if isinstance(v, str) and k == "object_key" else v)
                for k, v in t.items()}
    kind, _, profile = arg.partition(":")
    if kind != "managed_fsspec" or not profile:
        raise RequestSpecError(f"--target {arg!r}: shorthand is managed_fsspec:PROFILE, else pass a JSON target object")
    return {"kind": kind, "profile": profile, "object_key": f"runs/{run_id}/{index:05d}.gart"}


async def run_generate(*, model: str, prompts: list[dict[str, Any]], cfg: config_mod.Config, contents: list[str],
                       target: str, max_tokens: int, run_id: str, engine_kwargs: Mapping[str, Any],
                       progress: bool = True) -> list[dict[str, Any]]:
    """Run every prompt concurrently through one engine; return one receipt per prompt, in input order."""
    from tqdm import tqdm

    from genartifact.engine.vllm_adapter import VllmEngine

    host = PluginHost(cfg.plugins)
    settings = cfg.target_settings()
    journal = cfg.journal()
    engine = await VllmEngine(host, model, **engine_kwargs).start()
    try:
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not progress)

        async def one(i: int, row: dict[str, Any]) -> dict[str, Any]:
            ids = engine.tokenizer(row["prompt"])["input_ids"]
            sampling = {"max_tokens": int(row.get("max_tokens", max_tokens)), "temperature": 1.0}
            sampling.update({k: row[k] for k in SAMPLING_KEYS if k in row})
            tgt = row["target"] if "target" in row else target_for(target, run_id, i)
            spec = {"format": "generation_artifact_v1", "contents": row.get("contents", contents), "codec": "zstd",
                    "delivery": {"mode": "object_store", "target": tgt}}
            try:
                res = await engine.run(ids, sampling, spec, settings, routes_start=row.get("routed_experts_prompt_start", 0),
                                       journal=journal)
                receipt = dict(res.receipt or {})
                receipt.update(index=i, prompt_tokens=len(ids), completion_tokens=len(res.completion_token_ids))
            except GenartifactError as e:  # rejected before inference: specific message, nothing stored
                receipt = {"index": i, "state": "rejected", "error_code": "admission_rejected", "error": str(e)}
            bar.update(1)
            return receipt

        receipts = await asyncio.gather(*(one(i, r) for i, r in enumerate(prompts)))
        bar.close()
        return list(receipts)
    finally:
        engine.shutdown()


def run_generate_cli(args: argparse.Namespace) -> int:
    """Entry point of ``genartifact generate``; exit code 1 if any receipt is not ready."""
    cfg = config_mod.load(args.config)
    prompts = read_prompts(args.prompts)
    contents = [c.strip() for c in args.contents.split(",")] if args.contents else list(cfg.plugins["contents"])
    if not contents:
        raise ConfigError("no contents: pass --contents or enable content plugins in the config")
    if args.max_tokens < 1:
        raise RequestSpecError(f"--max-tokens must be >= 1; got {args.max_tokens}")
    run_id = args.run_id or time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    kwargs: dict[str, Any] = {"max_model_len": args.max_model_len, "seed": args.seed}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.perf_counter()
    receipts = asyncio.run(run_generate(model=args.model, prompts=prompts, cfg=cfg, contents=contents,
                                        target=args.target, max_tokens=args.max_tokens, run_id=run_id,
                                        engine_kwargs=kwargs))
    out = Path(args.out or Path("artifacts") / "runs" / run_id / "receipts.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in receipts), encoding="utf-8")
    tmp.replace(out)
    ready = sum(r.get("state") == "ready" for r in receipts)
    log.info("generate_done", run_id=run_id, ready=ready, total=len(receipts), receipts=str(out),
             seconds=round(time.perf_counter() - t0, 2))
    print(f"{ready}/{len(receipts)} artifacts ready; receipts: {out}")
    return 0 if ready == len(receipts) else 1
