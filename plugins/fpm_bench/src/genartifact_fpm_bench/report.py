"""``genartifact bench report``: PNG plots (step time vs tokens for prefill, vs context for decode, one line
per batch size; noisy points ringed) and a Markdown summary with CV flags."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def report(artifact: str | Path, out_dir: str | Path) -> Path:
    """Render ``artifact`` (rank or merged) into ``out_dir``; returns the Markdown path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(artifact).read_text(encoding="utf-8"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in doc["points"] if r.get("status") == "completed"]
    lines = [f"# FPM self-benchmark — run `{doc['run_id']}`", "",
             f"grid `{doc['grid_digest'][:16]}…`, mode `{doc['mode']}`, {len(done)}/{len(doc['points'])} point "
             f"records completed; estimate: {doc['protocol']['estimate']} ({doc['protocol']['timing_basis']}).", ""]
    for phase, xkey, xlabel in (("prefill", "tokens", "new tokens in the pass"),
                                ("decode", "context", "context tokens per request")):
        rows = [r for r in done if r["point"]["phase"] == phase]
        if not rows:
            continue
        series: dict[tuple[int, int], list[tuple[int, float, bool]]] = defaultdict(list)
        for r in rows:
            p = r["point"]
            series[(p["batch"], p.get("kv", 0))].append((p[xkey], r["estimate"]["wall_time"] * 1e3,
                                                         r["estimate"]["noisy"]))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (b, kv), pts in sorted(series.items()):
            pts.sort()
            label = f"batch {b}" + (f", kv {kv}" if kv else "")
            ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o", label=label)
            noisy = [(x, y) for x, y, n in pts if n]
            if noisy:
                ax.scatter(*zip(*noisy, strict=True), s=160, facecolors="none", edgecolors="red")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("step wall time (ms)")
        ax.set_title(f"{phase}: step time (red ring: CV > {doc['protocol']['noisy_cv']})")
        ax.grid(True, alpha=0.3)
        ax.legend()
        png = out / f"{phase}.png"
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
        lines += [f"## {phase}", "", f"![{phase}]({png.name})", "",
                  "| point | rank | step ms | CV | samples | noisy |", "|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["key"], r.get("dp_rank", 0))):
            e = r["estimate"]
            cv = "–" if e["cv"] is None else f"{e['cv']:.3f}"
            lines.append(f"| {r['key']} | {r.get('dp_rank', 0)} | {e['wall_time'] * 1e3:.3f} | {cv} | "
                         f"{len(e['raw_sample_indices'])} | {'⚠' if e['noisy'] else ''} |")
        lines.append("")
    failed = [r for r in doc["points"] if r.get("status") != "completed"]
    if failed:
        lines += ["## failed points", ""] + [f"- {r['key']} (rank {r.get('dp_rank', 0)}): {r.get('error')}" for r in failed]
    md = out / "report.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return md
