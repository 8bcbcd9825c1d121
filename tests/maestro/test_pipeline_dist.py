"""A user's own model pipelined (``pp = 2``) on real ranks, with ``[eval]``.

The job, written here as a user would: a trainable encoder feeds a per-token hint into a
language model of the user's own blocks (found by Maestro's defaults: a ``ModuleList`` of
identical blocks), which reads the hint both before its blocks (on the first stage) and after
them (on the last), so the encoder's gradient is the sum of both stages' shares. Trained 3
steps in float64 it must equal the single-process loop (``reference_train``); its eval
figures must equal the same run's at ``pp = 1``, whose eval path
``test_eval_logging.py`` pins against a hand-written no-grad forward.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from maestro import config as C
from maestro.runtime import RunOptions, launch, reference_train

pytestmark = pytest.mark.dist

JOB = textwrap.dedent(
    """
    from pathlib import Path
    import torch
    import torch.nn.functional as F
    from torch import nn
    from maestro import Job, Section
    from maestro.data import JsonlDataset


    class Encoder(nn.Module):
        def __init__(self, vocab, dim):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)

        def forward(self, ids):
            return torch.tanh(self.emb(ids))


    class MyBlock(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.ff = nn.Linear(dim, dim)

        def forward(self, h, mask):  # h: (B, T, D), mask: (B, T, 1)
            return h + torch.tanh(self.ff(self.norm(h))) * mask


    class MyLM(nn.Module):
        def __init__(self, vocab, dim, layers):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(MyBlock(dim) for _ in range(layers))
            self.out = nn.Linear(dim, vocab)

        def forward(self, ids, hint, mask):  # ids: (B, T); hint: (B, T, D)
            h = self.emb(ids) + hint
            for layer in self.layers:
                h = layer(h, mask)
            return self.out(h * (1 + hint))  # the hint again, after the blocks


    def encode(module, samples, inputs):
        return [{"hint": module(s["input_ids"])} for s in samples]


    def pad(ts):
        t = max(x.shape[0] for x in ts)
        out = ts[0].new_zeros((len(ts), t, *ts[0].shape[1:]))
        for i, x in enumerate(ts):
            out[i, : x.shape[0]] = x
        return out


    def learn(module, samples, inputs):
        ids = pad([s["input_ids"] for s in samples])
        hint = pad([h["hint"] for h in inputs["enc"]])
        lens = [s["input_ids"].numel() for s in samples]
        mask = (torch.arange(ids.shape[1])[None] < torch.tensor(lens)[:, None])[..., None]
        logits = module(ids, hint, mask.to(hint.dtype))  # (B, T, V)
        outs = []
        for i, (s, n) in enumerate(zip(samples, lens)):
            ce = F.cross_entropy(logits[i, : n - 1], s["input_ids"][1:], reduction="sum")
            outs.append({"loss": ce, "ce": ce})
        return outs


    def job(config):
        w = config.model
        return Job(
            [
                Section("enc", lambda: Encoder(w["vocab"], w["dim"]), forward=encode),
                Section("lm", lambda: MyLM(w["vocab"], w["dim"], 3), inputs=["enc"],
                        forward=learn),
            ],
            dataset=JsonlDataset(Path(config.config_dir) / w["data"]),
        )
    """
)

VOCAB = 16


def _records(path, n, seed):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = int(torch.randint(3, 9, (1,), generator=g))
            ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids}) + "\n")


def _write(d, lm: str) -> C.TrainConfig:
    _records(d / "train.jsonl", 18, 0)
    _records(d / "heldout.jsonl", 7, 1)
    (d / "ppjob.py").write_text(JOB)
    (d / "run.toml").write_text(
        f"""
global_batch = 6
steps = 3
seed = 5
dtype = "float64"
scheduler = "fifo"
[eval]
data = "heldout.jsonl"
every = 2
[workload]
name = "ppjob:job"
data = "train.jsonl"
vocab = {VOCAB}
dim = 6
[sections.enc]
micro_batch_size = 6
lr = 0.01
grad_clip = 1.0
[sections.lm]
micro_batch_size = 2
lr = 0.01
grad_clip = 1.0
{lm}
"""
    )
    return C.load(d / "run.toml")


def _rel_err(saved, ref):
    num = sum(((saved[k].double() - ref[k].double()) ** 2).sum() for k in ref)
    den = sum((ref[k].double() ** 2).sum() for k in ref)
    return float((num / den).sqrt())


def test_users_model_at_pp2_equals_the_plain_loop_and_evaluates_like_pp1(tmp_path):
    runs = {}
    for label, lm in (("pp2", "pp = 2"), ("pp1", "")):
        d = tmp_path / label
        d.mkdir()
        cfg = _write(d, lm)
        runs[label] = (cfg, launch(cfg, opts=RunOptions(progress=False, save_dir=str(d / "w"))))
    cfg, res = runs["pp2"]
    graph, losses = reference_train(cfg)
    for name in ("enc", "lm"):
        err = _rel_err(
            torch.load(tmp_path / "pp2" / "w" / f"{name}.pt"), graph[name].module.state_dict()
        )
        assert err <= 1e-10, f"{name}: relative error {err:.3g}"
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )
    got, want = res["eval"], runs["pp1"][1]["eval"]
    assert [r["step"] for r in got] == [2, 3] == [r["step"] for r in want]
    for a, b in zip(got, want):
        assert a["eval/samples"] == b["eval/samples"] == 7
        for key in ("eval/loss", "eval/ce"):
            assert abs(a[key] - b[key]) <= 1e-10 * abs(b[key]), (key, a, b)
