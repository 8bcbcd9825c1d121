"""A user's own transformer under Maestro's strategies: its blocks declared (or found), its TP
plan given, FSDP per block, recompute; exact in float64 against a plain loop written here.

The job below is what a user writes from scratch: their own ``MyBlock`` (q/k/v/o projections,
an MLP, the head count inferred from the projection width so a column split just works) in a
``ModuleList``, a frozen teacher and a student trained on cross-entropy plus a KL term to the
teacher's logits. ``maestro.Parallelism`` names the blocks and the TP plan; the teacher's
blocks are found by default (the ``ModuleList`` of identical blocks).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

from maestro import config as C
from maestro.runtime.launch import RunOptions, launch

JOB = textwrap.dedent(
    """
    import json
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from maestro import Job, Parallelism, Section


    class MyBlock(nn.Module):
        def __init__(self, dim, n_heads):
            super().__init__()
            self.n_heads, self.head_dim = n_heads, dim // n_heads
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.q, self.k = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.v, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

        def forward(self, x):                                   # (T, D)
            t = x.shape[0]
            h = self.norm1(x)
            # (H, T, hd): -1 heads, so a column-split projection gives this rank's heads
            q, k, v = (p(h).view(t, -1, self.head_dim).transpose(0, 1)
                       for p in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(0, 1).reshape(t, -1))
            return x + self.down(F.gelu(self.up(self.norm2(x))))


    class MyLM(nn.Module):
        def __init__(self, vocab, dim, layers, n_heads):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(MyBlock(dim, n_heads) for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

        def forward(self, ids):                                 # (T,) -> (T, V)
            x = self.emb(ids)
            for blk in self.layers:
                x = blk(x)
            return self.head(self.norm(x))


    PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


    EXPECT = {}


    def check(name, module):
        # the strategies the layout asks for really wrap the user's blocks
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        for blk in module.layers:
            for what in EXPECT.get(name, ()):
                ok = {"fsdp": isinstance(blk, FSDPModule),
                      "tp": isinstance(blk.q.weight, DTensor),
                      "recompute": hasattr(blk.forward, "__wrapped__")}[what]
                assert ok, f"{name}: {what} not applied to {type(blk).__name__}"


    def teach(module, samples, inputs):
        check("teacher", module)
        return [{"logits": module(s["input_ids"][:-1])} for s in samples]


    def learn(module, samples, inputs):
        check("student", module)
        outs = []
        for s, t in zip(samples, inputs["teacher"]):
            logits = module(s["input_ids"][:-1])
            ce = F.cross_entropy(logits, s["input_ids"][1:], reduction="sum")
            kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t["logits"], -1),
                          log_target=True, reduction="sum")
            outs.append({"loss": ce + 0.5 * kl})
        return outs


    def job(config):
        w = config.model
        EXPECT.update(w["expect"])
        records = [json.loads(line) for line in open(w["data"])]
        if w["declare"] == "classes":
            spec = Parallelism(blocks=[MyBlock], tp_plan=PLAN, tp_divides=["n_heads"])
        else:  # a function listing the blocks
            spec = Parallelism(blocks=lambda m: list(m.layers))
        return Job(
            [
                Section("teacher", lambda: MyLM(w["vocab"], 8, 2, 2), frozen=True,
                        forward=teach),
                Section("student", lambda: MyLM(w["vocab"], 8, 2, 2), inputs=["teacher"],
                        forward=learn, parallel=spec),
            ],
            dataset=records,
        )
    """
)


def write_job(tmp_path, teacher: str, student: str, declare: str, expect: str, vocab=16):
    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "train.jsonl", "w") as f:
        for _ in range(24):
            length = int(torch.randint(3, 10, (1,), generator=g))
            f.write(json.dumps({"input_ids": torch.randint(0, vocab, (length,)).tolist()}) + "\n")
    (tmp_path / "userblocks.py").write_text(JOB)
    path = tmp_path / "run.toml"
    path.write_text(
        f"""
global_batch = 8
steps = 3
seed = 5
dtype = "float64"
[workload]
name = "userblocks:job"
data = "{tmp_path / "train.jsonl"}"
vocab = {vocab}
declare = "{declare}"
expect = {expect}
[sections.teacher]
micro_batch_size = 4
{teacher}
[sections.student]
micro_batch_size = 2
optimizer = "AdamW"
lr = 0.01
{student}
"""
    )
    return path


def plain_loop(cfg, steps=3):
    """The same distillation in one process, whole global batches, written by hand."""
    import torch.nn.functional as F

    job = cfg.job()
    teacher, student = job.build_module("teacher"), job.build_module("student")
    opt = torch.optim.AdamW(student.parameters(), lr=0.01, weight_decay=0.0, foreach=False)
    losses = []
    for step in range(steps):
        total, targets = 0.0, 0
        for s in job.batch(step):
            ids = s["input_ids"]
            with torch.no_grad():
                t = teacher(ids[:-1])
            lg = student(ids[:-1])
            ce = F.cross_entropy(lg, ids[1:], reduction="sum")
            kl = F.kl_div(
                F.log_softmax(lg, -1), F.log_softmax(t, -1), log_target=True, reduction="sum"
            )
            total = total + ce + 0.5 * kl
            targets += ids.numel() - 1
        loss = total / targets
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, student.state_dict()


LAYOUTS = {
    # teacher: FSDP over its default-found blocks; student: a user TP plan and recompute
    "teacher-fsdp2_student-tp2-recompute": (
        "fsdp = 2",
        "tp = 2\nrecompute = true",
        "classes",
        '{ teacher = ["fsdp"], student = ["tp", "recompute"] }',
    ),
    # student: FSDP per block (blocks listed by a function) and recompute, on two replicas
    "student-fsdp2-dp2-recompute": (
        "",
        "fsdp = 2\ndp = 2\nrecompute = true",
        "function",
        '{ student = ["fsdp", "recompute"] }',
    ),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_user_transformer_matches_a_plain_loop(tmp_path, name):
    cfg = C.load(write_job(tmp_path, *LAYOUTS[name]))
    want, weights = plain_loop(cfg)
    res = launch(cfg, opts=RunOptions(progress=False, save_dir=str(tmp_path / "out")))
    for a, b in zip(res["losses"], want, strict=True):
        assert abs(a - b) <= 1e-10 * abs(b), (res["losses"], want)
    saved = torch.load(tmp_path / "out" / "student.pt")
    # the student's weights as a whole (Adam's step on a near-zero gradient turns its
    # rounding into a 1e-12 difference of one element: relative to the weights, ~1e-13)
    num = sum(((saved[k] - v) ** 2).sum() for k, v in weights.items())
    den = sum((v**2).sum() for v in weights.values())
    assert float((num / den).sqrt()) <= 1e-10


# -- the declaration itself, no processes ------------------------------------------------------


class Blk(nn.Module):
    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.n_heads = heads
        self.q, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.act = nn.GELU()


class Net(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(Blk() for _ in range(layers))
        self.head = nn.Linear(8, 10)


def test_default_blocks_are_a_modulelist_of_identical_blocks():
    from maestro.parallel.spec import find_blocks

    net = Net()
    assert find_blocks(net) == list(net.layers)
    # a ModuleList of bare Linears is not a stack of blocks
    flat = nn.Sequential(nn.ModuleList(nn.Linear(2, 2) for _ in range(3)))
    assert find_blocks(flat) == []
    # mixed classes are not one stack either
    mixed = nn.Sequential(nn.ModuleList([Blk(), nn.Sequential(nn.Linear(2, 2))]))
    assert find_blocks(mixed) == []


def test_hf_no_split_modules_name_the_blocks():
    from maestro.parallel.spec import find_blocks

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    class Model(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.a, self.b = Layer(), Layer()  # not in a ModuleList: found by name

    m = Model()
    assert find_blocks(m) == [m.a, m.b]


def test_declared_blocks_by_class_name_and_function():
    from maestro import Parallelism
    from maestro.parallel.spec import find_blocks

    net = Net()
    assert find_blocks(net, Parallelism(blocks="Blk")) == list(net.layers)
    assert find_blocks(net, Parallelism(blocks=lambda m: [m.layers[0]])) == [net.layers[0]]
    with pytest.raises(ValueError, match=r"sections.s: Parallelism.blocks: no submodule of class"):
        find_blocks(net, Parallelism(blocks=["Nope"]), "sections.s")
    with pytest.raises(ValueError, match="not a submodule"):
        find_blocks(net, Parallelism(blocks=lambda m: [nn.Linear(1, 1)]), "sections.s")
    with pytest.raises(ValueError, match="returned no block"):
        find_blocks(net, Parallelism(blocks=lambda m: []), "sections.s")


def test_user_plan_errors_name_the_class():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from maestro import Parallelism
    from maestro.parallel.spec import check_user_plan
    from maestro.parallel.tp import tp_refusal

    net = Net()
    blocks = list(net.layers)
    ok = Parallelism(tp_plan={"q": ColwiseParallel(), "o": RowwiseParallel()}, tp_divides="n_heads")
    assert tp_refusal(blocks, "sections.s", ok) is None
    assert "no tensor-parallel plan for Blk" in tp_refusal(blocks, "sections.s")
    missing = Parallelism(tp_plan={"attn.q": ColwiseParallel()})
    assert tp_refusal(blocks, "sections.s", missing) == (
        "sections.s.tp: Blk has no submodule 'attn.q' (Parallelism.tp_plan)"
    )
    not_linear = Parallelism(tp_plan={"act": ColwiseParallel()})
    assert "Blk.act is a GELU" in tp_refusal(blocks, "sections.s", not_linear)
    with pytest.raises(ValueError, match=r"sections.s.tp=3 must divide Blk.q.out_features=8"):
        check_user_plan(blocks[0], ok.tp_plan, ok, 3, "sections.s")
    heads = Parallelism(tp_plan={"q": ColwiseParallel()}, tp_divides=["n_heads"])
    blocks[0].n_heads = 3
    with pytest.raises(ValueError, match=r"sections.s.tp=2 must divide Blk.n_heads=3"):
        check_user_plan(blocks[0], heads.tp_plan, heads, 2, "sections.s")
    with pytest.raises(ValueError, match="no integer attribute 'nope'"):
        check_user_plan(blocks[0], {}, Parallelism(tp_divides=["nope"]), 2, "sections.s")
    # a parallelize function is never refused ahead
    assert tp_refusal([], "s", Parallelism(parallelize=lambda m, mesh, lay: None)) is None


def test_bad_declarations_are_one_line_errors():
    from maestro import Parallelism, Section

    with pytest.raises(ValueError, match="Parallelism\\(blocks=...\\)"):
        Parallelism(blocks=[1, 2])
    with pytest.raises(ValueError, match="tp_plan or parallelize, not both"):
        Parallelism(tp_plan={}, parallelize=lambda m, mesh, lay: None)
    with pytest.raises(ValueError, match="parallel must be a maestro.Parallelism"):
        Section("s", nn.Linear(2, 2), parallel={"blocks": []})


def test_planner_sees_the_declared_plan():
    """The planner's facts of a section come from the same declaration: its TP divisor is the
    gcd of the split widths and the declared attributes, and it may split it at all."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from maestro import Parallelism
    from maestro.parallel.apply import module_tp_refusal
    from maestro.parallel.spec import plan_divisor

    net = Net()
    spec = Parallelism(
        tp_plan={"q": ColwiseParallel(), "o": RowwiseParallel()}, tp_divides="n_heads"
    )
    assert plan_divisor(net.layers[0], spec) == 2  # gcd(8, 8, heads 2)
    assert module_tp_refusal(net, "sections.s", spec) is None
    assert "no tensor-parallel plan" in module_tp_refusal(net, "sections.s")


@pytest.mark.dist
def test_fsdp_producer_root_gives_no_view_warning(tmp_path, capfd):
    """A trainable FSDP producer returns per-sample slices (views) from its root: FSDP2's
    in-place warning does not apply there (the executor never writes them) and is not shown."""
    from dist_cases import MLLM

    text = MLLM.format(
        dtype="float32",
        scheduler="wavefront",
        mix="{ text = 0.4, image = 0.6 }",
        audio="",
        llm_dp=1,
    ).replace("[sections.vision]\ndp = 1", "[sections.vision]\nfsdp = 2")
    path = tmp_path / "run.toml"
    path.write_text(text.replace("steps = 3", "steps = 1"))
    res = launch(C.load(path), opts=RunOptions(progress=False))
    assert len(res["losses"]) == 1
    assert "returned a view tensor" not in capfd.readouterr().err
