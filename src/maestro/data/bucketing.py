"""Length bucketing: global batches of similar lengths, in an order fixed by a seed.

``length_grouped_order`` returns dataset positions only (a sampler's job); ``LengthBucketed``
is a dataset read in that order. Use it with ``Job(shuffle=False)`` so the job reads it as
is: consecutive ``global_batch`` positions then hold similar lengths (less padding per
micro-batch, better balanced replicas), while which lengths meet in a batch, and the order of
the batches, are shuffled by the seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset


def length_grouped_order(
    lengths: Sequence[int], group_size: int, seed: int = 0, *, megabatch: int = 8
) -> list[int]:
    """A permutation of ``range(len(lengths))`` whose consecutive groups have similar lengths.

    The positions are shuffled (seeded), cut into chunks of ``megabatch * group_size`` whose
    members are sorted by length (longest first), cut into groups of ``group_size``, and the
    groups shuffled. Same ``(lengths, group_size, seed)``: same order, on every rank.

    Args:
        lengths: tokens (or any cost) per dataset position.
        group_size: positions per group (the global batch).
        seed: seeds both shuffles.
        megabatch: groups per sorted chunk; larger means tighter lengths, less randomness.
    """
    if group_size < 1 or megabatch < 1:
        raise ValueError(f"group_size and megabatch must be >= 1, got {group_size}, {megabatch}")
    n = len(lengths)
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=g).tolist()
    span = group_size * megabatch
    sorted_chunks = []
    for a in range(0, n, span):
        chunk = perm[a : a + span]
        sorted_chunks += sorted(chunk, key=lambda i: (-lengths[i], i))
    groups = [sorted_chunks[a : a + group_size] for a in range(0, n, group_size)]
    order = torch.randperm(len(groups), generator=g).tolist()
    return [i for k in order for i in groups[k]]


class LengthBucketed(Dataset):
    """``dataset`` read in ``length_grouped_order`` (use with ``Job(shuffle=False)``).

    Args:
        dataset: a map-style dataset; its ``lengths`` attribute (``JsonlDataset``,
            ``TableDataset``) is used unless ``lengths`` is given.
        global_batch: the run's ``global_batch`` (the group size).
        seed: the run's seed.
        lengths: tokens per record, when the dataset has no ``lengths``.
        megabatch: see ``length_grouped_order``.
    """

    def __init__(
        self,
        dataset: Any,
        global_batch: int,
        seed: int = 0,
        *,
        lengths: Sequence[int] | None = None,
        megabatch: int = 8,
    ) -> None:
        if lengths is None:
            lengths = getattr(dataset, "lengths", None)
            if lengths is None:
                raise ValueError(
                    f"LengthBucketed: {type(dataset).__name__} has no 'lengths'; pass lengths="
                )
        lengths = list(lengths)
        if len(lengths) != len(dataset):
            raise ValueError(f"LengthBucketed: {len(lengths)} lengths for {len(dataset)} records")
        self.dataset = dataset
        self.order = length_grouped_order(lengths, global_batch, seed, megabatch=megabatch)
        self.lengths = [lengths[i] for i in self.order]

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int):
        return self.dataset[self.order[i]]
