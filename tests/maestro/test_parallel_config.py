"""Per-section parallel layout fields: validation (one line naming the field), the rank
arithmetic of ``TrainConfig`` and the schedulers' replica count (no processes)."""

import pytest

from maestro import config as C
from maestro.parallel.mesh import section_layouts

BASE = """
global_batch = 8
steps = 2
[workload]
name = "kd"
heads = 2
[sections.teacher]
micro_batch_size = 4
frozen = true
{teacher}
[sections.student]
micro_batch_size = 2
{student}
"""


def load(teacher="", student=""):
    return C.loads(BASE.format(teacher=teacher, student=student))


def test_layout_ranks_and_scheduler_replicas():
    cfg = load(teacher="tp = 2", student="dp = 2\nfsdp = 2\ntp = 2")
    assert cfg.world_size == 2 + 8
    assert cfg.rank_layout() == {"teacher": [0, 1], "student": list(range(2, 10))}
    specs = {s.name: s for s in cfg.section_specs()}
    assert (specs["teacher"].dp, specs["teacher"].tp) == (1, 2)
    assert (specs["student"].dp, specs["student"].tp) == (4, 2)  # dp x fsdp replicas
    lay = section_layouts(cfg)["student"]
    assert lay.replica_ranks(3) == [8, 9] and lay.dp_peers(3) == [3, 5, 7, 9]
    sc = cfg.sections["student"]
    assert sc.reshard_after_forward is True and sc.zero == 0 and sc.recompute is False


@pytest.mark.parametrize(
    "student, match",
    [
        ("fsdp = 0", r"sections\.student\.fsdp must be an integer >= 1, got 0"),
        ("tp = 1.5", r"sections\.student\.tp must be an integer"),
        ("zero = 2", r"sections\.student\.zero must be 0 or 1, got 2"),
        ("zero = 1\nfsdp = 2", r"sections\.student\.zero = 1 needs fsdp = 1"),
        ("reshard_after_forward = 1", r"sections\.student\.reshard_after_forward must be"),
        ("recompute = 1", r"sections\.student\.recompute must be"),
    ],
)
def test_bad_fields_name_the_field(student, match):
    with pytest.raises(ValueError, match=match):
        load(student=student)


def test_frozen_section_has_no_zero_or_recompute():
    with pytest.raises(ValueError, match=r"sections\.teacher\.zero: a frozen section"):
        load(teacher="zero = 1")
    with pytest.raises(ValueError, match=r"sections\.teacher\.recompute: a frozen section"):
        load(teacher="recompute = true")


def test_world_size_error_names_every_degree_in_one_line():
    cfg = load(teacher="tp = 2", student="fsdp = 2")
    with pytest.raises(ValueError) as e:
        cfg.check_world_size(3)
    msg = str(e.value)
    assert "\n" not in msg
    assert "dp x fsdp x tp is 4" in msg and "world size is 3" in msg
    assert "teacher=dp 1 x fsdp 1 x tp 2" in msg and "student=dp 1 x fsdp 2 x tp 1" in msg
