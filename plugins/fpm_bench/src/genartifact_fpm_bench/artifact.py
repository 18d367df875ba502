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


def engine_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two engine blocks (ignoring :data:`ENGINE_IGNORED`)."""
    fa, fb = _flat(a), _flat(b)
    keys = sorted(set(fa) | set(fb))
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
        return json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise JSONFileError(type(e).__name__) from None
    except RecursionError:
        raise JSONFileError("nested too deeply") from None


def load_rank(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        doc = read_json(path)
    except JSONFileError as e:
        raise MergeError(f"{path}: cannot read rank artifact ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != RANK_SCHEMA or doc.get("schema_version") != SCHEMA_VERSION:
        raise MergeError(f"{path}: not a {RANK_SCHEMA} v{SCHEMA_VERSION} artifact (legacy or foreign); "
                         f"got schema={doc.get('schema') if isinstance(doc, dict) else None!r} "
                         f"version={doc.get('schema_version') if isinstance(doc, dict) else None!r}")
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
    for p, d in clean[1:]:
        diff = engine_diff(clean[0][1]["engine"], d["engine"])
        if diff:
            raise MergeError(f"engine provenance differs between {clean[0][0]} and {p}: {', '.join(diff[:10])}")
    out = Path(out)
    if out.exists():
        raise MergeError(f"merged artifact {out} exists; merged artifacts are written once")
    sidecar = out.with_name(f"{out.stem}_worker_probe.json")
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
    write_once(sidecar, probe)
    write_once(out, merged)
    return merged
