"""``genartifact`` command line: plugins, generate, inspect, verify, make-tiny-model.

Engine commands import :mod:`genartifact.engine` lazily, so ``plugins``/``inspect``/``verify`` run without vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from genartifact import config as config_mod
from genartifact.engine.engine_args import accept_engine_args, takes_engine_args
from genartifact.errors import GenartifactError
from genartifact.logging import configure_logging


def _read_capped(f: Any, what: str) -> bytes:
    from genartifact.format import MAX_OBJECT_BYTES

    data = f.read(MAX_OBJECT_BYTES + 1)
    if len(data) > MAX_OBJECT_BYTES:
        raise GenartifactError(f"{what} is larger than the largest valid artifact ({MAX_OBJECT_BYTES} bytes)")
    return bytes(data)


def _read_object(ref: str, cfg_path: str | None) -> bytes:
    """Read an object by local path, fsspec URL (``s3://…``, ``memory://…``) or ``profile:key`` of a
    managed_fsspec profile in the config. Reads at most the largest valid object size (+1 byte to detect
    more). Raises :class:`GenartifactError` with a clean message for anything missing or unreadable."""
    try:
        p = Path(ref)
        if p.exists():
            if p.is_dir():
                raise GenartifactError(f"{ref!r} is a directory, not an artifact")
            with p.open("rb") as f:
                return _read_capped(f, ref)
        if "://" in ref:
            import fsspec

            with fsspec.open(ref, "rb") as f:
                return _read_capped(f, ref)
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,63}):(.+)", ref)
        if m:
            cfg = config_mod.load(cfg_path)
            from genartifact_fsspec_target import fs_and_path, parse_profiles, validate_key

            profiles = parse_profiles(cfg.targets.get("managed_fsspec", {}), cfg.base_dir)
            if m.group(1) in profiles:
                fs, path = fs_and_path(profiles[m.group(1)], validate_key(m.group(2)))
                with fs.open(path, "rb") as f:
                    return _read_capped(f, ref)
    except GenartifactError:
        raise
    except (OSError, ValueError) as e:
        raise GenartifactError(f"object {ref!r} cannot be read: {type(e).__name__}") from None
    raise GenartifactError(f"object {ref!r} not found: give a file path, an fsspec URL or profile:key")


_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _safe(value: Any) -> str:
    """Text from an untrusted artifact, with control characters escaped (no terminal escape injection)."""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))


def _summary(art: Any) -> dict[str, Any]:
    import numpy as np

    m = art.manifest
    out: dict[str, Any] = {
        "format": m["format"],
        "version": m["version"],
        "byte_count": art.byte_count,
        "sha256": art.sha256,
        "contents": m["contents"],
        "prompt_token_count": m["prompt_token_count"],
        "completion_token_count": m["completion_token_count"],
        "header": m["header"],
        "tensors": [{k: r[k] for k in ("name", "dtype", "shape", "byte_count")} for r in m["tensors"]],
    }
    if "moe_routes" in m["sections"]:
        s = m["sections"]["moe_routes"]
        routes = art.routes()
        out["moe_routes"] = {
            "rows": int(routes.shape[0]),
            "routers": s["router_ids"],
            "top_k": s["top_k"],
            "token_start": s["token_start"],
            "source": s.get("source"),
            "first_row": routes[0].tolist() if routes.shape[0] else [],
        }
    if "selected_logprobs" in m["sections"]:
        lp = art.selected_logprobs()
        finite = lp[np.isfinite(lp)]
        out["selected_logprobs"] = {
            "count": int(lp.size),
            "mean": float(finite.mean()) if finite.size else None,
            "neg_inf": int(np.isneginf(lp).sum()),
        }
    return out


def cmd_plugins(args: argparse.Namespace) -> int:
    from genartifact.host import PluginHost

    cfg = config_mod.load(args.config)
    host = PluginHost(cfg.plugins)
    rows = host.listing()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'kind':9} {'name':20} {'distribution':28} {'version':8} enabled")
        for r in rows:
            print(f"{r['kind']:9} {r['name']:20} {r['dist']:28} {r['version']:8} {'yes' if r['enabled'] else 'no'}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from genartifact.format import decode

    art = decode(_read_object(args.object, args.config))
    s = _summary(art)
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        hdr = s["header"]
        model = hdr.get("model") if isinstance(hdr.get("model"), dict) else {}
        print(f"{s['format']} v{s['version'][0]}.{s['version'][1]}  {s['byte_count']} bytes  sha256 {s['sha256']}")
        print(_safe(f"contents: {', '.join(s['contents'])}; tokens: prompt {s['prompt_token_count']} + completion "
                    f"{s['completion_token_count']}"))
        print(_safe(f"engine: {hdr.get('engine')}  model: {model.get('name')}"))
        for t in s["tensors"]:
            print(_safe(f"  {t['name']:28} {t['dtype']:4} {str(t['shape']):18} {t['byte_count']} bytes"))
        if "moe_routes" in s:
            r = s["moe_routes"]
            print(_safe(f"moe_routes: {r['rows']} rows x {len(r['routers'])} routers {r['routers']} x top-{r['top_k']}, "
                        f"start {r['token_start']}, source {r['source']}; row 0: {r['first_row']}"))
        if "selected_logprobs" in s:
            lp = s["selected_logprobs"]
            print(f"selected_logprobs: {lp['count']} values, mean {lp['mean']}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from genartifact.format import decode

    if args.receipts:
        return _verify_receipts(args.receipts, args.config)
    if not args.object:
        raise GenartifactError("verify needs OBJECT [--sha256 H], or --receipts FILE")
    if args.sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", args.sha256):
        raise GenartifactError("--sha256 must be 64 hexadecimal characters")
    data = _read_object(args.object, args.config)
    digest = hashlib.sha256(data).hexdigest()
    if args.sha256 and digest != args.sha256.lower():
        print(f"FAIL: sha256 {digest} != expected {args.sha256}", file=sys.stderr)
        return 1
    decode(data)
    print(f"OK {len(data)} bytes sha256 {digest}")
    return 0


def _verify_receipts(path: str, cfg_path: str | None) -> int:
    """Check every ready receipt of a receipts.jsonl: object readable, SHA-256 and size match, strict decode.
    Each bad line or object counts as a failure; nothing aborts the scan."""
    from genartifact.format import decode

    try:
        lines = [x for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise GenartifactError(f"receipts file {path!r} cannot be read: {type(e).__name__}") from None
    bad = 0
    for n, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
            if not isinstance(r, dict):
                raise ValueError("not an object")
        except ValueError:
            print(f"line {n}: not a JSON object")
            bad += 1
            continue
        label = f"#{_safe(r.get('index', n))}"
        if r.get("state") != "ready":
            print(f"{label}: {_safe(r.get('state'))} {_safe(r.get('error_code'))}")
            bad += 1
            continue
        if not isinstance(r.get("object_id"), str) or not isinstance(r.get("sha256"), str):
            print(f"{label}: ready receipt without object_id/sha256")
            bad += 1
            continue
        try:
            data = _read_object(r["object_id"], cfg_path)
            if hashlib.sha256(data).hexdigest() != r["sha256"] or len(data) != r.get("byte_count"):
                raise GenartifactError("sha256 or byte_count mismatch")
            decode(data)
        except GenartifactError as e:
            print(f"{label}: {_safe(r['object_id'])}: {_safe(e)}")
            bad += 1
    print(f"{len(lines) - bad}/{len(lines)} receipts verified (sha256, byte_count, strict decode)")
    return 0 if bad == 0 else 1


def cmd_reconcile(args: argparse.Namespace) -> int:
    """Judge journaled deliveries that have no proven outcome, dispatching on the target kind each intent
    records (the target's ``exists``/``open``/``delete`` read-back protocol), and report crash leftovers.

    Never touches an object that a ``ready`` journal outcome or ready receipt (``--receipts``) vouches for, nor
    one whose bytes differ from the journaled SHA-256, nor any delivery younger than ``--older-than`` seconds.
    With ``--delete``: orphans are removed by the target's conditional delete (only if the bytes still hash to
    the journaled SHA-256), verdicts are journaled, and temp-file leftovers older than the guard are removed."""
    import asyncio
    import time

    from genartifact.errors import ObjectTooLargeError, TargetNotReadableError
    from genartifact.host import PluginHost
    from genartifact.journal import DeliveryJournal, split_by_age, vouchers

    if not (args.older_than >= 0):
        raise GenartifactError(f"--older-than={args.older_than}; allowed: seconds >= 0")
    cfg = config_mod.load(args.config)
    journal = DeliveryJournal(args.journal) if args.journal else cfg.journal()
    if journal is None:
        raise GenartifactError("no journal: pass --journal PATH or set [journal].path in the config")
    receipts: list[dict[str, Any]] = []
    for path in args.receipts or []:
        try:
            with open(path, encoding="utf-8", newline="") as f:
                for line in f.read().split("\n"):
                    if line.strip():
                        rec = json.loads(line)
                        receipts.append(rec.get("generation_artifact", rec) if isinstance(rec, dict) else {})
        except (OSError, ValueError) as e:
            raise GenartifactError(f"--receipts {path!r} cannot be read: {type(e).__name__}") from None
    deliveries = journal.deliveries()
    vouched = vouchers(deliveries, receipts)
    old, young = split_by_age(journal.unresolved(), args.older_than)
    kinds = sorted({d["kind"] for d in old} | set(cfg.targets))
    settings = cfg.target_settings()
    targets: dict[str, Any] = {}
    for kind in kinds:
        try:
            host = PluginHost({"targets": [kind]})
            targets[kind] = host.hooks.storage_target(kind=kind, settings=settings.get(kind, {}))
        except GenartifactError:
            targets[kind] = None  # kind not installed: its deliveries stay unverifiable
    now = time.time()

    async def judge() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rows = [{"id": d["id"], "kind": d["kind"], "object_id": d["object_id"], "last_state": d["last_state"],
                 "last_code": d.get("last_code"), "sha256": d["sha256"], "age_s": round(now - d["t"], 1),
                 "status": "in_flight"} for d in young]
        for d in old:
            row = {"id": d["id"], "kind": d["kind"], "object_id": d["object_id"], "last_state": d["last_state"],
                   "last_code": d.get("last_code"), "sha256": d["sha256"], "age_s": round(now - d["t"], 1)}
            target = targets.get(d["kind"])
            if d["sha256"] in vouched.get(d["object_id"], set()):
                row["status"] = "vouched"  # a ready delivery/receipt names exactly these bytes at this id
            elif target is None or not hasattr(target, "exists"):
                row["status"] = "unverifiable"
            else:
                try:
                    if not await target.exists(d["object_id"]):
                        row["status"] = "absent"
                    else:
                        try:
                            data = await target.open(d["object_id"], int(d.get("byte_count", 0)))
                            same = hashlib.sha256(data).hexdigest() == d["sha256"]
                        except ObjectTooLargeError:
                            same = False
                        if not same:
                            row["status"] = "foreign"  # not our bytes: never touched
                        elif vouched.get(d["object_id"]):
                            row["status"] = "vouched"
                        else:
                            row["status"] = "orphan"
                except TargetNotReadableError:
                    row["status"] = "unverifiable"
                except GenartifactError as e:
                    row["status"], row["detail"] = "unverifiable", _safe(e)
                if args.delete and row["status"] == "orphan":
                    if await target.delete(d["object_id"], d["sha256"]):
                        row["status"] = "deleted"
            if args.delete and row["status"] in ("deleted", "absent", "vouched", "foreign"):
                journal.outcome(d["id"], row["status"])
            rows.append(row)
        left: list[dict[str, Any]] = []
        for kind, target in targets.items():
            if target is not None and hasattr(target, "leftovers"):
                for item in await target.leftovers(args.older_than):
                    item = {"kind": kind, **item, "status": "leftover"}
                    if args.delete and await target.remove_leftover(item):
                        item["status"] = "removed"
                    left.append(item)
        return rows, left

    rows, left = asyncio.run(judge())
    if args.json:
        print(json.dumps({"deliveries": rows, "leftovers": left}, indent=2))
    else:
        for r in rows:
            code = f", {r['last_code']}" if r.get("last_code") else ""
            print(f"{r['status']:12} {r['kind']:20} {_safe(r['object_id'])}  (last state: {r['last_state']}{code}; "
                  f"age {r['age_s']:.0f} s)")
        for item in left:
            print(f"{item['status']:12} {item['kind']:20} {_safe(item['path'])}  (temp file, {item['bytes']} bytes, "
                  f"age {item['age_s']:.0f} s)")
        print(f"{len(rows)} unresolved deliveries, {len(left)} temp-file leftovers "
              f"(age guard: older than {args.older_than:g} s)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from genartifact.engine.job import run_generate_cli

    return run_generate_cli(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from genartifact.engine.server import run_serve_cli

    return run_serve_cli(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from genartifact_fpm_bench.cli import main as bench_main

    return bench_main(args)


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from genartifact.engine.tiny_model import make_tiny_model

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise GenartifactError(f"{args.out!r} exists and is not an empty directory; pass --force to overwrite")
    path = make_tiny_model(out, family=args.family)
    print(f"tiny {args.family} model written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="genartifact", description=__doc__)
    ap.add_argument("--log-json", action="store_true", help="JSON log lines instead of console output")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, allow_abbrev=False)  # vLLM engine args must never match by prefix
        p.set_defaults(fn=fn)
        p.add_argument("--config", help="TOML config (default: $GENARTIFACT_CONFIG or the embedded default)")
        return p

    p = add("plugins", cmd_plugins, "list installed and enabled plugins")
    p.add_argument("--json", action="store_true")
    p = add("inspect", cmd_inspect, "decode and summarize an artifact")
    p.add_argument("object", help="file path, fsspec URL, or profile:key")
    p.add_argument("--json", action="store_true")
    p = add("verify", cmd_verify, "check an artifact's SHA-256 and decode it strictly")
    p.add_argument("object", nargs="?")
    p.add_argument("--sha256", help="expected SHA-256 (hex); without it only the strict decode is checked")
    p.add_argument("--receipts", help="verify every receipt of a receipts.jsonl instead")
    p = add("generate", cmd_generate, "run prompts through vLLM and store one artifact per request")
    p.add_argument("--model", required=True, help="local model directory")
    p.add_argument("--prompts", required=True, help="JSONL: {\"prompt\": str, ...} per line")
    p.add_argument("--contents", help="comma list (default: every enabled content plugin)")
    p.add_argument("--target", default="managed_fsspec:local",
                   help="KIND:PROFILE shorthand for managed_fsspec, or a JSON target object")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=None,
                   help="receipts.jsonl path, must not exist unless --resume (default: artifacts/runs/<run-id>/receipts.jsonl)")
    p.add_argument("--run-id", default=None)
    p.add_argument("--resume", action="store_true",
                   help="continue the run --run-id/--out: rerun only rows without a ready receipt (objects already "
                        "stored with the journaled SHA-256 are recognised by read-back)")
    accept_engine_args(p)  # plus vLLM's own engine arguments (parsed lazily: genartifact.engine.engine_args)
    p = add("serve", cmd_serve, "OpenAI-compatible + token-in/out HTTP server; requests may ask for artifacts")
    p.add_argument("--model", required=True, help="local model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--drain-s", type=float, default=30.0, help="graceful shutdown: wait this long for deliveries")
    accept_engine_args(p)
    try:  # the FPM self-benchmark ships as its own distribution
        from genartifact_fpm_bench.cli import add_arguments as bench_arguments
    except ImportError:
        bench_arguments = None
    if bench_arguments is not None:
        p = add("bench", cmd_bench, "FPM self-benchmark: run a rank, merge ranks, render a report")
        bench_arguments(p)
    p = add("reconcile", cmd_reconcile, "list uploads without a ready receipt (crash leftovers); --delete removes them")
    p.add_argument("--journal", help="journal path (default: [journal].path of the config)")
    p.add_argument("--delete", action="store_true",
                   help="delete orphans (conditional: bytes must still match) and temp-file leftovers")
    p.add_argument("--older-than", type=float, default=3600.0, metavar="SECONDS",
                   help="age guard: judge only deliveries/temp files older than this (default 3600 s; an upload "
                        "may still be in flight)")
    p.add_argument("--receipts", action="append", metavar="JSONL",
                   help="receipts file(s) whose ready receipts also vouch for objects (repeatable)")
    p.add_argument("--json", action="store_true", help='print {"deliveries": [...], "leftovers": [...]}')
    p = add("make-tiny-model", cmd_make_tiny_model, "build a deterministic tiny MoE checkpoint")
    p.add_argument("out")
    p.add_argument("--family", choices=["qwen3_moe", "qwen3_moe_small", "deepseek"], default="qwen3_moe")
    p.add_argument("--force", action="store_true", help="overwrite an existing model directory")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra and not takes_engine_args(args):
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    args.engine_argv = extra  # vLLM engine arguments, parsed by the engine command (engine_args.engine_kwargs)
    configure_logging(json_lines=args.log_json)
    try:
        return int(args.fn(args) or 0)
    except GenartifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
