"""Timing of compute and transfers per rank: busy fractions and a Chrome/Perfetto trace."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

#: event categories that count as busy (the rest is waiting or communication)
COMPUTE = ("forward", "backward", "optimizer")


class Tracer:
    """Records ``(name, category, start, duration)`` events of one rank.

    Args:
        rank: the rank (the trace's thread id).
        label: what the rank runs (e.g. ``"student[1]"``), the trace's thread name.
        keep_events: store events for a trace file (busy time is always accumulated).
    """

    def __init__(self, rank: int, label: str, keep_events: bool = False) -> None:
        self.rank, self.label, self.keep = rank, label, keep_events
        self.events: list[dict] = []
        self.busy = 0.0
        self.totals: dict[str, float] = {}  # seconds per category

    @contextmanager
    def span(self, name: str, cat: str, **args):
        """Time the body as one event; compute categories add to ``busy``.

        Yields the event's ``args`` dict, so the body can add what it learns (e.g. bytes sent).
        """
        t0 = time.time()
        try:
            yield args
        finally:
            dur = time.time() - t0
            if cat in COMPUTE:
                self.busy += dur
            self.totals[cat] = self.totals.get(cat, 0.0) + dur
            if self.keep:
                self.events.append(
                    {
                        "name": name,
                        "cat": cat,
                        "ph": "X",
                        "ts": t0 * 1e6,
                        "dur": dur * 1e6,
                        "pid": 0,
                        "tid": self.rank,
                        "args": args,
                    }
                )


def write_chrome_trace(path: str | Path, per_rank: list[tuple[int, str, list[dict]]]) -> None:
    """Write ``[(rank, label, events)]`` as a Chrome trace (open in ui.perfetto.dev)."""
    events: list[dict] = []
    t0 = min((e["ts"] for _, _, evs in per_rank for e in evs), default=0.0)
    for rank, label, evs in per_rank:
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"rank {rank}: {label}"},
            }
        )
        for e in evs:
            events.append({**e, "ts": e["ts"] - t0})
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
