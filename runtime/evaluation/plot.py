"""The TPF-quality plot: x = tokens per decode forward, y = a quality metric in [0, 1].

One panel per metric present (GSM8K accuracy, HumanEval pass@1, exact agreement with AR,
common-prefix agreement), one line per (bundle, B, draft source, adaptive masks), each point
labelled with its tau; the AR point (tau >= 1) is on the masks line, and a tau >= 1 point that
feeds no masks (AR, lookup drafts at tau 1) also on the adaptive line of its draft source.
Points that coincide share one label; the labels of points close together are placed apart
(:func:`place_labels`), so "1" and "0.9" at nearly the same TPF never read as "10.9".
Needs matplotlib (the ``bench`` extra); drawn on a bare Figure, so no pyplot state is touched.
"""

from __future__ import annotations

import math
from pathlib import Path

from runtime.evaluation.summary import draft_label

PLOT_FILE = "tpf_quality.png"
_PANELS = (("gsm8k_accuracy", "GSM8K accuracy"), ("humaneval_pass_at_1", "HumanEval pass@1"),
           ("agreement_exact", "identical to AR (fraction)"), ("agreement_prefix", "common prefix with AR (mean)"))
LABEL_FONT_SIZE = 7  # points
_GAP = 4  # points between a point and its label, along x and y
# Where a tau label may go, tried in this order: (offset from its point in points, horizontal and vertical alignment).
LABEL_PLACES = (((_GAP, _GAP), "left", "bottom"), ((-_GAP, -_GAP), "right", "top"), ((-_GAP, _GAP), "right", "bottom"),
                ((_GAP, -_GAP), "left", "top"))
_CHAR_WIDTH = 0.65  # of the font size: a digit of DejaVu Sans (matplotlib's default) is 0.636 em wide
_MAX_PUSHES = 8  # a label that fits no place is moved out by one line height at a time, up to this many


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


def tau_labels(rows: list[dict], field: str) -> dict[tuple, str]:
    """(TPF, value of ``field``) -> the label of the taus there (``"1, 0.95"`` where points coincide), of ``rows``
    (every line's, a row on two lines counted once), by TPF; rows without a value are not drawn."""
    taus: dict[tuple, list[str]] = {}
    for r in sorted(rows, key=lambda r: r["tpf"]):
        if r[field] is None:
            continue
        names, tau = taus.setdefault((r["tpf"], r[field]), []), f"{r['tau']:g}"
        if tau not in names:
            names.append(tau)
    return {point: ", ".join(names) for point, names in taus.items()}


def place_labels(anchors: list[tuple[float, float]], texts: list[str],
                 font_size: float = LABEL_FONT_SIZE) -> list[tuple[tuple[float, float], str, str]]:
    """Where each label goes, so that no two labels' boxes meet: each, in order, takes the first of
    :data:`LABEL_PLACES` whose box meets no label placed before it, else the first that fits once moved out by one
    line height at a time (up to :data:`_MAX_PUSHES`), else its first place.

    Args:
        anchors: each label's point, in points on the page (x to the right, y up); texts: the labels.

    Returns:
        per label (offset from its point in points, horizontal alignment, vertical alignment).
    """
    placed, places = [], []
    for (x, y), text in zip(anchors, texts):
        size = (len(text) * _CHAR_WIDTH * font_size, font_size)
        options = [((dx + math.copysign(push * font_size, dx), dy + math.copysign(push * font_size, dy)), ha, va)
                   for push in range(_MAX_PUSHES + 1) for (dx, dy), ha, va in LABEL_PLACES]
        boxes = [_label_box((x + offset[0], y + offset[1]), size, ha, va) for offset, ha, va in options]
        free = next((i for i, box in enumerate(boxes) if not any(_meet(box, other) for other in placed)), 0)
        placed.append(boxes[free])
        places.append(options[free])
    return places


def _label_box(at: tuple[float, float], size: tuple[float, float], ha: str, va: str) -> tuple[float, ...]:
    """(x0, y0, x1, y1) of a label of ``size`` (width, height) aligned at ``at`` as ``ha``/``va`` say."""
    x0 = at[0] - size[0] if ha == "right" else at[0]
    y0 = at[1] - size[1] if va == "top" else at[1]
    return x0, y0, x0 + size[0], y0 + size[1]


def _meet(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def plot_tpf_quality(out_dir: Path, summary: list[dict]) -> Path:
    """Write ``tpf_quality.png`` into ``out_dir`` and return its path."""
    path = out_dir / PLOT_FILE
    make_tpf_figure(summary).savefig(path, dpi=110)
    return path


def make_tpf_figure(summary: list[dict]):
    """The plot (see the module docstring) as a matplotlib ``Figure``."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    panels = [(f, title) for f, title in _PANELS if any(row[f] is not None for row in summary)]
    lines = tpf_lines(summary)
    fig = Figure(figsize=(4.5 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (field, title) in zip(axes[0], panels):
        for label, rows in lines.items():
            ax.plot([r["tpf"] for r in rows], [r[field] for r in rows], marker="o", label=label)
        ax.set(title=title, xlabel="tokens per forward (TPF)", ylim=(-0.05, 1.05))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("MARS speed/quality: points labelled by tau", fontsize=10)
    fig.tight_layout()
    for ax, (field, _) in zip(axes[0], panels):  # once the layout is final: the labels are placed on the page
        _annotate_taus(ax, tau_labels([r for rows in lines.values() for r in rows], field))
    return fig


def _annotate_taus(ax, labels: dict[tuple, str]) -> None:
    """Draw ``labels`` (point -> text) on ``ax`` where :func:`place_labels` puts them; one moved away from its point
    gets a thin line to it."""
    if not labels:
        return
    to_points = 72 / ax.figure.dpi
    anchors = [(x * to_points, y * to_points) for x, y in ax.transData.transform(list(labels))]
    for (point, text), (offset, ha, va) in zip(labels.items(), place_labels(anchors, list(labels.values()))):
        moved = max(map(abs, offset)) > _GAP
        ax.annotate(text, point, textcoords="offset points", xytext=offset, ha=ha, va=va, fontsize=LABEL_FONT_SIZE,
                    arrowprops={"arrowstyle": "-", "linewidth": 0.5, "color": "0.5"} if moved else None)
