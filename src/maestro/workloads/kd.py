"""Knowledge distillation: a frozen decoder-only teacher and a student trained on CE + KL."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from maestro.config import KDConfig
from maestro.sections import Outputs, Sample, Section
from maestro.workloads.base import Workload
from maestro.workloads.data import BigramLanguage, long_tailed_lengths, seed_for
from maestro.workloads.layers import Decoder, pad_stack


class KDWorkload(Workload):
    """Teacher (frozen) -> student. The teacher sends per-token logits (or its top-k) per sample.

    The student's per-sample loss is ``sum over tokens of CE + alpha * T^2 * KL(p_T || p_S)``
    at temperature ``T``; with ``top_k`` the teacher distribution is renormalised over its top
    k tokens and the KL is taken on that support.
    """

    def __init__(self, config) -> None:
        super().__init__(config)
        self.cfg: KDConfig = config.model
        self.language = BigramLanguage(self.cfg.vocab_size, config.seed)

    def _module(self, name: str) -> nn.Module:
        c = self.cfg
        if name == "teacher":
            return Decoder(c.vocab_size, c.teacher_dim, c.teacher_layers, c.heads, c.seq_len_max)
        return Decoder(c.vocab_size, c.student_dim, c.student_layers, c.heads, c.seq_len_max)

    def _section(self, name: str, module: nn.Module) -> Section:
        inputs = self.config.section_inputs()[name]
        fwd = self._teacher_forward if name == "teacher" else self._student_forward
        return Section(
            name, module, inputs=inputs, frozen=self.config.sections[name].frozen, forward=fwd
        )

    def _teacher_forward(
        self, module: nn.Module, samples: Sequence[Sample], inputs: Mapping
    ) -> list[Outputs]:
        logits = module(pad_stack([s["tokens"] for s in samples]))  # (B, T, V)
        outs = []
        for i, s in enumerate(samples):
            lg = logits[i, : s["tokens"].numel() - 1]  # (L-1, V): predictions of tokens 1..L-1
            if self.cfg.top_k:
                v, idx = lg.topk(self.cfg.top_k, dim=-1)
                outs.append({"top_values": v.contiguous(), "top_indices": idx.contiguous()})
            else:
                outs.append({"logits": lg.contiguous()})
        return outs

    def _student_forward(
        self, module: nn.Module, samples: Sequence[Sample], inputs: Mapping
    ) -> list[Outputs]:
        c = self.cfg
        logits = module(pad_stack([s["tokens"] for s in samples]))  # (B, T, V)
        teacher = inputs.get("teacher", [None] * len(samples))
        outs = []
        for i, s in enumerate(samples):
            n = s["tokens"].numel() - 1
            lg = logits[i, :n]  # (L-1, V)
            loss = F.cross_entropy(lg, s["tokens"][1:], reduction="sum")
            t = teacher[i]
            if t is not None and c.alpha:
                log_ps = F.log_softmax(lg / c.temperature, dim=-1)
                if "logits" in t:
                    log_pt = F.log_softmax(t["logits"] / c.temperature, dim=-1)
                    kl = (log_pt.exp() * (log_pt - log_ps)).sum()
                else:
                    log_pt = F.log_softmax(t["top_values"] / c.temperature, dim=-1)
                    kl = (log_pt.exp() * (log_pt - log_ps.gather(-1, t["top_indices"]))).sum()
                loss = loss + c.alpha * c.temperature**2 * kl
            outs.append({"loss": loss})
        return outs

    def batch(self, step: int) -> list[Sample]:
        c = self.cfg
        g = torch.Generator().manual_seed(seed_for("batch", self.config.seed, step))
        lens = long_tailed_lengths(g, self.config.global_batch, c.seq_len_min, c.seq_len_max)
        toks = self.language.sample(g, lens)
        return [{"id": i, "kind": "text", "tokens": t} for i, t in enumerate(toks)]

    def _cost(self, sample: Sample) -> dict[str, float]:
        n = sample["tokens"].numel()
        return {"tokens": n, "text_tokens": n, "images": 0, "audio": 0}
