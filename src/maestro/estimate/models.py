"""Transformer shapes the cost model prices: presets of published models and Hugging Face
``config.json`` files (read locally; nothing is downloaded)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """A decoder or encoder transformer, as the cost model sees it.

    Args:
        name: label.
        layers: transformer blocks.
        hidden: model width ``h``.
        heads: query heads.
        kv_heads: key/value heads (GQA); ``heads`` for multi-head attention.
        ffn: MLP inner width ``f``.
        vocab: vocabulary of the embedding and LM head; 0 for an encoder without one.
        gated: SwiGLU MLP (three ``h x f`` matrices) instead of a plain two-matrix MLP.
        causal: causal self-attention (decoders); ``False``: bidirectional (vision encoders).
        tied: the LM head shares the embedding's weights.
        head_dim: width of one head (default ``hidden // heads``).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 0
    gated: bool = True
    causal: bool = True
    tied: bool = False
    head_dim: int = 0

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn"):
            if getattr(self, f) < 1:
                raise ValueError(f"model {self.name!r}: {f} must be >= 1, got {getattr(self, f)}")
        if self.vocab < 0:
            raise ValueError(f"model {self.name!r}: vocab must be >= 0, got {self.vocab}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: heads ({self.heads}) must be a multiple of "
                f"kv_heads ({self.kv_heads})"
            )

    @property
    def dh(self) -> int:
        """Head width."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.dh

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dh

    @functools.cached_property
    def layer_params(self) -> float:
        """Weights of one block: attention projections, MLP, two norms."""
        h, f = self.hidden, self.ffn
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        mlp = (3 if self.gated else 2) * h * f
        return float(attn + mlp + 2 * h)

    @property
    def embedding_params(self) -> float:
        return float(self.vocab * self.hidden)

    @property
    def head_params(self) -> float:
        """LM-head weights (0 when tied to the embedding or without a vocabulary)."""
        return 0.0 if self.tied else float(self.vocab * self.hidden)

    @functools.cached_property
    def params(self) -> float:
        """All parameters."""
        return (
            self.layers * self.layer_params + self.embedding_params + self.head_params + self.hidden
        )

    def with_layers(self, layers: int) -> ModelSpec:
        return replace(self, layers=layers)


def gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 131072) -> ModelSpec:
    """A Megatron-LM GPT model: multi-head attention, a ``4h`` GeLU MLP, untied head."""
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, vocab, gated=False)


# Sources: each model's published config.json (Hugging Face model cards): layers, hidden,
# heads, kv heads, intermediate size, vocabulary.
PRESETS: dict[str, ModelSpec] = {
    # meta-llama/Llama-3.1-8B / 70B / 405B
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 8, 53248, 128256),
    # Qwen/Qwen2.5-7B / 72B
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064),
    "qwen2.5-72b": ModelSpec("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064),
    # google/siglip-so400m-patch14-384 vision tower
    "siglip-so400m": ModelSpec(
        "siglip-so400m", 27, 1152, 16, 16, 4304, 0, gated=False, causal=False
    ),
    # Qwen/Qwen2-VL-7B-Instruct vision_config: depth 32, embed_dim 1280, 16 heads, mlp_ratio 4
    "qwen2-vl-vit": ModelSpec("qwen2-vl-vit", 32, 1280, 16, 16, 5120, 0, gated=False, causal=False),
    # OpenGVLab/InternViT-6B-448px-V1-5: 45 layers, hidden 3200, 25 heads, intermediate 12800
    "internvit-6b": ModelSpec(
        "internvit-6b", 45, 3200, 25, 25, 12800, 0, gated=False, causal=False
    ),
}


def model(name_or_path: str | ModelSpec) -> ModelSpec:
    """A preset by name, or a Hugging Face ``config.json`` (a file or a directory holding one).

    ``ValueError`` names the unknown preset or the field the config lacks.
    """
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    key = name_or_path.lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) and no "
            "config.json there"
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    return from_hf_config(cfg, name=path.parent.name or str(path))


def from_hf_config(cfg: dict, name: str = "hf") -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face config dict: a decoder's top-level fields (or its
    ``text_config`` / ``llm_config``), or a vision tower's (``depth``/``embed_dim`` or
    ``num_hidden_layers``/``hidden_size`` without a vocabulary)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{name}: config must be a JSON object")
    for sub in ("text_config", "llm_config"):
        if "num_hidden_layers" not in cfg and isinstance(cfg.get(sub), dict):
            cfg = cfg[sub]

    def need(*keys):
        for k in keys:
            if k in cfg:
                return cfg[k]
        raise ValueError(f"{name}: config.json has none of {', '.join(keys)}")

    layers = int(need("num_hidden_layers", "depth", "n_layer", "num_layers"))
    hidden = int(need("hidden_size", "embed_dim", "n_embd", "d_model"))
    heads = int(need("num_attention_heads", "num_heads", "n_head"))
    kv = int(cfg.get("num_key_value_heads") or heads)
    if "intermediate_size" in cfg:
        ffn = int(cfg["intermediate_size"])
    elif "mlp_ratio" in cfg:
        ffn = int(float(cfg["mlp_ratio"]) * hidden)
    else:
        ffn = int(cfg.get("n_inner") or 4 * hidden)
    vocab = int(cfg.get("vocab_size") or 0)
    act = str(cfg.get("hidden_act", cfg.get("activation_function", "silu"))).lower()
    gated = "silu" in act or "swiglu" in act or bool(cfg.get("gated", False))
    return ModelSpec(
        name,
        layers,
        hidden,
        heads,
        kv,
        ffn,
        vocab,
        gated=gated,
        causal=vocab > 0,
        tied=bool(cfg.get("tie_word_embeddings", False)),
        head_dim=int(cfg.get("head_dim") or 0),
    )
