"""The main job: ``genartifact generate`` — prompts in, one artifact per request, ``receipts.jsonl`` out.

Everything that can be checked without the engine is checked before it starts (about 20 s on CPU): the run
id, the receipts path (never overwritten), environment limits, plugin and target settings, every prompt row's
fields and its target (side-effect-free validation). Rows that fail (bad JSON, bad fields, bad target) get a
``rejected`` receipt and never reach the engine; the others run concurrently on one engine.

Receipts are appended to ``receipts.jsonl`` (created create-only) and flushed to disk as each request ends, in
completion order (each carries its row ``index``). SIGINT/SIGTERM stop the run promptly in every phase: during
engine start-up the start is abandoned; while running, requests still generating are aborted, deliveries
already started are drained for up to ``DRAIN_S`` seconds, every row gets a receipt (``interrupted`` for
those that did not finish) and the exit status is 130 (SIGINT) or 143 (SIGTERM); a second signal stops the
drain. ``generate --resume`` re-runs only the rows without a ready receipt, and first recognises a row whose
object is already stored with the SHA-256 its journaled delivery recorded (read back through the target) as
ready; without a journal entry, a rerun row whose create-only delivery meets an existing object with exactly
the bytes it just encoded (deterministic rows: seeded or temperature 0) is ready too (``recovered``). Receipts
that cannot be written (disk full) are named on stderr (object id and SHA-256), never lost
silently.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import hashlib
import json
import math
import os
import re
import signal
import string
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from genartifact import config as config_mod
from genartifact.errors import ConfigError, GenartifactError, PluginFault, RequestSpecError, TargetError
from genartifact.host import PluginHost, redact
from genartifact.limits import max_decoded_bytes, pipeline_concurrency, small_pipeline_concurrency
from genartifact.spec import parse_request

log = structlog.get_logger("genartifact.job")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "logprobs")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 256  # samples per prompts row ("n"); sample keys carry a 3-digit index
DRAIN_S = 60.0  # after SIGINT/SIGTERM: how long started deliveries may finish (the default whole-delivery deadline)
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _num(v: Any, lo: float, hi: float) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi


def _unicode(v: str) -> bool:
    """``v`` encodes to UTF-8 (JSON can carry a lone surrogate escape, which no tokenizer takes)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# field -> (check, allowed values as told to the user)
ROW_FIELDS: dict[str, tuple[Any, str]] = {
    "prompt": (lambda v: isinstance(v, str) and v != "" and _unicode(v),
               "a non-empty string of valid Unicode (no lone surrogate: JSON's \\ud800..\\udfff escapes unpaired)"),
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
    "n": (lambda v: _int(v, 1, MAX_N), f"an integer 1..{MAX_N} (samples of this prompt, run as one group)"),
}


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def read_prompt_rows(path: str | Path) -> list[dict[str, Any] | RequestSpecError]:
    """Parse a prompts JSONL file into rows, one per non-blank line: a validated row object, or the
    :class:`RequestSpecError` (naming the line, the field and the allowed values) that refuses that row alone.

    A row has ``prompt`` and optional per-request ``max_tokens``, ``contents``, ``routed_experts_prompt_start``,
    sampling parameters (``temperature``, ``top_p``, ``top_k``, ``seed``, ``logprobs``), ``target`` (a
    full target object, e.g. a presigned URL grant for this request, overriding ``--target``) and ``n`` (samples
    of this prompt, run as one GRPO group: :func:`run_group`). Types are strict
    (no coercion). Lines are split on ``\\n`` only (JSONL): U+2028, U+0085 and other Unicode line separators
    are legal inside JSON strings; a trailing ``\\r`` is dropped. Each line is decoded as UTF-8 on its own.
    Raises :class:`RequestSpecError` only for the file as a whole (unreadable, or no rows)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise RequestSpecError(f"prompts file {str(path)!r} cannot be read: {e.strerror}") from None
    rows: list[dict[str, Any] | RequestSpecError] = []
    for i, bline in enumerate(raw.split(b"\n"), 1):
        if bline.endswith(b"\r"):
            bline = bline[:-1]
        if not bline.strip():
            continue
        try:
            rows.append(_parse_row(bline, path, i))
        except RequestSpecError as e:
            rows.append(e)
    if not rows:
        raise RequestSpecError(f"prompts file {path} has no prompts")
    return rows


def _parse_row(bline: bytes, path: str | Path, i: int) -> dict[str, Any]:
    try:
        line = bline.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestSpecError(f"{path}:{i}: not UTF-8") from None
    try:
        obj = json.loads(line, parse_constant=_no_constants)
    except ValueError as e:
        raise RequestSpecError(f"{path}:{i}: not JSON: {getattr(e, 'msg', e)}") from None
    except RecursionError:
        raise RequestSpecError(f"{path}:{i}: not JSON: nested too deeply") from None
    check_row(obj, f"{path}:{i}")
    return obj


def check_row(obj: Any, where: str) -> None:
    """Check one prompts row (a JSON object) against :data:`ROW_FIELDS`; raises :class:`RequestSpecError`
    starting with ``where`` and naming the offending key and its allowed values."""
    if not isinstance(obj, dict) or "prompt" not in obj:
        raise RequestSpecError(f"{where}: needs an object with a non-empty string 'prompt'")
    extra = set(obj) - set(ROW_FIELDS)
    if extra:
        raise RequestSpecError(f"{where}: unknown key(s) {sorted(map(str, extra))}; allowed: {sorted(ROW_FIELDS)}")
    for k, v in obj.items():
        check, allowed = ROW_FIELDS[k]
        if not check(v):
            raise RequestSpecError(f"{where}: {k}={_shown(k, v)} invalid; allowed: {allowed}")


def _shown(key: str, value: Any) -> str:
    """A row value as an error message may show it: a ``target`` by its JSON type only (a presigned grant's URL and
    signed headers are secrets, whatever shape the row gave them), anything else as JSON with URL queries and
    secret-named values redacted (:func:`genartifact.host.redact`), cut to 80 characters."""
    if key == "target":
        kind = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value))
        return f"<a JSON {kind or 'number'}, not shown>"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return redact(text, 80)


def _checked_row(row: Any, i: int) -> dict[str, Any] | RequestSpecError:
    """``row`` if it is a valid prompts row (or already a refusal), else its :class:`RequestSpecError`."""
    if isinstance(row, RequestSpecError):
        return row
    try:
        check_row(row, f"row {i}")
    except RequestSpecError as e:
        return e
    return row


def group_size(row: Any) -> int:
    """Samples a prompts row asks for: its ``"n"`` when the row is a valid group row, else 1 (a row refused
    before it ran counts once)."""
    n = row.get("n", 1) if isinstance(row, dict) else 1
    return n if _int(n, 2, MAX_N) else 1


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Strict form of :func:`read_prompt_rows`: every row valid, else the first row's
    :class:`RequestSpecError` is raised (naming the line, the field and the allowed values)."""
    rows = read_prompt_rows(path)
    for r in rows:
        if isinstance(r, RequestSpecError):
            raise r
    return rows  # type: ignore[return-value]


class ReceiptsWriter:
    """Appends one JSON line per receipt to ``path`` and makes it durable (flush + fsync) before returning.

    ``resume=False`` creates the file create-only (``O_EXCL``: an existing receipts file is never touched);
    ``resume=True`` appends to an existing one. A write that fails (ENOSPC, EDQUOT, EIO...) is rolled back to
    the last complete line (no torn line stays behind), and the receipt is kept in :attr:`unwritten` so the
    caller can name it on stderr; later receipts are still attempted.
    Raises :class:`RequestSpecError` if the file cannot be opened (exists without ``resume``, or missing)."""

    def __init__(self, path: str | os.PathLike[str], resume: bool = False) -> None:
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_APPEND | (0 if resume else os.O_CREAT | os.O_EXCL)
        try:
            self._fd = os.open(self.path, flags, 0o644)
        except FileExistsError:
            raise RequestSpecError(f"receipts file {str(self.path)!r} already exists; choose another --run-id or "
                                   f"--out, or pass --resume") from None
        except FileNotFoundError:
            raise RequestSpecError(f"--resume: receipts file {str(self.path)!r} does not exist") from None
        except OSError as e:
            raise RequestSpecError(f"receipts file {str(self.path)!r} cannot be opened: {e.strerror}") from None
        self.written = 0
        self.unwritten: list[dict[str, Any]] = []

    def write(self, receipt: Mapping[str, Any]) -> bool:
        """Append and fsync one receipt; False (and kept in :attr:`unwritten`) if the disk refused it."""
        line = (json.dumps(receipt, sort_keys=True) + "\n").encode()
        try:
            start = os.lseek(self._fd, 0, os.SEEK_END)
        except OSError:
            start = None
        try:
            n = os.write(self._fd, line)
            if n != len(line):
                raise OSError(errno.ENOSPC, "short write")
            os.fsync(self._fd)
        except OSError as e:
            if start is not None:
                try:
                    os.ftruncate(self._fd, start)  # no torn line
                except OSError:
                    pass
            log.error("receipt_not_written", errno=e.errno, index=receipt.get("index"))
            self.unwritten.append(dict(receipt))
            return False
        self.written += 1
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def report_unwritten(self, stream: Any = None) -> None:
        """Name on stderr every receipt that could not be written: stored objects first (object id and
        SHA-256, so nothing stored is unaccounted for), then the rows whose outcome is otherwise lost."""
        stream = stream or sys.stderr
        for r in self.unwritten:
            if r.get("state") == "ready":
                print(f"error: receipt not written for row {r.get('index')}: object {r.get('object_id')} is stored "
                      f"(sha256 {r.get('sha256')}, {r.get('byte_count')} bytes)", file=stream)
            else:
                print(f"error: receipt not written for row {r.get('index')}: {r.get('state')} "
                      f"{r.get('error_code', '')}", file=stream)


def receipt_key(rec: Mapping[str, Any]) -> int | tuple[int, int]:
    """A receipt's key in a run: its row ``index``, or ``(index, sample)`` for a group sample's receipt."""
    k = rec.get("sample")
    return (rec["index"], k) if isinstance(k, int) and not isinstance(k, bool) else rec["index"]


def _key_order(k: int | tuple[int, int]) -> tuple[int, int]:
    return k if isinstance(k, tuple) else (k, -1)


def read_receipts(path: str | Path) -> dict[int | tuple[int, int], dict[str, Any]]:
    """The last receipt per key (:func:`receipt_key`: row ``index``, or ``(index, sample)`` for a group sample)
    in an existing receipts file (a resumed run appends; the last one wins). A torn last line (a crash
    mid-write) is ignored. Raises :class:`RequestSpecError`."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise RequestSpecError(f"receipts file {str(path)!r} cannot be read: {e.strerror}") from None
    out: dict[int, dict[str, Any]] = {}
    lines = raw.split(b"\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            if n == len(lines):
                continue
            raise RequestSpecError(f"receipts file {str(path)!r} line {n} is not JSON") from None
        if isinstance(rec, dict) and isinstance(rec.get("index"), int):
            out[receipt_key(rec)] = rec
    return out


def _fill_template(key: str, template: str, values: Mapping[str, str]) -> str:
    """``template`` with each bare ``{name}`` replaced by ``values[name]``. Only bare placeholders: no attribute or
    item access (``{run_id.__class__}``), conversion (``!r``) or format spec (``{index:>3000000000}`` would build
    a 3 GB string). Raises :class:`RequestSpecError` naming ``key``."""
    bad = RequestSpecError(f"--target {key}: only the placeholders {{run_id}} and {{index}} are allowed (write "
                           f"literal braces as {{{{ and }}}})")
    out: list[str] = []
    try:
        for literal, field, spec, conv in string.Formatter().parse(template):
            out.append(literal)
            if field is None:
                continue
            if field not in values or spec or conv is not None:
                raise bad
            out.append(values[field])
    except ValueError:  # unbalanced braces
        raise bad from None
    return "".join(out)


def target_for(arg: str, run_id: str, index: int, host: PluginHost | None = None) -> dict[str, Any]:
    """``--target``: a JSON target object, or ``KIND:VALUE`` shorthand expanded by the target plugin of KIND
    (``genartifact_target_shorthand``; e.g. ``managed_fsspec:PROFILE`` -> key ``runs/<run_id>/<index>.gart``).

    Templating (every target kind alike): in a JSON target, every top-level string value may use
    ``{run_id}`` and ``{index}`` (5-digit zero-padded request index); ``{{``/``}}`` are literal braces.
    Raises :class:`RequestSpecError`."""
    if arg.lstrip().startswith("{"):
        try:
            t = json.loads(arg, parse_constant=_no_constants)
        except ValueError as e:
            raise RequestSpecError(f"--target is not valid JSON: {getattr(e, 'msg', e)}") from None
        if not isinstance(t, dict):
            raise RequestSpecError("--target JSON must be an object")
        values = {"run_id": run_id, "index": f"{index:05d}"}
        for k, v in t.items():
            if isinstance(v, str) and k != "kind":
                t[k] = _fill_template(k, v, values)
        return t
    kind, _, value = arg.partition(":")
    kind = kind.strip().replace("-", "_")
    if not value:
        raise RequestSpecError(f"--target {arg!r}: give KIND:VALUE (a target plugin's shorthand) or a JSON target object")
    t = None
    if host is not None:
        host.require("targets", kind, "--target")
        t = host.hooks.target_shorthand(kind=kind, value=value, run_id=run_id, index=index)
    if t is None:
        raise RequestSpecError(f"--target {arg!r}: target kind {kind!r} has no KIND:VALUE shorthand; pass a JSON "
                               f"target object")
    return t


#: ``generate --target`` when none is given: the config's ``local`` profile of the ``managed_fsspec`` target
DEFAULT_TARGET = "managed_fsspec:local"


def default_target(arg: str | None, host: PluginHost) -> str:
    """``generate``'s ``--target`` argument: ``arg`` as given, else :data:`DEFAULT_TARGET` when the ``managed_fsspec``
    target is enabled. Raises :class:`~genartifact.errors.ConfigError` when no ``--target`` was given and the
    config does not enable ``managed_fsspec`` (a config enabling only a third-party target kind): the error names
    the enabled kinds instead of refusing the default as a kind that is "not enabled"."""
    if arg is not None:
        return arg
    enabled = [p.name for p in host.enabled["targets"]]
    if "managed_fsspec" in enabled:
        return DEFAULT_TARGET
    raise ConfigError(f"--target not given, and its default {DEFAULT_TARGET} needs the managed_fsspec target, which "
                      f"this config does not enable (enabled targets: {enabled}); pass --target KIND:VALUE (an "
                      f"enabled target plugin's shorthand) or a JSON target object")


def check_target_tables(cfg: config_mod.Config, host: PluginHost) -> dict[str, Any]:
    """Build every enabled target from its settings (raises ``ConfigError`` on bad settings) and reject
    settings tables for target kinds that no installed plugin provides. A target factory that faults (a plugin
    bug, :class:`PluginFault`) maps its kind to the fault: only requests for that kind fail."""
    installed = host.installed("targets")
    unknown = sorted(set(cfg.targets) - set(installed))
    if unknown:
        raise ConfigError(f"{cfg.source}: [targets.{unknown[0]}] names no installed target kind; installed: {sorted(installed)}")
    settings = cfg.target_settings()
    out: dict[str, Any] = {}
    for p in host.enabled["targets"]:
        try:
            out[p.name] = host.hooks.storage_target(kind=p.name, settings=settings.get(p.name, {}))
        except PluginFault as e:
            out[p.name] = e
    return out


def _fault_receipt(i: int, spec: Mapping[str, Any] | None) -> dict[str, Any]:
    from genartifact.session import fault_receipt

    try:
        req = parse_request(spec) if spec is not None else None
    except GenartifactError:
        req = None
    return {"index": i, **fault_receipt(req, PluginFault(""))}


def group_object_target(target: Mapping[str, Any], part: str) -> dict[str, Any]:
    """The target of one object of a group (``"n" > 1``): the row's target with ``part`` inserted before the
    extension of its ``object_key`` — ``runs/R/00003.gart`` -> ``runs/R/00003.s002.gart`` for sample 2
    (``part = "s002"``), ``runs/R/00003.prompt-<group id>.gart`` for the group's prompt part; a key without an
    extension gets ``.<part>`` appended. Raises :class:`RequestSpecError` for a target without an ``object_key``
    (a presigned URL grant names exactly one object: give one row per sample there)."""
    key = target.get("object_key")
    if not isinstance(key, str) or not key:
        raise RequestSpecError(f'"n" > 1 needs a target with an object_key (e.g. managed_fsspec) to derive each '
                               f"sample's key from; target kind {target.get('kind')!r} has none (a presigned URL "
                               f"names one object: give one row per sample instead)")
    head, slash, name = key.rpartition("/")
    stem, dot, ext = name.rpartition(".")
    name = f"{stem}.{part}.{ext}" if dot and stem else f"{name}.{part}"
    return {**target, "object_key": f"{head}{slash}{name}"}


def sample_spec(spec: Mapping[str, Any], k: int) -> dict[str, Any]:
    """Sample ``k``'s request spec: ``spec`` with the target from :func:`group_object_target` (``s{k:03d}``)."""
    tgt = group_object_target(spec["delivery"]["target"], f"s{k:03d}")
    return {**spec, "delivery": {**spec["delivery"], "target": tgt}}


def preflight_row(host: PluginHost, targets: Mapping[str, Any], row: Mapping[str, Any], contents: list[str],
                  target_arg: str, run_id: str, index: int, allow_groups: bool = True) -> dict[str, Any]:
    """The row's validated request spec; raises :class:`GenartifactError` (nothing is sent anywhere). A row
    with ``"n" > 1`` also has every sample's and the prompt part's derived target validated
    (:func:`group_object_target`); ``allow_groups=False`` refuses it (``generate --replicas``)."""
    check_row(row, f"row {index}")
    tgt = dict(row["target"]) if "target" in row else target_for(target_arg, run_id, index, host)
    spec = {"format": "generation_artifact_v1", "contents": row.get("contents", contents), "codec": "zstd",
            "delivery": {"mode": "object_store", "target": tgt}}
    req = parse_request(spec)
    for c in req.contents:
        host.require("contents", c, "generation_artifact.contents")
    host.require("targets", req.target_kind, "generation_artifact.delivery.target.kind")
    target = targets[req.target_kind]
    if isinstance(target, PluginFault):
        raise target
    if target is None:
        raise RequestSpecError(f"target kind '{req.target_kind}': its plugin returned no target")
    target.validate(req.target)
    n = group_size(row)
    if n > 1:
        if not allow_groups:
            raise RequestSpecError('"n" > 1 (a group) is not supported with --replicas yet; allowed there: 1 (or '
                                   "run without --replicas)")
        for k in range(n):
            target.validate(sample_spec(spec, k)["delivery"]["target"])
        target.validate(group_object_target(spec["delivery"]["target"], "prompt-" + "0" * 12))
    return spec


class _Interrupted(BaseException):
    """SIGINT/SIGTERM arrived while the engine was starting (raised from the signal handler)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupted_receipt(i: int) -> dict[str, Any]:
    return {"index": i, "state": "failed", "error_code": "interrupted",
            "error": "the run was stopped (signal) before this request finished; rerun with --resume"}


def _engine_failed(exc: BaseException) -> dict[str, Any]:
    """The failure of a request the engine (or the code around it) raised for after it was admitted."""
    return {"state": "failed", "error_code": "engine_failed",
            "error": f"the engine failed while this request ran ({type(exc).__name__}; the log has the cause); "
                     "rerun with --resume"}


def _engine_not_started(exc: BaseException) -> dict[str, Any]:
    """The receipt of a row whose engine never started (a worker's init failed, the model could not load...)."""
    return {"state": "failed", "error_code": "engine_failed",
            "error": f"the engine did not start ({type(exc).__name__}; the log's last line has the cause); fix it and "
                     "rerun with --resume"}


def _unfinished_receipt(i: int, task: Any, signalled: bool) -> dict[str, Any]:
    """The receipt of row ``i`` whose request task ended without one: ``engine_failed`` when the task raised
    (the engine died under it, e.g. ``EngineDeadError`` after its worker was killed: named by exception type
    only, as a message could carry a target's secrets), ``interrupted`` when a signal stopped the run, else
    ``interrupted`` without blaming a signal (the run itself was cancelled by its caller)."""
    exc = task.exception() if task is not None and task.done() and not task.cancelled() else None
    if exc is not None:  # the receipt says "the log has the cause": this is that line (message redacted)
        log.error("request_failed", index=i, error_type=type(exc).__name__, error=redact(str(exc), 300))
        return {"index": i, **_engine_failed(exc)}
    if signalled:
        return _interrupted_receipt(i)
    return {"index": i, "state": "failed", "error_code": "interrupted",
            "error": "the run was cancelled before this request finished; rerun with --resume"}


def _group_of(data: bytes) -> dict[str, Any] | None:
    """A recovered group sample's receipt ``group`` field, from its own ``header.group`` (None otherwise)."""
    from genartifact import format as fmt

    try:
        g = fmt.decode(data).manifest["header"].get("group")
    except (GenartifactError, ValueError):
        return None
    if not isinstance(g, dict) or g.get("role") != "sample":
        return None
    out = {k: g[k] for k in ("id", "index", "size", "prompt_row_mismatches") if k in g}
    if isinstance(g.get("prompt_part"), dict):
        out["prompt_part"] = {k: g["prompt_part"][k] for k in ("object_id", "sha256", "byte_count")
                              if k in g["prompt_part"]}
    else:
        out["not_shared"] = "stored whole"
    return out


def _refuse_shared_keys(targets: Mapping[str, Any], specs: dict[int, dict[str, Any]], todo: dict[int, list[int]],
                        prompts: Sequence[Any], emit: Any, spec_of: Any) -> None:
    """Refuse (``request_invalid``, before the engine starts) every row one of whose objects — the row's, or a
    sample's of a group — has the same target object as an earlier row's: two artifacts of a run never share a
    key. Otherwise the second is an ``object_exists`` failure after inference, and a ``--resume`` would read
    the first row's object back as the second's (its journaled SHA-256 matches) and call it ready. Keys are
    compared as the target resolves them (its ``object_id``), for all of a group's samples, not just those
    still to run. Prompt parts carry a random group id and cannot collide. Rows not run now (ready in an earlier
    run: ``spec_of(i)`` gives their spec, or None) own their keys first: a ``--resume`` never hands a ready
    row's object to another row."""

    def objects(i: int, spec: Mapping[str, Any]) -> list[tuple[str, str]]:
        target = targets.get(spec["delivery"]["target"].get("kind"))
        if target is None or isinstance(target, PluginFault):
            return []
        n = group_size(prompts[i])
        objs = []
        for k in range(n) if n > 1 else [None]:
            s = spec if k is None else sample_spec(spec, k)
            try:
                objs.append((str(target.validate(s["delivery"]["target"]).object_id),
                             f"row {i}" if k is None else f"row {i} sample {k}"))
            except GenartifactError:
                continue
        return objs

    owner: dict[str, str] = {}
    for i, row in enumerate(prompts):
        if i not in specs and isinstance(row, dict) and (spec := spec_of(i)) is not None:
            for o, who in objects(i, spec):
                owner.setdefault(o, who)
    for i in sorted(specs):
        objs = objects(i, specs[i])
        clash = next(((o, owner[o]) for o, _ in objs if o in owner), None)
        if clash is None:
            ids = [o for o, _ in objs]
            dup = next((o for o in ids if ids.count(o) > 1), None)
            if dup is not None:
                clash = (dup, f"another sample of row {i}")
        if clash is not None:
            emit(i, {"index": i, "state": "rejected", "error_code": "request_invalid",
                     "error": f"row {i}: target object {clash[0]!r} is also the target of {clash[1]}; every artifact "
                              "of a run needs its own object key"})
            del specs[i]
            todo.pop(i, None)
            continue
        owner.update({o: who for o, who in objs})


async def _recover_from_journal(targets: Mapping[str, Any], spec: Mapping[str, Any], journal: Any,
                                intents: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """--resume: a ready receipt for a row whose object is already stored with the SHA-256 that a journaled
    delivery of it recorded (verified by reading it back through the target, at most its byte count), else
    None. Targets that cannot read back (presigned grants) recover nothing."""
    kind = spec["delivery"]["target"].get("kind")
    target = targets.get(kind)
    if target is None or isinstance(target, PluginFault) or not hasattr(target, "open"):
        return None
    from genartifact.errors import TargetError

    try:
        object_id = target.validate(spec["delivery"]["target"]).object_id
    except TargetError:
        return None
    for d in reversed(intents.get(object_id, [])):
        try:
            data = await target.open(object_id, int(d["byte_count"]))
        except (GenartifactError, OSError):
            return None
        if hashlib.sha256(data).hexdigest() == d["sha256"]:
            if journal is not None:
                try:
                    await asyncio.to_thread(journal.outcome, d["id"], "ready")
                except OSError:
                    pass
            rec = {"format": spec["format"], "contents": sorted(spec["contents"]), "state": "ready", "target": kind,
                   "byte_count": len(data), "sha256": d["sha256"], "object_id": object_id,
                   "recovered": "read_back"}
            group = _group_of(data)
            return rec if group is None else {**rec, "group": group}
    return None


async def run_row(engine: Any, i: int, row: Mapping[str, Any], spec: Mapping[str, Any], settings: Mapping[str, Any],
                  journal: Any, max_tokens: int, on_generated: Any = None, resume: bool = False) -> dict[str, Any]:
    """Run one preflighted prompt row on a started engine and return its receipt (with ``index``,
    ``prompt_tokens``, ``completion_tokens``); refusals before inference are ``rejected`` receipts
    (``admission_rejected``, ``engine_rejected``), a plugin fault at admission an ``internal_error`` one.
    ``on_generated()`` is called when generation ended and only delivery is left. ``resume`` (``--resume``): an
    ``object_exists`` whose stored bytes equal this run's encoding is a ready receipt (``ArtifactSession.
    recover_existing``). Never raises for the row."""
    from genartifact.engine.vllm_adapter import RequestResult

    max_len = int(engine.model_info.engine_options.get("max_model_len", 0))
    ids = engine.tokenizer(row["prompt"])["input_ids"]
    sampling = {"max_tokens": row.get("max_tokens", max_tokens), "temperature": 1.0}
    sampling.update({k: row[k] for k in SAMPLING_KEYS if k in row})
    try:
        if max_len and len(ids) >= max_len:
            raise RequestSpecError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}")
        prep = engine.prepare(ids, sampling, spec, settings, routes_start=row.get("routed_experts_prompt_start", 0),
                              journal=journal)
        if resume and prep.session is not None:
            prep.session.recover_existing = True
        res = None
        # a batch job consumes no per-token output: one final delta, then the receipt
        async for ev in engine.execute(prep, stream=False):
            if isinstance(ev, RequestResult):
                res = ev
            elif ev[0].finished and on_generated is not None:
                on_generated()
        assert res is not None
        receipt = dict(res.receipt or {})
        receipt.update(index=i, prompt_tokens=len(ids), completion_tokens=len(res.completion_token_ids))
    except PluginFault:  # a plugin broke its contract at admission: logged naming it
        receipt = _fault_receipt(i, spec)
    except GenartifactError as e:  # refused before inference: specific message, nothing stored
        receipt = {"index": i, "state": "rejected", "error_code": "admission_rejected", "error": str(e)}
    except (ValueError, TypeError) as e:  # the engine's own request validation (before generation)
        receipt = {"index": i, "state": "rejected", "error_code": "engine_rejected",
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return receipt


async def run_group(engine: Any, i: int, row: Mapping[str, Any], spec: Mapping[str, Any],
                    settings: Mapping[str, Any], journal: Any, max_tokens: int, samples: list[int],
                    on_receipt: Any = None, on_generated: Any = None) -> list[dict[str, Any]]:
    """Run a ``"n": K`` prompts row as one GRPO group (``samples``: the sample indices to run, all of
    ``0..K-1`` or, on ``--resume``, those without a ready receipt) and return one receipt per sample.

    Each sample is its own engine request (K requests rather than vLLM's ``SamplingParams.n``: each keeps its
    own request id, capture rows and admission, so its artifact is exactly that of a one-sample request).
    A row ``seed`` gives sample k the seed ``seed + k`` — vLLM's own rule for ``n > 1``
    (``v1/engine/parallel_sampling.py``: child k gets ``seed + index``). Every sample is admitted (as a full,
    non-deduplicated artifact: the worst case of its sample part) before any starts; one refusal rejects the
    whole group. The prompt part is stored once (:class:`genartifact.groups.GroupCollector`) at
    ``group_object_target(target, "prompt-<group id>")``, each sample at ``sample_spec(spec, k)``.

    Receipts: ``index``, ``sample``, ``group`` (``id``, ``index``, ``size``; when shared: ``prompt_part``
    (``object_id``, ``sha256``, ``byte_count``), ``prompt_row_mismatches``, ``route_token_start``; else
    ``not_shared``: why the sample was stored whole). ``on_receipt(receipt)`` is called as each sample ends
    (a stop never loses a finished sample's receipt); ``on_generated()`` once every sample finished generating.
    Never raises for a sample (a sample's failure is its receipt only)."""
    from genartifact.engine.vllm_adapter import RequestResult
    from genartifact.groups import GroupCollector

    n = int(row["n"])
    gid = uuid.uuid4().hex[:12]
    max_len = int(engine.model_info.engine_options.get("max_model_len", 0))
    ids = engine.tokenizer(row["prompt"])["input_ids"]
    sampling = {"max_tokens": row.get("max_tokens", max_tokens), "temperature": 1.0}
    sampling.update({k: row[k] for k in SAMPLING_KEYS if k in row})

    def base(k: int) -> dict[str, Any]:
        return {"index": i, "sample": k, "group": {"id": gid, "index": k, "size": n}}

    def done(r: dict[str, Any]) -> dict[str, Any]:
        if on_receipt is not None:
            on_receipt(r)
        return r

    preps: dict[int, Any] = {}
    refused: dict[str, Any] | None = None
    try:
        if max_len and len(ids) >= max_len:
            raise RequestSpecError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}")
        for k in samples:  # the group's worst case: every sample admitted before any runs
            sk = dict(sampling)
            if row.get("seed") is not None:
                sk["seed"] = int(row["seed"]) + k
            preps[k] = engine.prepare(ids, sk, sample_spec(spec, k), settings,
                                      routes_start=row.get("routed_experts_prompt_start", 0), journal=journal)
    except PluginFault:
        refused = _fault_receipt(i, spec)
    except GenartifactError as e:
        refused = {"state": "rejected", "error_code": "admission_rejected", "error": str(e)}
    except (ValueError, TypeError) as e:
        refused = {"state": "rejected", "error_code": "engine_rejected", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    if refused is not None:
        for p in preps.values():
            if p.session is not None:
                p.session.release()
        return [done({**refused, **base(k)}) for k in samples]
    tgt = spec["delivery"]["target"]

    async def store_prompt(part: Any, leader: int) -> dict[str, Any]:
        return await preps[leader].session.deliver_extra(part, group_object_target(tgt, f"prompt-{gid}"))

    collector = GroupCollector(gid, n, samples, store_prompt)
    for k, p in preps.items():
        p.session.group, p.session.group_index = collector, k
    generating = set(samples)

    async def one(k: int) -> dict[str, Any]:
        res = None
        try:
            async for ev in engine.execute(preps[k], stream=False):
                if isinstance(ev, RequestResult):
                    res = ev
                elif ev[0].finished:
                    generating.discard(k)
                    if not generating and on_generated is not None:
                        on_generated()
            assert res is not None
            receipt = {**dict(res.receipt or {}), "prompt_tokens": len(ids),
                       "completion_tokens": len(res.completion_token_ids)}
        except (ValueError, TypeError) as e:  # the engine's own request validation (before generation)
            receipt = {"state": "rejected", "error_code": "engine_rejected",
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - one sample's failure must not lose the others' receipts
            log.error("group_sample_failed", index=i, sample=k, error_type=type(e).__name__)
            receipt = _engine_failed(e)
            preps[k].session.release()  # idempotent; a sample that never started holds its capture state
        finally:
            generating.discard(k)
            collector.withdraw(k)  # a no-op once it submitted; else the others must not wait for it
        b = base(k)
        return done({**b, **receipt, "group": {**b["group"], **receipt.get("group", {})}})

    return list(await asyncio.gather(*(one(k) for k in samples)))


async def run_generate(*, model: str, prompts: list[dict[str, Any] | RequestSpecError], cfg: config_mod.Config,
                       contents: list[str], target: str, max_tokens: int, run_id: str,
                       engine_kwargs: Mapping[str, Any], progress: bool = True, writer: ReceiptsWriter | None = None,
                       done: Mapping[Any, Mapping[str, Any]] | None = None,
                       stop: dict[str, Any] | None = None, resume: bool = False,
                       freeze_heap: bool = False) -> list[dict[str, Any]]:
    """Validate every row, then run the valid ones concurrently through one engine; one receipt per prompt,
    one per sample for a ``"n" > 1`` row (:func:`run_group`; ``rejected`` for rows refused before inference),
    returned in input order (then sample order) and, with ``writer``, appended to it as each request ends.
    ``done``: receipts of an earlier run (``--resume``, keyed by :func:`receipt_key`): rows with a ready one
    are skipped, and of a group only the samples without a ready receipt run again (as a new group attempt
    with its own prompt part). ``resume``: this is a ``--resume`` run (objects an earlier run stored are
    recognised by read-back, even without a journal or any receipt). ``stop``: filled with ``{"signal":
    signum}`` when SIGINT/SIGTERM stopped the run. ``freeze_heap``: this process is the run's own (the CLI):
    freeze its start-up heap once the engine started (:func:`~genartifact.engine.vllm_adapter.freeze_startup_heap`:
    no full-heap GC pauses during the run), and unfreeze it after the engine's shutdown."""
    from tqdm import tqdm

    done = done or {}
    stop = stop if stop is not None else {}
    prompts = [_checked_row(r, i) for i, r in enumerate(prompts)]  # rows given through the API are checked too
    host = cfg.host()
    targets = check_target_tables(cfg, host)
    settings = cfg.target_settings()
    journal = cfg.journal()
    receipts: dict[int | tuple[int, int], dict[str, Any]] = {}

    def emit(i: int | tuple[int, int], r: dict[str, Any]) -> None:
        receipts[i] = r
        if r.get("state") == "rejected":  # on the console too, not only in receipts.jsonl (its text is the receipt's)
            log.warning("generate_row_rejected", index=r.get("index"), error_code=r.get("error_code"),
                        error=str(r.get("error", ""))[:300])
        if writer is not None:
            writer.write(r)

    specs: dict[int, dict[str, Any]] = {}
    todo: dict[int, list[int]] = {}  # group rows: the sample indices to run
    for i, row in enumerate(prompts):
        if done.get(i, {}).get("state") == "ready":
            continue
        if group_size(row) > 1:
            todo[i] = [k for k in range(group_size(row)) if done.get((i, k), {}).get("state") != "ready"]
            if not todo[i]:
                continue
        if isinstance(row, RequestSpecError):
            emit(i, {"index": i, "state": "rejected", "error_code": "request_invalid", "error": str(row)})
            continue
        try:
            specs[i] = preflight_row(host, targets, row, contents, target, run_id, i)
        except PluginFault:  # logged naming the plugin; this request fails, the others run
            emit(i, _fault_receipt(i, None))
        except (GenartifactError, ValueError, TypeError, OverflowError) as e:
            emit(i, {"index": i, "state": "rejected", "error_code": "request_invalid", "error": str(e)})
        else:
            continue
        todo.pop(i, None)
    def spec_of(i: int) -> dict[str, Any] | None:  # a row not run now (ready earlier): the keys it owns
        try:
            return preflight_row(host, targets, prompts[i], contents, target, run_id, i)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - a row that does not preflight owns no key
            return None

    _refuse_shared_keys(targets, specs, todo, prompts, emit, spec_of)
    if (done or resume) and specs:  # --resume: objects a crashed run stored are recognised by SHA-256 read-back
        intents: dict[str, list[dict[str, Any]]] = {}
        for d in (journal.deliveries() if journal is not None else []):
            intents.setdefault(d["object_id"], []).append(d)
        for i in list(specs):
            if i in todo:  # a group: each missing sample on its own (its header names its group and prompt part)
                for k in list(todo[i]):
                    rec = await _recover_from_journal(targets, sample_spec(specs[i], k), journal, intents)
                    if rec is not None:
                        emit((i, k), {**rec, "index": i, "sample": k})
                        todo[i].remove(k)
                if not todo[i]:
                    del specs[i], todo[i]
                continue
            rec = await _recover_from_journal(targets, specs[i], journal, intents)
            if rec is not None:
                emit(i, {**rec, "index": i})
                del specs[i]
    if not specs:
        return [receipts[i] for i in sorted(receipts, key=_key_order)]
    loop = asyncio.get_running_loop()
    tasks: dict[int, asyncio.Task[dict[str, Any]]] = {}
    delivering: set[int] = set()
    stopping = asyncio.Event()

    def on_signal(signum: int) -> None:
        if "signal" not in stop:
            stop["signal"] = signum
            log.warning("generate_stopping", signal=signal.Signals(signum).name,
                        draining=len([i for i in delivering if not tasks[i].done()]),
                        aborting=len([i for i in tasks if i not in delivering and not tasks[i].done()]),
                        drain_s=DRAIN_S)
            for i, t in tasks.items():
                if i not in delivering:
                    t.cancel()  # still generating: abort in vLLM, nothing stored
            stopping.set()
        else:  # a second signal: stop draining
            for t in tasks.values():
                t.cancel()

    def startup_signal(signum: int, _frame: Any) -> None:
        stop["signal"] = signum
        raise _Interrupted(signum)

    from genartifact.engine.vllm_adapter import VllmEngine, freeze_startup_heap

    for s in EXIT_SIGNAL:  # engine start blocks the event loop: a plain handler interrupts it promptly
        signal.signal(s, startup_signal)
    engine = VllmEngine(host, model, **engine_kwargs)
    frozen = 0  # objects freeze_startup_heap froze (freeze_heap)
    start_failed: BaseException | None = None  # the engine did not start: every row's receipt says so
    try:
        try:
            await engine.start()
        except Exception as e:
            start_failed = e
            raise
        finally:
            for s in EXIT_SIGNAL:  # replaces the start-up handlers with no gap in between
                loop.add_signal_handler(s, on_signal, s)
        if "signal" in stop:
            raise _Interrupted(stop["signal"])
        if freeze_heap:
            frozen = freeze_startup_heap()
            log.info("generate_heap_frozen", objects=frozen)
        bar = tqdm(total=len(specs), desc="generate", unit="req", disable=not progress)

        async def one(i: int) -> Any:
            row = prompts[i]
            assert isinstance(row, dict)
            if i in todo:
                out = await run_group(engine, i, row, specs[i], settings, journal, max_tokens, todo[i],
                                      on_receipt=lambda r: emit(receipt_key(r), r),
                                      on_generated=lambda: delivering.add(i))
                bar.update(1)
                return out
            receipt = await run_row(engine, i, row, specs[i], settings, journal, max_tokens,
                                    on_generated=lambda: delivering.add(i), resume=resume)  # from here on a stop drains
            emit(i, receipt)
            bar.update(1)
            return receipt

        tasks.update({i: asyncio.ensure_future(one(i)) for i in specs})
        pending = set(tasks.values())
        while pending:
            stop_wait = asyncio.ensure_future(stopping.wait())
            finished, pending = await asyncio.wait(pending | {stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stop_wait)
            stop_wait.cancel()
            if stopping.is_set() and pending:
                _, still = await asyncio.wait(pending, timeout=DRAIN_S)
                for t in still:
                    t.cancel()
                await asyncio.wait(pending)
                break
        bar.close()
    except _Interrupted:
        if engine.llm is None:  # interrupted during start-up: nothing graceful to wait for
            from genartifact.engine.vllm_adapter import kill_engine_processes

            kill_engine_processes()
    finally:
        for s in EXIT_SIGNAL:
            loop.remove_signal_handler(s)
        engine.shutdown()
        if frozen:  # as vLLM's EngineCore.shutdown: the process may go on (what start-up made is collectable again)
            gc.unfreeze()
        for i in specs:
            for key in ([(i, k) for k in todo[i]] if i in todo else [i]):
                if key not in receipts:
                    r = ({"index": i, **_engine_not_started(start_failed)} if start_failed is not None
                         and "signal" not in stop else _unfinished_receipt(i, tasks.get(i), "signal" in stop))
                    emit(key, r if key == i else {**r, "sample": key[1]})
    return [receipts[i] for i in sorted(receipts, key=_key_order)]


def run_generate_cli(args: argparse.Namespace) -> int:
    """Entry point of ``genartifact generate``: 0 if every row has a ready receipt, 1 if any is not ready,
    130/143 when SIGINT/SIGTERM stopped the run, 2 for errors found before the engine starts."""
    from genartifact.engine.engine_args import command_engine_kwargs

    cfg = config_mod.load(args.config)
    kwargs = command_engine_kwargs(cfg, args)  # vLLM's engine arguments: [engine] table, then the command line
    prompts = read_prompt_rows(args.prompts)
    contents = [c.strip() for c in args.contents.split(",")] if args.contents else list(cfg.plugins["contents"])
    if not contents:
        raise ConfigError("no contents: pass --contents or enable content plugins in the config")
    if args.max_tokens < 1:
        raise RequestSpecError(f"--max-tokens must be >= 1; got {args.max_tokens}")
    resume = bool(getattr(args, "resume", False))
    if resume and not (args.run_id or args.out):
        raise RequestSpecError("--resume needs the --run-id (or --out) of the run to resume")
    run_id = args.run_id or time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    if not RUN_ID.fullmatch(run_id):
        raise RequestSpecError(f"--run-id {run_id!r} invalid; allowed: 1..128 of [A-Za-z0-9_.-], starting alphanumeric")
    host = cfg.host()
    for c in contents:  # a typo in --contents fails now, not as one rejected receipt per row
        host.require("contents", c, "--contents")
    built = check_target_tables(cfg, host)  # plugin and target settings fail now
    args.target = default_target(args.target, host)
    first = target_for(args.target, run_id, 0, host)  # and a malformed --target
    target = built.get(first.get("kind")) if isinstance(first.get("kind"), str) else None
    if target is not None and not isinstance(target, PluginFault):
        try:  # one the target refuses (an unknown profile...) fails now, not as one rejected receipt per row
            target.validate(first)
        except TargetError as e:  # (a target's errors carry no secrets: never the grant's URL or headers)
            raise RequestSpecError(f"--target is refused by its target: {e}") from None
    replicas = getattr(args, "replicas", None)
    from genartifact.engine.replicas import check_replica_args

    # before anything is created; always: --max-inflight 0 must fail here, not be silently ignored on one engine
    check_replica_args(replicas, getattr(args, "ray", None), getattr(args, "max_inflight", 8), resume)
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise RequestSpecError(f"--model {args.model!r} is not a model directory (no config.json)")
    out = Path(args.out or Path("artifacts") / "runs" / run_id / "receipts.jsonl")
    done: dict[Any, dict[str, Any]] = {}
    if resume:
        done = read_receipts(out)
    elif out.exists() or out.is_symlink():
        raise RequestSpecError(f"receipts file {str(out)!r} already exists; choose another --run-id or --out, or "
                               f"pass --resume")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RequestSpecError(f"cannot create the receipts directory {str(out.parent)!r}: {e.strerror}") from None
    if not os.access(out.parent, os.W_OK):
        raise RequestSpecError(f"receipts directory {str(out.parent)!r} is not writable")
    max_decoded_bytes(), pipeline_concurrency(), small_pipeline_concurrency()  # environment limits fail now, not after inference
    t0 = time.perf_counter()
    writer = ReceiptsWriter(out, resume=resume)
    stop: dict[str, Any] = {}
    try:
        if replicas is not None:  # N engine replicas as Ray actors: engine/replicas.py
            from genartifact.engine.replicas import run_generate_replicated

            receipts = run_generate_replicated(model=str(model), prompts=prompts, cfg=cfg, contents=contents,
                                               target=args.target, max_tokens=args.max_tokens, run_id=run_id,
                                               engine_kwargs=kwargs, writer=writer, replicas=replicas,
                                               ray_address=args.ray, max_inflight=args.max_inflight,
                                               start_together=args.start_together)
        else:
            receipts = asyncio.run(run_generate(model=str(model), prompts=prompts, cfg=cfg, contents=contents,
                                                target=args.target, max_tokens=args.max_tokens, run_id=run_id,
                                                engine_kwargs=kwargs, writer=writer, done=done, stop=stop,
                                                resume=resume, freeze_heap=True))
    except _Interrupted as e:  # raised inside the event loop's own code during start-up; the run's
        stop["signal"] = e.signum  # cleanup (receipts, engine shutdown) already ran when asyncio.run cancelled it
        receipts = []
        from genartifact.engine.vllm_adapter import kill_engine_processes

        kill_engine_processes()
    finally:
        writer.close()
        writer.report_unwritten()
    final = {**done, **{receipt_key(r): r for r in receipts}}
    # one artifact per row, n per group row (a row refused before it was parsed counts once)
    expected = [(i, k) for i, row in enumerate(prompts) if group_size(row) > 1 for k in range(group_size(row))]
    expected += [i for i, row in enumerate(prompts) if group_size(row) == 1]
    ready = sum(final.get(key, {}).get("state") == "ready" for key in expected)
    log.info("generate_done", run_id=run_id, ready=ready, total=len(expected), receipts=str(out),
             seconds=round(time.perf_counter() - t0, 2), interrupted=bool(stop))
    print(f"{ready}/{len(expected)} artifacts ready; receipts: {out}")
    if writer.unwritten:
        print(f"error: {len(writer.unwritten)} receipt(s) could not be written to {out} (named above)",
              file=sys.stderr)
    if stop:
        print(f"error: stopped by {signal.Signals(stop['signal']).name}; rerun with --resume --run-id {run_id}",
              file=sys.stderr)
        return EXIT_SIGNAL.get(stop["signal"], 1)
    return 0 if ready == len(expected) and not writer.unwritten else 1
