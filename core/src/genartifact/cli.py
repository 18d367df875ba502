"""``genartifact`` command line: plugins, generate, inspect, verify, make-tiny-model.

Engine commands import :mod:`genartifact.engine` lazily, so ``plugins``/``inspect``/``verify`` run without vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
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
    """List journaled uploads without a ready receipt; with ``--delete`` remove such objects from managed
    profiles when their bytes match the journaled SHA-256 (never someone else's object)."""
    from genartifact.journal import DeliveryJournal

    cfg = config_mod.load(args.config)
    journal = DeliveryJournal(args.journal) if args.journal else cfg.journal()
    if journal is None:
        raise GenartifactError("no journal: pass --journal PATH or set [journal].path in the config")
    profiles: dict[str, Any] = {}
    if "managed_fsspec" in cfg.targets or os.environ.get("GENARTIFACT_STORAGE_PROFILES"):
        from genartifact_fsspec_target import parse_profiles

        profiles = parse_profiles(cfg.targets.get("managed_fsspec", {}), cfg.base_dir)
    rows = []
    for rec in journal.unresolved():
        row = {"id": rec["id"], "kind": rec["kind"], "object_id": rec["object_id"], "last_state": rec["last_state"],
               "sha256": rec["sha256"], "status": "unverifiable"}
        prof = profiles.get(rec.get("ref", {}).get("profile")) if rec["kind"] == "managed_fsspec" else None
        if prof is not None:
            from genartifact_fsspec_target import delete_object, object_exists, open_object

            key = rec["ref"]["key"]
            if not object_exists(prof, key):
                row["status"] = "absent"
            elif hashlib.sha256(open_object(prof, key)).hexdigest() != rec["sha256"]:
                row["status"] = "foreign"  # not our bytes: never touched
            else:
                row["status"] = "orphan"
            if args.delete and row["status"] in ("orphan", "absent"):
                if row["status"] == "orphan":
                    delete_object(prof, key)
                    row["status"] = "deleted"
                journal.outcome(rec["id"], row["status"])
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['status']:12} {r['kind']:20} {r['object_id']}  (last state: {r['last_state']})")
        print(f"{len(rows)} unresolved deliveries")
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
                   help="receipts.jsonl path, must not exist (default: artifacts/runs/<run-id>/receipts.jsonl)")
    p.add_argument("--run-id", default=None)
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
    p.add_argument("--delete", action="store_true", help="delete orphans from managed profiles (bytes must match)")
    p.add_argument("--json", action="store_true")
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
