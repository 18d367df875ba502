"""``genartifact replay-check``: do stored routes and logprobs match the model?

Each artifact's token ids are teacher-forced through the Hugging Face transformers implementation of the same
checkpoint (fp32, one sequence at a time). For every MoE layer the router's own top-k (captured with a forward
hook on the layer's router module, ``mlp.gate``, which returns ``(router_logits, top-k weights, top-k
indices)`` in transformers' Qwen3-MoE and DeepSeek-V3 implementations) is compared with the stored rows:

* ``set_agreement``: rows whose expert *sets* are equal; ``order_agreement``: rows whose expert lists are equal
  element by element (the oracle's list ordered by descending selection score, vLLM's top-k order).
* a set mismatch where the oracle's k-th and (k+1)-th selection scores differ by less than ``--tie-tol`` is a
  *near tie* (numerics of two implementations legitimately flip it) and counted separately, not as a mismatch.
  Selection score: ``softmax(router_logits)`` (Qwen3-MoE, Mixtral-style) or ``sigmoid(router_logits) +
  e_score_correction_bias`` (DeepSeek-V3 ``noaux_tc``).
* ``selected_logprobs`` against ``log_softmax`` of the oracle's logits at the previous position: max and mean
  absolute difference (nats). Valid for ``logprobs_mode = raw_logprobs`` (vLLM's default); the mode is reported.
* ``moe_route_weights`` (when the artifact has them): per layer, on the rows whose expert sets agree, the stored
  weights times the section's ``output_scale`` against the oracle router's own top-k weights (HF's
  ``(router_logits, top-k weights, top-k indices)``, after its ``norm_topk_prob`` and, for DeepSeek-V3,
  ``routed_scaling_factor``), matched expert by expert: ``weight_max_abs_diff`` / ``weight_mean_abs_diff``
  (checked against ``--max-weight-diff``) and ``weight_rows``.

Exit status: 0 when every artifact meets ``--min-agreement`` (non-near-tie set agreement, per layer),
``--max-logprob-diff`` and (with weights) ``--max-weight-diff``; 1 when one does not; 2 for unreadable input (the CLI's error convention).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pluggy
from genartifact import format as fmt
from genartifact.errors import GenartifactError

hookimpl = pluggy.HookimplMarker("genartifact")
COMMAND = "replay-check"
SKIPPED = "\x00skipped: "  # marks an input with nothing to check (a failed receipt), not an error


class ReplayCheckError(GenartifactError):
    """Input that cannot be checked: unreadable object, no moe_routes/selected_logprobs, routers that do not
    match the model's MoE layers."""


# ------------------------------------------------------------------------------------------- HF oracle


class HFOracle:
    """Teacher forcing through HF transformers (imported lazily; needs torch + transformers).

    :param model_dir: a Hugging Face checkpoint directory (``config.json`` + weights).
    """

    def __init__(self, model_dir: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model_dir = str(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.routers: dict[int, Any] = {}
        for i, layer in enumerate(self.model.model.layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "weight"):
                self.routers[i] = gate
        if not self.routers:
            raise ReplayCheckError(f"model {self.model_dir!r} has no MoE router modules (layer.mlp.gate with top_k)")

    def run(self, token_ids: np.ndarray) -> tuple[dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], np.ndarray]:
        """Teacher-force ``token_ids`` (``uint32 [n]``).

        Returns ``(routes, logits)``: ``routes[layer] = (ids int64 [n, top_k] ordered by descending selection
        score, scores float32 [n, experts], weights float32 [n, top_k] — the router's top-k combine weights in
        the same order as ids)`` for every MoE layer, and ``logits float32 [n, vocab]``.
        """
        import torch

        seen: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        hooks = []
        for i, gate in self.routers.items():
            def hook(mod: Any, _inp: Any, out: Any, _i: int = i) -> None:
                logits, w, idx = out
                logits = logits.float()
                bias = getattr(mod, "e_score_correction_bias", None)
                score = logits.sigmoid() + bias if bias is not None else torch.softmax(logits, -1)
                sel = torch.gather(score, 1, idx)
                order = torch.argsort(sel, dim=-1, descending=True, stable=True)
                seen[_i] = (torch.gather(idx, 1, order).numpy().astype(np.int64), score.detach().numpy(),
                            torch.gather(w.float(), 1, order).detach().numpy().astype(np.float32))

            hooks.append(gate.register_forward_hook(hook))
        try:
            with torch.no_grad():
                out = self.model(torch.tensor(np.asarray(token_ids, np.int64)[None]))
        finally:
            for h in hooks:
                h.remove()
        return seen, out.logits[0].float().numpy()

    def topk(self, token_ids: np.ndarray) -> np.ndarray:
        """``[n, moe_layers, top_k]`` expert ids of the oracle (MoE layers ascending)."""
        seen, _ = self.run(token_ids)
        return np.stack([seen[i][0] for i in sorted(seen)], 1)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ------------------------------------------------------------------------------------------- comparison


def compare(art: fmt.Artifact, oracle: HFOracle, *, tie_tol: float = 0.01) -> dict[str, Any]:
    """Compare one artifact with the oracle. Returns a JSON-ready dict: ``tokens``, ``prompt_tokens``,
    ``layers`` (per router: ``layer``, ``rows``, ``set_agreement``, ``order_agreement``, ``mismatches``,
    ``near_ties``, ``agreement_excl_ties``; with ``moe_route_weights`` also ``weight_rows``,
    ``weight_max_abs_diff``, ``weight_mean_abs_diff``), ``logprobs`` (``count``, ``max_abs_diff``, ``mean_abs_diff``,
    ``mode``) or None. Raises :class:`ReplayCheckError` when the artifact has neither content or its routers
    are not the model's MoE layers."""
    secs = art.manifest["sections"]
    if "moe_routes" not in secs and "selected_logprobs" not in secs:
        raise ReplayCheckError(f"artifact has neither moe_routes nor selected_logprobs (contents {art.contents})")
    tok = np.asarray(art.token_ids)
    p, t = art.prompt_token_count, tok.shape[0]
    seen, logits = oracle.run(tok[:-1]) if t > 1 else ({}, np.zeros((0, 1), np.float32))
    report: dict[str, Any] = {"tokens": int(t), "prompt_tokens": int(p), "layers": [], "logprobs": None}
    if "moe_routes" in secs:
        s = secs["moe_routes"]
        if list(s["router_ids"]) != sorted(oracle.routers):
            raise ReplayCheckError(f"artifact routers {s['router_ids']} are not the model's MoE layers "
                                   f"{sorted(oracle.routers)} (wrong checkpoint?)")
        start, rows = int(s["token_start"]), art.routes()
        weights = art.content("moe_route_weights") if "moe_route_weights" in secs else None
        w_scale = secs["moe_route_weights"]["output_scale"] if weights is not None else None
        for j, layer in enumerate(s["router_ids"]):
            got = rows[:, j, :].astype(np.int64)
            want, score = seen[layer][0][start:], seen[layer][1][start:]
            same_set = (np.sort(got, -1) == np.sort(want, -1)).all(-1)
            same_order = (got == want).all(-1)
            k = got.shape[1]
            if score.shape[1] > k:
                top = -np.partition(-score, k, axis=-1)[:, : k + 1]
                top = -np.sort(-top, -1)
                gap = top[:, k - 1] - top[:, k]
            else:
                gap = np.full(got.shape[0], np.inf)
            tie = ~same_set & (gap < tie_tol)
            n = int(got.shape[0])
            mism = int((~same_set & ~tie).sum())
            entry = {
                "layer": int(layer), "rows": n,
                "set_agreement": float(same_set.mean()) if n else 1.0,
                "order_agreement": float(same_order.mean()) if n else 1.0,
                "mismatches": mism, "near_ties": int(tie.sum()),
                "agreement_excl_ties": (n - mism) / n if n else 1.0,
            }
            if weights is not None:
                entry.update(_weight_diff(got, want, weights[:, j, :].astype(np.float64) * float(w_scale[j]),
                                          seen[layer][2][start:].astype(np.float64), same_set))
            report["layers"].append(entry)
    if "selected_logprobs" in secs and t > p:
        lp = np.asarray(art.selected_logprobs(), np.float64)
        ref = _log_softmax(logits[p - 1 : t - 1].astype(np.float64))[np.arange(t - p), tok[p:].astype(np.int64)] \
            if p >= 1 else None
        if ref is None:
            raise ReplayCheckError("selected_logprobs need a prompt of at least one token to teacher-force")
        both_inf = np.isneginf(lp) & np.isneginf(ref)
        d = np.where(both_inf, 0.0, np.abs(lp - ref))
        report["logprobs"] = {"count": int(d.size), "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
                              "mode": art.manifest["header"].get("sampling", {}).get("logprobs_mode")}
    return report


def _weight_diff(got: np.ndarray, want: np.ndarray, got_w: np.ndarray, want_w: np.ndarray,
                 same_set: np.ndarray) -> dict[str, Any]:
    """Stored vs oracle weights of one layer, expert by expert, over the rows whose expert sets agree
    (``got``/``want`` ``[rows, k]`` ids, ``got_w``/``want_w`` ``[rows, k]`` weights in their own id order)."""
    g, w, gw, ww = got[same_set], want[same_set], got_w[same_set], want_w[same_set]
    if not g.shape[0]:
        return {"weight_rows": 0, "weight_max_abs_diff": 0.0, "weight_mean_abs_diff": 0.0}
    pos = np.argmax(g[:, :, None] == w[:, None, :], axis=-1)  # where each stored expert sits in the oracle row
    d = np.abs(gw - np.take_along_axis(ww, pos, axis=1))
    return {"weight_rows": int(g.shape[0]), "weight_max_abs_diff": float(d.max()),
            "weight_mean_abs_diff": float(d.mean())}


def verdict(report: dict[str, Any], min_agreement: float, max_logprob_diff: float,
            max_weight_diff: float = math.inf) -> list[str]:
    """The reasons one artifact's report fails the thresholds (empty = pass)."""
    why = [f"layer {r['layer']}: agreement {r['agreement_excl_ties']:.4f} < {min_agreement}"
           for r in report["layers"] if r["agreement_excl_ties"] < min_agreement]
    why += [f"layer {r['layer']}: route weights max |diff| {r['weight_max_abs_diff']:.3g} > {max_weight_diff}"
            for r in report["layers"] if not r.get("weight_max_abs_diff", 0.0) <= max_weight_diff]
    lp = report["logprobs"]
    if lp is not None and not lp["max_abs_diff"] <= max_logprob_diff:
        why.append(f"selected_logprobs max |diff| {lp['max_abs_diff']:.3g} > {max_logprob_diff}")
    return why


# ------------------------------------------------------------------------------------------- inputs


def _load_inputs(refs: Sequence[str], config: str | None) -> list[tuple[str, Any]]:
    """``(label, Artifact | error message)`` per artifact: ``*.jsonl`` = receipts (fetched and verified through
    the configured target's read-back), an existing path = an object file, ``scheme://`` = an fsspec URL,
    anything else = an object id of the configured ``managed_fsspec`` target."""
    from genartifact import loaders

    out: list[tuple[str, Any]] = []
    target = None

    def get_target() -> Any:
        nonlocal target
        if target is None:
            target = loaders.open_target("managed_fsspec", config)
        return target

    for ref in refs:
        p = Path(ref)
        if p.suffix == ".jsonl" and p.is_file():
            items: list[tuple[str, Any]] = []
            for n, line in enumerate(p.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        items.append((f"{ref}:{n}", json.loads(line)))
                    except json.JSONDecodeError as e:
                        items.append((f"{ref}:{n}", f"receipt is not JSON: {e.msg}"))
                    except RecursionError:
                        items.append((f"{ref}:{n}", "receipt is not JSON: nested too deeply"))
            ready = [i for i, (_, r) in enumerate(items) if isinstance(r, dict) and r.get("state") == "ready"]
            res = loaders.load_batch([items[i][1] for i in ready], get_target()) if ready else None
            loaded = {}
            for j, i in enumerate(ready):
                loaded[i] = res.items[j] if res.items[j] is not None else \
                    next(str(e) for e in res.errors if e.index == j)
            for i, (lab, r) in enumerate(items):  # file order; failed/rejected receipts listed, never dropped
                if i in loaded:
                    out.append((lab, loaded[i]))
                elif isinstance(r, str):
                    out.append((lab, r))
                else:
                    state = r.get("state") if isinstance(r, dict) else type(r).__name__
                    out.append((lab, SKIPPED + f"receipt state {state!r}, no object to check"))
            continue
        try:
            if p.is_file():
                with p.open("rb") as f:
                    data = f.read(fmt.MAX_OBJECT_BYTES + 1)
                out.append((ref, fmt.decode(data)))
            elif "://" in ref:
                import fsspec

                with fsspec.open(ref, "rb") as f:
                    out.append((ref, fmt.decode(f.read(fmt.MAX_OBJECT_BYTES + 1))))
            elif ":" in ref:
                out.append((ref, loaders.fetch_sync(get_target(), ref)))
            else:
                out.append((ref, "not found: give a receipts .jsonl, an object file, an fsspec URL or PROFILE:KEY"))
        except GenartifactError as e:
            out.append((ref, str(e)))
        except OSError as e:
            out.append((ref, f"cannot read ({type(e).__name__})"))
    return out


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory the artifacts came from")
    parser.add_argument("refs", nargs="+", metavar="RECEIPTS_OR_OBJECTS",
                        help="receipts .jsonl files, object files, fsspec URLs or managed_fsspec object ids")
    try:  # the genartifact CLI already gives every subcommand --config
        parser.add_argument("--config", help="config file (targets used to read receipts/object ids)")
    except argparse.ArgumentError:
        pass
    parser.add_argument("--min-agreement", type=float, default=0.99,
                        help="per layer, fraction of rows whose expert sets agree, near ties excluded (default 0.99)")
    parser.add_argument("--max-logprob-diff", type=float, default=0.05,
                        help="largest allowed |stored - teacher-forced| selected logprob, nats (default 0.05)")
    parser.add_argument("--max-weight-diff", type=float, default=0.01,
                        help="largest allowed |stored x output_scale - HF| router weight on agreeing rows (default "
                             "0.01: bf16 storage alone may differ by 2**-9 for weights < 1)")
    parser.add_argument("--tie-tol", type=float, default=0.01,
                        help="selection-score gap below which a flipped top-k boundary is a near tie (default 0.01)")
    parser.add_argument("--json", dest="json_out", help="write the full JSON report here ('-' = stdout)")


def run(args: argparse.Namespace) -> int:
    """The ``replay-check`` handler: exit 0 pass, 1 below threshold, 2 unreadable input."""
    for name in ("min_agreement", "max_logprob_diff", "max_weight_diff", "tie_tol"):
        v = getattr(args, name)
        if not math.isfinite(v) or v < 0 or (name == "min_agreement" and v > 1):
            raise ReplayCheckError(f"--{name.replace('_', '-')}={v}; allowed: finite, >= 0"
                                   + (" and <= 1" if name == "min_agreement" else ""))
    if not (Path(args.model) / "config.json").is_file():
        raise ReplayCheckError(f"--model {args.model!r} is not a checkpoint directory (no config.json)")
    inputs = _load_inputs(args.refs, args.config)
    oracle = HFOracle(args.model) if any(not isinstance(a, str) for _, a in inputs) else None
    if not any(not isinstance(a, str) or not a.startswith(SKIPPED) for _, a in inputs):
        raise ReplayCheckError("no artifact to check: every receipt is failed or rejected")
    results, status = [], 0
    for label, art in inputs:
        if isinstance(art, str) and art.startswith(SKIPPED):
            results.append({"artifact": label, "skipped": art[len(SKIPPED):]})
            continue
        if isinstance(art, str):
            results.append({"artifact": label, "error": art})
            status = 2
            continue
        try:
            rep = compare(art, oracle, tie_tol=args.tie_tol)
        except ReplayCheckError as e:
            results.append({"artifact": label, "error": str(e)})
            status = 2
            continue
        why = verdict(rep, args.min_agreement, args.max_logprob_diff, args.max_weight_diff)
        results.append({"artifact": label, "pass": not why, "failures": why, **rep})
        if why and status == 0:
            status = 1
    doc = {"model": args.model, "thresholds": {"min_agreement": args.min_agreement,
                                               "max_logprob_diff": args.max_logprob_diff,
                                               "max_weight_diff": args.max_weight_diff, "tie_tol": args.tie_tol},
           "pass": status == 0, "artifacts": results}
    if args.json_out == "-":
        print(json.dumps(doc, indent=1))
    else:
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")
        print(table(results))
    return status


def table(results: list[dict[str, Any]]) -> str:
    """Short human summary: one line per artifact (worst layer, ties, logprob diffs, route weight diff or -)."""
    lines = [f"{'artifact':40} {'result':6} {'rows':>6} {'set':>7} {'order':>7} {'ties':>5} {'lp max':>9} {'lp mean':>9} "
             f"{'w max':>9}"]
    for r in results:
        name = r["artifact"] if len(r["artifact"]) <= 40 else "…" + r["artifact"][-39:]
        if "error" in r:
            lines.append(f"{name:40} {'ERROR':6} {r['error']}")
            continue
        if "skipped" in r:
            lines.append(f"{name:40} {'skip':6} {r['skipped']}")
            continue
        layers = r["layers"]
        rows = sum(x["rows"] for x in layers)
        s = min((x["set_agreement"] for x in layers), default=float("nan"))
        o = min((x["order_agreement"] for x in layers), default=float("nan"))
        ties = sum(x["near_ties"] for x in layers)
        lp = r["logprobs"] or {"max_abs_diff": float("nan"), "mean_abs_diff": float("nan")}
        wd = [x["weight_max_abs_diff"] for x in layers if "weight_max_abs_diff" in x]
        wtxt = f"{max(wd):9.2e}" if wd else f"{'-':>9}"
        lines.append(f"{name:40} {'pass' if r['pass'] else 'FAIL':6} {rows:6d} {s:7.4f} {o:7.4f} {ties:5d} "
                     f"{lp['max_abs_diff']:9.2e} {lp['mean_abs_diff']:9.2e} {wtxt}")
        lines += [f"{'':40} {'':6} {f}" for f in r["failures"]]
    return "\n".join(lines)


@hookimpl
def genartifact_command(name: str, parser: argparse.ArgumentParser) -> Any:
    """CLI command plugin hook: ``replay-check`` (the host may pass the normalized ``replay_check``)."""
    if name.replace("_", "-") != COMMAND:
        return None
    add_arguments(parser)
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry (``python -m genartifact_route_capture.replay_check``)."""
    parser = argparse.ArgumentParser(prog=f"genartifact {COMMAND}", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except GenartifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
