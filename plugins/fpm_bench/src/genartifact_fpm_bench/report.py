"""``genartifact bench report``: plots and summaries a performance engineer can check against the raw samples.

* One series per DP rank and batch (and KV-read) — ranks are never joined into one line; colour = batch,
  line style and marker = rank.
* Each point is the artifact's estimate (median wall time of the measured samples) with **p10–p90 of the raw
  measured samples** as error bars; the y axis starts at zero.
* The CV is **recomputed from the raw samples** (population stdev / mean of the measured samples' ``wall_time``)
  and compared with the stored ``noisy`` flag; a disagreement is listed.
* **Cross-rank disagreement**: a point whose rank estimates differ by more than :data:`RANK_DISAGREEMENT`
  (``(max − min) / min``) is flagged, with the threshold named in the report.
* With a fitted model (``--model``, from ``bench fit``): the selected model's line along each series and a
  residual plot per phase (leave-one-point-out residuals on the grid, residuals of off-grid holdout points).

Outputs in ``out_dir``: ``prefill.png``, ``decode.png`` (and ``<phase>_residuals.png`` with a model),
``report.md`` (Markdown summary linking the PNGs) and ``report.html`` (one self-contained file: the same
content with the plots embedded as base64 PNG data URIs).
"""

from __future__ import annotations

import base64
import html
import statistics
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

#: relative difference of the rank estimates of one point, (max − min) / min, above which it is flagged
RANK_DISAGREEMENT = 0.2
PHASE_AXIS = {"prefill": ("tokens", "new tokens in the pass"), "decode": ("context", "context tokens per request")}


def _measured_walls(rec: Mapping[str, Any]) -> list[float]:
    return [rec["raw_samples"][i]["timing"]["wall_time"] for i in rec["estimate"]["raw_sample_indices"]]


def point_stats(rec: Mapping[str, Any], noisy_cv: float) -> dict[str, Any]:
    """Statistics of one completed point record from its raw measured samples (seconds): ``median``, ``p10``,
    ``p90`` (linear interpolation, numpy's default), ``cv`` (population stdev / mean; None with < 2 samples),
    ``noisy`` (cv > ``noisy_cv``), ``stored_noisy`` and ``flag_ok`` (stored flag equals the recomputed one),
    ``estimate`` (the stored estimate) and ``n``."""
    walls = _measured_walls(rec)
    arr = np.array(walls, float)
    cv = statistics.pstdev(walls) / statistics.fmean(walls) if len(walls) > 1 else None
    noisy = bool(cv is not None and cv > noisy_cv)
    stored = bool(rec["estimate"].get("noisy"))
    return {"n": len(walls), "median": float(np.median(arr)), "p10": float(np.percentile(arr, 10)),
            "p90": float(np.percentile(arr, 90)), "cv": cv, "noisy": noisy, "stored_noisy": stored,
            "flag_ok": stored == noisy, "estimate": float(rec["estimate"]["wall_time"])}


def rank_disagreement(recs: list[Mapping[str, Any]]) -> float | None:
    """(max − min) / min of the rank estimates of one point; None with fewer than 2 ranks."""
    ys = [float(r["estimate"]["wall_time"]) for r in recs]
    return None if len(ys) < 2 else (max(ys) - min(ys)) / min(ys)


def _png_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _series_shape(phase: str, batch: int, kv: int, x: float) -> dict[str, float]:
    if phase == "prefill":
        return {"num_prefill_requests": batch, "sum_prefill_tokens": x, "sum_prefill_kv_tokens": batch * kv}
    return {"num_decode_requests": batch, "sum_decode_kv_tokens": batch * (x - 1)}


def report(artifact: str | Path, out_dir: str | Path, model: str | Path | None = None) -> Path:
    """Render ``artifact`` (rank or merged) — and ``model`` (a ``bench fit`` JSON) if given — into ``out_dir``;
    returns the Markdown path (``report.html`` is written next to it). Raises ``ValueError`` (``FitError``) for a
    model of a foreign schema, and ``OSError``/``ValueError`` for an unreadable artifact."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from genartifact_fpm_bench.fit import StepModel, load_artifact

    doc = load_artifact(artifact)  # bounded read; a foreign or malformed file is a FitError naming it
    step = StepModel.load(model) if model else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    noisy_cv = float(doc["protocol"].get("noisy_cv", 0.1))
    done = [r for r in doc["points"] if r.get("status") == "completed"]
    ranks = sorted({int(r.get("dp_rank", 0)) for r in doc["points"]})
    stats = {(r["key"], int(r.get("dp_rank", 0))): point_stats(r, noisy_cv) for r in done}
    by_key: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in done:
        by_key[r["key"]].append(r)
    disagree = {k: rank_disagreement(v) for k, v in by_key.items()}
    flagged = {k: d for k, d in disagree.items() if d is not None and d > RANK_DISAGREEMENT}
    mismatches = [(k, rk) for (k, rk), s in stats.items() if not s["flag_ok"]]
    cov = doc.get("coverage", {})
    md = [f"# FPM self-benchmark — run `{doc['run_id']}`", "",
          f"grid `{doc['grid_digest'][:16]}…`, mode `{doc['mode']}`, ranks {ranks}, {len(done)}/{len(doc['points'])} "
          f"point records completed; estimate: {doc['protocol'].get('estimate')} "
          f"({doc['protocol'].get('timing_basis')}); error bars: p10–p90 of the raw measured samples; CV recomputed "
          f"from the raw samples (noisy: CV > {noisy_cv}).", ""]
    if cov.get("excluded_points"):
        md += [f"Excluded before running: {len(cov['excluded_points'])} candidate points "
               f"({'; '.join(x['reason'] for x in cov['excluded_points'][:5])}"
               f"{'; …' if len(cov['excluded_points']) > 5 else ''}).", ""]
    md += [f"**Cross-rank disagreement** (rank estimates differ by more than {RANK_DISAGREEMENT:.0%}, "
           f"(max − min) / min): " + (", ".join(f"`{k}` {d:.0%}" for k, d in sorted(flagged.items())) or "none")
           + ("" if len(ranks) > 1 else " (single rank)") + ".", "",
           "**Stored noisy flag vs CV recomputed from raw samples**: "
           + (", ".join(f"`{k}` rank {rk}" for k, rk in sorted(mismatches)) + " disagree" if mismatches
              else "all agree") + ".", ""]
    if step is not None:
        src = step.doc["source"]
        same = src.get("grid_digest") == doc["grid_digest"]
        md += ["## Step-time model", "",
               f"model from run `{src.get('run_id')}`, grid `{str(src.get('grid_digest'))[:16]}…`"
               f"{'' if same else ' (**a different grid than this artifact**)'}, engine identity "
               f"`{str(src.get('engine_identity'))[:16]}…`.", "",
               "| phase | model | selected | LOO MAPE (CV≤0.1) | LOO max | off-grid MAPE (CV≤0.1) | off-grid max | "
               "off-grid MAPE (all) |", "|---|---|---|---|---|---|---|---|"]

        def f(e: Mapping[str, Any] | None, k: str, sub: str = "cv_ok") -> str:
            if not e or e[sub]["n"] == 0 or e[sub][k] is None:
                return "–"
            return f"{e[sub][k]:.2f} % (n={e[sub]['n']})" if k == "mape_pct" else f"{e[sub][k]:.2f} %"

        for phase, m in step.doc["phases"].items():
            for kind in ("linear", "interpolate"):
                ev = m["holdout"][kind]
                md.append(f"| {phase} | {kind} | {'✔' if m['selected'] == kind else ''} | {f(ev['loo'], 'mape_pct')} | "
                          f"{f(ev['loo'], 'max_error_pct')} | {f(ev.get('off_grid'), 'mape_pct')} | "
                          f"{f(ev.get('off_grid'), 'max_error_pct')} | {f(ev.get('off_grid'), 'mape_pct', 'all')} |")
        md.append("")
        for phase, m in step.doc["phases"].items():
            lin = m["linear"]
            md += [f"{phase} linear coefficients (seconds per unit, non-negative): " + ", ".join(
                f"{n} {c:.3g}" for n, c in zip(lin["features"], lin["coefficients"], strict=True)), ""]
    pngs: list[tuple[str, Path]] = []
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P"]
    for phase, (xkey, xlabel) in PHASE_AXIS.items():
        rows = [r for r in done if r["point"]["phase"] == phase]
        if not rows:
            continue
        series: dict[tuple[int, int, int], list[tuple[int, dict[str, Any], str]]] = defaultdict(list)
        for r in rows:
            p, rk = r["point"], int(r.get("dp_rank", 0))
            series[(rk, p["batch"], p.get("kv", 0))].append((p[xkey], stats[(r["key"], rk)], r["key"]))
        batches = sorted({b for _, b, _ in series})
        cmap = plt.get_cmap("tab10")
        fig, ax = plt.subplots(figsize=(8, 5))
        for (rk, b, kv), pts in sorted(series.items()):
            pts.sort(key=lambda t: t[0])
            xs = np.array([x for x, _, _ in pts], float)
            ys = np.array([s["estimate"] for _, s, _ in pts]) * 1e3
            lo = ys - np.array([s["p10"] for _, s, _ in pts]) * 1e3
            hi = np.array([s["p90"] for _, s, _ in pts]) * 1e3 - ys
            label = f"rank {rk}, batch {b}" + (f", kv {kv}" if kv else "")
            ax.errorbar(xs, ys, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], color=cmap(batches.index(b)),
                        linestyle=styles[ranks.index(rk) % len(styles)], marker=markers[ranks.index(rk) % len(markers)],
                        capsize=3, label=label, alpha=0.6 if kv else 0.9)
            noisy = [(x, y) for (x, s, _), y in zip(pts, ys, strict=True) if s["noisy"]]
            if noisy:
                ax.scatter(*zip(*noisy, strict=True), s=170, facecolors="none", edgecolors="red", zorder=5)
            dis = [(x, y) for (x, _, k), y in zip(pts, ys, strict=True) if k in flagged]
            if dis:
                ax.scatter(*zip(*dis, strict=True), s=260, marker="s", facecolors="none", edgecolors="orange", zorder=5)
        if step is not None and phase in step.doc["phases"]:
            for (rk, b, kv), pts in sorted(series.items()):
                if rk != ranks[0] or len(pts) < 2:
                    continue  # one model line per (batch, kv): the model is shared by the ranks
                xs = np.linspace(min(x for x, _, _ in pts), max(x for x, _, _ in pts), 64)
                ax.plot(xs, [step.predict(_series_shape(phase, b, kv, x)) * 1e3 for x in xs], color=cmap(batches.index(b)),
                        linewidth=1, alpha=0.5, linestyle=(0, (1, 1)))
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("step wall time (ms), median with p10–p90")
        title = f"{phase}: one series per rank; red ring CV > {noisy_cv}; orange square ranks differ > {RANK_DISAGREEMENT:.0%}"
        if step is not None and phase in step.doc["phases"]:
            title += f"\nthin dotted: {step.selected(phase)} model"
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        png = out / f"{phase}.png"
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
        pngs.append((phase, png))
        md += [f"## {phase}", "", f"![{phase}]({png.name})", ""]
        if step is not None and phase in step.doc["phases"]:
            m = step.doc["phases"][phase]
            sel = m["selected"]
            fig, ax = plt.subplots(figsize=(8, 3.8))
            g = [x for x in m["grid"] if x["loo"].get(sel) is not None]
            ax.scatter([x["y"] * 1e3 for x in g], [(x["loo"][sel] - x["y"]) / x["y"] * 100 for x in g],
                       label=f"grid, leave-one-point-out ({sel})", marker="o")
            if m["off_grid"]:
                ax.scatter([x["y"] * 1e3 for x in m["off_grid"]],
                           [(x["pred"][sel] - x["y"]) / x["y"] * 100 for x in m["off_grid"]],
                           label=f"off-grid holdout ({sel})", marker="x")
            ax.axhline(0, color="black", linewidth=0.8)
            for s in (-5, 5):
                ax.axhline(s, color="grey", linestyle="--", linewidth=0.8)
            ax.set_xlabel("measured step wall time (ms)")
            ax.set_ylabel("(predicted − measured) / measured, %")
            ax.set_title(f"{phase}: residuals of the {sel} model (dashed: ±5 %)", fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
            rpng = out / f"{phase}_residuals.png"
            fig.tight_layout()
            fig.savefig(rpng, dpi=110)
            plt.close(fig)
            pngs.append((f"{phase} residuals", rpng))
            md += [f"![{phase} residuals]({rpng.name})", ""]
        head = "| point | rank | median ms | p10 ms | p90 ms | CV (raw) | samples | noisy | stored flag | ranks differ |"
        md += [head, "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["key"], r.get("dp_rank", 0))):
            s = stats[(r["key"], int(r.get("dp_rank", 0)))]
            cv = "–" if s["cv"] is None else f"{s['cv']:.3f}"
            d = disagree.get(r["key"])
            md.append(f"| {r['key']} | {r.get('dp_rank', 0)} | {s['estimate'] * 1e3:.3f} | {s['p10'] * 1e3:.3f} | "
                      f"{s['p90'] * 1e3:.3f} | {cv} | {s['n']} | {'⚠' if s['noisy'] else ''} | "
                      f"{'ok' if s['flag_ok'] else '**mismatch**'} | "
                      f"{'' if d is None else (f'**{d:.0%}**' if d > RANK_DISAGREEMENT else f'{d:.0%}')} |")
        md.append("")
    failed = [r for r in doc["points"] if r.get("status") != "completed"]
    if failed:
        md += ["## failed points", ""] + [f"- {r['key']} (rank {r.get('dp_rank', 0)}): {r.get('error')}" for r in failed]
    mdp = out / "report.md"
    mdp.write_text("\n".join(md) + "\n", encoding="utf-8")
    _write_html(out / "report.html", md, dict((p.name, p) for _, p in pngs), doc["run_id"])
    return mdp


def _write_html(path: Path, md: list[str], pngs: dict[str, Path], run_id: str) -> None:
    """Self-contained HTML of the Markdown lines (headings, tables, images as data URIs, paragraphs)."""
    import re

    def inline(t: str) -> str:
        t = html.escape(t)
        t = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", t)
        return re.sub(r"`(.+?)`", r"<code>\1</code>", t)

    body: list[str] = []
    table: list[list[str]] = []

    def flush() -> None:
        if table:
            head, rows = table[0], [r for r in table[2:]]
            body.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in head) + "</tr>" +
                        "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in rows) +
                        "</table>")
            table.clear()

    for line in md:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        flush()
        m = re.fullmatch(r"!\[(.*?)\]\((.+?)\)", line)
        if line.startswith("## "):
            body.append(f"<h2>{inline(line[3:])}</h2>")
        elif line.startswith("# "):
            body.append(f"<h1>{inline(line[2:])}</h1>")
        elif m and m.group(2) in pngs:
            body.append(f'<img alt="{html.escape(m.group(1))}" src="{_png_uri(pngs[m.group(2)])}">')
        elif line.startswith("- "):
            body.append(f"<p>• {inline(line[2:])}</p>")
        elif line:
            body.append(f"<p>{inline(line)}</p>")
    flush()
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
             "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}img{max-width:100%}")
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>FPM report {html.escape(run_id)}"
                    f"</title><style>{style}</style></head><body>{''.join(body)}</body></html>\n", encoding="utf-8")
