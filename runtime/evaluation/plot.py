"""The TPF-quality plot: x = tokens per decode forward, y = a quality metric in [0, 1].

One panel per metric present (GSM8K accuracy, HumanEval pass@1, exact agreement with AR,
common-prefix agreement), one line per (bundle, B, draft source, adaptive masks), each point
labelled with its tau; the AR point (tau >= 1) is on the masks line, and a tau >= 1 point that
feeds no masks (AR, lookup drafts at tau 1) also on the adaptive line of its draft source.
Needs matplotlib (the ``bench`` extra); drawn on a bare Figure, so no pyplot state is touched.
"""

from __future__ import annotations

from pathlib import Path

from runtime.evaluation.summary import draft_label

PLOT_FILE = "tpf_quality.png"
_PANELS = (("gsm8k_accuracy", "GSM8K accuracy"), ("humaneval_pass_at_1", "HumanEval pass@1"),
           ("agreement_exact", "identical to AR (fraction)"), ("agreement_prefix", "common prefix with AR (mean)"))


def tpf_lines(summary: list[dict]) -> dict[str, list[dict]]:
    """The plot's lines: legend label -> the summary rows on it, by TPF (see the module docstring)."""
    lines: dict[tuple, list[dict]] = {}
    for row in summary:
        lines.setdefault((row["bundle"], row["block_size"], row["draft"], row["adaptive_masks"]), []).append(row)
    for (bundle, block_size, draft, adaptive), rows in lines.items():
        if adaptive:  # a tau >= 1 run without an adaptive twin feeds no masks: the same with adaptive masks
            taus = {r["tau"] for r in rows}
            rows += [r for r in lines[bundle, block_size, draft, False] if r["tau"] >= 1.0 and r["tau"] not in taus]
    labelled = {}
    for (bundle, block_size, _, _), rows in lines.items():
        label = draft_label(rows[0])
        labelled[f"{bundle} B={block_size}" + ("" if label == "masks" else f" +{label}")] = sorted(
            rows, key=lambda r: r["tpf"])
    return labelled


def plot_tpf_quality(out_dir: Path, summary: list[dict]) -> Path:
    """Write ``tpf_quality.png`` into ``out_dir`` and return its path."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    panels = [(f, title) for f, title in _PANELS if any(row[f] is not None for row in summary)]
    lines = tpf_lines(summary)
    fig = Figure(figsize=(4.5 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (field, title) in zip(axes[0], panels):
        for label, rows in lines.items():
            xs, ys = [r["tpf"] for r in rows], [r[field] for r in rows]
            ax.plot(xs, ys, marker="o", label=label)
            labels: dict[tuple, list[str]] = {}  # points that coincide (e.g. tau 1 and 0.95) share one label
            for r in rows:
                labels.setdefault((r["tpf"], r[field]), []).append(f"{r['tau']:g}")
            for point, taus in labels.items():
                ax.annotate(", ".join(taus), point, textcoords="offset points", xytext=(3, 4), fontsize=7)
        ax.set(title=title, xlabel="tokens per forward (TPF)", ylim=(-0.05, 1.05))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("MARS speed/quality: points labelled by tau", fontsize=10)
    fig.tight_layout()
    path = out_dir / PLOT_FILE
    fig.savefig(path, dpi=110)
    return path
