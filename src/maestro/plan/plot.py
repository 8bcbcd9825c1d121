"""``maestro plan SCENARIO --plot OUT.png``: GPU-hours per million samples against the budget.

For each GPU budget the scenario is planned afresh (its global batch is 8 samples per GPU of
the budget) under the same search for Maestro, the tuned baseline (b: best monolithic plan,
length-balanced sampler) and the conventional one (a: one configuration, data order), and
the three curves are drawn on log-scaled budgets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class SweepPoint:
    """GPU-hours per million samples of the three plans at one budget."""

    gpus: int
    maestro: float
    tuned: float
    conventional: float
    maestro_layout: str


def budget_sweep(config: str, budgets: Sequence[int], options, progress: bool = True):
    """``[SweepPoint]`` for the scenario ``config`` at each of ``budgets``."""
    from tqdm import tqdm

    from maestro.plan.report import compare
    from maestro.plan.workload import load_workload

    out = []
    for g in tqdm(list(budgets), desc="plan sweep", unit="budget", disable=not progress):
        wl = load_workload(config, g)
        if wl.config is not None:
            raise ValueError("--plot sweeps a scenario's GPU budget; CONFIG is a run config")
        c = compare(wl, g, options, match=False)
        conv = c.conventional or c.monolithic
        out.append(
            SweepPoint(
                g,
                c.maestro.gpu_hours_per_million,
                c.monolithic.gpu_hours_per_million,
                conv.gpu_hours_per_million,
                c.maestro.describe(),
            )
        )
    return out


def plot_sweep(points: Sequence[SweepPoint], title: str, path: str) -> None:
    """Draw the sweep to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = [p.gpus for p in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(g, [p.maestro for p in points], "o-", label="Maestro")
    ax.plot(g, [p.tuned for p in points], "s--", label="(b) tuned: monolithic, length-balanced")
    ax.plot(g, [p.conventional for p in points], "x:", label="(a) conventional: one config")
    ax.set_xscale("log", base=2)
    ax.set_xticks(g, [str(x) for x in g])
    ax.set_xlabel("GPU budget")
    ax.set_ylabel("GPU-hours per million samples")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_sweep(points: Sequence[SweepPoint]) -> str:
    """The sweep as a text table with both savings."""
    lines = [
        f"{'GPUs':>5} {'maestro':>9} {'(b) tuned':>10} {'(a) conv':>9} {'vs (b)':>7} "
        f"{'vs (a)':>7}  maestro layout"
    ]
    for p in points:
        lines.append(
            f"{p.gpus:>5} {p.maestro:>9.2f} {p.tuned:>10.2f} {p.conventional:>9.2f} "
            f"{1 - p.maestro / p.tuned:>+7.1%} {1 - p.maestro / p.conventional:>+7.1%}  "
            f"{p.maestro_layout}"
        )
    return "\n".join(lines)


__all__ = ["SweepPoint", "budget_sweep", "format_sweep", "plot_sweep"]
