"""The main job: ``genartifact generate`` — prompts in, one artifact per request, ``receipts.jsonl`` out.

Everything that can be checked without the engine is checked before it starts (about 20 s on CPU): the run
id, the receipts path (never overwritten), environment limits, plugin and target settings, every prompt row's
fields and its target (side-effect-free validation). Rows that fail get a ``rejected`` receipt and never reach
the engine; the others run concurrently on one engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from genartifact import config as config_mod
from genartifact.errors import ConfigError, GenartifactError, RequestSpecError
from genartifact.host import PluginHost
from genartifact.limits import max_decoded_bytes, pipeline_concurrency
from genartifact.spec import parse_request

log = structlog.get_logger("genartifact.job")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "logprobs")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _num(v: Any, lo: float, hi: float) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi


# field -> (check, allowed values as told to the user)
ROW_FIELDS: dict[str, tuple[Any, str]] = {
    "prompt": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "max_tokens": (lambda v: _int(v, 1, 1_000_000), "an integer 1..1000000"),
    "contents": (lambda v: isinstance(v, list) and v and all(isinstance(c, str) for c in v),
                 "a non-empty list of content names"),
    "routed_experts_prompt_start": (lambda v: _int(v, 0, 2**31 - 1), "an integer >= 0"),
    "temperature": (lambda v: _num(v, 0.0, 100.0), "a number 0..100"),
    "top_p": (lambda v: _num(v, 1e-9, 1.0), "a number in (0, 1]"),
    "top_k": (lambda v: _int(v, -1, 1 << 20), "an integer >= -1 (-1 or 0: disabled)"),
    "seed": (lambda v: _int(v, 0, 2**63 - 1), "a non-negative integer"),
    "logprobs": (lambda v: _int(v, 0, MAX_LOGPROBS), f"an integer 0..{MAX_LOGPROBS}"),
    "target": (lambda v: isinstance(v, dict), "a target object"),
}


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Parse and validate a prompts JSONL file: one object per line with ``prompt`` and optional per-request
    ``max_tokens``, ``contents``, ``routed_experts_prompt_start``, sampling parameters (``temperature``,
    ``top_p``, ``top_k``, ``seed``, ``logprobs``) and ``target`` (a full target object, e.g. a presigned URL
    grant for this request, overriding ``--target``). Types are strict (no coercion).
    Raises :class:`RequestSpecError` naming the line, the field and the allowed values."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise RequestSpecError(f"prompts file {str(path)!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise RequestSpecError(f"prompts file {str(path)!r} is not UTF-8") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, parse_constant=_no_constants)
        except ValueError as e:
            raise RequestSpecError(f"{path}:{i}: not JSON: {getattr(e, 'msg', e)}") from None
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise RequestSpecError(f"{path}:{i}: needs an object with a non-empty string 'prompt'")
        extra = set(obj) - set(ROW_FIELDS)
        if extra:
            raise RequestSpecError(f"{path}:{i}: unknown key(s) {sorted(extra)}; allowed: {sorted(ROW_FIELDS)}")
        for k, v in obj.items():
            check, allowed = ROW_FIELDS[k]
            if not check(v):
                raise RequestSpecError(f"{path}:{i}: {k}={json.dumps(v)[:80]} invalid; allowed: {allowed}")
        rows.append(obj)
    if not rows:
        raise RequestSpecError(f"prompts file {path} has no prompts")
    return rows


def target_for(arg: str, run_id: str, index: int) -> dict[str, Any]:
    """``--target``: ``managed_fsspec:PROFILE`` (key ``runs/<run_id>/<index>.gart``) or a JSON target object
    (its ``object_key`` may contain ``{run_id}`` and ``{index}``). Raises :class:`RequestSpecError`."""
    if arg.lstrip().startswith("{"):
        try:
            t = json.loads(arg, parse_constant=_no_constants)
        except ValueError as e:
            raise RequestSpecError(f"--target is not valid JSON: {getattr(e, 'msg', e)}") from None
        if not isinstance(t, dict):
            raise RequestSpecError("--target JSON must be an object")
        if isinstance(t.get("object_key"), str):
            try:
                t["object_key"] = t["object_key"].format(run_id=run_id, index=f"{index:05d}")
            except (KeyError, IndexError, ValueError):
                raise RequestSpecError("--target object_key may only use the placeholders {run_id} and {index}") from None
        return t
    kind, _, profile = arg.partition(":")
    if kind != "managed_fsspec" or not profile:
        raise RequestSpecError(f"--target {arg!r}: shorthand is managed_fsspec:PROFILE, else pass a JSON target object")
    return {"kind": kind, "profile": profile, "object_key": f"runs/{run_id}/{index:05d}.gart"}


def check_target_tables(cfg: config_mod.Config, host: PluginHost) -> dict[str, Any]:
    """Build every enabled target from its settings (raises ``ConfigError`` on bad settings) and reject
    settings tables for target kinds that no installed plugin provides."""
    installed = host.installed("targets")
    unknown = sorted(set(cfg.targets) - set(installed))
    if unknown:
        raise ConfigError(f"{cfg.source}: [targets.{unknown[0]}] names no installed target kind; installed: {sorted(installed)}")
    settings = cfg.target_settings()
    return {p.name: host.hooks.storage_target(kind=p.name, settings=settings.get(p.name, {}))
            for p in host.enabled["targets"]}


def preflight_row(host: PluginHost, targets: Mapping[str, Any], row: Mapping[str, Any], contents: list[str],
                  target_arg: str, run_id: str, index: int) -> dict[str, Any]:
    """The row's validated request spec; raises :class:`GenartifactError` (nothing is sent anywhere)."""
    tgt = dict(row["target"]) if "target" in row else target_for(target_arg, run_id, index)
    spec = {"format": "generation_artifact_v1", "contents": row.get("contents", contents), "codec": "zstd",
            "delivery": {"mode": "object_store", "target": tgt}}
    req = parse_request(spec)
    for c in req.contents:
        host.require("contents", c, "generation_artifact.contents")
    host.require("targets", req.target_kind, "generation_artifact.delivery.target.kind")
    targets[req.target_kind].validate(req.target)
    return spec


async def run_generate(*, model: str, prompts: list[dict[str, Any]], cfg: config_mod.Config, contents: list[str],
                       target: str, max_tokens: int, run_id: str, engine_kwargs: Mapping[str, Any],
                       progress: bool = True) -> list[dict[str, Any]]:
    """Validate every row, then run the valid ones concurrently through one engine; one receipt per prompt,
    in input order (``rejected`` for rows refused before inference)."""
    from tqdm import tqdm

    host = PluginHost(cfg.plugins)
    targets = check_target_tables(cfg, host)
    settings = cfg.target_settings()
    journal = cfg.journal()
    receipts: list[dict[str, Any] | None] = [None] * len(prompts)
    specs: dict[int, dict[str, Any]] = {}
    for i, row in enumerate(prompts):
        try:
            specs[i] = preflight_row(host, targets, row, contents, target, run_id, i)
        except (GenartifactError, ValueError, TypeError, OverflowError) as e:
            receipts[i] = {"index": i, "state": "rejected", "error_code": "request_invalid", "error": str(e)}
    if specs:
        from genartifact.engine.vllm_adapter import VllmEngine

        engine = await VllmEngine(host, model, **engine_kwargs).start()
        try:
            bar = tqdm(total=len(specs), desc="generate", unit="req", disable=not progress)
            max_len = int(engine.model_info.engine_options.get("max_model_len", 0))  # type: ignore[union-attr]

            async def one(i: int) -> dict[str, Any]:
                row = prompts[i]
                ids = engine.tokenizer(row["prompt"])["input_ids"]
                sampling = {"max_tokens": row.get("max_tokens", max_tokens), "temperature": 1.0}
                sampling.update({k: row[k] for k in SAMPLING_KEYS if k in row})
                try:
                    if max_len and len(ids) >= max_len:
                        raise RequestSpecError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}")
                    res = await engine.run(ids, sampling, specs[i], settings,
                                           routes_start=row.get("routed_experts_prompt_start", 0), journal=journal,
                                           stream=False)  # a batch job consumes no per-token output
                    receipt = dict(res.receipt or {})
                    receipt.update(index=i, prompt_tokens=len(ids), completion_tokens=len(res.completion_token_ids))
                except GenartifactError as e:  # refused before inference: specific message, nothing stored
                    receipt = {"index": i, "state": "rejected", "error_code": "admission_rejected", "error": str(e)}
                except (ValueError, TypeError) as e:  # the engine's own request validation (before generation)
                    receipt = {"index": i, "state": "rejected", "error_code": "engine_rejected",
                               "error": f"{type(e).__name__}: {str(e)[:300]}"}
                bar.update(1)
                return receipt

            done = await asyncio.gather(*(one(i) for i in specs))
            bar.close()
        finally:
            engine.shutdown()
        for i, r in zip(specs, done, strict=True):
            receipts[i] = r
    return [r for r in receipts if r is not None]


def run_generate_cli(args: argparse.Namespace) -> int:
    """Entry point of ``genartifact generate``; exit code 1 if any receipt is not ready."""
    from genartifact.engine.engine_args import command_engine_kwargs

    cfg = config_mod.load(args.config)
    kwargs = command_engine_kwargs(cfg, args)  # vLLM's engine arguments: [engine] table, then the command line
    prompts = read_prompts(args.prompts)
    contents = [c.strip() for c in args.contents.split(",")] if args.contents else list(cfg.plugins["contents"])
    if not contents:
        raise ConfigError("no contents: pass --contents or enable content plugins in the config")
    if args.max_tokens < 1:
        raise RequestSpecError(f"--max-tokens must be >= 1; got {args.max_tokens}")
    run_id = args.run_id or time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    if not RUN_ID.fullmatch(run_id):
        raise RequestSpecError(f"--run-id {run_id!r} invalid; allowed: 1..128 of [A-Za-z0-9_.-], starting alphanumeric")
    check_target_tables(cfg, PluginHost(cfg.plugins))  # plugin and target settings fail now
    target_for(args.target, run_id, 0)  # and a malformed --target
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise RequestSpecError(f"--model {args.model!r} is not a model directory (no config.json)")
    out = Path(args.out or Path("artifacts") / "runs" / run_id / "receipts.jsonl")
    if out.exists() or out.is_symlink():
        raise RequestSpecError(f"receipts file {str(out)!r} already exists; choose another --run-id or --out")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RequestSpecError(f"cannot create the receipts directory {str(out.parent)!r}: {e.strerror}") from None
    if not os.access(out.parent, os.W_OK):
        raise RequestSpecError(f"receipts directory {str(out.parent)!r} is not writable")
    max_decoded_bytes(), pipeline_concurrency()  # environment limits fail now, not after inference
    t0 = time.perf_counter()
    receipts = asyncio.run(run_generate(model=str(model), prompts=prompts, cfg=cfg, contents=contents,
                                        target=args.target, max_tokens=args.max_tokens, run_id=run_id,
                                        engine_kwargs=kwargs))
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in receipts), encoding="utf-8")
    try:
        os.link(tmp, out)  # create-only: never replaces a receipts file
    except FileExistsError:
        raise RequestSpecError(f"receipts file {str(out)!r} appeared during the run; receipts kept in {tmp}") from None
    tmp.unlink()
    ready = sum(r.get("state") == "ready" for r in receipts)
    log.info("generate_done", run_id=run_id, ready=ready, total=len(receipts), receipts=str(out),
             seconds=round(time.perf_counter() - t0, 2))
    print(f"{ready}/{len(receipts)} artifacts ready; receipts: {out}")
    return 0 if ready == len(receipts) else 1
