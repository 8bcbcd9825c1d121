"""Synthetic data: a learnable token language, long-tailed lengths and a modality mix.

Everything derives from ``(seed, step)``, so every rank rebuilds the same global batch without
communication and a run is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from maestro.seeding import seed_for

#: Successors per token in the bigram chain: low enough that a model can learn the language.
BRANCHING = 4


def long_tailed_lengths(gen: torch.Generator, n: int, lo: int, hi: int) -> list[int]:
    """``n`` lengths in ``[lo, hi]``, log-normal: most samples short, a few near ``hi``."""
    z = torch.randn(n, generator=gen, dtype=torch.float64)
    # exp(0.9 z) has median 1 and p99 ~ 8; scale so p99 lands near hi
    frac = torch.exp(0.9 * z) / math.exp(0.9 * 2.33)
    lens = lo + (hi - lo) * frac
    return [int(v) for v in lens.round().clamp(lo, hi)]


class BigramLanguage:
    """Token sequences from a fixed sparse bigram chain (each token has ``BRANCHING`` successors).

    Args:
        vocab_size: tokens in the vocabulary.
        seed: fixes the chain (the "language"), shared by all steps.
    """

    def __init__(self, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed_for("language", seed))
        self.vocab_size = vocab_size
        self.successors = torch.randint(0, vocab_size, (vocab_size, BRANCHING), generator=g)

    def sample(self, gen: torch.Generator, lengths: list[int]) -> list[torch.Tensor]:
        """One int64 sequence per requested length."""
        n, t = len(lengths), max(lengths)
        seq = torch.empty(n, t, dtype=torch.long)
        seq[:, 0] = torch.randint(0, self.vocab_size, (n,), generator=gen)
        for j in range(1, t):
            pick = torch.randint(0, BRANCHING, (n,), generator=gen)
            seq[:, j] = self.successors[seq[:, j - 1], pick]
        return [seq[i, :length].clone() for i, length in enumerate(lengths)]


def draw_kinds(gen: torch.Generator, n: int, mix: Mapping[str, float]) -> list[str]:
    """``n`` modality kinds drawn i.i.d. from ``mix`` (kind -> share)."""
    kinds = [k for k, v in mix.items() if v > 0]
    probs = torch.tensor([mix[k] for k in kinds], dtype=torch.float64)
    idx = torch.multinomial(probs, n, replacement=True, generator=gen)
    return [kinds[i] for i in idx.tolist()]
