"""``genartifact`` command line: plugins, generate, serve, inspect, verify, reconcile, make-tiny-model, and the
commands installed plugins add (``bench`` from fpm_bench, ``replay-check`` from route_capture).

Engine commands import :mod:`genartifact.engine` lazily, so ``plugins``/``inspect``/``verify`` run without vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from genartifact import config as config_mod
from genartifact.engine.engine_args import accept_engine_args, takes_engine_args
from genartifact.errors import GenartifactError, PluginFault
from genartifact.logging import configure_logging


def _read_capped(f: Any, what: str) -> bytes:
    from genartifact.format import MAX_OBJECT_BYTES

    data = f.read(MAX_OBJECT_BYTES + 1)
    if len(data) > MAX_OBJECT_BYTES:
        raise GenartifactError(f"{what} is larger than the largest valid artifact ({MAX_OBJECT_BYTES} bytes)")
    return bytes(data)


REF_HELP = "file path, fsspec URL (needs fsspec), or KIND:OBJECT_ID (KIND = an installed target kind)"


def _target_for_kind(kind: str, cfg_path: str | None) -> Any:
    """The (guarded) storage target of an installed ``kind`` built from the config's settings, for read-back.
    Raises :class:`GenartifactError` naming the installed kinds when ``kind`` is not one of them."""
    from genartifact.errors import ConfigError
    from genartifact.host import PluginHost, normalize

    kind = normalize(kind)
    cfg = config_mod.load(cfg_path)
    host = PluginHost({"targets": [kind]})
    configured = kind in cfg.target_settings()
    try:
        target = host.hooks.storage_target(kind=kind,
                                           settings=cfg.target_settings().get(kind, {"base_dir": str(cfg.base_dir)}))
    except ConfigError as e:
        if configured:
            raise
        raise ConfigError(f"{e} ({cfg.source} has no [targets.{kind}] table: pass --config with the config the "
                          f"object was written under)") from None
    if target is None:
        raise GenartifactError(f"target kind '{kind}': its plugin returned no target")
    return target


def split_ref(ref: str) -> tuple[str, str] | None:
    """``KIND:OBJECT_ID`` -> ``(kind, object_id)`` when KIND is an installed target kind, else None. Object ids
    are unambiguous: the kind is always explicit (``managed_fsspec:local:runs/x.gart``), so a profile name can
    never shadow a target kind (docs/receipts.md)."""
    from genartifact.host import PluginHost, normalize

    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_-]{0,63}):(.+)", ref, flags=re.S)
    if not m:
        return None
    kind = normalize(m.group(1))
    return (kind, m.group(2)) if kind in PluginHost({}).installed("targets") else None


async def _aread(target: Any, object_id: str, what: str) -> bytes:
    from genartifact.format import MAX_OBJECT_BYTES

    return await target.open(object_id, MAX_OBJECT_BYTES)


def _read_object(ref: str, cfg_path: str | None) -> bytes:
    """Read an object by local path, fsspec URL (``s3://…``, ``memory://…``; needs the ``fsspec`` package) or
    ``KIND:OBJECT_ID`` through that target kind's read-back (``StorageTarget.open``). Reads at most the largest
    valid object size. Raises :class:`GenartifactError` with a clean message for anything missing or unreadable."""
    import asyncio

    if not ref:
        raise GenartifactError(f"object reference is empty: give a {REF_HELP}")
    try:
        p = Path(ref)
        if p.exists():
            if p.is_dir():
                raise GenartifactError(f"{_shown(ref)!r} is a directory, not an artifact")
            if p.is_fifo() or p.is_socket():  # opening a FIFO without a writer blocks forever
                raise GenartifactError(f"{_shown(ref)!r} is a FIFO or socket, not an artifact file")
            with p.open("rb") as f:
                return _read_capped(f, _shown(ref))
        if "://" in ref:
            try:
                import fsspec
            except ImportError:
                raise GenartifactError("reading URLs needs the fsspec package (pip install fsspec)") from None
            with fsspec.open(ref, "rb") as f:
                return _read_capped(f, _shown(ref))
        kr = split_ref(ref)
        if kr is not None:
            target = _target_for_kind(kr[0], cfg_path)
            return asyncio.run(_aread(target, kr[1], ref))
    except GenartifactError:
        raise
    except Exception as e:  # noqa: BLE001 - any storage backend's error (botocore NoCredentialsError, ClientError, ...)
        # is a clean "cannot be read" (exit 2); its type only: provider text may echo signed URLs or credentials
        raise GenartifactError(f"object {_shown(ref)!r} cannot be read: {type(e).__name__}") from None
    hint = ""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}:.+", ref, flags=re.S):  # a receipt's object id without its kind
        from genartifact.host import PluginHost

        kinds = sorted(PluginHost({}).installed("targets"))
        hint = (f"; a receipt's object_id needs its target kind (the receipt's \"target\") in front, e.g. "
                f"{kinds[0] if kinds else 'KIND'}:{_shown(ref)} (installed kinds: {', '.join(kinds) or 'none'})")
    raise GenartifactError(f"object {_shown(ref)!r} not found: give a {REF_HELP}{hint}")


def _shown(ref: str) -> str:
    """An object reference as errors show it: URL user-info and query (credentials, presigned signatures)
    redacted, control characters escaped, at most 200 characters."""
    from genartifact.host import redact

    return _safe(redact(ref, 200))


_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _safe(value: Any, limit: int = 1100) -> str:
    """Text from an untrusted artifact or receipt, with control characters escaped (no terminal escape injection),
    cut to ``limit`` characters (default: room for a target kind and a 1,024-byte object key; a hostile receipt's
    5,000-character field prints its start and ``...``)."""
    text = str(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _summary(art: Any) -> dict[str, Any]:
    """The generic envelope plus, under each content's name, its reader's summary (from the content plugin)."""
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
    out["faults"] = {}
    for name in m["contents"]:
        try:
            out.setdefault(name, art.content_summary(name))
        except PluginFault as e:  # isolated: the other contents still summarise; the command then exits 1
            out["faults"][name] = str(e)
            out.setdefault(name, {"error": "plugin_fault", "plugin": e.plugin, "method": e.method})
    return out


def survey(cfg_path: str | None, *, check: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """Every installed plugin (all groups, commands included) as rows, plus the problems found — never raises
    for a broken config or install. Enabled plugins (and, with ``check``, every installed one) are imported and
    validated one by one; with ``check`` the config's plugin set is also loaded together and every enabled
    target is built from its settings. A problem names the plugin and the fix."""
    from genartifact.host import GROUPS, KINDS, PluginHost, _default_source, load_command, normalize

    problems: list[str] = []
    cfg = None
    try:
        cfg = config_mod.load(cfg_path)
    except GenartifactError as e:
        problems.append(f"config: {e}")
    enabled = {k: [normalize(n) for n in (cfg.plugins.get(k, []) if cfg else [])] for k in KINDS}
    rows: list[dict[str, Any]] = []
    for kind, group in GROUPS.items():
        seen: dict[str, dict[str, Any]] = {}
        try:
            eps = list(_default_source(group))
        except Exception as e:  # noqa: BLE001 - a broken install must not hide the listing
            problems.append(f"{group}: entry points cannot be listed: {type(e).__name__}: {e}")
            eps = []
        for ep in eps:
            dist = getattr(ep, "dist", None)
            row = {"kind": kind, "name": normalize(ep.name), "dist": getattr(dist, "name", None) or "unknown",
                   "version": getattr(dist, "version", None) or "unknown", "value": ep.value,
                   "enabled": kind == "commands" or normalize(ep.name) in enabled.get(kind, []), "hooks": [],
                   "problem": None}
            prev = seen.get(row["name"])
            if prev is not None:
                if prev["dist"] == row["dist"]:
                    continue
                row["problem"] = prev["problem"] = (f"{kind[:-1]} '{row['name']}' is provided by {prev['dist']} and "
                                                    f"{row['dist']}; uninstall one")
            seen[row["name"]] = row
            rows.append(row)
    for row in rows:
        if row["problem"] or not (check or row["enabled"]) or row["kind"] == "commands" and not check:
            continue
        try:
            if row["kind"] == "commands":
                probe = argparse.ArgumentParser(prog=f"genartifact {row['name']}", conflict_handler="resolve")
                probe.add_argument("--config")  # as the real subcommand parser has it
                load_command(row["name"], probe)
                row["hooks"] = ["genartifact_command"]
            else:
                host = PluginHost({row["kind"]: [row["name"]]})
                row["hooks"] = next(r["hooks"] for r in host.listing() if r["kind"] == row["kind"]
                                    and r["name"] == row["name"])
        except GenartifactError as e:
            row["problem"] = str(e)
    for kind in KINDS:
        installed = {r["name"] for r in rows if r["kind"] == kind}
        for name in enabled[kind]:
            if name not in installed:
                problems.append(f"config [plugins].{kind} enables '{name}', which no installed distribution provides")
    problems.extend(f"{r['kind']} '{r['name']}' ({r['dist']} {r['version']}): {r['problem']}" for r in rows
                    if r["problem"])
    if check and cfg is not None and not problems:
        problems.extend(check_settings(cfg))
    return rows, problems


def check_settings(cfg: Any) -> list[str]:
    """Load the config's plugin set together and build every enabled target *and* content producer from its
    settings (``[targets.<kind>]`` / ``[contents.<name>]`` plus ``base_dir``), as a run would; each
    ``ConfigError`` or plugin fault is one problem naming the plugin, and so is a settings table for a plugin
    that is not enabled (a misspelt table name would otherwise be ignored). Content factories get a stand-in model
    (:func:`genartifact.testing.model_info`, a tiny MoE description); a factory that refuses that model with
    ``AdmissionError`` (a model it cannot serve, not a settings error) is not a problem."""
    from genartifact.errors import AdmissionError
    from genartifact.testing import model_info

    try:
        host = cfg.host()
    except GenartifactError as e:
        return [f"config {cfg.source}: {e}"]
    problems = []
    tsettings, csettings = cfg.target_settings(), cfg.content_settings()
    for table, kind in ((cfg.contents, "contents"), (cfg.targets, "targets")):
        on = {p.name for p in host.enabled[kind]}
        for name in sorted(set(table) - on):
            problems.append(f"config {cfg.source}: [{kind}.{name}] configures a {kind[:-1]} that is not enabled "
                            f"(enabled: {sorted(on)}); fix the name, enable it in [plugins].{kind}, or remove the "
                            f"table")
    for p in host.enabled["targets"]:
        try:
            if host.hooks.storage_target(kind=p.name, settings=tsettings.get(p.name, {})) is None:
                problems.append(f"config {cfg.source}: target '{p.name}': its plugin returned no target")
        except GenartifactError as e:
            problems.append(f"config {cfg.source}: [targets.{p.name}]: {e}")
    model = model_info()
    for p in host.enabled["contents"]:
        try:
            prod = host.hooks.content_producer(name=p.name, model=model, settings=csettings.get(p.name, {}))
            if prod is not None:
                prod.release()
        except AdmissionError:
            continue
        except GenartifactError as e:
            problems.append(f"config {cfg.source}: [contents.{p.name}]: {e}")
    return problems


def survey_notes(cfg_path: str | None) -> dict[str, list[str]]:
    """kind -> names the embedded default would enable but that are not installed (empty for a config file)."""
    try:
        return config_mod.load(cfg_path).not_installed
    except GenartifactError:
        return {}


def cmd_plugins(args: argparse.Namespace) -> int:
    """List installed plugins (even with a broken config or install: problems are listed, not raised); with
    ``--check`` import and validate every installed plugin and exit 1 if anything is wrong."""
    rows, problems = survey(args.config, check=args.check)
    if args.json:
        print(json.dumps({"plugins": rows, "problems": problems}, indent=2))
    else:
        names = [r["name"].replace("_", "-") if r["kind"] == "commands" else r["name"] for r in rows]  # as typed
        wn = max([20, *map(len, names)])  # columns as wide as their longest entry (a third party's long names)
        wd = max([28, *(len(str(r["dist"])) for r in rows)])
        wv = max([8, *(len(str(r["version"])) for r in rows)])
        print(f"{'kind':9} {'name':{wn}} {'distribution':{wd}} {'version':{wv}} enabled")
        for r, name in zip(rows, names, strict=True):
            flag = "yes" if r["enabled"] else "no"
            print(_safe(f"{r['kind']:9} {name:{wn}} {r['dist']:{wd}} {r['version']:{wv}} {flag}"
                        + ("  PROBLEM" if r["problem"] else "")))
        for p in problems:
            print(_safe(f"problem: {p}"))
        for kind, names in survey_notes(args.config).items():
            print(_safe(f"note: the embedded default's {kind} {names} are not installed and not enabled"))
        if args.check and not problems:
            print(f"OK: {len(rows)} plugins imported and validated")
    return 1 if args.check and problems else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """Decode an artifact strictly and print its envelope and each content's reader summary. A content reader
    whose ``summary``/``summary_text`` raises or returns a wrong value is isolated: its line (``--json``: its
    entry and ``faults``) names the plugin, every other content still prints, and the command exits 1."""
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
        g = hdr.get("group")
        if isinstance(g, dict):  # GRPO group (docs/format.md, "Groups")
            ref = g.get("prompt_part") if isinstance(g.get("prompt_part"), dict) else {}
            print(_safe(f"group: {g.get('id')} " + (f"sample {g.get('index')} of {g.get('size')}"
                        if g.get("role") == "sample" else f"{g.get('role')} of {g.get('size')} samples")
                        + (f"; prompt part {ref.get('object_id')} sha256 {ref.get('sha256')} rows from "
                           f"{ref.get('token_start')}; prompt row mismatches {g.get('prompt_row_mismatches')}"
                           if ref else "")))
        for t in s["tensors"]:
            print(_safe(f"  {t['name']:28} {t['dtype']:4} {str(t['shape']):18} {t['byte_count']} bytes"))
        from genartifact.host import guard_reader
        from genartifact.readers import reader_for

        for name in s["contents"]:
            if name not in s["faults"]:
                try:
                    reader = guard_reader(reader_for(name), None, name)
                    text = reader.summary_text(s[name]) if reader is not None else json.dumps(s[name], sort_keys=True)
                except PluginFault as e:
                    s["faults"][name] = str(e)
            if name in s["faults"]:
                text = f"plugin fault: {s['faults'][name]}"
            print(_safe(f"{name}: {text}"))
    for name, msg in s["faults"].items():
        print(_safe(f"error: content {name!r}: {msg}"), file=sys.stderr)
    return 1 if s["faults"] else 0


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


def _rkey(r: Mapping[str, Any]) -> Any:
    k = r.get("sample")
    return (r["index"], k) if type(k) is int else r["index"]


def _rlabel(r: Mapping[str, Any]) -> str:
    k = r.get("sample")
    return f"{r['index']}" + (f".s{k}" if type(k) is int else "")


def _verify_receipts(path: str, cfg_path: str | None) -> int:
    """Check every ready receipt of a receipts.jsonl: object readable through its target kind's read-back
    (the receipt's ``target`` field + ``object_id``), SHA-256 and size match, strict decode (each content by its
    plugin's reader). A group sample's receipt (``group.prompt_part``) also has its prompt part checked the same
    way (once per prompt part) and joined with the sample (:func:`genartifact.groups.join`). Each bad line or
    object counts as a failure; nothing aborts the scan."""
    from genartifact.format import decode

    try:
        lines = [x for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise GenartifactError(f"receipts file {path!r} cannot be read: {type(e).__name__}") from None
    import asyncio

    from genartifact.errors import ObjectNotFoundError

    bad = checked = missing = 0
    targets: dict[str, Any] = {}
    prompt_parts: dict[str, Any] = {}  # a group's prompt part object id -> decoded artifact (or its error)
    parsed: list[Any] = []
    # a generate receipt's key (index, or (index, sample) of a group sample) -> its last line (--resume appends)
    last_line: dict[Any, int] = {}
    for n, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply
            r = None
        parsed.append(r)
        if isinstance(r, dict) and "generation_artifact" not in r and type(r.get("index")) is int:
            last_line[_rkey(r)] = n
    for n, r in enumerate(parsed, 1):
        try:
            if not isinstance(r, dict):
                raise ValueError("not an object")
            if isinstance(r.get("generation_artifact"), dict):  # a serve response's artifact block
                r = {"index": r.get("index", n), **r["generation_artifact"]}
            elif type(r.get("index")) is int and last_line[_rkey(r)] != n:
                print(f"#{_rlabel(r)}: superseded by line {last_line[_rkey(r)]}")
                continue
        except ValueError:
            print(f"line {n}: not a JSON object")
            checked += 1
            bad += 1
            continue
        checked += 1
        label = f"#{_safe(_rlabel(r) if type(r.get('index')) is int else r.get('index', n))}"
        if r.get("state") != "ready":
            print(f"{label}: {_safe(r.get('state'))} {_safe(r.get('error_code'))}")
            bad += 1
            continue
        if not isinstance(r.get("object_id"), str) or not isinstance(r.get("sha256"), str):
            print(f"{label}: ready receipt without object_id/sha256")
            bad += 1
            continue
        if not isinstance(r.get("target"), str):
            print(f"{label}: receipt has no 'target' kind (written before receipts named it); verify the object "
                  f"with: genartifact verify KIND:{_safe(r['object_id'])} --sha256 {_safe(r['sha256'])}")
            bad += 1
            continue
        try:
            kind = r["target"]
            if kind not in targets:
                targets[kind] = _target_for_kind(kind, cfg_path)
            data = asyncio.run(_aread(targets[kind], r["object_id"], r["object_id"]))
            if hashlib.sha256(data).hexdigest() != r["sha256"] or len(data) != r.get("byte_count"):
                raise GenartifactError("sha256 or byte_count mismatch")
            art = decode(data)
            g = r.get("group")
            if isinstance(g, dict) and "prompt_part" in g:  # a group sample: its prompt part too, and the join
                ref = g["prompt_part"]
                if not isinstance(ref, dict) or not isinstance(ref.get("object_id"), str) \
                        or not isinstance(ref.get("sha256"), str):
                    raise GenartifactError("group.prompt_part has no object_id/sha256")
                if ref["object_id"] not in prompt_parts:
                    try:
                        pdata = asyncio.run(_aread(targets[kind], ref["object_id"], ref["object_id"]))
                        if hashlib.sha256(pdata).hexdigest() != ref["sha256"] or len(pdata) != ref.get("byte_count"):
                            raise GenartifactError("sha256 or byte_count mismatch")
                        prompt_parts[ref["object_id"]] = decode(pdata)
                    except GenartifactError as e:
                        prompt_parts[ref["object_id"]] = e
                part = prompt_parts[ref["object_id"]]
                if isinstance(part, GenartifactError):
                    raise GenartifactError(f"prompt part {_safe(ref['object_id'])}: {part}")
                from genartifact.groups import join

                join(part, art)  # digest reference, prompt tokens, routers and row counts agree
        except GenartifactError as e:
            print(f"{label}: {_safe(r['object_id'])}: {_safe(e)}")
            bad += 1
            missing += isinstance(e, ObjectNotFoundError)
    print(f"{checked - bad}/{checked} receipts verified (sha256, byte_count, strict decode)")
    if missing:
        base = config_mod.load(cfg_path).base_dir
        print(f"{missing} object(s) not found: object ids resolve against the config's folder ({_safe(base)}; the "
              f"working directory for the embedded default): run from where the run ran, or pass its --config")
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
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deeply
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
                    if vouched.get(item.get("object_id")):  # a ready outcome/receipt names it: an object, kept
                        item["status"] = "vouched"
                    elif args.delete and await target.remove_leftover(item):
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
            what = "an object with a temp file's name, vouched for: kept" if item["status"] == "vouched" else "temp file"
            print(f"{item['status']:12} {item['kind']:20} {_safe(item['path'])}  ({what}, {item['bytes']} bytes, "
                  f"age {item['age_s']:.0f} s)")
        n_left = sum(1 for item in left if item["status"] != "vouched")
        print(f"{len(rows)} unresolved deliveries, {n_left} temp-file leftovers "
              f"(age guard: older than {args.older_than:g} s)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from genartifact.engine.job import run_generate_cli

    return run_generate_cli(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from genartifact.engine.server import run_serve_cli

    return run_serve_cli(args)


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from genartifact.engine.tiny_model import make_tiny_model

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise GenartifactError(f"{args.out!r} exists and is not an empty directory; pass --force to overwrite")
    path = make_tiny_model(out, family=args.family)
    print(f"tiny {args.family} model written to {path}")
    return 0


#: global options (before the subcommand) that take a value
_GLOBAL_VALUE_OPTIONS = ("--config",)


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand named in ``argv``: the first token that is neither an option nor the value of a global
    option that takes one (``genartifact --config FILE plugins`` -> ``plugins``)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _GLOBAL_VALUE_OPTIONS:
            i += 2
            continue
        if not a.startswith("-"):
            return a
        i += 1
    return None


def _add_plugin_commands(sub: Any, add: Any, argv: list[str] | None) -> None:
    """One subparser per ``genartifact.commands`` entry point (built-in names win). Only the chosen command's
    plugin is imported (:func:`genartifact.host.load_command`), so ``--help`` stays fast."""
    from genartifact.host import _default_source, normalize

    chosen = _chosen_command(argv or [])
    try:
        eps = list(_default_source("genartifact.commands"))
    except Exception:  # noqa: BLE001 - `genartifact plugins` reports a broken install
        eps = []
    for ep in eps:
        name = ep.name  # as its distribution spells it (``replay-check``); matched with - and _ alike
        if name in sub.choices or normalize(name) in {normalize(c) for c in sub.choices}:
            continue
        dist = getattr(ep, "dist", None)
        help_ = f"plugin command ({getattr(dist, 'name', 'unknown')} {getattr(dist, 'version', '')})".strip()
        if chosen is not None and normalize(chosen) == normalize(name):
            from genartifact.host import load_command

            # a plugin may declare its own --config (it then replaces core's): conflicts resolve to the plugin's
            p = sub.add_parser(name, help=help_, conflict_handler="resolve")
            p.add_argument("--config", help="TOML config (default: $GENARTIFACT_CONFIG or the embedded default)")
            p.set_defaults(fn=load_command(name, p))
        else:
            add(name, None, help_)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``argv`` (the command line) selects which plugin command, if any, is loaded."""
    ap = argparse.ArgumentParser(prog="genartifact", description=__doc__)
    ap.add_argument("--log-json", action="store_true", help="JSON log lines instead of console output")
    ap.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"],
                    help="least severe genartifact log lines shown, any case (debug adds one artifact_ready line "
                         "per stored artifact); given after an engine command it is vLLM's own --log-level")
    ap.add_argument("--traceback", action="store_true", help="print the full traceback of any error")
    ap.add_argument("--config", dest="global_config", metavar="CONFIG",
                    help="TOML config for any subcommand (same as the subcommand's --config)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, allow_abbrev=False)  # vLLM engine args must never match by prefix
        p.set_defaults(fn=fn)
        p.add_argument("--config", help="TOML config (default: $GENARTIFACT_CONFIG or the embedded default)")
        return p

    p = add("plugins", cmd_plugins, "list installed and enabled plugins (problems included)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", action="store_true", help="import and validate every installed plugin; exit 1 on problems")
    p = add("inspect", cmd_inspect, "decode and summarize an artifact")
    p.add_argument("object", help=REF_HELP)
    p.add_argument("--json", action="store_true")
    p = add("verify", cmd_verify, "check an artifact's SHA-256 and decode it strictly")
    p.add_argument("object", nargs="?", help=REF_HELP)
    p.add_argument("--sha256", help="expected SHA-256 (hex); without it only the strict decode is checked")
    p.add_argument("--receipts", help="verify every receipt of a receipts.jsonl instead")
    p = add("generate", cmd_generate, "run prompts through vLLM and store one artifact per request")
    p.add_argument("--model", required=True, help="local model directory")
    p.add_argument("--prompts", required=True, help="JSONL: {\"prompt\": str, ...} per line")
    p.add_argument("--contents", help="comma list (default: every enabled content plugin)")
    p.add_argument("--target", default=None,
                   help="KIND:VALUE shorthand of an enabled target plugin (managed_fsspec:PROFILE, or a third-party "
                        "kind's own), or a JSON target object; default managed_fsspec:local (needs managed_fsspec "
                        "enabled); a row's own \"target\" wins")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=None,
                   help="receipts.jsonl path, must not exist unless --resume (default: artifacts/runs/<run-id>/receipts.jsonl)")
    p.add_argument("--run-id", default=None)
    p.add_argument("--resume", action="store_true",
                   help="continue the run --run-id/--out: rerun only rows without a ready receipt (objects already "
                        "stored with the journaled SHA-256 are recognised by read-back)")
    p.add_argument("--replicas", type=int, default=None, help="N engine replicas as Ray actors (needs ray)")
    p.add_argument("--ray", default=None, metavar="ADDRESS", help="Ray cluster for --replicas (default: a private one)")
    p.add_argument("--max-inflight", type=int, default=8, help="rows in flight per replica (--replicas)")
    p.add_argument("--start-together", action="store_true",
                   help="--replicas: deal rows only once every replica's engine has started (even sharding, e.g. "
                        "for benchmarks); default: each replica takes rows as soon as its engine is up")
    accept_engine_args(p)  # plus vLLM's own engine arguments (parsed lazily: genartifact.engine.engine_args)
    p = add("serve", cmd_serve, "OpenAI-compatible + token-in/out HTTP server; requests may ask for artifacts")
    p.add_argument("--model", required=True, help="local model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--drain-s", type=float, default=30.0, help="graceful shutdown: wait this long for deliveries")
    accept_engine_args(p)
    _add_plugin_commands(sub, add, argv)
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
    """Run the CLI. Exit codes: 0 ok; 1 the command's own failure verdict (e.g. not every receipt ready);
    2 an error (one ``error:`` line: bad input, config, plugin or storage — every :class:`GenartifactError`,
    including those plugins raise); 3 an unexpected internal error (one line; ``--traceback`` shows the trace);
    130 interrupted."""
    import traceback

    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = _chosen_command(argv)
    show_tb = "--traceback" in (argv[: argv.index(cmd)] if cmd is not None else argv)
    try:
        ap = build_parser(argv)
        args, extra = ap.parse_known_args(argv)
        if extra and not takes_engine_args(args):
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        glob = getattr(args, "global_config", None)
        if glob is not None:
            if getattr(args, "config", None) not in (None, glob):
                ap.error(f"--config given twice with different values ({glob!r} before the subcommand, "
                         f"{args.config!r} after it); give it once")
            args.config = glob
        args.engine_argv = extra  # vLLM engine arguments, parsed by the engine command (engine_args.engine_kwargs)
        configure_logging(json_lines=args.log_json, level=getattr(logging, args.log_level.upper()))
        return int(args.fn(args) or 0)
    except GenartifactError as e:
        if show_tb:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `genartifact inspect --json | head`: the reader left; exit quietly, as Unix tools do
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        except (OSError, ValueError):
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the broken pipe
    except Exception as e:  # noqa: BLE001 - one line unless --traceback
        from genartifact.host import redact

        if show_tb:
            traceback.print_exc()
        print(f"error: unexpected {type(e).__name__}: {redact(str(e))} (run with --traceback for the full trace)",
              file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
