"""Knowledge distillation: a frozen decoder-only teacher and a student trained on CE + KL.

``job(config)`` is the built-in ``kd`` job (``[workload] name = "kd"``): synthetic token data
from a bigram language, the project's own small decoders. It uses only the public job API.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from maestro.config import KDConfig
from maestro.job import Job
from maestro.sections import Outputs, Sample, Section
from maestro.workloads.data import BigramLanguage, long_tailed_lengths, seed_for
from maestro.workloads.layers import Decoder, pad_stack


def job(config) -> Job:
    """The ``kd`` job: teacher -> student; the teacher sends per-token logits (or its top-k).

    The student's per-sample loss is ``sum over tokens of CE + alpha * T^2 * KL(p_T || p_S)``
    at temperature ``T``; with ``top_k`` the teacher distribution is renormalised over its top
    k tokens and the KL is taken on that support.
    """
    c: KDConfig = config.model
    language = BigramLanguage(c.vocab_size, config.seed)

    def teacher(module: nn.Module, samples: Sequence[Sample], inputs: Mapping) -> list[Outputs]:
        logits = module(pad_stack([s["tokens"] for s in samples]))  # (B, T, V)
        outs = []
        for i, s in enumerate(samples):
            lg = logits[i, : s["tokens"].numel() - 1]  # (L-1, V): predictions of tokens 1..L-1
            if c.top_k:
                v, idx = lg.topk(c.top_k, dim=-1)
                outs.append({"top_values": v.contiguous(), "top_indices": idx.contiguous()})
            else:
                outs.append({"logits": lg.contiguous()})
        return outs

    def student(module: nn.Module, samples: Sequence[Sample], inputs: Mapping) -> list[Outputs]:
        logits = module(pad_stack([s["tokens"] for s in samples]))  # (B, T, V)
        got = inputs.get("teacher", [None] * len(samples))
        outs = []
        for i, s in enumerate(samples):
            n = s["tokens"].numel() - 1
            lg = logits[i, :n]  # (L-1, V)
            loss = F.cross_entropy(lg, s["tokens"][1:], reduction="sum")
            t = got[i]
            if t is not None and c.alpha:
                log_ps = F.log_softmax(_wide(lg) / c.temperature, dim=-1)
                if "logits" in t:
                    log_pt = F.log_softmax(_wide(t["logits"]) / c.temperature, dim=-1)
                    kl = (log_pt.exp() * (log_pt - log_ps)).sum()
                else:
                    log_pt = F.log_softmax(_wide(t["top_values"]) / c.temperature, dim=-1)
                    kl = (log_pt.exp() * (log_pt - log_ps.gather(-1, t["top_indices"]))).sum()
                loss = loss + c.alpha * c.temperature**2 * kl
            outs.append({"loss": loss})
        return outs

    def batches(step: int) -> list[Sample]:
        g = torch.Generator().manual_seed(seed_for("batch", config.seed, step))
        lens = long_tailed_lengths(g, config.global_batch, c.seq_len_min, c.seq_len_max)
        return [{"kind": "text", "tokens": t} for t in language.sample(g, lens)]

    def cost(sample: Sample) -> dict[str, float]:
        n = sample["tokens"].numel()
        return {"tokens": n, "text_tokens": n, "images": 0, "audio": 0}

    ins = c.default_inputs()

    def decoder(dim: int, layers: int) -> Decoder:
        return Decoder(c.vocab_size, dim, layers, c.heads, c.seq_len_max)

    return Job(
        [
            Section(
                "teacher",
                lambda: Decoder(
                    c.vocab_size, c.teacher_dim, c.teacher_layers, c.heads, c.seq_len_max
                ),
                inputs=ins["teacher"],
                forward=teacher,
            ),
            Section(
                "student",
                lambda: Decoder(
                    c.vocab_size, c.student_dim, c.student_layers, c.heads, c.seq_len_max
                ),
                inputs=ins["student"],
                forward=student,
            ),
        ],
        batches=batches,
        sample_cost=cost,
    )


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32 (a bf16 run's logits), float64 kept (exactness runs)."""
    return t if t.dtype == torch.float64 else t.float()


#: the ``[workload]`` table's settings (validated when the config loads)
job.Config = KDConfig
