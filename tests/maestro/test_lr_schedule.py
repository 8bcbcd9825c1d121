"""The learning-rate schedule at every step against its closed form (issue 35).

Linear warmup over ``w`` steps (step ``s < w`` at ``(s + 1) / (w + 1)``), then a cosine or
linear decay from ``lr`` to ``min_lr_ratio * lr`` reached at the last step. The expected
values are written out here, not taken from ``maestro.runtime.local``.
"""

import math

import pytest
import torch

from maestro import config as C
from maestro.runtime.local import set_lr

LR, TOTAL = 0.3, 13


def closed_form(schedule: str, step: int, total: int, warmup: int, floor: float) -> float:
    if step < warmup:
        return LR * (step + 1) / (warmup + 1)
    t = min((step - warmup) / (total - 1 - warmup), 1.0)
    if schedule == "cosine":
        return LR * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))
    if schedule == "linear":
        return LR * (floor + (1 - floor) * (1 - t))
    return LR


def section(schedule: str, warmup: int, floor: float) -> C.SectionConfig:
    sc = C.SectionConfig(lr=LR, lr_schedule=schedule, warmup_steps=warmup, min_lr_ratio=floor)
    sc.validate("sections.s")
    return sc


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("warmup,floor", [(0, 0.25), (3, 0.25), (2, 0.0), (1, 1.0)])
def test_every_optimizer_group_follows_the_closed_form_at_every_step(schedule, warmup, floor):
    sc = section(schedule, warmup, floor)
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 5.0}], lr=1.0)
    got = []
    for step in range(TOTAL):
        set_lr(opt, sc, step, TOTAL)
        lrs = {g["lr"] for g in opt.param_groups}
        assert len(lrs) == 1, lrs  # every group at the section's LR
        got.append(lrs.pop())
    want = [closed_form(schedule, s, TOTAL, warmup, floor) for s in range(TOTAL)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    # the shape a user reads off the config: the peak right after warmup, the floor at the
    # last step, and in between a strict decay (not a curve that sits at the floor)
    assert got[warmup] == pytest.approx(LR) and got[-1] == pytest.approx(floor * LR)
    decay = got[warmup:]
    if floor < 1:
        assert all(x > y for x, y in zip(decay, decay[1:])), decay
        mid = (warmup + TOTAL - 1) / 2
        if mid == int(mid):  # halfway through a cosine or linear decay: halfway to the floor
            assert got[int(mid)] == pytest.approx(LR * (1 + floor) / 2)
    # past the schedule's end (a resume under more steps) the LR stays at the floor
    set_lr(opt, sc, TOTAL + 4, TOTAL)
    assert opt.param_groups[0]["lr"] == pytest.approx(floor * LR)


def test_warmup_then_constant():
    sc = section("constant", 4, 0.5)  # the floor does not apply to a constant schedule
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    got = []
    for step in range(TOTAL):
        set_lr(opt, sc, step, TOTAL)
        got.append(opt.param_groups[0]["lr"])
    assert got == pytest.approx([LR * (s + 1) / 5 for s in range(4)] + [LR] * (TOTAL - 4))


def test_the_logged_lr_follows_the_schedule_of_the_run_it_resumed():
    """``metrics.jsonl``'s ``lr/<section>`` is the LR of that step, over the schedule's own
    total (a resume under other ``steps`` keeps the total it started with)."""
    from maestro.runtime.launch import _step_row

    text = """
global_batch = 4
steps = 30
[workload]
name = "kd"
vocab_size = 32
seq_len_min = 4
seq_len_max = 8
teacher_dim = 8
teacher_layers = 1
student_dim = 8
student_layers = 1
heads = 2
[sections.teacher]
frozen = true
[sections.student]
lr = 0.3
lr_schedule = "cosine"
warmup_steps = 2
min_lr_ratio = 0.1
"""
    cfg = C.loads(text)
    world = 2
    stats = torch.zeros(1 + 3 * world + 1)
    for step in (0, 1, 2, 7, 12):
        row = _step_row(cfg, step, stats, ["teacher", "student"], {"student"}, 0.0, [0.0], 13)
        assert row["lr/student"] == pytest.approx(closed_form("cosine", step, 13, 2, 0.1))
        assert "lr/teacher" not in row  # frozen: no optimizer
