"""Emulated-device runs: the real runtime on a plan, every compute a wait of the cost model.

``maestro train CONFIG --emulate SCENARIO`` keeps CONFIG's layout (sections' dp, fsdp, tp,
micro-batch sizes, token budgets, scheduler; ``--monolithic`` for the baselines) and swaps its
job for ``maestro.emulate.job``: tiny sections that wait as long as the scenario's GPUs would
take (see that module). So 16 or 32 ranks on a 2-core machine follow what the analytical GPUs
would do, through the runtime's own launcher, scheduler, executor, messages and collectives,
and the measured step can be held against the simulator's prediction of the same plan.

It is an emulation, not a measurement of GPUs: every output says so.
"""

from __future__ import annotations

from maestro.config import TrainConfig

#: what every emulated run prints and records
NOTICE = (
    "EMULATION: no model runs; every compute and transfer is a wait of the {gpu} cost model's "
    "duration for the {scenario} scenario (the launcher, scheduler, executor, messages and "
    "collectives are real)"
)


def emulated_config(
    cfg: TrainConfig,
    scenario: str,
    *,
    monolithic: bool = False,
    world: int | None = None,
    gpu: str = "H100",
    time_scale: float = 1.0,
) -> TrainConfig:
    """``cfg`` with its job replaced by the emulated ``scenario`` on the same layout.

    Args:
        cfg: the run config (e.g. ``maestro plan SCENARIO --out``): its sections, layout,
            global batch, scheduler and seed are kept.
        scenario: ``kd``, ``mllm`` or ``mllm-audio``.
        monolithic: the ``--monolithic`` baseline: ``world`` replicas of the whole model, each
            standing for ``tp`` GPUs priced with the sections' ``tp`` and ``fsdp``.
        world: ranks of the run (``--nproc``; default: the layout's).
        gpu: analytical GPU preset.
        time_scale: multiplies every wait.
    """
    from maestro import config as C
    from maestro.emulate.job import Config, layout_cost_model

    d = cfg.to_dict()
    model = d.pop("workload")
    text_only = model.get("text_only", 0.4) if isinstance(model, dict) else 0.4
    c = Config(
        scenario=scenario,
        gpu=gpu,
        text_only=float(text_only),
        batch_seed=cfg.seed,
        time_scale=time_scale,
        colocated=monolithic,
    )
    c.validate("--emulate")
    cm = layout_cost_model(c, cfg.sections)
    gpn = cm.gpu.gpus_per_node
    layout = cfg.rank_layout()
    n_ranks = world if world is not None else sum(len(r) for r in layout.values())
    for n, sc in cfg.sections.items():
        s = d["sections"][n]
        if sc.frozen:
            continue
        if monolithic:
            seconds = cm.allreduce_time(n, n_ranks, n_ranks <= gpn)
        else:
            ranks = layout[n]
            same = ranks[0] // gpn == ranks[-1] // gpn
            seconds = cm.allreduce_time(n, sc.dp * sc.fsdp, same)
        s["optimizer"] = "maestro.emulate.job:WaitOptimizer"
        s["optimizer_args"] = {"seconds": seconds * time_scale}
    d["cost_profile"] = None  # the scheduler prices with the emulated job's own model
    d["workload"] = {
        "name": "maestro.emulate.job:job",
        "scenario": c.scenario,
        "gpu": c.gpu,
        "text_only": c.text_only,
        "batch_seed": c.batch_seed,
        "time_scale": c.time_scale,
        "colocated": c.colocated,
    }
    d.pop("config_dir", None)
    return C.from_dict(d)


__all__ = ["NOTICE", "emulated_config"]
