"""Gantt chart of a simulated step: one row per rank, forward and backward bars per section."""

from __future__ import annotations

from pathlib import Path

from maestro.schedule.timeline import SimResult


def gantt(result: SimResult, path: str | Path, max_rows_per_section: int = 8, title: str = ""):
    """Draw ``result.events`` (simulate with ``trace=True``) to a PNG.

    Args:
        result: a traced simulation.
        path: output PNG path.
        max_rows_per_section: draw at most this many replicas of each section (large runs
            have thousands; the first few show the pattern).
        title: chart title (the step time is appended).

    Returns:
        The path written.
    """
    if not result.events:
        raise ValueError("no events to draw: simulate with trace=True")
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    names = list(result.sections)
    colours = plt.get_cmap("tab10")
    rows: dict[tuple[str, int], int] = {}
    for n in names:
        for r in range(min(result.sections[n].replicas, max_rows_per_section)):
            rows[(n, r)] = len(rows)
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for sec, r, kind, a, b in result.events:
        row = rows.get((sec, r))
        if row is not None:
            bars.setdefault((row, sec + ":" + kind), []).append((a, b - a))
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.5))
    for (row, label), spans in bars.items():
        sec, kind = label.split(":")
        c = colours(names.index(sec) % 10)
        ax.broken_barh(
            spans,
            (row - 0.4, 0.8),
            facecolors=c,
            alpha=1.0 if kind == "fwd" else 0.5,
            edgecolor="black",
            linewidth=0.2,
        )
    ax.set_yticks(range(len(rows)), [f"{n}[{r}]" for n, r in rows])
    ax.invert_yaxis()
    ax.axvline(result.step_time, color="red", linewidth=1)
    ax.set_xlabel("seconds (solid: forward, light: backward; red: step end incl. all-reduce)")
    ax.set_title(f"{title} step {result.step_time * 1e3:.1f} ms".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
