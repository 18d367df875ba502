"""Router layout (which decoder layers are MoE routers, expert count, top-k) from a HF model config.

Rules per family follow vLLM's model files (``vllm/model_executor/models/``), L = 0-based decoder layer:

* Qwen2-MoE / Qwen3-MoE: ``L not in mlp_only_layers and num_experts > 0 and (L+1) % decoder_sparse_step == 0``
* DeepSeek-V2/V3 (and Kimi-K2): ``L >= first_k_dense_replace and L % moe_layer_freq == 0``
* GLM-4.5 MoE: ``L >= first_k_dense_replace`` (``moe_layer_freq`` ignored, as in vLLM)
* Mixtral, gpt-oss: every layer
* Llama4: ``(L+1) % interleave_moe_layer_step == 0``

Shared experts are not routed and never reported; dense layers are absent from the router axis.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from genartifact.errors import AdmissionError

EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k")
MAX_LAYERS = 65536

FAMILIES = {
    "qwen2_moe": "qwen",
    "qwen3_moe": "qwen",
    "qwen3_next": "qwen",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "kimi_k2": "deepseek",
    "glm4_moe": "glm",
    "mixtral": "all",
    "gpt_oss": "all",
    "llama4_text": "llama4",
    "llama4": "llama4",
}


@dataclass(frozen=True)
class RouterLayout:
    """``router_ids``: MoE decoder-layer indices, ascending; ``num_experts``: routed experts per router;
    ``top_k``: experts per token; ``num_hidden_layers``: decoder layers (the native route tensor's layer axis)."""

    router_ids: tuple[int, ...]
    num_experts: int
    top_k: int
    num_hidden_layers: int

    @property
    def routers(self) -> int:
        return len(self.router_ids)

    @property
    def itemsize(self) -> int:
        """Bytes per expert id: 1 (uint8) when ``num_experts <= 256`` else 2 (uint16), the vLLM convention."""
        return 1 if self.num_experts <= 256 else 2


def _int(cfg: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise AdmissionError(f"model config {key}={v!r} invalid; allowed: integer {lo}..{hi}")
    return v


def _one_of(cfg: Mapping[str, Any], keys: tuple[str, ...], what: str, lo: int, hi: int) -> int:
    found = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    if not found:
        raise AdmissionError(f"model config has no {what}: expected one of {list(keys)}")
    vals = {repr(v) for v in found.values()}
    if len(vals) > 1:
        raise AdmissionError(f"model config has conflicting values for {what}: {found}")
    return _int(found, next(iter(found)), lo, hi)


def resolve_layout(cfg: Mapping[str, Any]) -> RouterLayout:
    """Resolve the router layout of a HF config dict (text config; nested ``text_config`` is merged).

    :raises AdmissionError: unsupported family (names the supported ``model_type`` values), missing or
        conflicting expert/top-k metadata, or a layout with no MoE layer.
    """
    text = cfg.get("text_config")
    if isinstance(text, Mapping):
        conflicts = [k for k in text if k in cfg and k != "model_type" and cfg[k] != text[k]]
        if conflicts:
            raise AdmissionError(f"model config has conflicting values in text_config for {sorted(conflicts)}")
        cfg = {**cfg, **text}
    mt = cfg.get("model_type")
    family = FAMILIES.get(mt) if isinstance(mt, str) else None
    if family is None:
        raise AdmissionError(f"moe_routes: model_type {mt!r} has no known router layout; supported: {sorted(FAMILIES)}")
    layers = _int(cfg, "num_hidden_layers", 1, MAX_LAYERS) if "num_hidden_layers" in cfg else None
    if layers is None:
        raise AdmissionError("model config has no num_hidden_layers")
    experts = _one_of(cfg, EXPERT_KEYS, "routed expert count", 1, 65536)
    top_k = _one_of(cfg, TOPK_KEYS, "experts per token (top-k)", 1, 1024)
    if top_k > experts:
        raise AdmissionError(f"model config top-k {top_k} exceeds expert count {experts}")
    if family == "qwen":
        step = _int(cfg, "decoder_sparse_step", 1, MAX_LAYERS) if "decoder_sparse_step" in cfg else 1
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(x, int) for x in dense):
            raise AdmissionError(f"model config mlp_only_layers={dense!r} invalid; allowed: list of layer indices")
        ids = [L for L in range(layers) if L not in dense and (L + 1) % step == 0]
    elif family in ("deepseek", "glm"):
        first = _int(cfg, "first_k_dense_replace", 0, layers) if cfg.get("first_k_dense_replace") is not None else 0
        freq = 1
        if family == "deepseek" and cfg.get("moe_layer_freq") is not None:
            freq = _int(cfg, "moe_layer_freq", 1, MAX_LAYERS)
        ids = [L for L in range(layers) if L >= first and L % freq == 0]
    elif family == "llama4":
        step = _int(cfg, "interleave_moe_layer_step", 1, MAX_LAYERS)
        ids = [L for L in range(layers) if (L + 1) % step == 0]
    else:
        ids = list(range(layers))
    if not ids:
        raise AdmissionError(f"model config ({mt}) yields no MoE layer; moe_routes cannot be captured")
    return RouterLayout(tuple(ids), experts, top_k, layers)


def worker_rows(answer: Mapping[str, Any], layout: RouterLayout, *, content: str, start: int, rows: int,
                missing_what: str, dtype: Any = None) -> Any:
    """The ``[routers, rows, top_k]`` array of a worker's fetch answer (``{"data", "dtype", "shape", "missing"}``,
    :meth:`~genartifact_route_capture.recorder.RouteRecorder.fetch`) for positions ``start .. start+rows-1``: a
    read-only view of ``answer["data"]``. An out-of-band handover sends rows up to the last *forwarded* position,
    which may lie beyond the completion the engine reported: those are trimmed, and holes only there are no
    holes. ``dtype``: when given, the dtype the answer must have. Shared by every content recorded with
    :class:`RouteRecorder` (``moe_routes``, ``moe_route_weights``).

    Raises :class:`~genartifact.errors.CaptureError` (prefixed ``content``) for another dtype, a shape other than
    ``[layout.routers, rows, layout.top_k]``, or positions with no rows (``missing_what`` names them)."""
    import numpy as np
    from genartifact.errors import CaptureError

    if dtype is not None and np.dtype(answer["dtype"]) != np.dtype(dtype):
        raise CaptureError(f"{content}: worker rows dtype {answer['dtype']}; expected {np.dtype(dtype).str}")
    arr = np.frombuffer(answer["data"], dtype=np.dtype(answer["dtype"])).reshape(answer["shape"])
    arr.flags.writeable = False  # (an RPC answer's data is a bytearray)
    missing = answer.get("missing")
    if arr.ndim == 3 and arr.shape[1] > rows:  # handed over up to the last forwarded position: trim
        arr = arr[:, :rows]
        if missing is not None and missing[0] >= start + rows:
            missing = None  # the holes lie beyond the completion the engine reported
    if arr.shape != (layout.routers, rows, layout.top_k):
        raise CaptureError(f"{content}: worker rows shape {arr.shape}; expected {(layout.routers, rows, layout.top_k)}")
    if missing is not None:
        first, count = missing
        raise CaptureError(f"{content}: {count} positions have no {missing_what} (first: {first})")
    return arr
