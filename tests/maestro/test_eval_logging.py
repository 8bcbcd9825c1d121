"""``[eval]`` and ``--log-dir`` of ``maestro train`` (issue 31 item 5), on real processes.

A user job (a frozen "tagger" feeding a trainable sink that returns ``loss`` and an extra
``ce`` per sample; the sink's blocks hold a child whose output depends on its training flag)
reads ``maestro.data.JsonlDataset`` files; ``[eval] data`` names a held-out file of 7 records
(global batch 4: a full batch and a partial one). The eval figures must equal a no-grad
forward of the same modules written here by hand in one process (``model.eval()``), with the
weights of the plain training loop at that step; a run with ``[eval]`` must train exactly like
one without; the logs must parse with TensorBoard's own reader.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from maestro import config as C
from maestro.runtime.launch import RunOptions, launch

JOB = textwrap.dedent(
    """
    from pathlib import Path
    import torch
    from torch import nn
    from maestro import Job, Section
    from maestro.data import JsonlDataset


    class Tagger(nn.Module):
        def __init__(self, vocab, dim):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)

        def forward(self, ids):
            return self.emb(ids)


    class Damp(nn.Module):
        # Dropout's expectation made deterministic: halves in training, passes in eval (a
        # child's flag that eval must set and restore, with no randomness to compare)

        def forward(self, x):
            return 0.5 * x if self.training else x


    class Learner(nn.Module):
        def __init__(self, vocab, dim):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(
                [nn.Sequential(nn.Linear(2 * dim, 2 * dim), Damp()) for _ in range(2)]
            )
            self.out = nn.Linear(2 * dim, vocab)

        def forward(self, ids, hint):
            h = torch.cat([self.emb(ids), hint], -1)
            for b in self.blocks:
                h = torch.tanh(b(h))
            return self.out(h)


    def tag(module, samples, inputs):
        return [{"hint": module(s["input_ids"])} for s in samples]


    def per_sample(module, ids, hint):
        logits = module(ids[:-1], hint[:-1])
        ce = nn.functional.cross_entropy(logits, ids[1:], reduction="sum")
        return ce + 0.01 * (logits**2).sum(), ce


    def learn(module, samples, inputs):
        outs = []
        for s, t in zip(samples, inputs["tagger"]):
            loss, ce = per_sample(module, s["input_ids"], t["hint"])
            outs.append({"loss": loss, "ce": ce})
        return outs


    def job(config):
        w = config.model
        return Job(
            [
                Section("tagger", lambda: Tagger(w["vocab"], w["dim"]), frozen=True, forward=tag),
                Section("learner", lambda: Learner(w["vocab"], w["dim"]), inputs=["tagger"],
                        forward=learn),
            ],
            dataset=JsonlDataset(Path(config.config_dir) / w["data"]),
        )
    """
)

STEPS, EVERY, VOCAB = 3, 2, 16


def _records(path, n, seed):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = int(torch.randint(3, 9, (1,), generator=g))
            ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids}) + "\n")


def write_run(tmp_path, eval_table: str | None, learner: str = "dp = 2") -> C.TrainConfig:
    _records(tmp_path / "train.jsonl", 16, 0)
    _records(tmp_path / "heldout.jsonl", 7, 1)
    (tmp_path / "evaljob.py").write_text(JOB)
    toml = f"""
global_batch = 4
steps = {STEPS}
seed = 3
dtype = "float64"
scheduler = "fifo"
{eval_table or ""}
[workload]
name = "evaljob:job"
data = "train.jsonl"
vocab = {VOCAB}
dim = 4
[sections.tagger]
dp = 1
micro_batch_size = 4
[sections.learner]
{learner}
micro_batch_size = 2
optimizer = "Adam"
lr = 0.01
"""
    path = tmp_path / "run.toml"
    path.write_text(toml)
    return C.load(path)


EVAL = f'[eval]\ndata = "heldout.jsonl"\nevery = {EVERY}'


def plain_loop(cfg):
    """One process, no Maestro: the training losses and, after every ``EVERY`` steps and the
    last, the eval figures of a no-grad forward over the held-out file."""
    import evaljob  # on sys.path once the config loaded

    job = cfg.job()
    tagger, learner = job.build_module("tagger"), job.build_module("learner")
    opt = torch.optim.Adam(learner.parameters(), lr=0.01)
    held = [json.loads(line) for line in open(cfg.config_dir + "/heldout.jsonl")]
    losses, evals = [], {}
    for step in range(STEPS):
        total, targets = 0.0, 0
        for s in job.batch(step):
            ids = s["input_ids"]
            with torch.no_grad():
                hint = tagger(ids)
            total = total + evaljob.per_sample(learner, ids, hint)[0]
            targets += ids.numel() - 1
        loss = total / targets
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if (step + 1) % EVERY == 0 or step + 1 == STEPS:
            tot, ce, norm = 0.0, 0.0, 0
            learner.eval()  # every submodule (the Damp children) in eval mode
            with torch.no_grad():
                for r in held:
                    ids = torch.tensor(r["input_ids"])
                    lo, c = evaljob.per_sample(learner, ids, tagger(ids))
                    tot, ce, norm = tot + lo.item(), ce + c.item(), norm + ids.numel() - 1
            learner.train()
            evals[step + 1] = (tot / norm, ce / norm)
    return losses, evals, learner.state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run with ``[eval]`` and logs, one without, and the plain loop."""
    d1, d2 = tmp_path_factory.mktemp("with_eval"), tmp_path_factory.mktemp("without")
    cfg = write_run(d1, EVAL)
    logs = d1 / "logs"
    with_eval = launch(
        cfg, opts=RunOptions(progress=False, save_dir=str(d1 / "w"), log_dir=str(logs))
    )
    without = launch(write_run(d2, None), opts=RunOptions(progress=False, save_dir=str(d2 / "w")))
    return {
        "cfg": cfg,
        "with": with_eval,
        "without": without,
        "plain": plain_loop(cfg),
        "logs": logs,
        "dirs": (d1, d2),
    }


@pytest.mark.dist
def test_eval_loss_equals_a_hand_written_no_grad_forward(runs):
    _, want, _ = runs["plain"]
    got = runs["with"]["eval"]
    assert [r["step"] for r in got] == [2, 3]
    for r in got:
        loss, ce = want[r["step"]]
        assert abs(r["eval/loss"] - loss) <= 1e-10 * abs(loss), (r, want)
        assert abs(r["eval/ce"] - ce) <= 1e-10 * abs(ce), (r, want)
        assert r["eval/loss/learner"] == r["eval/loss"]
        assert r["eval/samples"] == 7  # a full batch of 4 and a partial one of 3


@pytest.mark.dist
def test_eval_does_not_change_training(runs):
    plain_losses, _, weights = runs["plain"]
    a, b = runs["with"]["losses"], runs["without"]["losses"]
    assert a == b  # bit for bit
    for x, y in zip(a, plain_losses):
        assert abs(x - y) <= 1e-10 * abs(y)
    d1, d2 = runs["dirs"]
    wa, wb = torch.load(d1 / "w" / "learner.pt"), torch.load(d2 / "w" / "learner.pt")
    for k, v in wa.items():
        assert torch.equal(v, wb[k]), k
        torch.testing.assert_close(v, weights[k], rtol=1e-10, atol=1e-12)
    assert runs["without"]["eval"] == []


@pytest.mark.dist
def test_logs_parse_with_tensorboard_and_jsonl(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = runs["logs"]
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    ev = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in train] == list(range(STEPS))
    assert [r["step"] for r in ev] == [2, 3]
    train_keys = {
        "step",
        "loss",
        "loss/learner",
        "lr/learner",
        "samples_per_s",
        "busy/tagger",
        "busy/learner",
        "peak_mem_bytes/tagger",
        "peak_mem_bytes/learner",
        "skipped",
    }
    for r in train:
        assert set(r) == train_keys, set(r) ^ train_keys
        assert r["peak_mem_bytes/learner"] > 0 and r["samples_per_s"] > 0
        assert r["lr/learner"] == 0.01 and r["skipped"] == 0
    assert [r["loss"] for r in train] == runs["with"]["losses"]
    assert [r["loss/learner"] for r in train] == runs["with"]["losses"]  # the only sink
    eval_keys = {
        "step",
        "eval/loss",
        "eval/loss/learner",
        "eval/ce",
        "eval/samples",
        "eval/normaliser",
        "eval/seconds",
    }
    for r in ev:
        assert set(r) == eval_keys, set(r) ^ eval_keys

    acc = EventAccumulator(str(logs))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == (train_keys | eval_keys) - {"step"}
    # one axis, optimizer steps done (issue 44 item 5): training at 1..STEPS, the eval after
    # 2 and 3 steps at 2 and 3, with the losses of the steps that made those weights
    for tag in train_keys - {"step"}:
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, STEPS + 1)), tag
    for tag in eval_keys - {"step"}:
        assert [e.step for e in acc.Scalars(tag)] == [2, 3], tag
    by_x = {e.step: e.value for e in acc.Scalars("loss")}
    assert by_x[2] == pytest.approx(runs["with"]["losses"][1], rel=1e-6)
    got = [e.value for e in acc.Scalars("eval/loss")]
    assert got == pytest.approx([r["eval/loss"] for r in ev], rel=1e-6)  # float32 in events


@pytest.mark.dist
def test_eval_under_fsdp_and_monolithic(tmp_path):
    """FSDP (a partial eval batch: one shard replica pads its forwards; the sink's blocks are
    FSDP units and its forward calls the module once per sample, so the two ranks make 2 and
    1 calls for the last batch) and --monolithic."""
    cfg = write_run(tmp_path, EVAL, learner="dp = 1\nfsdp = 2")
    losses, want, _ = plain_loop(cfg)
    for mono in (False, True):
        res = launch(
            cfg, nproc=3 if not mono else 2, opts=RunOptions(progress=False, monolithic=mono)
        )
        got = {r["step"]: r for r in res["eval"]}
        assert sorted(got) == [2, 3]
        # training after an eval pass (blocks' resharding and training flags restored)
        for x, y in zip(res["losses"], losses, strict=True):
            assert abs(x - y) <= 1e-10 * abs(y), (mono, res["losses"], losses)
        for step, (loss, ce) in want.items():
            assert abs(got[step]["eval/loss"] - loss) <= 1e-10 * abs(loss), (mono, got, want)
            assert abs(got[step]["eval/ce"] - ce) <= 1e-10 * abs(ce), (mono, got, want)


def test_eval_config_errors_are_one_line(tmp_path):
    write_run(tmp_path, None)
    text = (tmp_path / "run.toml").read_text()

    def load(table):
        # a top-level key before the tables, an [eval] table after them
        doc = table + "\n" + text if table.startswith("log_dir") else text + "\n" + table
        return C.loads(doc, config_dir=tmp_path)

    cases = [
        ('[eval]\ndata = "heldout.jsonl"\nevery = 0', r"^eval\.every must be >= 1, got 0$"),
        ('[eval]\ndata = "heldout.jsonl"', r"^eval\.every: missing"),
        ('[eval]\ndata = "heldout.jsonl"\nevery = "2"', r"^eval\.every must be an integer"),
        ('[eval]\ndata = "heldout.jsonl"\nevery = 1\nbatches = 0', r"^eval\.batches must be >= 1"),
        (
            '[eval]\ndata = "nope.jsonl"\nevery = 1',
            r"^eval\.data: file .*nope\.jsonl does not exist$",
        ),
        ('[eval]\ndata = "heldout.jsonl"\nevry = 1', r"^eval\.evry: unknown field; known fields"),
        ("[eval]\nevery = 1", r"^eval\.data: missing"),
        ("log_dir = 3", r"^log_dir must be a path string"),
    ]
    for table, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as e:
            load(table)
        assert "\n" not in str(e.value)
    cfg = load('[eval]\ndata = "heldout.jsonl"\nevery = 1\nbatches = 1')
    assert cfg.eval.batches == 1 and cfg.eval.every == 1
    # a job that does not read a JsonlDataset cannot read eval.data like its own data; it
    # sets job.eval_dataset instead
    import sys

    listed = JOB.replace(
        'dataset=JsonlDataset(Path(config.config_dir) / w["data"]),',
        'dataset=[json.loads(x) for x in open(Path(config.config_dir) / w["data"])],',
    ).replace("import torch\n", "import json\nimport torch\n", 1)
    try:
        (tmp_path / "evaljob.py").write_text(listed)
        sys.modules.pop("evaljob", None)
        with pytest.raises(ValueError, match=r"^eval\.data: the job reads a list, not a maestro"):
            load(EVAL)
        with pytest.raises(ValueError, match=r"^eval\.data: missing; name a JSONL file"):
            load("[eval]\nevery = 1")
        (tmp_path / "evaljob.py").write_text(
            listed.replace("    return Job(", "    j = Job(", 1)
            + "    j.eval_dataset = [{'input_ids': [1, 2, 3]}]\n    return j\n"
        )
        sys.modules.pop("evaljob", None)
        cfg = load("[eval]\nevery = 1")
        from maestro.runtime.evaluation import eval_batches

        assert list(eval_batches(cfg.job(), cfg))[0][0]["input_ids"].tolist() == [1, 2, 3]
    finally:
        (tmp_path / "evaljob.py").write_text(JOB)
        sys.modules.pop("evaljob", None)


@pytest.mark.dist
@pytest.mark.parametrize(
    "learner",
    [
        # FSDP: a shard group runs padding forwards in step (7 held-out records, 2 replicas)
        "fsdp = 2",
        # colocated with the frozen tagger: the group's replica runs both, outputs in memory
        'dp = 1\ngroup = "all"',
    ],
    ids=["fsdp2", "colocated"],
)
def test_eval_under_other_layouts_equals_the_no_grad_forward(tmp_path, learner):
    """Under FSDP and in a colocated group the eval figures still equal the hand-written
    no-grad forward (the colocated sink's ``ce`` included: a group once reported only its
    ``loss``)."""
    cfg = write_run(tmp_path, EVAL, learner)
    if "group" in learner:
        cfg.sections["tagger"].group = "all"
    res = launch(cfg, opts=RunOptions(progress=False))
    _, want, _ = plain_loop(cfg)
    assert [r["step"] for r in res["eval"]] == [2, 3]
    for r in res["eval"]:
        loss, ce = want[r["step"]]
        assert abs(r["eval/loss"] - loss) <= 1e-10 * abs(loss), (r, want)
        assert abs(r["eval/ce"] - ce) <= 1e-10 * abs(ce), (r, want)
        assert r["eval/samples"] == 7


def test_eval_mode_sets_every_submodule_and_restores_each_flag():
    """``eval_mode`` equals ``model.eval()`` + a no-grad forward with Dropout and BatchNorm
    inside child modules, and gives every module its own flag back (one child was already in
    eval mode, the rest in training)."""
    from torch import nn

    from maestro.runtime.evaluation import eval_mode

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.5))
    model = nn.Sequential(nn.Linear(4, 6), inner, nn.Sequential(nn.Dropout(0.3), nn.Linear(6, 2)))
    with torch.no_grad():  # running statistics far from a batch's own
        inner[1].running_mean.fill_(3.0)
        inner[1].running_var.fill_(0.25)
    model[2][0].eval()  # a child the user keeps in eval mode
    flags = {n: m.training for n, m in model.named_modules()}
    x = torch.randn(8, 4)
    reference = __import__("copy").deepcopy(model).eval()
    with torch.no_grad():
        want = reference(x)
        stats = inner[1].running_mean.clone()
        with eval_mode([model]):
            assert not any(m.training for m in model.modules())
            got = model(x)
        assert torch.equal(inner[1].running_mean, stats)  # eval does not update them
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert {n: m.training for n, m in model.named_modules()} == flags
    assert flags[""] and not flags["2.0"]
