"""Section-graph helpers the schedulers, the validator and the simulator share.

Works on ``SectionSpec`` lists only (no torch): checks the specs, orders sections
topologically, and says which sections send gradients back to which.
"""

from __future__ import annotations

from collections.abc import Sequence

from maestro.schedule.types import SectionSpec


def check_sections(sections: Sequence[SectionSpec]) -> dict[str, SectionSpec]:
    """Validate section specs and return them by name.

    Raises:
        ValueError: duplicate name, unknown input, ``dp``/``micro_batch_size`` below 1, a
            non-positive ``token_budget``, or a cycle.
    """
    by_name: dict[str, SectionSpec] = {}
    for sec in sections:
        if sec.name in by_name:
            raise ValueError(f"section {sec.name!r} is listed twice")
        by_name[sec.name] = sec
    for sec in sections:
        for inp in sec.inputs:
            if inp not in by_name:
                raise ValueError(f"section {sec.name!r}: unknown input {inp!r}")
        if sec.dp < 1:
            raise ValueError(f"section {sec.name!r}: dp must be >= 1, got {sec.dp}")
        if sec.micro_batch_size < 1:
            raise ValueError(
                f"section {sec.name!r}: micro_batch_size must be >= 1, got {sec.micro_batch_size}"
            )
        if sec.max_in_flight is not None and sec.max_in_flight < 0:
            raise ValueError(
                f"section {sec.name!r}: max_in_flight must be >= 0, got {sec.max_in_flight}"
            )
        if sec.token_budget is not None and sec.token_budget < 1:
            raise ValueError(
                f"section {sec.name!r}: token_budget must be >= 1, got {sec.token_budget}"
            )
    topo_order(sections)  # raises on a cycle
    return by_name


def topo_order(sections: Sequence[SectionSpec]) -> list[str]:
    """Section names with every producer before its consumers (stable: list order breaks ties).

    Raises:
        ValueError: the inputs form a cycle (the message names the sections on it).
    """
    names = [s.name for s in sections]
    indeg = {s.name: len(set(s.inputs)) for s in sections}
    consumers = consumers_of(sections)
    ready = [n for n in names if indeg[n] == 0]
    out: list[str] = []
    while ready:
        n = ready.pop(0)
        out.append(n)
        for c in consumers.get(n, ()):
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    if len(out) != len(names):
        stuck = sorted(n for n in names if n not in out)
        raise ValueError(f"section inputs form a cycle through {stuck}")
    return out


def consumers_of(sections: Sequence[SectionSpec]) -> dict[str, list[str]]:
    """``producer name -> names of sections that list it as an input`` (every section a key)."""
    out: dict[str, list[str]] = {s.name: [] for s in sections}
    for s in sections:
        for inp in dict.fromkeys(s.inputs):
            out.setdefault(inp, []).append(s.name)
    return out


def grad_consumers(sections: Sequence[SectionSpec]) -> dict[str, list[str]]:
    """``producer -> consumers that send input gradients back to it``.

    Only trainable producers receive gradients, and only from trainable consumers; a frozen
    section is forward-only in both directions.
    """
    by_name = {s.name: s for s in sections}
    cons = consumers_of(sections)
    return {
        p: ([] if by_name[p].frozen else [c for c in cs if not by_name[c].frozen])
        for p, cs in cons.items()
    }


def role(sec: SectionSpec, grad_cons: dict[str, list[str]]) -> str:
    """How the runtime executes a section: ``"forward"``, ``"step"`` or ``"producer"``.

    ``forward``: frozen, forward only. ``step``: trainable with no trainable consumer, runs
    each micro-batch's backward right after its forward. ``producer``: trainable with
    trainable consumers; runs all forwards, then each backward once the gradients of all its
    samples have arrived.
    """
    if sec.frozen:
        return "forward"
    return "producer" if grad_cons.get(sec.name) else "step"
