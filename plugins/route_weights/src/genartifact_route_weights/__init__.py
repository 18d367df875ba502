"""``moe_route_weights``: the router's combine weights of the selected experts, aligned 1:1 with ``moe_routes``.

What is stored
    For every forwarded position and every MoE router, the ``top_k`` weights the router returned with its
    expert ids (``topk_weights`` of vLLM's ``BaseRouter._compute_routing``; see :mod:`.worker` for the exact
    call), in the router's top-k order — so ``weights[r, i, j]`` belongs to expert ``moe_routes[r, i, j]``.
    Rows: ``prompt + completion - 1 - token_start`` (``token_start`` = the request's
    ``routed_experts_prompt_start`` clamped to the prompt, exactly moe_routes' rows). Stored router-major
    ``[routers, rows, top_k]`` as tensor ``moe_route_weights.weights``: ``f32`` (dtype code ``f32``) or
    bfloat16 (``"dtype": "bf16"`` in the section; the tensor holds the bf16 bit patterns as ``u16``, rounded
    to nearest-even from the fp32 weights, as ``torch.Tensor.to(torch.bfloat16)`` rounds). Chosen per server by
    ``[contents.moe_route_weights] dtype = "f32" | "bf16"`` (default ``"f32"``).

Which normalisation (vLLM 0.32, ``vllm/model_executor/layers/fused_moe/router/cpu_router.py``)
    * Qwen2/3-MoE, Mixtral-style (``scoring_func="softmax"``, ``_softmax_topk``): with ``renormalize`` =
      the config's ``norm_topk_prob`` the weights are ``softmax`` over the k selected logits (= the top-k
      probabilities renormalised to sum 1); without it ``exp(logit - logsumexp(all logits))``.
    * DeepSeek-V2/V3 (``_grouped_topk``; ``sigmoid`` + ``e_score_correction_bias`` for ``noaux_tc``): the
      *unbiased* scores of the selected experts (the bias only steers selection), divided by their sum when
      ``norm_topk_prob``. The config's ``routed_scaling_factor`` is **not** in the stored weights on vLLM's
      default path: ``DeepseekV2DecoderLayer`` builds ``DeepseekV2MoE(apply_routed_scale_to_output=True)``
      (``vllm/model_executor/models/deepseek_v2.py``) unless ROCm aiter is enabled, so the router gets
      ``routed_scaling_factor=1.0`` and the ``MoERunner`` multiplies the MoE output instead
      (``fused_moe/layer.py``). The section records both factors per router: ``router_scale`` (already in
      the stored weights) and ``output_scale`` (applied by the runner); the effective combine weight is
      ``weights * output_scale`` — what HF transformers' ``DeepseekV3TopkRouter`` returns (it multiplies
      ``routed_scaling_factor`` in).

Section ``{"token_start", "router_ids", "top_k", "dtype": "f32"|"bf16", "layout": "router_major",
"router_scale": [float per router], "output_scale": [float per router], "source": "worker_capture"}``.
The reader requires finite, non-negative weights; when the artifact also has ``moe_routes``, its
``token_start``, ``router_ids`` and ``top_k`` must be equal (the alignment contract).

Capture: worker path only (vLLM returns ids, never weights): the producer refuses admission when no worker
answered init with a ``moe_route_weights`` capture, and, like ``moe_routes``' worker path, refuses prefix
caching (cached positions are never recomputed, so their weights are never seen) and turns it off at
engine start.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import pluggy
import structlog
from genartifact.engine.worker_ext import discard_capture, fetch_capture
from genartifact.errors import AdmissionError, ArtifactFormatError, CaptureError, ConfigError
from genartifact.format import TensorPart
from genartifact.types import AdmissionContext, Delta, FinalContext, ModelInfo
from genartifact_route_capture.layout import RouterLayout, resolve_layout, worker_rows

hookimpl = pluggy.HookimplMarker("genartifact")
NAME = "moe_route_weights"
TENSOR = f"{NAME}.weights"
CAPTURE_KEY = "genartifact_route_weights_capture_id"
DTYPES = {"f32": np.dtype("<f4"), "bf16": np.dtype("<u2")}  # section dtype -> stored numpy dtype
SETTINGS = ("dtype",)
__version__ = "0.1.0"


# ------------------------------------------------------------------------------------------------ bf16


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """fp32 -> bfloat16 bit patterns ``uint16`` (same shape), round to nearest, ties to even — the rounding of
    ``torch.Tensor.to(torch.bfloat16)``. Input must be finite (NaN payloads are not preserved)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (``uint16``) -> exact ``float32`` values (a new array, same shape)."""
    return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32)


# ------------------------------------------------------------------------------------------------ settings


def parse_settings(settings: Mapping[str, Any] | None) -> str:
    """``[contents.moe_route_weights]`` -> the storage dtype code (``"f32"`` default or ``"bf16"``).

    :raises ConfigError: an unknown key (allowed: ``dtype``) or a ``dtype`` other than ``"f32"``/``"bf16"``."""
    s = {k: v for k, v in (settings or {}).items() if k != "base_dir"}
    unknown = sorted(set(s) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"[contents.{NAME}] unknown key(s) {unknown}; allowed: {list(SETTINGS)}")
    dt = s.get("dtype", "f32")
    if not isinstance(dt, str) or dt not in DTYPES:  # a TOML array/table is unhashable: name it, not TypeError
        raise ConfigError(f"[contents.{NAME}] dtype={dt!r} invalid; allowed: {sorted(DTYPES)}")
    return str(dt)


# ------------------------------------------------------------------------------------------------ producer


class MoeRouteWeights:
    """Per-request producer. Admits ``rows x routers x top_k x itemsize`` (4 for f32, 2 for bf16) plus the
    section; retains at most that (weights arrive once, at collect, from the worker)."""

    name = NAME

    def __init__(self, model: ModelInfo, dtype: str = "f32") -> None:
        self.model = model
        self.dtype = dtype
        self.layout: RouterLayout | None = None
        self.capture_id: str | None = None
        self.start = 0
        self._max_rows = 0
        self._weights: np.ndarray | None = None  # router-major [routers, rows, top_k], stored dtype
        self._scales: tuple[list[float], list[float]] | None = None
        self._fetched = False
        self.consumes_deltas = False  # the weights come from the worker at collect time (on_delta does nothing)

    def admit(self, ctx: AdmissionContext) -> int:
        opts = ctx.model.engine_options
        if NAME not in (opts.get("worker_captures") or ()):
            raise AdmissionError(
                "moe_route_weights needs genartifact's worker capture (vLLM returns expert ids, never router "
                "weights): no worker answered init with a moe_route_weights capture (is the vllm.general_plugins "
                "entry point 'genartifact' installed and the content enabled in the engine's config?)")
        if opts.get("enable_prefix_caching"):
            raise AdmissionError("moe_route_weights cannot see prefix-cached tokens (they are never recomputed); "
                                 "start the engine with enable_prefix_caching=False")
        self.layout = resolve_layout(ctx.model.hf_config)
        self.start = ctx.routes_start
        self._max_rows = max(0, ctx.prompt_token_count + ctx.max_tokens - 1 - self.start)
        per_row = self.layout.routers * self.layout.top_k * DTYPES[self.dtype].itemsize
        # section: ids + two float lists per router (<= 24 bytes per float in canonical JSON) + fixed keys
        return self._max_rows * per_row + 64 * self.layout.routers + 256

    def sampling_overrides(self, params: dict[str, Any]) -> None:
        self.capture_id = uuid.uuid4().hex
        extra = dict(params.get("extra_args") or {})
        extra[CAPTURE_KEY] = self.capture_id
        if self.start:  # the worker hands rows over from here (out-of-band handover)
            extra["genartifact_routes_start"] = self.start
        else:  # a caller's own value must not shift this request's handed-over rows
            extra.pop("genartifact_routes_start", None)
        params["extra_args"] = extra

    def on_delta(self, delta: Delta) -> None:
        return None

    def _lay(self) -> RouterLayout:
        if self.layout is None:
            raise CaptureError("moe_route_weights: producer not admitted")
        return self.layout

    async def collect(self, final: FinalContext) -> None:
        if self.capture_id is None:
            return
        if final.engine is None:
            raise CaptureError("moe_route_weights: worker path needs the engine at collect time")
        lay = self._lay()
        positions = max(0, final.prompt_token_count + final.completion_token_count - 1)
        rows = max(0, positions - self.start)
        if rows > self._max_rows:
            raise CaptureError(f"moe_route_weights: {rows} rows; admitted at most {self._max_rows}")
        self._fetched = True  # fetch pops the worker's rows
        r = await fetch_capture(final.engine, NAME, self.capture_id, self.start, positions)
        arr = worker_rows(r, lay, content=NAME, start=self.start, rows=rows, missing_what="router weights",
                          dtype="<f4")
        if arr.size and not (np.isfinite(arr).all() and float(arr.min()) >= 0.0):
            raise CaptureError("moe_route_weights: router weights not finite and >= 0")
        scales = ([float(x) for x in r.get("router_scale", [1.0] * lay.routers)],
                  [float(x) for x in r.get("output_scale", [1.0] * lay.routers)])
        if any(len(s) != lay.routers or not all(math.isfinite(x) for x in s) for s in scales):
            raise CaptureError(f"moe_route_weights: worker scales {scales} do not list {lay.routers} finite floats")
        self._scales = scales
        self._weights = to_bf16_bits(arr) if self.dtype == "bf16" else arr.copy()

    async def discard(self, engine: Any) -> None:
        """Drop worker-side rows not fetched (request failed or was cancelled). Idempotent."""
        if self.capture_id is not None and not self._fetched and engine is not None:
            self._fetched = True
            await discard_capture(engine, NAME, self.capture_id)

    def finalize(self, final: FinalContext) -> tuple[dict[str, Any], list[TensorPart]]:
        lay = self._lay()
        rows = max(0, final.prompt_token_count + final.completion_token_count - 1 - self.start)
        if self._weights is None or self._scales is None:
            raise CaptureError("moe_route_weights: no router weights were captured for this request")
        if self._weights.shape != (lay.routers, rows, lay.top_k):
            raise CaptureError(f"moe_route_weights: {self._weights.shape[1]} rows captured; expected "
                               f"prompt + completion - 1 - start = {rows}")
        section = {"token_start": self.start, "router_ids": list(lay.router_ids), "top_k": lay.top_k,
                   "dtype": self.dtype, "layout": "router_major", "router_scale": self._scales[0],
                   "output_scale": self._scales[1], "source": "worker_capture"}
        return section, [TensorPart(TENSOR, self._weights)]

    def retained_bytes(self) -> int:
        return 0 if self._weights is None else int(self._weights.nbytes)

    def release(self) -> None:
        self._weights = None


# ------------------------------------------------------------------------------------------------ reader


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def weights_f32(section: Mapping[str, Any], stored: np.ndarray) -> np.ndarray:
    """Stored ``[routers, rows, top_k]`` -> float32 (the f32 tensor itself, or bf16 widened exactly)."""
    return bf16_bits_to_f32(stored) if section["dtype"] == "bf16" else stored


class MoeRouteWeightsReader:
    """Strict decode-side checks, view and ``inspect`` summary of ``moe_route_weights`` (numpy only).

    ``validate`` raises :class:`ArtifactFormatError` naming the field: section keys (see the module doc),
    ``dtype`` in ``f32``/``bf16`` matching the tensor dtype (``f32`` / ``u16``), ``layout`` ``router_major``,
    rows = ``P + C - 1 - token_start``, ``router_ids`` ascending unique with one per router, ``top_k`` equal to
    the tensor's, scales lists of finite floats (one per router), weights finite and >= 0, and — when the
    artifact has ``moe_routes`` — the same ``token_start``, ``router_ids`` and ``top_k`` as moe_routes."""

    KEYS = frozenset({"token_start", "router_ids", "top_k", "dtype", "layout", "router_scale", "output_scale"})

    def validate(self, manifest: Mapping[str, Any], s: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        p, c = manifest["prompt_token_count"], manifest["completion_token_count"]
        if not self.KEYS <= set(s) or not set(s) <= self.KEYS | {"source"}:
            raise ArtifactFormatError(f"{NAME} section keys {sorted(s)}; needs {sorted(self.KEYS)} (+ optional source)")
        if set(tensors) != {TENSOR}:
            raise ArtifactFormatError(f"{NAME} tensors {sorted(tensors)}; allowed exactly ['{TENSOR}']")
        w = tensors[TENSOR]
        if not isinstance(s["dtype"], str) or s["dtype"] not in DTYPES:
            raise ArtifactFormatError(f"{NAME} dtype {s['dtype']!r}; allowed: {sorted(DTYPES)}")
        if w.ndim != 3 or w.dtype != DTYPES[s["dtype"]]:
            raise ArtifactFormatError(f"{TENSOR} must be rank 3 [routers, rows, top_k] of "
                                      f"{'u16 (bf16 bits)' if s['dtype'] == 'bf16' else 'f32'} for dtype {s['dtype']!r}")
        routers, rows, k = w.shape
        if s["layout"] != "router_major":
            raise ArtifactFormatError(f"{NAME} layout {s['layout']!r}; allowed: 'router_major'")
        start = s["token_start"]
        if not _is_int(start) or not 0 <= start <= p:
            raise ArtifactFormatError(f"{NAME} token_start {start!r} out of range 0..{p}")
        if rows != max(0, p + c - 1 - start):
            raise ArtifactFormatError(f"{NAME} rows {rows} != prompt + completion - 1 - token_start = "
                                      f"{max(0, p + c - 1 - start)}")
        rid = s["router_ids"]
        if not (isinstance(rid, list) and len(rid) == routers > 0 and all(_is_int(x) and x >= 0 for x in rid)
                and rid == sorted(set(rid))):
            raise ArtifactFormatError(f"{NAME} router_ids must list {routers} unique, ascending, non-negative ints")
        if not _is_int(s["top_k"]) or s["top_k"] != k or k < 1:
            raise ArtifactFormatError(f"{NAME} top_k {s['top_k']!r} != tensor top_k {k}")
        for key in ("router_scale", "output_scale"):
            v = s[key]
            if not (isinstance(v, list) and len(v) == routers
                    and all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in v)):
                raise ArtifactFormatError(f"{NAME} {key} must list {routers} finite numbers (one per router)")
        routes = manifest.get("sections", {}).get("moe_routes")
        if isinstance(routes, Mapping):
            for key in ("token_start", "router_ids", "top_k"):
                if routes.get(key) != s[key]:
                    raise ArtifactFormatError(f"{NAME} {key} {s[key]!r} != moe_routes {key} {routes.get(key)!r}: "
                                              "weights must align 1:1 with moe_routes rows")
        if w.size:
            f = weights_f32(s, w)
            if not np.isfinite(f).all() or float(f.min()) < 0.0:
                raise ArtifactFormatError(f"{NAME} weights must be finite and >= 0")

    def view(self, manifest: Mapping[str, Any], s: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        """Weights ``float32 [rows, routers, top_k]`` (row i = position token_start + i, aligned with
        ``Artifact.routes()``): a zero-copy transposed view for f32, an exact widened copy for bf16. As the
        router returned them: multiply by the section's ``output_scale`` for the effective combine weight."""
        return weights_f32(s, tensors[TENSOR]).transpose(1, 0, 2)

    def summary(self, manifest: Mapping[str, Any], s: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
        w = self.view(manifest, s, tensors)
        sums = w.sum(-1) if w.size else np.zeros(0, np.float32)
        return {"rows": int(w.shape[0]), "routers": s["router_ids"], "top_k": s["top_k"], "dtype": s["dtype"],
                "token_start": s["token_start"], "output_scale": s["output_scale"],
                "row_sum_min": float(sums.min()) if sums.size else None,
                "row_sum_max": float(sums.max()) if sums.size else None,
                "first_row": [[round(float(x), 6) for x in r] for r in w[0]] if w.shape[0] else []}

    def summary_text(self, summary: Mapping[str, Any]) -> str:
        r = summary
        return (f"{r['rows']} rows x {len(r['routers'])} routers x top-{r['top_k']} {r['dtype']}, start "
                f"{r['token_start']}, row sums {r['row_sum_min']}..{r['row_sum_max']}; row 0: {r['first_row']}")


READER = MoeRouteWeightsReader()


@hookimpl
def genartifact_content_producer(name: str, model: ModelInfo, settings: Mapping[str, Any]) -> MoeRouteWeights | None:
    if name != NAME:
        return None
    return MoeRouteWeights(model, parse_settings(settings))


@hookimpl
def genartifact_content_reader(name: str) -> MoeRouteWeightsReader | None:
    return READER if name == NAME else None


@hookimpl
def genartifact_engine_options(options: dict[str, Any], worker_capture: bool) -> None:
    """Worker capture cannot see prefix-cached tokens (never recomputed): prefix caching is turned off when
    worker capture will run, with a warning when it was on or left to vLLM's default."""
    if not worker_capture:
        return
    if options.get("enable_prefix_caching") is not False:
        structlog.get_logger("genartifact.route_weights").warning(
            "prefix_caching_disabled", option="enable_prefix_caching", was=options.get("enable_prefix_caching"),
            reason="moe_route_weights worker capture never sees prefix-cached tokens (they are not recomputed)")
    options["enable_prefix_caching"] = False


@hookimpl
def genartifact_worker_capture(worker: Any, settings: Mapping[str, Any]) -> Any:
    """The worker capture (see :mod:`.worker`): wraps every MoE router's weight computation."""
    from genartifact_route_weights.worker import RouteWeightsCapture

    return RouteWeightsCapture(worker)
