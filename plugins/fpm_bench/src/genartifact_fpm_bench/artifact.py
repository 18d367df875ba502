"""Rank artifacts, merge across data-parallel ranks, and the worker-probe sidecar.

Rank artifact: JSON ``{"schema": "genartifact.fpm_bench.rank", "schema_version": 1, ...}`` written once
(create-only) and atomically (temp file + link). Merge checks that all ranks share run id, grid digest,
measurement protocol and coverage; exactly one record per rank and point; engine blocks of ranks that captured
cleanly agree (ignoring the rank id and probe-filled fields) — else it fails naming the differing keys; ranks
whose capture failed are excluded from that comparison and listed in ``capture_errors``. The worker-probe results
go to ``<merged stem>_worker_probe.json`` (schema ``genartifact.fpm_bench.worker_probe`` v1), named by
``worker_probe_path`` in the merged artifact. The blocks of the config's own probes (``provenance``) and their faults
(``provenance_errors``) are carried per rank, never compared. Nothing is ever rewritten.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from genartifact.errors import GenartifactError

RANK_SCHEMA = "genartifact.fpm_bench.rank"
MERGED_SCHEMA = "genartifact.fpm_bench.merged"
PROBE_SCHEMA = "genartifact.fpm_bench.worker_probe"
SCHEMA_VERSION = 1
#: engine-block keys that legitimately differ per rank (rank id, probe-filled fields)
ENGINE_IGNORED = {("parallel", "data_parallel_rank"), ("worker_probe",), ("resolved",)}


class MergeError(GenartifactError, ValueError):
    """Rank artifacts cannot be merged (names the rank files and the differing keys)."""


def write_once(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> Path:
    """Write JSON atomically and create-only (temp file in the same directory, then ``os.link``).
    Raises ``FileExistsError`` if ``path`` exists."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, allow_nan=False), encoding="utf-8")
    try:
        os.link(tmp, p)
    finally:
        tmp.unlink()
    return p


def rank_path(out_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(out_dir) / f"fpm_rank{rank}.json"


def _flat(d: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if isinstance(d, Mapping):
        out: dict[tuple[str, ...], Any] = {}
        for k, v in d.items():
            out.update(_flat(v, (*prefix, str(k))))
        return out
    return {prefix: d}


def engine_diff(a: Mapping[str, Any], b: Mapping[str, Any], common_only: bool = False) -> list[str]:
    """Dotted keys whose values differ between two engine blocks (ignoring :data:`ENGINE_IGNORED`); with
    ``common_only`` only keys both blocks hold (a rank whose capture partly failed: what it did capture must still
    agree)."""
    fa, fb = _flat(a), _flat(b)
    keys = sorted(set(fa) & set(fb) if common_only else set(fa) | set(fb))
    return [".".join(k) for k in keys if not any(k[: len(i)] == i for i in ENGINE_IGNORED) and fa.get(k) != fb.get(k)]


#: Largest JSON file (bytes) the bench commands read: rank/merged artifacts, models, points files. A device or
#: a huge file is refused after reading this much, never read whole into memory.
MAX_JSON_BYTES = 256 << 20


class JSONFileError(ValueError):
    """A JSON input file that cannot be used; ``str()`` is the reason (exception type name, "larger than N
    bytes" or "nested too deeply")."""


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse the JSON file ``path``, reading at most :data:`MAX_JSON_BYTES` + 1 bytes. Raises
    :class:`JSONFileError` for unreadable (``OSError``), oversized, non-UTF-8, malformed or too deeply nested
    input — never ``RecursionError``/``MemoryError``."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise JSONFileError(type(e).__name__) from None
    if len(raw) > MAX_JSON_BYTES:
        raise JSONFileError(f"larger than {MAX_JSON_BYTES} bytes")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except ValueError as e:
        raise JSONFileError(f"{type(e).__name__}: {str(e)[:120]}") from None
    except RecursionError:
        raise JSONFileError("nested too deeply") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (bench artifacts hold finite numbers only)")


#: the largest data-parallel size a rank artifact may declare
MAX_DP_SIZE = 4096


def _is_int(v: Any) -> bool:
    return type(v) is int


def load_rank(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check one rank artifact: schema and version, the fields the merge reads and their types, every point
    record against its own key and the artifact's grid digest, and each completed estimate finite and >= 0.
    :raises MergeError: naming the file and the offending field."""
    try:
        doc = read_json(path)
    except JSONFileError as e:
        raise MergeError(f"{path}: cannot read rank artifact ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != RANK_SCHEMA or not _is_int(doc.get("schema_version")) \
            or doc.get("schema_version") != SCHEMA_VERSION:
        raise MergeError(f"{path}: not a {RANK_SCHEMA} v{SCHEMA_VERSION} artifact (legacy or foreign); "
                         f"got schema={str(doc.get('schema'))[:80] if isinstance(doc, dict) else None!r} "
                         f"version={str(doc.get('schema_version'))[:20] if isinstance(doc, dict) else None!r}")

    def bad(field: str, want: str) -> MergeError:
        return MergeError(f"{path}: field {field} must be {want}")

    for k, t, want in (("run_id", str, "a string"), ("grid_digest", str, "a string"), ("mode", str, "a string"),
                       ("protocol", dict, "an object"), ("coverage", dict, "an object"), ("limits", dict, "an object"),
                       ("dp", dict, "an object"), ("points", list, "a list")):
        if not isinstance(doc.get(k), t):
            raise bad(k, want)
    dp = doc["dp"]
    if not _is_int(dp.get("size")) or not 1 <= dp["size"] <= MAX_DP_SIZE:
        raise bad("dp.size", f"an integer 1..{MAX_DP_SIZE}")
    if not _is_int(dp.get("rank")) or not 0 <= dp["rank"] < dp["size"]:
        raise bad("dp.rank", f"an integer 0..dp.size-1 ({dp['size'] - 1})")
    if doc.get("engine") is not None and not isinstance(doc["engine"], dict):
        raise bad("engine", "an object or null")
    for k in ("capture_errors", "provenance", "provenance_errors"):
        if doc.get(k) is not None and not isinstance(doc[k], dict):
            raise bad(k, "an object")
    from genartifact_fpm_bench.grid import PHASES, GridError, grid_digest, point_from_dict

    points = []
    for i, rec in enumerate(doc["points"]):
        where = f"points[{i}]"
        if not isinstance(rec, dict) or not isinstance(rec.get("key"), str) or not isinstance(rec.get("point"), dict):
            raise bad(where, "an object with a string key and a point object")
        try:
            pt = point_from_dict(rec["point"], "point")
        except GridError as e:
            raise bad(f"{where}.point", f"a bench point ({e})") from None
        if pt.phase not in PHASES or min(pt.batch, pt.tokens, pt.kv, pt.context) < 0:
            raise bad(f"{where}.point", "a bench point (phase prefill or decode, counts integers >= 0)")
        key = pt.key()
        if key != rec["key"]:
            raise MergeError(f"{path}: {where}: key {rec['key'][:80]!r} does not match its point (key {key!r})")
        if not _is_int(rec.get("dp_rank")):
            raise bad(f"{where}.dp_rank", "an integer")
        if rec.get("status") == "completed":
            est = rec.get("estimate")
            wall = est.get("wall_time") if isinstance(est, dict) else None
            if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not 0 <= wall < float("inf"):
                raise bad(f"{where}.estimate.wall_time", "a finite number of seconds >= 0")
            cv = est.get("cv")
            if cv is not None and (isinstance(cv, bool) or not isinstance(cv, (int, float)) or cv < 0):
                raise bad(f"{where}.estimate.cv", "null or a number >= 0")
        points.append(pt)
    if grid_digest(points) != doc["grid_digest"]:
        raise MergeError(f"{path}: its point records do not hash to its grid_digest (records changed after the run, "
                         f"or a foreign grid)")
    return doc


def merge(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Merge rank artifacts into ``out`` (create-only) plus the worker-probe sidecar; returns the merged doc."""
    if not paths:
        raise MergeError("no rank artifacts given")
    docs = [(str(p), load_rank(p)) for p in paths]
    ref_path, ref = docs[0]
    for key in ("run_id", "grid_digest", "protocol", "coverage", "mode"):
        for p, d in docs[1:]:
            if d.get(key) != ref.get(key):
                raise MergeError(f"{p} and {ref_path} differ in {key}")
    ranks = [d["dp"]["rank"] for _, d in docs]
    if len(set(ranks)) != len(ranks):
        raise MergeError(f"duplicate DP ranks {sorted(ranks)}: exactly one artifact per rank")
    size = ref["dp"]["size"]
    if sorted(ranks) != list(range(size)) or any(d["dp"]["size"] != size for _, d in docs):
        raise MergeError(f"ranks {sorted(ranks)} do not cover data-parallel size {size}")
    keys = None
    for p, d in docs:
        ks = [r["key"] for r in d["points"]]
        if len(set(ks)) != len(ks):
            raise MergeError(f"{p}: more than one record for a point")
        if keys is None:
            keys = ks
        elif sorted(ks) != sorted(keys):
            raise MergeError(f"{p} and {ref_path} cover different points")
        if any(r.get("dp_rank") != d["dp"]["rank"] for r in d["points"]):
            raise MergeError(f"{p}: a record's dp_rank differs from the artifact's rank")
    clean = [(p, d) for p, d in docs if d.get("engine") and not d.get("capture_errors")]
    capture_errors = {str(d["dp"]["rank"]): (d.get("capture_errors") or "missing engine block")
                      for _, d in docs if not d.get("engine") or d.get("capture_errors")}
    # every rank with an engine block against one reference (a cleanly captured rank where there is one): in full
    # between clean ranks; where either side's capture partly failed, on the fields both captured (e.g. versions)
    blocks = [(p, d) for p, d in docs if d.get("engine")]
    ref_p, ref_d = clean[0] if clean else (blocks[0] if blocks else (None, None))
    for p, d in blocks:
        if p == ref_p:
            continue
        partial = bool(d.get("capture_errors") or ref_d.get("capture_errors"))
        diff = engine_diff(ref_d["engine"], d["engine"], common_only=partial)
        if diff:
            why = " (capture errors on one side; the fields both captured are compared)" if partial else ""
            raise MergeError(f"engine provenance differs between {ref_p} and {p}{why}: {', '.join(diff[:10])}")
    unverified = sorted(d["dp"]["rank"] for _, d in docs if not d.get("engine"))
    out = Path(out)
    if out.exists():
        raise MergeError(f"merged artifact {out} exists; merged artifacts are written once")
    sidecar = out.with_name(f"{out.stem}_worker_probe.json")
    if sidecar.exists():
        raise MergeError(f"worker-probe sidecar {sidecar} exists; merged artifacts are written once")
    engine = None
    if clean:
        engine = json.loads(json.dumps(clean[0][1]["engine"]))
        engine.pop("worker_probe", None)
        engine.setdefault("parallel", {})["data_parallel_rank"] = None
    merged = {
        "schema": MERGED_SCHEMA, "schema_version": SCHEMA_VERSION, "artifact_type": "merged",
        "run_id": ref["run_id"], "grid_digest": ref["grid_digest"], "mode": ref["mode"], "protocol": ref["protocol"],
        "limits": {str(d["dp"]["rank"]): d["limits"] for _, d in docs},
        "dp": {"size": size, "source_ranks": sorted(ranks)},
        "rank_files": [p for p, _ in docs],
        "coverage": {k: v * size if isinstance(v, int) else v for k, v in ref["coverage"].items()},
        "points": [r for _, d in sorted(docs, key=lambda x: x[1]["dp"]["rank"]) for r in d["points"]],
        "warmup_evidence": {str(d["dp"]["rank"]): d.get("warmup_evidence", []) for _, d in docs},
        "engine": engine,
        "capture_errors": capture_errors,
        # ranks with no engine block at all: nothing of theirs could be checked for identity
        "unverified_ranks": unverified,
        "worker_probe_path": sidecar.name,
        # the config's own probes (third-party): per rank, as each rank recorded them; never compared
        "provenance": {str(d["dp"]["rank"]): d.get("provenance") or {} for _, d in docs},
        "provenance_errors": {str(d["dp"]["rank"]): d["provenance_errors"] for _, d in docs
                              if d.get("provenance_errors")},
    }
    probe = {"schema": PROBE_SCHEMA, "schema_version": SCHEMA_VERSION, "run_id": ref["run_id"],
             "merged_output_path": out.name, "rank_files": [p for p, _ in docs],
             "ranks": {str(d["dp"]["rank"]): (d.get("engine") or {}).get("worker_probe", {"status": "missing"})
                       for _, d in docs}}
    for doc in (probe, merged):  # both serialisable before either is written: all or nothing
        try:
            json.dumps(doc, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise MergeError(f"merged artifact cannot be written: {type(e).__name__}: {str(e)[:200]}") from None
    write_once(sidecar, probe)
    try:
        write_once(out, merged)
    except BaseException:
        sidecar.unlink(missing_ok=True)  # ours, written just now: the merge leaves nothing or both
        raise
    return merged
