"""The precision chooser's gates (issue 35): bf16 is kept only when it is faster by the margin
*and* its answers agree with fp32's; the agreement is the share of seeds whose argmax matches.

A toy served model makes both sides known: its fp32 copy sleeps (so bf16 is always much
faster) and its bf16 copy answers a chosen share of the seeds with another class.
"""

import time

import numpy as np
import pytest
import torch
from torch import nn

from quiver.precision import measure_precision, stored_records

N, DIM, CLASSES = 64, 8, 4


class Sampler:
    """Every seed is its own subgraph: ``n_id`` = the seeds, no hops."""

    def sample(self, seeds):
        return seeds, seeds.numel(), []


class Toy(nn.Module):
    """Logits = one-hot of ``label[node]``: the fp32 copy sleeps 5 ms, the bf16 copy answers
    class ``label + 1`` on the nodes of ``wrong``."""

    def __init__(self, wrong: np.ndarray):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.register_buffer("label", torch.arange(N) % CLASSES)
        self.register_buffer("wrong", torch.from_numpy(wrong))

    def forward_all(self, x, adjs):
        ids = x[:, 0].round().long()  # feature 0 carries the node id
        label = self.label[ids]
        if self.w.dtype == torch.bfloat16:
            label = torch.where(self.wrong[ids], (label + 1) % CLASSES, label)
        else:
            time.sleep(0.005)
        logits = torch.nn.functional.one_hot(label, CLASSES).to(self.w.dtype) * self.w
        return None, logits

    def forward(self, x, adjs):
        return self.forward_all(x, adjs)[1]


def features() -> torch.Tensor:
    x = torch.zeros(N, DIM)
    x[:, 0] = torch.arange(N, dtype=torch.float32)  # exact in bf16 below 256
    return x


def choose(wrong, **kw):
    return measure_precision(
        Sampler(), features(), Toy(wrong), N, batch_sizes=(N,), repeats=2, margin=0.05, **kw
    )


def test_bf16_is_refused_when_its_answers_disagree_even_when_faster():
    wrong = np.zeros(N, dtype=bool)
    wrong[::4] = True  # a quarter of the nodes: agreement 0.75, independent of the seeds
    c = choose(wrong)
    assert c.model == "fp32"
    assert c.agreement == pytest.approx(0.75)
    assert "agreement 0.7500 < 0.99" in c.note
    assert c.max_abs_diff == pytest.approx(1.0)
    assert set(c.timings["pairs"]) == {"fp32+fp32", "bf16+fp32"}  # the bf16 model left out
    # the same bf16 model answering like fp32 is kept: it is the faster one, so the
    # agreement gate, not the timings, refused it above
    assert choose(np.zeros(N, dtype=bool)).model == "bf16"


def test_the_agreement_threshold_decides_at_the_measured_share():
    wrong = np.zeros(N, dtype=bool)
    wrong[::4] = True
    below = choose(wrong, min_agreement=0.8)  # 0.75 < 0.8: refused
    assert below.model == "fp32" and "< 0.8" in below.note
    above = choose(wrong, min_agreement=0.7)  # 0.75 >= 0.7: the faster bf16 model is kept
    assert above.model == "bf16" and above.note == "" and above.agreement == 0.75


def test_calibrate_prints_why_bf16_was_refused(capsys, tmp_path, monkeypatch):
    """``quiver calibrate --checkpoint``: the reason is printed and recorded in the manifest."""
    import json
    from types import SimpleNamespace

    import quiver.usermodel
    from quiver.commands import calibrate

    wrong = np.zeros(N, dtype=bool)
    wrong[::2] = True
    monkeypatch.setattr(
        quiver.usermodel,
        "load_served_model",
        lambda *a: (Toy(wrong), {"fanouts": [], "extra_hops": 0, "frontier": None}),
    )
    monkeypatch.setattr("quiver.pyg.GraphSageSampler", lambda *a, **k: Sampler())
    args = SimpleNamespace(
        precision_batches=str(N),
        checkpoint="ckpt.pt",
        model=None,
        trust_pickle=False,
        sizes=None,
        seed=0,
        precision_repeats=2,
        torch_threads=1,
    )
    ds = SimpleNamespace(topo=None, features=features(), num_nodes=N)
    calibrate._calibrate_precision(args, tmp_path, ds, [1])
    out = capsys.readouterr().out
    assert "note: bf16 model argmax agreement 0.5000 < 0.99" in out
    assert "model fp32" in out
    rec = stored_records(json.loads((tmp_path / "manifest.json").read_text()), "precision")[-1]
    assert rec["model"] == "fp32" and rec["agreement"] == 0.5 and "agreement" in rec["note"]
