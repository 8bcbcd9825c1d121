"""A compound model of your own: a frozen teacher and a student, trained by distillation.

Run: `python examples/quickstart/make_data.py` once, then
`maestro train examples/quickstart/run.toml` (2 ranks: one per section).
"""

from pathlib import Path

import torch.nn.functional as F
from torch import nn

from maestro import Job, Section
from maestro.data import JsonlDataset


class TinyLM(nn.Module):
    """Any nn.Module works; this one maps (T,) token ids to (T, vocab) logits."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids)[None])
        return self.head(h[0])


def teacher_forward(module, samples, inputs):
    # one dict per sample: what the student receives for that sample
    return [{"logits": module(s["input_ids"][:-1])} for s in samples]


def student_forward(module, samples, inputs):
    outs = []
    for s, t in zip(samples, inputs["teacher"]):
        logits = module(s["input_ids"][:-1])  # (T-1, V)
        ce = F.cross_entropy(logits, s["input_ids"][1:], reduction="sum")
        kl = F.kl_div(
            F.log_softmax(logits, -1),
            F.log_softmax(t["logits"], -1),
            log_target=True,
            reduction="sum",
        )
        outs.append({"loss": ce + kl})  # summed over the sample; Maestro normalises
    return outs


def job(config):
    w = config.model  # the [workload] table of run.toml
    return Job(
        [
            Section(
                "teacher",
                lambda: TinyLM(w["vocab"], 4 * w["dim"]),
                frozen=True,
                forward=teacher_forward,
            ),
            Section(
                "student",
                lambda: TinyLM(w["vocab"], w["dim"]),
                inputs=["teacher"],
                forward=student_forward,
            ),
        ],
        dataset=JsonlDataset(Path(config.config_dir) / w["data"]),  # relative to run.toml
    )
