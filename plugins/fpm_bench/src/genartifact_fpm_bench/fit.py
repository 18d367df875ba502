"""``genartifact bench fit``: a step-time model per phase from FPM benchmark artifacts, with measured holdout error.

Per phase (prefill, decode) two candidate models are fitted to the grid points of a rank or merged artifact:

* ``linear`` — planner-style linear regression with **non-negative** coefficients (``scipy.optimize.nnls``, then
  a robust soft-L1 refinement under the same bounds, see :func:`fit_linear`), in the
  spirit of NVIDIA Dynamo's planner (prefill: wall time ~ prefill tokens; decode: wall time ~ decode requests and
  decode KV tokens). Features (all from the pass shape an FPM carries):

  - prefill: ``intercept``, ``prefill_requests``, ``prefill_tokens``, ``prefill_attention_pairs`` =
    ``prefill_tokens × (prefill_kv_tokens + prefill_tokens / 2) / prefill_requests`` — the query × key pairs of
    causal attention when the requests of a pass are equally long (the grid's are);
  - decode: ``intercept``, ``decode_requests``, ``decode_kv_tokens``.

* ``interpolate`` — piecewise-linear interpolation over the grid (``scipy.interpolate.LinearNDInterpolator`` on a
  Delaunay triangulation; ``numpy.interp`` when only one coordinate varies) in the coordinates
  prefill ``(prefill_tokens, prefill_requests, prefill_kv_tokens / prefill_requests)``, decode
  ``(decode_requests, decode_kv_tokens / decode_requests)``, each scaled to [0, 1] over the grid. Outside the
  grid's convex hull it answers with the linear model (``extrapolation: "linear"``). It holds only the points
  with CV <= 0.1 when there are enough of them (it passes exactly through each point it holds).

Each grid point's training value is the artifact's estimate (median ``wall_time`` of its measured samples, seconds);
its coordinates are the mean shape of those samples as the FPMs recorded them (a decode point's contexts spread by
its admission passes). Ranks of a merged artifact are pooled per point (mean of the rank estimates); their
disagreement is the report's business. The CV of every point is recomputed from its raw samples.

Holdout error (absolute percentage error ``|pred − truth| / truth``), for each model and phase:

* ``loo`` — leave-one-point-out over the grid: refit without the point, predict it;
* ``off_grid`` — the points of a second artifact (``bench run --points FILE`` of shapes not on the grid, same
  engine identity), predicted by the full fit.

Each is reported as MAPE and max error over all points and over points with CV ≤ ``NOISY_CV`` (0.1). The model
selected per phase is the one with the lower off-grid MAPE over CV ≤ 0.1 points when an off-grid set exists, else
the lower LOO MAPE over those points.

Output: a JSON model (schema ``genartifact.fpm_bench.step_model`` v1, see :data:`MODEL_SCHEMA`) carrying the
coefficients and the grid, the source artifacts' run id, grid digest and engine identity, and the holdout errors;
:class:`StepModel` loads it and ``predict(shape) -> seconds``.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from genartifact_fpm_bench.artifact import (
    ENGINE_IGNORED,
    MERGED_SCHEMA,
    RANK_SCHEMA,
    SCHEMA_VERSION,
    JSONFileError,
    engine_diff,
    read_json,
)
from genartifact_fpm_bench.runner import NOISY_CV

MODEL_SCHEMA = "genartifact.fpm_bench.step_model"
MODEL_SCHEMA_VERSION = 1
PHASES = ("prefill", "decode")
SHAPE_FIELDS = ("num_prefill_requests", "sum_prefill_tokens", "sum_prefill_kv_tokens", "num_decode_requests",
                "sum_decode_kv_tokens")
LINEAR_FEATURES = {"prefill": ("intercept", "prefill_requests", "prefill_tokens", "prefill_attention_pairs"),
                   "decode": ("intercept", "decode_requests", "decode_kv_tokens")}
INTERP_COORDS = {"prefill": ("prefill_tokens", "prefill_requests", "prefill_kv_per_request"),
                 "decode": ("decode_requests", "decode_context_per_request")}


#: inlier scale of the robust linear fit: relative residuals up to about 5 % count fully, larger ones less
ROBUST_SCALE = 0.05


class FitError(ValueError):
    """Artifacts cannot be fitted (names the file and the problem: schema, engine identity, too few points)."""


# ---------------------------------------------------------------- shapes and features


def _shape(s: Mapping[str, Any]) -> dict[str, float]:
    """Pass shape from an FPM ``scheduled`` mapping (``ScheduledStats`` field names); missing fields are 0."""
    return {f: float(s.get(f, 0) or 0) for f in SHAPE_FIELDS}


def phase_of(shape: Mapping[str, float]) -> str:
    """``prefill`` (only prefill requests), ``decode`` (only decode requests) or ``mixed``. Raises ``ValueError``
    for an empty shape."""
    p, d = shape.get("num_prefill_requests", 0), shape.get("num_decode_requests", 0)
    if p and not d:
        return "prefill"
    if d and not p:
        return "decode"
    if p and d:
        return "mixed"
    raise ValueError("shape has neither prefill nor decode requests (num_prefill_requests = num_decode_requests = 0)")


def linear_features(phase: str, shape: Mapping[str, float]) -> np.ndarray:
    """Feature vector (float64 ``[len(LINEAR_FEATURES[phase])]``) of ``shape`` for the linear model."""
    if phase == "prefill":
        r, t, k = shape["num_prefill_requests"], shape["sum_prefill_tokens"], shape["sum_prefill_kv_tokens"]
        return np.array([1.0, r, t, t * (k + t / 2.0) / max(r, 1.0)])
    r, k = shape["num_decode_requests"], shape["sum_decode_kv_tokens"]
    return np.array([1.0, r, k])


def interp_coords(phase: str, shape: Mapping[str, float]) -> np.ndarray:
    """Unscaled interpolation coordinates (float64 ``[len(INTERP_COORDS[phase])]``) of ``shape``."""
    if phase == "prefill":
        r = max(shape["num_prefill_requests"], 1.0)
        return np.array([shape["sum_prefill_tokens"], shape["num_prefill_requests"], shape["sum_prefill_kv_tokens"] / r])
    r = max(shape["num_decode_requests"], 1.0)
    return np.array([shape["num_decode_requests"], shape["sum_decode_kv_tokens"] / r])


# ---------------------------------------------------------------- observations from artifacts


@dataclass
class Observation:
    """One grid point of one phase: ``y`` seconds (mean over ranks of the per-rank median), ``shape`` the mean
    measured shape, ``cv`` the largest per-rank CV recomputed from raw samples (None with < 2 samples)."""

    key: str
    phase: str
    y: float
    shape: dict[str, float]
    cv: float | None
    ranks: dict[int, float] = field(default_factory=dict)


def recomputed_cv(rec: Mapping[str, Any]) -> float | None:
    """CV (population stdev / mean) of the measured samples' ``wall_time``, from the raw samples; None with < 2."""
    walls = [rec["raw_samples"][i]["timing"]["wall_time"] for i in rec["estimate"]["raw_sample_indices"]]
    if len(walls) < 2:
        return None
    return statistics.pstdev(walls) / statistics.fmean(walls)


def load_artifact(path: str | Path) -> dict[str, Any]:
    """A rank or merged FPM benchmark artifact (v1). Raises :class:`FitError` for anything else."""
    try:
        doc = read_json(path)
    except JSONFileError as e:
        raise FitError(f"{path}: cannot read artifact ({e})") from None
    if (not isinstance(doc, dict) or doc.get("schema") not in (RANK_SCHEMA, MERGED_SCHEMA)
            or doc.get("schema_version") != SCHEMA_VERSION):
        raise FitError(f"{path}: not a {RANK_SCHEMA} or {MERGED_SCHEMA} v{SCHEMA_VERSION} artifact")
    return doc


def observations(doc: Mapping[str, Any], rank: int | None = None) -> list[Observation]:
    """Completed points of ``doc`` (optionally of one DP ``rank``), pooled across ranks per point key."""
    by_key: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in doc["points"]:
        if r.get("status") == "completed" and (rank is None or r.get("dp_rank", 0) == rank):
            by_key[r["key"]].append(r)
    out = []
    for key, recs in by_key.items():
        shapes, ys, cvs, ranks = [], [], [], {}
        for r in recs:
            idx = r["estimate"]["raw_sample_indices"]
            ms = [_shape(r["raw_samples"][i]["scheduled"]) for i in idx]
            shapes.append({f: statistics.fmean(m[f] for m in ms) for f in SHAPE_FIELDS})
            ys.append(float(r["estimate"]["wall_time"]))
            ranks[int(r.get("dp_rank", 0))] = ys[-1]
            cv = recomputed_cv(r)
            if cv is not None:
                cvs.append(cv)
        shape = {f: statistics.fmean(s[f] for s in shapes) for f in SHAPE_FIELDS}
        out.append(Observation(key, recs[0]["point"]["phase"], statistics.fmean(ys), shape,
                               max(cvs) if cvs else None, ranks))
    return sorted(out, key=lambda o: o.key)


def engine_identity(engine: Mapping[str, Any] | None) -> str | None:
    """SHA-256 (hex) of the canonical JSON of an engine block without the per-rank and probe-filled keys
    (:data:`genartifact_fpm_bench.artifact.ENGINE_IGNORED`); None without an engine block."""
    if not engine:
        return None
    body = {k: v for k, v in engine.items() if (k,) not in ENGINE_IGNORED}
    par = dict(body.get("parallel") or {})
    par.pop("data_parallel_rank", None)
    if "parallel" in body:
        body["parallel"] = par
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


# ---------------------------------------------------------------- the two model kinds


def fit_linear(phase: str, obs: Sequence[Observation]) -> np.ndarray:
    """Non-negative linear fit of ``y`` on :func:`linear_features` minimizing *relative* error (what MAPE
    measures): non-negative least squares (``scipy.optimize.nnls``) on rows weighted by ``1 / y``, then a robust
    refinement under the same bounds (``scipy.optimize.least_squares``, ``loss="soft_l1"``, ``f_scale`` =
    :data:`ROBUST_SCALE` relative) — on a shared host, contention makes one-sided outliers that plain least
    squares chases. Returns coefficients (float64, seconds per feature unit, all >= 0). Raises
    :class:`FitError` with no points."""
    from scipy.optimize import least_squares, nnls

    if not obs:
        raise FitError(f"{phase}: no completed points to fit")
    X = np.array([linear_features(phase, o.shape) for o in obs])
    y = np.array([o.y for o in obs])
    scale = np.maximum(np.abs(X).max(axis=0), 1e-12)  # column scaling for conditioning
    Xs = X / scale
    w = 1.0 / y
    c0, _ = nnls(Xs * w[:, None], y * w)
    if len(obs) > X.shape[1]:
        res = least_squares(lambda c: (Xs @ c - y) * w, np.maximum(c0, 1e-12), bounds=(0.0, np.inf),
                            loss="soft_l1", f_scale=ROBUST_SCALE)
        c0 = np.maximum(res.x, 0.0)
    return c0 / scale


def _free_dims(pts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    free = np.flatnonzero(hi - lo > 1e-9 * np.maximum(1.0, np.abs(hi)))
    return free, lo, hi


class Interpolator:
    """Piecewise-linear interpolation of ``values`` (seconds) over ``points`` (``[n, d]`` unscaled coordinates);
    ``__call__`` returns NaN outside the convex hull (or off the grid's fixed coordinates)."""

    def __init__(self, points: np.ndarray, values: np.ndarray) -> None:
        self.points, self.values = np.asarray(points, float), np.asarray(values, float)
        self.trained_on = "given points"
        self.free, self.lo, self.hi = _free_dims(self.points)
        self._f: Any = None
        scaled = self._scale(self.points)
        if len(self.free) >= 2 and len(self.points) > len(self.free):
            from scipy.interpolate import LinearNDInterpolator
            from scipy.spatial import QhullError

            try:
                self._f = LinearNDInterpolator(scaled, self.values)
            except (QhullError, ValueError):
                self._f = None  # degenerate (e.g. collinear) grid: the linear model answers
        elif len(self.free) == 1:
            order = np.argsort(scaled[:, 0])
            xs, ys = scaled[order, 0], self.values[order]
            self._f = lambda q: np.where((q[:, 0] < xs[0]) | (q[:, 0] > xs[-1]), np.nan, np.interp(q[:, 0], xs, ys))

    def _scale(self, pts: np.ndarray) -> np.ndarray:
        span = np.where(self.hi - self.lo > 0, self.hi - self.lo, 1.0)
        return ((pts - self.lo) / span)[:, self.free]

    def __call__(self, q: np.ndarray) -> np.ndarray:
        q = np.atleast_2d(np.asarray(q, float))
        out = np.full(len(q), np.nan)
        fixed = np.setdiff1d(np.arange(self.points.shape[1]), self.free)
        on = np.all(np.abs(q[:, fixed] - self.lo[fixed]) <= 1e-6 * np.maximum(1.0, np.abs(self.lo[fixed])), axis=1)
        if self._f is None:
            if len(self.free) == 0 and len(self.values):  # a single grid point: exact there only
                out[on] = self.values[0]
            return out
        if on.any():
            out[on] = np.asarray(self._f(self._scale(q[on])), float).reshape(-1)
        return out


def _interpolator(phase: str, obs: Sequence[Observation]) -> Interpolator:
    """Interpolator over the points with CV <= NOISY_CV (it passes exactly through every point it holds, so a
    noisy point would bend it) when at least ``dims + 2`` such points exist, else over all points."""
    ok = [o for o in obs if o.cv is not None and o.cv <= NOISY_CV]
    use = ok if len(ok) >= len(INTERP_COORDS[phase]) + 2 else list(obs)
    it = Interpolator(np.array([interp_coords(phase, o.shape) for o in use]), np.array([o.y for o in use]))
    it.trained_on = f"cv <= {NOISY_CV}" if use is ok else "all points"
    return it


def _predict_phase(phase: str, kind: str, coef: np.ndarray, interp: Interpolator | None,
                   shape: Mapping[str, float]) -> tuple[float, bool]:
    """(seconds, extrapolated) for a pure ``phase`` pass."""
    lin = float(linear_features(phase, shape) @ coef)
    if kind == "linear" or interp is None:
        return lin, False
    v = float(interp(interp_coords(phase, shape))[0])
    return (lin, True) if math.isnan(v) else (v, False)


# ---------------------------------------------------------------- errors


def _errors(truth: Sequence[float], pred: Sequence[float], cvs: Sequence[float | None]) -> dict[str, Any]:
    """MAPE / max absolute percentage error (percent) over all points and over points with CV ≤ NOISY_CV."""
    def summary(pairs: list[tuple[float, float]]) -> dict[str, Any]:
        if not pairs:
            return {"n": 0, "mape_pct": None, "max_error_pct": None}
        ape = [abs(p - t) / t * 100.0 for t, p in pairs]
        return {"n": len(ape), "mape_pct": statistics.fmean(ape), "max_error_pct": max(ape)}

    pairs = list(zip(truth, pred, strict=True))
    ok = [pt for pt, cv in zip(pairs, cvs, strict=True) if cv is not None and cv <= NOISY_CV]
    return {"all": summary(pairs), "cv_ok": summary(ok), "cv_threshold": NOISY_CV}


def _loo(phase: str, obs: list[Observation]) -> dict[str, list[float]]:
    """Leave-one-point-out predictions of both model kinds (NaN where a refit is impossible)."""
    out: dict[str, list[float]] = {"linear": [], "interpolate": []}
    for i, o in enumerate(obs):
        rest = obs[:i] + obs[i + 1:]
        if len(rest) < 2:
            out["linear"].append(float("nan"))
            out["interpolate"].append(float("nan"))
            continue
        coef = fit_linear(phase, rest)
        interp = _interpolator(phase, rest)
        out["linear"].append(_predict_phase(phase, "linear", coef, None, o.shape)[0])
        out["interpolate"].append(_predict_phase(phase, "interpolate", coef, interp, o.shape)[0])
    return out


# ---------------------------------------------------------------- fit


def fit(train: Sequence[str | Path], holdout: Sequence[str | Path] = (), rank: int | None = None,
        holdout_keys: Sequence[str] = ()) -> dict[str, Any]:
    """Fit both model kinds per phase on the ``train`` artifacts (rank or merged; all must share run id, grid
    digest and engine identity), measure holdout error (LOO on the grid; off-grid on the ``holdout``
    artifacts, whose engine identity must match, and on the points of ``train`` whose key is in
    ``holdout_keys`` — measured in the same run, interleaved with the grid, but never trained on), select per
    phase, and return the model document. Raises :class:`FitError` also when a ``holdout_keys`` key is not
    among the completed points.

    Raises :class:`FitError` naming the file when an artifact is unreadable, when engine identities differ
    (naming the differing engine keys), or when no phase has at least 2 completed points."""
    docs = [(str(p), load_artifact(p)) for p in train]
    if not docs:
        raise FitError("no training artifacts given")
    ref_path, ref = docs[0]
    for p, d in docs[1:]:
        for k in ("run_id", "grid_digest"):
            if d.get(k) != ref.get(k):
                raise FitError(f"{p} and {ref_path} differ in {k}; fit one run at a time")
    hold = [(str(p), load_artifact(p)) for p in holdout]
    for p, d in docs[1:] + hold:
        if ref.get("engine") and d.get("engine"):
            diff = engine_diff(ref["engine"], d["engine"])
            if diff:
                raise FitError(f"engine identity of {p} differs from {ref_path}: {', '.join(diff[:10])}")
    obs = [o for _, d in docs for o in observations(d, rank)]
    seen: dict[str, Observation] = {}
    for o in obs:  # the same run split over files (rank artifacts): pool per key
        if o.key in seen:
            a = seen[o.key]
            a.ranks.update(o.ranks)
            a.y = statistics.fmean(a.ranks.values())
        else:
            seen[o.key] = o
    obs = sorted(seen.values(), key=lambda o: o.key)
    missing = set(holdout_keys) - {o.key for o in obs}
    if missing:
        raise FitError(f"holdout points not completed in {ref_path}: {sorted(missing)[:10]}")
    hobs = [o for o in obs if o.key in set(holdout_keys)] + [o for _, d in hold for o in observations(d, rank)]
    obs = [o for o in obs if o.key not in set(holdout_keys)]
    phases: dict[str, Any] = {}
    for phase in PHASES:
        po = [o for o in obs if o.phase == phase]
        if len(po) < 2:
            continue
        coef = fit_linear(phase, po)
        coords = np.array([interp_coords(phase, o.shape) for o in po])
        interp = _interpolator(phase, po)
        loo = _loo(phase, po)
        hp = [o for o in hobs if o.phase == phase]
        ev: dict[str, Any] = {}
        for kind in ("linear", "interpolate"):
            keep = [i for i, v in enumerate(loo[kind]) if not math.isnan(v)]
            ev[kind] = {"loo": _errors([po[i].y for i in keep], [loo[kind][i] for i in keep],
                                       [po[i].cv for i in keep])}
            if hp:
                ev[kind]["off_grid"] = _errors([o.y for o in hp],
                                               [_predict_phase(phase, kind, coef, interp, o.shape)[0] for o in hp],
                                               [o.cv for o in hp])
        basis = "off_grid" if hp else "loo"

        def score(kind: str, basis: str = basis, ev: dict[str, Any] = ev) -> float:
            e = ev[kind][basis]
            m = e["cv_ok"]["mape_pct"] if e["cv_ok"]["n"] else e["all"]["mape_pct"]
            return math.inf if m is None else m

        selected = min(("linear", "interpolate"), key=score)
        phases[phase] = {
            "selected": selected, "selected_by": f"{basis} MAPE over points with CV <= {NOISY_CV} (all points if none)",
            "linear": {"features": list(LINEAR_FEATURES[phase]), "coefficients": coef.tolist(),
                       "units": "seconds per feature unit (features in tokens, requests, token pairs)"},
            "interpolate": {"coords": list(INTERP_COORDS[phase]), "points": interp.points.tolist(),
                            "values": interp.values.tolist(), "extrapolation": "linear",
                            "trained_on": interp.trained_on},
            "domain": {"min": coords.min(axis=0).tolist(), "max": coords.max(axis=0).tolist()},
            "holdout": ev,
            "grid": [{"key": o.key, "y": o.y, "cv": o.cv, "ranks": {str(k): v for k, v in o.ranks.items()},
                      "shape": o.shape, "pred": {k: _predict_phase(phase, k, coef, interp, o.shape)[0]
                                                 for k in ("linear", "interpolate")},
                      "loo": {k: (None if math.isnan(loo[k][i]) else loo[k][i]) for k in loo}}
                     for i, o in enumerate(po)],
            "off_grid": [{"key": o.key, "y": o.y, "cv": o.cv, "shape": o.shape,
                          "pred": {k: _predict_phase(phase, k, coef, interp, o.shape)[0]
                                   for k in ("linear", "interpolate")}} for o in hp],
        }
    if not phases:
        raise FitError(f"{ref_path}: no phase has at least 2 completed points to fit")
    engine = ref.get("engine") or {}
    return {
        "schema": MODEL_SCHEMA, "schema_version": MODEL_SCHEMA_VERSION, "created_at": time.time(),
        "units": "seconds", "timing_basis": ref["protocol"].get("timing_basis", "schedule_to_output"),
        "estimate": ref["protocol"].get("estimate"), "noisy_cv": NOISY_CV,
        "source": {"artifacts": [p for p, _ in docs], "run_id": ref["run_id"], "grid_digest": ref["grid_digest"],
                   "engine_identity": engine_identity(engine), "rank": rank,
                   "engine_summary": {k: engine.get(k) for k in ("model", "scheduler", "cache", "versions")
                                      if k in engine},
                   "holdout": [{"path": p, "run_id": d["run_id"], "grid_digest": d["grid_digest"]} for p, d in hold],
                   "holdout_keys": sorted(holdout_keys)},
        "phases": phases,
    }


def write_model(doc: Mapping[str, Any], out: str | Path) -> Path:
    """Write the model JSON create-only (``FileExistsError`` if ``out`` exists)."""
    from genartifact_fpm_bench.artifact import write_once

    return write_once(out, doc)


# ---------------------------------------------------------------- loading and prediction


class StepModel:
    """A fitted step-time model (schema ``genartifact.fpm_bench.step_model`` v1) that predicts a forward pass's
    scheduler wall time in seconds from its shape."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        if doc.get("schema") != MODEL_SCHEMA or doc.get("schema_version") != MODEL_SCHEMA_VERSION:
            raise FitError(f"not a {MODEL_SCHEMA} v{MODEL_SCHEMA_VERSION} model (schema={doc.get('schema')!r}, "
                           f"version={doc.get('schema_version')!r})")
        self.doc = doc
        self._coef: dict[str, np.ndarray] = {}
        self._interp: dict[str, Interpolator] = {}
        self._lo: dict[str, np.ndarray] = {}
        self._hi: dict[str, np.ndarray] = {}
        for phase, m in doc["phases"].items():
            self._coef[phase] = np.array(m["linear"]["coefficients"], float)
            self._interp[phase] = Interpolator(np.array(m["interpolate"]["points"]), np.array(m["interpolate"]["values"]))
            self._lo[phase], self._hi[phase] = np.array(m["domain"]["min"]), np.array(m["domain"]["max"])

    @classmethod
    def load(cls, path: str | Path) -> StepModel:
        """Load a model JSON; raises :class:`FitError` for a foreign schema or version."""
        try:
            doc = read_json(path)
        except JSONFileError as e:
            raise FitError(f"{path}: cannot read model ({e})") from None
        return cls(doc)

    def selected(self, phase: str) -> str:
        return str(self.doc["phases"][phase]["selected"])

    def in_domain(self, shape: Mapping[str, Any]) -> bool:
        """True for a pure-phase pass whose interpolation coordinates lie within the grid's bounding box."""
        s = _shape(shape)
        phase = phase_of(s)
        if phase not in self._coef:
            return False
        c = interp_coords(phase, s)
        tol = 1e-6 * np.maximum(1.0, np.abs(self._hi[phase]))
        return bool(np.all(c >= self._lo[phase] - tol) and np.all(c <= self._hi[phase] + tol))

    def predict(self, shape: Mapping[str, Any], kind: str | None = None) -> float:
        """Predicted wall time (seconds, ``schedule_to_output`` basis) of a pass with ``shape`` — a mapping with
        FPM ``ScheduledStats`` field names (``num_prefill_requests``, ``sum_prefill_tokens``,
        ``sum_prefill_kv_tokens``, ``num_decode_requests``, ``sum_decode_kv_tokens``; missing = 0), e.g.
        ``msgspec.structs.asdict(fpm.scheduled)``. ``kind``: ``linear``/``interpolate`` (default: the phase's
        selected model). A mixed pass (prefill and decode requests together, never on the grid) is predicted as
        the sum of both phases' linear models with one intercept (the larger) — an extrapolation.

        Raises ``ValueError`` for an empty shape, a phase the model has no fit for, or an unknown ``kind``."""
        s = _shape(shape)
        phase = phase_of(s)
        if kind not in (None, "linear", "interpolate"):
            raise ValueError(f"kind {kind!r}; allowed: linear, interpolate")
        if phase == "mixed":
            missing = [p for p in PHASES if p not in self._coef]
            if missing:
                raise ValueError(f"mixed pass needs both phases; the model has no fit for {missing}")
            pre = float(linear_features("prefill", s) @ self._coef["prefill"])
            dec = float(linear_features("decode", s) @ self._coef["decode"])
            return pre + dec - min(self._coef["prefill"][0], self._coef["decode"][0])
        if phase not in self._coef:
            raise ValueError(f"the model has no fit for phase {phase!r}; fitted: {sorted(self._coef)}")
        return _predict_phase(phase, kind or self.selected(phase), self._coef[phase], self._interp[phase], s)[0]


def predict(model: str | Path | Mapping[str, Any] | StepModel, shape: Mapping[str, Any]) -> float:
    """Convenience: ``StepModel`` (loaded from a path or a model document if needed) ``.predict(shape)`` in
    seconds."""
    m = model if isinstance(model, StepModel) else (StepModel(model) if isinstance(model, Mapping)
                                                    else StepModel.load(model))
    return m.predict(shape)


def summary_lines(doc: Mapping[str, Any]) -> list[str]:
    """Human-readable holdout summary (one line per phase and model kind)."""
    def fmt(e: Mapping[str, Any]) -> str:
        return "–" if e["mape_pct"] is None else f"MAPE {e['mape_pct']:.2f} % max {e['max_error_pct']:.2f} % (n={e['n']})"

    lines = []
    for phase, m in doc["phases"].items():
        for kind in ("linear", "interpolate"):
            ev = m["holdout"][kind]
            parts = []
            for basis in ("loo", "off_grid"):
                if basis in ev:
                    a, c = ev[basis]["all"], ev[basis]["cv_ok"]
                    parts.append(f"{basis}: {fmt(c)} [CV<={NOISY_CV}], {fmt(a)} [all]")
            mark = " (selected)" if m["selected"] == kind else ""
            lines.append(f"{phase:7} {kind:11}{mark:11} " + "; ".join(parts))
    return lines
