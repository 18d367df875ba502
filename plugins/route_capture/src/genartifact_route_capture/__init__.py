"""``moe_routes``: the routed experts (top-k expert ids, vLLM's order) of every token, per MoE layer.

Rows: ``prompt + completion - 1 - routes_start`` (the last sampled token is never forwarded), shape
``[rows, routers, top_k]``; stored router-major ``[routers, rows, top_k]`` (uint8 if <= 256 experts else
uint16). Row *i* is the routing of absolute position ``routes_start + i``; ``routes_start`` is the request's
``routed_experts_prompt_start`` (vLLM's ``SamplingParams`` field of that name), 0..prompt length: a start beyond
the prompt is refused at admission, as vLLM's input processor refuses it, so the section's ``token_start``
(effective) and ``requested_token_start`` (requested) are equal in every object this producer writes.

Two capture paths behind this one content:

(a) native — vLLM's ``CompletionOutput.routed_experts`` (GPU, Model Runner V2, ``enable_return_routed_experts``):
    the full tensor arrives on the final delta with the layer axis = all decoder layers; dense layers are
    dropped (never reported as expert 0) and the tensor is narrowed to the compact dtype before it is retained.
(b) worker — on runners without (a) (CPU): :mod:`genartifact_route_capture.worker` (a ``WorkerCapture`` run by
    genartifact's worker runtime on one rank per engine) binds each MoE router's capture callback, attributes
    rows by absolute position, and the producer fetches a finished request's rows from whichever
    data-parallel engine's worker holds them (``fetch_capture``: ``moe_routes.fetch``).

Prefix caching: cached prefix tokens are never recomputed and produce no rows, so the worker path refuses
``enable_prefix_caching=True`` at admission, and any unfilled position fails the artifact at collect time.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import pluggy
import structlog
from genartifact.engine.worker_ext import discard_capture, fetch_capture
from genartifact.errors import AdmissionError, ArtifactFormatError, CaptureError
from genartifact.format import DTYPES, TensorPart, route_dtype_code
from genartifact.types import AdmissionContext, Delta, FinalContext, ModelInfo

from genartifact_route_capture.layout import RouterLayout, resolve_layout, worker_rows

hookimpl = pluggy.HookimplMarker("genartifact")
NAME = "moe_routes"
CAPTURE_KEY = "genartifact_capture_id"
__version__ = "0.1.0"


#: worker rows of at least this many bytes have their expert-id range checked in a thread, off the driver's event
#: loop (a 32k-token request of a 48-router top-8 model: 12 MB, ~1.3 ms of numpy)
RANGE_CHECK_THREAD_BYTES = 4 << 20


class MoeRoutes:
    """Per-request producer. Retains at most ``routers x rows x top_k x itemsize`` bytes (the admitted
    route budget); native tensors are canonicalized before they are retained."""

    name = NAME

    def __init__(self, model: ModelInfo) -> None:
        self.model = model
        self.layout: RouterLayout | None = None
        self.native = bool(model.engine_options.get("native_routed_experts"))
        self.consumes_deltas = self.native  # worker capture: the rows come from collect, never from a delta
        self.capture_id: str | None = None
        self.start = 0
        self._max_rows = 0
        self._routes: np.ndarray | None = None  # router-major [routers, rows, top_k]
        self._fetched = False

    # admission ------------------------------------------------------------------------------------
    def admit(self, ctx: AdmissionContext) -> int:
        opts = ctx.model.engine_options
        if not self.native and NAME not in (opts.get("worker_captures") or ()):
            raise AdmissionError(
                "moe_routes needs a route source: set enable_return_routed_experts=True (GPU, Model Runner V2), "
                "or let genartifact's worker capture run (installed through the vllm.general_plugins entry point "
                "'genartifact'; no worker answered init with a moe_routes capture)"
            )
        if not self.native and opts.get("enable_prefix_caching"):
            raise AdmissionError(
                "moe_routes via the worker path cannot see prefix-cached tokens (they are never recomputed); "
                "start the engine with enable_prefix_caching=False"
            )
        self.layout = resolve_layout(ctx.model.hf_config)  # every admission: the config it is given
        self.start = ctx.routes_start
        self._max_rows = max(0, ctx.prompt_token_count + ctx.max_tokens - 1 - self.start)
        per_row = self.layout.routers * self.layout.top_k * self.layout.itemsize
        return self._max_rows * per_row + 32 * self.layout.routers + 256

    def sampling_overrides(self, params: dict[str, Any]) -> None:
        if self.native:
            if self.start:
                params["routed_experts_prompt_start"] = self.start
            return
        self.capture_id = os.urandom(16).hex()  # 128 random bits, like uuid4
        extra = dict(params.get("extra_args") or {})
        extra[CAPTURE_KEY] = self.capture_id
        if self.start:  # the worker hands rows over from here (out-of-band handover)
            extra["genartifact_routes_start"] = self.start
        else:  # a caller's own value must not shift this request's handed-over rows
            extra.pop("genartifact_routes_start", None)
        params["extra_args"] = extra

    # capture --------------------------------------------------------------------------------------
    def on_delta(self, delta: Delta) -> None:
        if delta.routed_experts is not None:
            self._routes = None  # only the latest full tensor is retained
            self._routes = self._canonical_native(np.asarray(delta.routed_experts))

    def _canonical_native(self, arr: np.ndarray) -> np.ndarray:
        lay = self._lay()
        if arr.ndim != 3 or arr.shape[2] != lay.top_k:
            raise CaptureError(f"moe_routes: engine tensor shape {arr.shape}; expected [rows, layers, {lay.top_k}]")
        if arr.shape[0] > self._max_rows:
            raise CaptureError(f"moe_routes: engine sent {arr.shape[0]} rows; admitted at most {self._max_rows}")
        if arr.dtype.kind not in "iu":
            raise CaptureError(f"moe_routes: engine tensor dtype {arr.dtype} is not integer")
        if arr.shape[1] == lay.num_hidden_layers:
            arr = arr[:, list(lay.router_ids), :]
        elif arr.shape[1] != lay.routers:
            raise CaptureError(
                f"moe_routes: engine layer axis {arr.shape[1]} matches neither num_hidden_layers "
                f"{lay.num_hidden_layers} nor the {lay.routers} MoE layers"
            )
        self._check_range(arr)
        return np.ascontiguousarray(arr.transpose(1, 0, 2), dtype=self._dtype())

    def _check_range(self, arr: np.ndarray) -> None:
        """Every expert id in ``0..num_experts - 1`` (one pass for an unsigned ``arr``: no minimum to check), else
        :class:`CaptureError`."""
        if arr.size and ((arr.dtype.kind != "u" and int(arr.min()) < 0) or int(arr.max()) >= self._lay().num_experts):
            raise CaptureError(f"moe_routes: expert id out of range 0..{self._lay().num_experts - 1}")

    def _lay(self) -> RouterLayout:
        if self.layout is None:
            raise CaptureError("moe_routes: producer not admitted")
        return self.layout

    def _dtype(self) -> np.dtype[Any]:
        return np.dtype("<u1") if self._lay().itemsize == 1 else np.dtype("<u2")

    async def collect(self, final: FinalContext) -> None:
        if self.native or self.capture_id is None:
            return
        if final.engine is None:
            raise CaptureError("moe_routes: worker path needs the engine at collect time")
        positions = max(0, final.prompt_token_count + final.completion_token_count - 1)
        self._fetched = True  # fetch pops the worker's rows
        r = await fetch_capture(final.engine, NAME, self.capture_id, self.start, positions)
        lay = self._lay()
        rows = max(0, positions - self.start)
        arr = worker_rows(r, lay, content=NAME, start=self.start, rows=rows, missing_what="routing rows")
        if arr.nbytes >= RANGE_CHECK_THREAD_BYTES:  # a long request's rows: numpy's max releases the GIL, the loop runs
            await asyncio.to_thread(self._check_range, arr)
        else:
            self._check_range(arr)
        self._routes = arr.astype(self._dtype(), copy=False)

    async def discard(self, engine: Any) -> None:
        """Drop worker-side rows not fetched (request failed or was cancelled). Idempotent."""
        if self.capture_id is not None and not self._fetched and engine is not None:
            self._fetched = True
            await discard_capture(engine, NAME, self.capture_id)

    def finalize(self, final: FinalContext) -> tuple[dict[str, Any], list[TensorPart]]:
        lay = self._lay()
        rows = max(0, final.prompt_token_count + final.completion_token_count - 1 - self.start)
        if self._routes is None:
            raise CaptureError("moe_routes: engine returned no routing data for this request")
        if self._routes.shape != (lay.routers, rows, lay.top_k):
            raise CaptureError(
                f"moe_routes: {self._routes.shape[1]} rows captured; expected prompt + completion - 1 - start = {rows}"
            )
        section = {
            "token_start": self.start,  # effective start: row 0 is this absolute position
            "requested_token_start": self.start,  # as requested (equal: a start beyond the prompt is refused)
            "router_ids": list(lay.router_ids),
            "expert_counts": [lay.num_experts] * lay.routers,
            "top_k": lay.top_k,
            "layout": "router_major",
            "source": "native" if self.native else "worker_capture",
        }
        return section, [TensorPart(f"{NAME}.expert_ids", self._routes)]

    def retained_bytes(self) -> int:
        return 0 if self._routes is None else int(self._routes.nbytes)

    def release(self) -> None:
        self._routes = None


class MoeRoutesReader:
    """Strict decode-side checks, typed view and ``inspect`` summary of ``moe_routes`` (no engine imports).

    Section keys: ``token_start`` (int, 0..P: the effective start), ``requested_token_start`` (optional, v1
    addition: the request's ``routed_experts_prompt_start``; int >= ``token_start`` — a producer may only clamp
    down; objects written before it was added have none), ``router_ids`` (ascending unique ints), ``expert_counts`` (ints
    1..65536, one per router), ``top_k`` (int >= 1), ``layout`` (``"router_major"``), ``source`` (optional).
    Tensor ``moe_routes.expert_ids``: ``[routers, rows, top_k]`` with rows = ``P + C - 1 - token_start``, dtype
    ``u8`` when every router has <= 256 experts else ``u16``, each id < its router's expert count."""

    def validate(self, manifest: Mapping[str, Any], s: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        p, c = manifest["prompt_token_count"], manifest["completion_token_count"]
        need = {"token_start", "router_ids", "expert_counts", "top_k", "layout"}
        if not need <= set(s):
            raise ArtifactFormatError(f"moe_routes section needs keys {sorted(need)}")
        extra = set(tensors) - {f"{NAME}.expert_ids"}
        if extra:
            raise ArtifactFormatError(f"moe_routes has unknown tensor(s) {sorted(extra)}; allowed: ['moe_routes.expert_ids']")
        ids = tensors.get(f"{NAME}.expert_ids")
        if ids is None or ids.ndim != 3:
            raise ArtifactFormatError("moe_routes.expert_ids must exist with rank 3 [routers, rows, top_k]")
        routers, rows, k = ids.shape
        start = s["token_start"]
        if s["layout"] != "router_major":
            raise ArtifactFormatError(f"moe_routes layout {s['layout']!r}; allowed: 'router_major'")
        if not _is_int(start) or not 0 <= start <= p:
            raise ArtifactFormatError(f"moe_routes token_start {start!r} out of range 0..{p}")
        req = s.get("requested_token_start", start)
        if not _is_int(req) or req < start:
            raise ArtifactFormatError(f"moe_routes requested_token_start {req!r} must be an integer >= token_start "
                                      f"{start} (the effective start is never above the requested one)")
        if rows != max(0, p + c - 1 - start):
            raise ArtifactFormatError(
                f"moe_routes rows {rows} != prompt + completion - 1 - token_start = {max(0, p + c - 1 - start)}")
        rid, ec = s["router_ids"], s["expert_counts"]
        if not (isinstance(rid, list) and isinstance(ec, list) and len(rid) == len(ec) == routers and routers > 0):
            raise ArtifactFormatError(f"router_ids/expert_counts must list {routers} routers")
        if not all(_is_int(x) and x >= 0 for x in rid) or rid != sorted(set(rid)):
            raise ArtifactFormatError("router_ids must be unique, ascending, non-negative integers")
        if not all(_is_int(x) and 1 <= x <= 65536 for x in ec):
            raise ArtifactFormatError("expert_counts must be in 1..65536")
        if not _is_int(s["top_k"]) or s["top_k"] != k or k < 1:
            raise ArtifactFormatError(f"moe_routes top_k {s['top_k']!r} != tensor top_k {k}")
        code = route_dtype_code(max(ec))
        if ids.dtype != DTYPES[code]:
            raise ArtifactFormatError(f"moe_routes.expert_ids dtype must be {code} for max expert count {max(ec)}")
        if ids.size and min(ec) < 1 << (8 * ids.dtype.itemsize):  # else every value of the dtype is a valid id
            # one pass over the ids (memory-bound: ~1 ms for 12 MB): a single max when every router has the same
            # expert count (the common case), per-router maxima only to name the offending router
            if len(set(ec)) == 1:
                if int(ids.max()) >= ec[0]:
                    self._range_error(ids, rid, ec)
            else:
                per_router_max = ids.reshape(routers, -1).max(axis=1)
                if (per_router_max >= np.asarray(ec)).any():
                    self._range_error(ids, rid, ec)

    @staticmethod
    def _range_error(ids: np.ndarray, rid: list[int], ec: list[int]) -> None:
        per_router_max = ids.reshape(ids.shape[0], -1).max(axis=1)
        i = int(np.nonzero(per_router_max >= np.asarray(ec))[0][0])
        raise ArtifactFormatError(
            f"expert id {int(per_router_max[i])} out of range for router {rid[i]} with {ec[i]} experts")

    def view(self, manifest: Mapping[str, Any], s: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        """Expert ids ``[rows, routers, top_k]`` (zero-copy transposed view; row i = position token_start + i)."""
        return tensors[f"{NAME}.expert_ids"].transpose(1, 0, 2)

    def summary(self, manifest: Mapping[str, Any], s: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
        routes = self.view(manifest, s, tensors)
        return {"rows": int(routes.shape[0]), "routers": s["router_ids"], "top_k": s["top_k"],
                "token_start": s["token_start"], "requested_token_start": s.get("requested_token_start"),
                "source": s.get("source"),
                "first_row": routes[0].tolist() if routes.shape[0] else []}

    def summary_text(self, summary: Mapping[str, Any]) -> str:
        r = summary
        return (f"{r['rows']} rows x {len(r['routers'])} routers {r['routers']} x top-{r['top_k']}, "
                f"start {r['token_start']}, source {r['source']}; row 0: {r['first_row']}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


READER = MoeRoutesReader()


@hookimpl
def genartifact_content_producer(name: str, model: ModelInfo) -> MoeRoutes | None:
    return MoeRoutes(model) if name == NAME else None


@hookimpl
def genartifact_content_reader(name: str) -> MoeRoutesReader | None:
    return READER if name == NAME else None


@hookimpl
def genartifact_engine_options(options: dict[str, Any], worker_capture: bool) -> None:
    """Worker path: route capture cannot see prefix-cached tokens (they are never recomputed), so prefix caching
    is turned off — only when worker capture will actually run (``worker_capture``) and the engine does not
    return routes natively — with a warning when it was on or left to vLLM's default."""
    if not worker_capture or options.get("enable_return_routed_experts"):
        return
    if options.get("enable_prefix_caching") is not False:
        structlog.get_logger("genartifact.route_capture").warning(
            "prefix_caching_disabled", option="enable_prefix_caching", was=options.get("enable_prefix_caching"),
            reason="moe_routes worker capture never sees prefix-cached tokens (they are not recomputed); keep "
                   "prefix caching with an engine that returns routes natively (enable_return_routed_experts=True)")
    options["enable_prefix_caching"] = False


@hookimpl
def genartifact_worker_capture(worker: Any, settings: Mapping[str, Any]) -> Any:
    """The worker path's capture (see :mod:`.worker`); None where vLLM returns routes natively."""
    if _native_routes_enabled(worker.vllm_config):
        return None
    from genartifact_route_capture.worker import RouteCapture

    return RouteCapture(worker)


def _native_routes_enabled(vcfg: Any) -> bool:
    aux = getattr(vcfg, "aux_output_config", None)
    if aux is not None and getattr(aux, "enable_return_routed_experts", False):
        return True
    return bool(getattr(vcfg.model_config, "enable_return_routed_experts", False))


def layout_for(cfg: Mapping[str, Any]) -> RouterLayout:
    """Public helper: the router layout of a HF config dict (see :mod:`.layout`)."""
    return resolve_layout(cfg)
