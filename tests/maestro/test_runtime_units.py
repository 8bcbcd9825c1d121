"""Runtime pieces without processes: wire format, schedule checks, the reference step."""

import pytest
import torch

from maestro import config as C
from maestro.runtime.executor import check_schedule
from maestro.runtime.local import compound_loss, reference_train
from maestro.runtime.wire import message_tags, pack, unpack
from maestro.schedule.fifo import fifo_schedule
from maestro.schedule.types import MicroBatch, SampleInfo, Schedule, SectionSpec
from maestro.workloads import get_workload


def test_pack_unpack_roundtrip_variable_shapes_and_dtypes():
    items = [
        (7, {"logits": torch.randn(5, 3, dtype=torch.float64)}),
        (2, {"top_values": torch.randn(3, 2), "top_indices": torch.randint(0, 9, (3, 2))}),
        (4, {"h": torch.randn(1, 2, 3).transpose(0, 2)}),  # non-contiguous, odd byte count
        (9, {"x": torch.randn(3, dtype=torch.float16), "y": torch.randn(0, 4)}),
    ]
    header, payload = pack(items)
    assert header.dtype == torch.int64 and payload.dtype == torch.uint8
    # no padding between samples beyond 8-byte alignment
    raw = sum(t.numel() * t.element_size() for _, d in items for t in d.values())
    assert raw <= payload.numel() < raw + 8 * 6
    back = unpack(header, payload)
    assert [sid for sid, _ in back] == [7, 2, 4, 9]
    for (_, want), (_, got) in zip(items, back):
        assert set(want) == set(got)
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])


def test_message_tags_differ_per_step_and_direction():
    tags = [t for s in range(4) for t in message_tags(s)]
    assert len(set(tags)) == len(tags)


def specs():
    return [
        SectionSpec("vision", dp=1, micro_batch_size=2),
        SectionSpec("llm", inputs=("vision",), dp=2, micro_batch_size=2),
    ]


def infos():
    return [SampleInfo(i, frozenset({"llm"} | ({"vision"} if i % 2 else set()))) for i in range(6)]


def test_check_schedule_accepts_fifo_and_rejects_bad_schedules():
    sched = fifo_schedule(infos(), specs())
    check_schedule(sched, infos(), specs())
    assert sched.samples_of("vision") == {1, 3, 5}
    dup = Schedule(
        {
            "vision": [[MicroBatch((1, 3, 5))]],
            "llm": [[MicroBatch((0, 1, 2))], [MicroBatch((2, 3, 4, 5))]],
        }
    )
    with pytest.raises(ValueError, match="'llm' must process each of its 6"):
        check_schedule(dup, infos(), specs())
    missing = Schedule({"vision": [[MicroBatch((1, 3))]], "llm": sched.order["llm"]})
    with pytest.raises(ValueError, match="'vision' must process"):
        check_schedule(missing, infos(), specs())
    extra = Schedule({"vision": [[MicroBatch((0, 1, 3, 5))]], "llm": sched.order["llm"]})
    with pytest.raises(ValueError, match="'vision' must process"):
        check_schedule(extra, infos(), specs())
    wrong_dp = Schedule({"vision": sched.order["vision"], "llm": sched.order["llm"][:1]})
    with pytest.raises(ValueError, match="'llm' needs 2 replica lists, got 1"):
        check_schedule(wrong_dp, infos(), specs())


KD = """
global_batch = 6
steps = 2
dtype = "float64"
[workload]
name = "kd"
vocab_size = 24
seq_len_min = 4
seq_len_max = 10
teacher_dim = 8
teacher_layers = 1
student_dim = 4
student_layers = 1
heads = 2
[sections.teacher]
frozen = true
[sections.student]
optimizer = "sgd"
lr = 0.5
"""


def test_reference_step_is_sgd_on_the_normalised_compound_loss():
    cfg = C.loads(KD.replace("steps = 2", "steps = 1"))
    wl = get_workload(cfg)
    g0 = wl.graph()
    batch = wl.batch(0)
    loss = compound_loss(g0, batch) / wl.normaliser(batch)
    loss.backward()
    want = {k: p.detach() - 0.5 * p.grad for k, p in g0["student"].module.named_parameters()}
    g1, losses = reference_train(cfg)
    assert losses == pytest.approx([loss.item()], rel=1e-12)
    for k, p in g1["student"].module.named_parameters():
        torch.testing.assert_close(p.detach(), want[k], rtol=1e-12, atol=1e-12)
    # the frozen teacher never moves
    t0, t1 = g0["teacher"].module.state_dict(), g1["teacher"].module.state_dict()
    assert all(torch.equal(t0[k], t1[k]) for k in t0)


def test_reference_training_lowers_the_loss():
    cfg = C.loads(
        KD.replace("steps = 2", "steps = 25").replace("global_batch = 6", "global_batch = 4")
    )
    _, losses = reference_train(cfg)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.1


def _allreduce_rank(rank: int, path: str, out: str) -> None:
    import torch.distributed as dist

    from maestro.runtime.executor import flat_allreduce_grads

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        a, b, c = (torch.nn.Parameter(torch.ones(n, dtype=torch.float64)) for n in (2, 3, 1))
        # a: a gradient on rank 0 only (an encoder that saw an image on one replica);
        # b: on no rank (no image anywhere); c: on both (summed)
        if rank == 0:
            a.grad = torch.tensor([1.0, 2.0], dtype=torch.float64)
        c.grad = torch.tensor([5.0 + rank], dtype=torch.float64)
        flat_allreduce_grads([a, b, c])
        torch.save({"a": a.grad, "b": b.grad, "c": c.grad}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_flat_allreduce_keeps_missing_gradients_missing(tmp_path):
    """Two gloo processes: a gradient missing on one replica counts as zeros (it is not
    dropped, and the replica that lacked it now holds the sum), a gradient missing on every
    replica stays ``None`` (AdamW then leaves the parameter and its moments alone)."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "grads")
    mp.start_processes(
        _allreduce_rank, args=(str(tmp_path / "pg"), out), nprocs=2, start_method="spawn"
    )
    for rank in (0, 1):
        g = torch.load(f"{out}.{rank}")
        assert torch.equal(g["a"], torch.tensor([1.0, 2.0], dtype=torch.float64)), rank
        assert g["b"] is None, rank
        assert torch.equal(g["c"], torch.tensor([11.0], dtype=torch.float64)), rank


def test_summary_table_fills_dp_and_mbs_of_colocated_groups():
    """A colocated group's row (``"a+b"``) lists its members' own dp and micro-batch size."""
    from maestro.runtime.launch import summary_table

    layout = {"vision": {"dp": 2, "micro_batch_size": 3}, "llm": {"dp": 1, "micro_batch_size": 2}}
    layout["audio"] = {"dp": 12, "micro_batch_size": 16}
    result = {
        "mode": "maestro",
        "workload": "mllm",
        "world_size": 14,
        "samples_per_s": 1.0,
        "measured_steps": 2,
        "losses": [1.0],
        "busy": {"vision+llm": 0.5, "audio": 0.25},
        "seconds": {"vision+llm": {"forward": 0.1}},
        "layout": layout,
    }
    lines = summary_table(result).splitlines()
    assert lines[1].split()[:4] == ["section", "dp", "mbs", "busy"]
    assert lines[2].split()[:5] == ["vision+llm", "2,1", "3,2", "50%", "0.100"]
    assert lines[3].split()[:4] == ["audio", "12", "16", "25%"]
    assert len({len(line) for line in lines[1:]}) == 1  # the columns line up
