"""``maestro plan SCENARIO --plot OUT.png``: GPU-hours per million samples against the budget.

For each GPU budget the scenario is planned afresh (its global batch is 8 samples per GPU of
the budget) under the same search for Maestro and the three baselines of ``compare``:
conventional (a: one configuration, data order), careful (b': token-count-balanced sampler)
and tuned (b: Maestro's cost-aware balancer), and the four curves are drawn on log-scaled
budgets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class SweepPoint:
    """GPU-hours per million samples of Maestro and the three baselines at one budget."""

    gpus: int
    maestro: float
    tuned: float
    conventional: float
    maestro_layout: str
    careful: float = float("nan")


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
        careful = c.careful or c.monolithic
        out.append(
            SweepPoint(
                g,
                c.maestro.gpu_hours_per_million,
                c.monolithic.gpu_hours_per_million,
                conv.gpu_hours_per_million,
                c.maestro.describe(),
                careful.gpu_hours_per_million,
            )
        )
    return out


def plot_sweep(points: Sequence[SweepPoint], title: str, path: str) -> None:
    """Draw the sweep to ``path`` (PNG): Maestro and the three baseline curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from maestro.plan.report import BASELINES

    label = {b.attr: b.label for b in BASELINES}
    g = [p.gpus for p in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    ax.plot(g, [p.maestro for p in points], "o-", label="Maestro")
    ax.plot(g, [p.conventional for p in points], "x:", label=label["conventional"])
    ax.plot(g, [p.careful for p in points], "^-.", label=label["careful"])
    ax.plot(g, [p.tuned for p in points], "s--", label=label["monolithic"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(g, [str(x) for x in g])
    ax.set_xlabel("GPU budget")
    ax.set_ylabel("GPU-hours per million samples")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_CARE, _VS_CARE = "(b') care", "vs (b')"


def format_sweep(points: Sequence[SweepPoint]) -> str:
    """The sweep as a text table: GPU-h/M of Maestro and each baseline, and Maestro's saving
    against each ((b) is the tuned baseline, which contains Maestro's cost-aware balancer)."""
    lines = [
        "GPU-h/M samples of Maestro, conventional (a), careful (b': token-balanced sampler) "
        "and tuned (b, contains Maestro's cost-aware balancer); Maestro's saving vs each",
        f"{'GPUs':>5} {'maestro':>9} {'(a) conv':>9} {_CARE:>10} {'(b) tuned':>10} "
        f"{'vs (a)':>7} {_VS_CARE:>7} {'vs (b)':>7}  maestro layout",
    ]
    for p in points:
        lines.append(
            f"{p.gpus:>5} {p.maestro:>9.2f} {p.conventional:>9.2f} {p.careful:>10.2f} "
            f"{p.tuned:>10.2f} {1 - p.maestro / p.conventional:>+7.1%} "
            f"{1 - p.maestro / p.careful:>+7.1%} {1 - p.maestro / p.tuned:>+7.1%}  "
            f"{p.maestro_layout}"
        )
    return "\n".join(lines)


__all__ = ["SweepPoint", "budget_sweep", "format_sweep", "plot_sweep"]
