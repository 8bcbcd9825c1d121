"""Hugging Face modules as section factories: causal LMs, vision and audio towers.

Every builder returns a ``ModelFactory``: a zero-argument callable (what ``maestro.Section``
takes as its module) whose ``config`` is readable *without* building the model, so a job can
check shapes (vocabularies, widths, image tokens) when it is built, on every rank alike, and
only the ranks that run a section pay for its weights. Nothing here touches the network: local
directories load with ``local_files_only=True``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: image normalisation of the encoders' processors (``mean``, ``std`` per channel)
_IMAGE_STATS = {
    "siglip_vision_model": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "clip_vision_model": (
        (0.48145466, 0.4578275, 0.40821073),
        (0.26862954, 0.26130258, 0.27577711),
    ),
}


class ModelFactory:
    """A zero-argument factory of an ``nn.Module`` with the module's config at hand.

    Args:
        build: ``build() -> nn.Module``; called once per rank that runs the section (the
            runtime seeds it, so randomly initialised weights do not depend on the layout).
        config: the Hugging Face config of the module (``vocab_size``, ``hidden_size``, ...).
        what: a short description for messages and ``repr``.
        info: further facts for the job (``out_dim``, ``num_tokens`` of a tower).
    """

    def __init__(self, build: Callable[[], nn.Module], config: Any, what: str, **info) -> None:
        self._build = build
        self.config = config
        self.what = what
        self.info = info

    def __call__(self) -> nn.Module:
        return self._build()

    def __getattr__(self, name: str):
        info = self.__dict__.get("info", {})
        if name in info:
            return info[name]
        raise AttributeError(f"{type(self).__name__} ({self.__dict__.get('what')}) has no {name!r}")

    def __repr__(self) -> str:
        return f"ModelFactory({self.what})"


def _on_meta() -> bool:
    """Whether modules are being built under ``with torch.device("meta")`` (the planner's and
    the cost estimate's shape-only build): ``from_pretrained`` cannot load weights there, so
    local directories are built from their config instead (same architecture, no weights)."""
    import torch

    return torch.empty(()).device.type == "meta"


def _meta_kw(kwargs: dict) -> dict:
    """``from_config`` arguments for a shape-only build: eager attention, whose mask needs no
    ``.item()`` (SDPA's mask checks whether it may skip the mask by reading its values, which
    meta tensors do not have). Same matmuls, so the same FLOP count."""
    return {**kwargs, "attn_implementation": "eager"}


def _as_config(source: Any, where: str):
    """A transformers ``PretrainedConfig`` from a config object or a dict with ``model_type``."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return copy.deepcopy(source)
    if isinstance(source, dict):
        d = dict(source)
        model_type = d.pop("model_type", None)
        if not isinstance(model_type, str):
            raise ValueError(
                f"{where}: a config dict needs a 'model_type' (e.g. 'llama', 'qwen2'), "
                f"got keys {sorted(source)}"
            )
        try:
            return AutoConfig.for_model(model_type, **d)
        except ValueError as e:
            raise ValueError(f"{where}: {e}".splitlines()[0]) from None
    raise ValueError(
        f"{where}: expected a transformers config, a dict with 'model_type' or a local "
        f"directory, got {type(source).__name__}"
    )


def _local_dir(path: str | Path, where: str) -> Path:
    """``path`` as a model directory (``config.json`` inside); a one-line error otherwise."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(f"{where}: model directory {p} does not exist")
    if not (p / "config.json").is_file():
        raise ValueError(f"{where}: {p} has no config.json (not a saved Hugging Face model)")
    return p


def _local_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def causal_lm(source: Any, **kwargs) -> ModelFactory:
    """A causal language model (``AutoModelForCausalLM``) as a section factory.

    Args:
        source: a transformers config (``LlamaConfig(...)``, ``Qwen2Config(...)``), a dict
            with ``model_type`` and the config's fields, or a local directory written by
            ``save_pretrained`` (loaded with ``from_pretrained(path, local_files_only=True)``;
            ``ValueError`` naming the path when it is missing).
        **kwargs: passed to ``from_config`` / ``from_pretrained`` (``attn_implementation``).

    Dropout in the config makes results depend on how samples are batched; set the config's
    dropout fields to 0 when comparing layouts.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(source, (str, Path)):
        path = _local_dir(source, "causal_lm")
        config = _local_config(path)

        def build() -> nn.Module:
            if _on_meta():
                return AutoModelForCausalLM.from_config(copy.deepcopy(config), **_meta_kw(kwargs))
            return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **kwargs)

        what = f"causal LM from {path}"
    else:
        config = _as_config(source, "causal_lm")

        def build() -> nn.Module:
            kw = _meta_kw(kwargs) if _on_meta() else kwargs
            return AutoModelForCausalLM.from_config(copy.deepcopy(config), **kw)

        what = f"causal LM {config.model_type}"
    return ModelFactory(
        build,
        config,
        what,
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
    )


class Tower(nn.Module):
    """An encoder and a LLaVA-style projector (Linear, GELU, Linear) to the LLM's width.

    ``forward(x)`` maps a batch of encoder inputs to ``(B, N, out_dim)`` token embeddings.

    Args:
        encoder: a vision model (``SiglipVisionModel``, ``CLIPVisionModel``) or an audio
            encoder (``WhisperEncoder``).
        input_name: the encoder's keyword for ``x`` (``pixel_values``, ``input_features``).
        enc_dim: the encoder's output width.
        out_dim: the LLM's hidden size.
        feature_layer: ``-1``: the encoder's ``last_hidden_state``; else that entry of its
            ``hidden_states`` (LLaVA takes the penultimate layer, ``-2``).
        drop_cls: drop the first (class) token of every sequence (CLIP).
    """

    def __init__(
        self,
        encoder: nn.Module,
        input_name: str,
        enc_dim: int,
        out_dim: int,
        *,
        feature_layer: int = -1,
        drop_cls: bool = False,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.projector = nn.Sequential(
            nn.Linear(enc_dim, out_dim), nn.GELU(), nn.Linear(out_dim, out_dim)
        )
        self.input_name = input_name
        self.feature_layer = feature_layer
        self.drop_cls = drop_cls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.feature_layer != -1
        out = self.encoder(**{self.input_name: x}, output_hidden_states=hidden)
        h = out.hidden_states[self.feature_layer] if hidden else out.last_hidden_state  # (B,N,E)
        if self.drop_cls:
            h = h[:, 1:]
        return self.projector(h)  # (B, N, out_dim)


_VISION_CLASSES = {
    "siglip": "SiglipVisionModel",
    "siglip_vision_model": "SiglipVisionModel",
    "clip": "CLIPVisionModel",
    "clip_vision_model": "CLIPVisionModel",
}


def vision_tower(source: Any, out_dim: int, *, feature_layer: int = -1, **kwargs) -> ModelFactory:
    """A SigLIP or CLIP vision encoder with a projector to ``out_dim`` (LLaVA-style).

    Args:
        source: ``SiglipVisionConfig``/``CLIPVisionConfig``, a dict with ``model_type``
            (``siglip_vision_model``, ``clip_vision_model``) or a local directory of a SigLIP /
            CLIP model (full or vision-only).
        out_dim: the LLM's hidden size (``causal_lm(...).hidden_size``).
        feature_layer: which hidden state feeds the projector (``-1``: the last).
        **kwargs: passed to ``from_config`` / ``from_pretrained``.

    The factory's ``num_tokens`` is the image tokens per image (patches; CLIP's class token
    is dropped), ``image_spec`` the ``maestro.data.ImageSpec`` its pixel values follow.
    """
    import transformers

    path = None
    if isinstance(source, (str, Path)):
        path = _local_dir(source, "vision_tower")
        config = _local_config(path)
    else:
        config = _as_config(source, "vision_tower")
    model_type = config.model_type
    if model_type not in _VISION_CLASSES:
        raise ValueError(
            f"vision_tower: model_type {model_type!r} is not supported; use a SigLIP or CLIP "
            "vision config"
        )
    cls = getattr(transformers, _VISION_CLASSES[model_type])
    vconfig = getattr(config, "vision_config", config)
    drop_cls = vconfig.model_type == "clip_vision_model"
    num_tokens = (vconfig.image_size // vconfig.patch_size) ** 2
    enc_dim = int(vconfig.hidden_size)

    def build() -> nn.Module:
        if path is not None and not _on_meta():
            enc = cls.from_pretrained(str(path), local_files_only=True, **kwargs)
        else:
            enc = cls._from_config(copy.deepcopy(vconfig), **kwargs)
        return Tower(
            enc, "pixel_values", enc_dim, out_dim, feature_layer=feature_layer, drop_cls=drop_cls
        )

    from maestro.data import ImageSpec

    mean, std = _IMAGE_STATS[vconfig.model_type]
    spec = ImageSpec(
        size=(int(vconfig.image_size), int(vconfig.image_size)),
        channels=int(vconfig.num_channels),
        mean=mean[: vconfig.num_channels],
        std=std[: vconfig.num_channels],
    )
    return ModelFactory(
        build,
        vconfig,
        f"vision tower {vconfig.model_type}",
        out_dim=int(out_dim),
        num_tokens=num_tokens,
        image_spec=spec,
    )


def audio_tower(source: Any, out_dim: int, **kwargs) -> ModelFactory:
    """The Whisper encoder with a projector to ``out_dim``.

    Args:
        source: a ``WhisperConfig``, a dict with ``model_type = "whisper"`` or a local Whisper
            directory (its encoder is kept).
        out_dim: the LLM's hidden size.
        **kwargs: passed to ``from_pretrained``.

    Whisper takes ``input_features`` of shape ``(num_mel_bins, 2 * max_source_positions)``
    (factory's ``feature_shape``) and gives ``max_source_positions`` tokens (``num_tokens``).
    """
    from transformers.models.whisper.modeling_whisper import WhisperEncoder, WhisperModel

    path = None
    if isinstance(source, (str, Path)):
        path = _local_dir(source, "audio_tower")
        config = _local_config(path)
    else:
        config = _as_config(source, "audio_tower")
    if config.model_type != "whisper":
        raise ValueError(
            f"audio_tower: model_type {config.model_type!r} is not supported; use a WhisperConfig"
        )
    enc_dim = int(config.d_model)

    def build() -> nn.Module:
        if path is not None and not _on_meta():
            model = WhisperModel.from_pretrained(str(path), local_files_only=True, **kwargs)
            enc = model.get_encoder()
        else:
            enc = WhisperEncoder(copy.deepcopy(config))
        return Tower(enc, "input_features", enc_dim, out_dim)

    return ModelFactory(
        build,
        config,
        "audio tower whisper",
        out_dim=int(out_dim),
        num_tokens=int(config.max_source_positions),
        feature_shape=(int(config.num_mel_bins), 2 * int(config.max_source_positions)),
    )
