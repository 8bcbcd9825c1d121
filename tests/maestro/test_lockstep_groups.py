"""The runtime's FSDP lockstep groups are the simulator's, and ``--monolithic`` predictions
replay the plain replicas that run (no processes)."""

from dataclasses import replace

import pytest

from maestro import config as C
from maestro.emulate import emulated_config
from maestro.emulate.predict import _Replicas, predict
from maestro.parallel.mesh import SectionLayout
from maestro.plan.steady import steady_state
from maestro.runtime.colocated import lockstep_groups
from maestro.schedule.monolithic import balanced_order, monolithic_schedule
from maestro.schedule.timeline import lockstep_degree, shard_groups

KD = """
global_batch = 16
steps = 3
scheduler = "wavefront"
monolithic_micro_batch_size = 4
monolithic_order = "balanced"
[workload]
name = "maestro.emulate.job:job"
scenario = "kd"
time_scale = 0.1
[sections.teacher]
dp = {tdp}
tp = {ttp}
micro_batch_size = 4
frozen = true
{group}
[sections.student]
dp = {sdp}
fsdp = {sfsdp}
micro_batch_size = 2
{group}
"""


def _cfg(tdp=1, ttp=1, sdp=2, sfsdp=2, group=""):
    return C.loads(KD.format(tdp=tdp, ttp=ttp, sdp=sdp, sfsdp=sfsdp, group=group))


@pytest.mark.parametrize(("dp", "fsdp", "tp"), [(2, 2, 1), (3, 2, 2), (1, 4, 1), (4, 1, 2)])
def test_shard_groups_are_the_mesh_rows_and_the_simulators(dp, fsdp, tp):
    lay = SectionLayout("s", tuple(range(10, 10 + dp * fsdp * tp)), dp, fsdp, tp)
    k = fsdp if fsdp > 1 else 0  # LayoutCostModel.lockstep
    assert lay.shard_groups() == shard_groups(lay.num_replicas, k)
    for rank in lay.ranks:
        d, f, _ = lay.coordinate(rank)
        rep = lay.replica_of(rank)
        # the replicas of rank's FSDP mesh row (same dp index), rank's own among them
        assert rep in lay.shard_group(rep) and len(lay.shard_group(rep)) == fsdp
        assert all(r // fsdp == d for r in lay.shard_group(rep)) and rep % fsdp == f


def test_the_emulated_layout_model_locksteps_by_fsdp():
    cm = _cfg().job().cost_model
    assert lockstep_degree(cm, "student") == 2 and lockstep_degree(cm, "teacher") == 0
    assert _Replicas(cm).lockstep("student") == 0
    assert _Replicas(cm).forward_time is not None  # everything else is the model's


def test_colocated_lockstep_groups():
    g = 'group = "kd"'
    # student dp 2 x fsdp 2 on 4 group replicas: its two mesh rows
    assert lockstep_groups(_cfg(tdp=4, group=g), "teacher+student") == [[0, 1], [2, 3]]
    # no FSDP member: every replica on its own
    assert lockstep_groups(_cfg(tdp=4, sdp=4, sfsdp=1, group=g), "teacher+student") == [
        [0],
        [1],
        [2],
        [3],
    ]
    # T = 2 (teacher tp 2): a student row is one group replica, but the planner syncs
    # fsdp = 2 consecutive group replicas (GroupedCostModel.lockstep): the runtime follows
    c = _cfg(tdp=2, ttp=2, group=g)
    assert c.group_tp("teacher+student") == 2
    assert lockstep_groups(c, "teacher+student") == [[0, 1]]


def test_monolithic_prediction_replays_plain_replicas():
    """``--monolithic`` runs no FSDP: its prediction has no lockstep padding, unlike a
    replay under the sections' fsdp."""
    world = 2
    cfg = emulated_config(_cfg(sdp=1), "kd", monolithic=True, world=world, time_scale=0.25)
    pred = predict(cfg, monolithic=True, world=world, steps=2)
    job = cfg.job()
    infos = job.sample_infos(job.batch(0), job.graph(build=[]))
    specs = [replace(s, dp=world, tp=1) for s in cfg.section_specs()]

    def replay(cm):
        ordered = balanced_order(
            infos,
            world,
            cm,
            [(s.name, s.frozen) for s in specs],
            cfg.monolithic_micro_batch_size,  # the balancer prices the ranks' micro-batches
        )
        sched = monolithic_schedule(
            ordered, specs, world_size=world, micro_batch_size=cfg.monolithic_micro_batch_size
        )
        return steady_state(sched, ordered, specs, cm, steps=2).step_ends[-1] / 2

    assert pred.window == pytest.approx(replay(_Replicas(job.cost_model)), rel=1e-12)
    assert lockstep_degree(job.cost_model, "student") == 2
    assert replay(job.cost_model) != pytest.approx(pred.window, rel=1e-6)
