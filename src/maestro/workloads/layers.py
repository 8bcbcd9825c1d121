"""Small transformer building blocks shared by the workloads (no dropout: steps are exact)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: self-attention then a GELU MLP.

    Args:
        dim: model width.
        heads: attention heads (``dim % heads == 0``).
        causal: causal (decoder) or bidirectional (encoder) attention.
    """

    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, D)
        b, t, d = x.shape
        # -1 heads: under tensor parallelism ``qkv`` yields this rank's heads only
        # (``maestro.parallel.tp``), H/tp of them, each still D/H wide
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, -1, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal
        )  # (B, H, T, D/H)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    """Decoder-only language model over embeddings, so callers may splice in image tokens.

    Args:
        vocab_size: vocabulary size.
        dim: width.
        layers: causal blocks.
        heads: attention heads.
        max_len: longest sequence (learned positions).
    """

    def __init__(self, vocab_size: int, dim: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, causal=True) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward_embeds(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) input embeddings -> (B, T, V) logits."""
        from maestro.parallel.cp import positions

        pos = positions(x.shape[0], x.shape[1], x.device)  # context parallelism: the share's
        if pos is None:
            x = x + self.pos.weight[: x.shape[1]]
        else:  # (B, T) global positions; a padded row's tail may run past max_len
            x = x + self.pos(pos.clamp_max(self.pos.num_embeddings - 1))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, V) logits."""
        return self.forward_embeds(self.tok(tokens))


class Encoder(nn.Module):
    """ViT-style encoder with a projector into the LLM's width.

    Inputs are already cut into patches (or audio frames): (B, P, patch_dim). The projector
    (two linear layers with GELU, as in LLaVA) is part of the encoder section.

    Args:
        in_dim: values per patch or frame.
        dim: encoder width.
        layers: bidirectional blocks.
        heads: attention heads.
        num_tokens: patches/frames per item (learned positions).
        out_dim: LLM width.
        pool: merge this many consecutive output tokens into one (mean) before the projector,
            as MLLMs merge 2x2 patches, so the LLM sees ``num_tokens / pool`` tokens per item.
    """

    def __init__(
        self,
        in_dim: int,
        dim: int,
        layers: int,
        heads: int,
        num_tokens: int,
        out_dim: int,
        pool: int = 1,
    ) -> None:
        super().__init__()
        assert num_tokens % pool == 0, "pool must divide num_tokens"
        self.pool = pool
        self.embed = nn.Linear(in_dim, dim)
        self.pos = nn.Parameter(torch.zeros(num_tokens, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, causal=False) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.proj = nn.Sequential(nn.Linear(dim, out_dim), nn.GELU(), nn.Linear(out_dim, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, P, in_dim) -> (B, P / pool, out_dim) tokens for the LLM."""
        x = self.embed(x) + self.pos
        for blk in self.blocks:
            x = blk(x)
        x = self.ln(x)
        if self.pool > 1:
            b, p, d = x.shape
            x = x.view(b, p // self.pool, self.pool, d).mean(2)
        return self.proj(x)


def pad_stack(seqs: list[torch.Tensor], value: float | int = 0) -> torch.Tensor:
    """Right-pad 1-D/2-D tensors of different lengths to (B, T_max, ...).

    Right padding needs no attention mask under causal attention: valid positions never attend
    to later (padded) ones, and padded outputs are dropped.
    """
    t = max(s.shape[0] for s in seqs)
    out = seqs[0].new_full((len(seqs), t, *seqs[0].shape[1:]), value)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
    return out
