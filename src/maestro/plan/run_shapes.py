"""A run config's own sections priced on an analytical GPU (``maestro plan RUN.toml
--hardware h100-sxm``) instead of timed on this CPU.

Each section's shape is read from its module built on the ``meta`` device: a Hugging Face
model's ``config`` (``maestro.estimate.models.from_hf_config``), else its transformer blocks
(``maestro.parallel.apply.transformer_blocks``: their count, the first linear layer's width,
the widest MLP projection, the block's ``heads``) and, for a decoder, the vocabulary of its
largest token embedding. The batch is the job's own (``Job.sample_infos`` of its first
global batch): a decoder computes the sample's ``tokens``; an encoder the units of the one
cost key present exactly on the samples it runs on (``images``, ``audio``), times its
positions per unit (a learned position table's rows, a vision config's
``(image_size / patch_size) ** 2``, an audio config's ``max_source_positions``). When a
section's shape or unit cannot be read, the ``ValueError`` names the section and what is
missing.
"""

from __future__ import annotations

from maestro.costmodel import AnalyticalCostModel, SectionShape, preset
from maestro.estimate.models import ModelSpec, from_hf_config
from maestro.schedule.types import SampleInfo

#: cost keys that count the decoder's own sequence, never an encoder's inputs
_SEQUENCE_KEYS = ("tokens", "text_tokens")


def _hf_config(module):
    """The Hugging Face config of ``module`` or its first sub-module that has one."""
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            return cfg
    return None


def _from_blocks(name: str, module, parallel) -> ModelSpec:
    import torch

    from maestro.parallel.apply import transformer_blocks

    try:
        blocks = transformer_blocks(module, parallel, f"sections.{name}")
    except ValueError:
        blocks = []
    if not blocks:
        raise ValueError(
            f"--hardware: section {name!r}: no transformer blocks and no Hugging Face config "
            "to read its shape from"
        )
    lins = [m for m in blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    if not lins:
        raise ValueError(f"--hardware: section {name!r}: its blocks have no linear layers")
    hidden = lins[0].in_features
    ffn = max((m.out_features for m in lins if m.in_features == hidden), default=4 * hidden)
    heads = int(getattr(blocks[0], "heads", 0) or max(1, hidden // 64))
    inside = {id(p) for b in blocks for p in b.parameters()}
    embeds = [
        m
        for m in module.modules()
        if isinstance(m, torch.nn.Embedding)
        and m.embedding_dim == hidden
        and id(m.weight) not in inside
    ]
    vocab = max((m.num_embeddings for m in embeds), default=0)
    return ModelSpec(
        name, len(blocks), hidden, heads, heads, ffn, vocab, gated=False, causal=vocab > 0
    )


def _positions_per_unit(name: str, module, hf) -> float:
    """Sequence positions an encoder computes per unit of its cost key."""
    import torch

    if hf is not None:
        d = hf.to_dict()
        d = d.get("vision_config", d)
        if d.get("image_size") and d.get("patch_size"):
            return float((int(d["image_size"]) // int(d["patch_size"])) ** 2)
        if d.get("max_source_positions"):
            return float(d["max_source_positions"])
    pos = getattr(module, "pos", None)
    if isinstance(pos, torch.nn.Parameter) and pos.dim() == 2:
        return float(pos.shape[0])
    if isinstance(pos, torch.nn.Embedding):
        return float(pos.num_embeddings)
    raise ValueError(
        f"--hardware: section {name!r}: cannot tell its positions per input (no vision "
        "config's image_size/patch_size, audio config's max_source_positions or learned "
        "position table)"
    )


def _unit_key(name: str, samples: list[SampleInfo]) -> str:
    """The cost key present (non-zero) exactly on the samples section ``name`` runs on."""
    runs = {s.sample_id for s in samples if name in s.sections}
    keys = sorted({k for s in samples for k in s.cost} - set(_SEQUENCE_KEYS))
    found = [k for k in keys if {s.sample_id for s in samples if s.cost.get(k, 0) > 0} == runs]
    if len(found) != 1:
        what = f"candidates {', '.join(found)}" if found else f"cost keys {', '.join(keys)}"
        raise ValueError(
            f"--hardware: section {name!r}: cannot tell which per-sample cost counts its "
            f"inputs ({what or 'none'}); its job's sample_cost needs one key present exactly "
            "on the samples it runs on"
        )
    return found[0]


def analytical_model(config, samples: list[SampleInfo], hardware: str) -> AnalyticalCostModel:
    """An ``AnalyticalCostModel`` of a run config's sections (their modules' shapes) on
    ``hardware`` (a ``maestro.costmodel`` GPU preset or ``maestro.estimate`` hardware name)."""
    from maestro.plan.modules import meta_graph, section_tp_plans

    gpu = preset(hardware)
    graph = list(meta_graph(config))
    tp_plans = section_tp_plans(config)
    specs: dict[str, tuple[ModelSpec, object]] = {}
    for sec in graph:
        hf = _hf_config(sec.module)
        if hf is not None:
            try:
                spec = from_hf_config(hf.to_dict(), name=sec.name)
            except ValueError as e:
                raise ValueError(f"--hardware: section {sec.name!r}: {e}") from None
        else:
            spec = _from_blocks(sec.name, sec.module, sec.parallel)
        specs[sec.name] = (spec, hf)
    consumers = {s.name: [c.name for c in graph if s.name in c.inputs] for s in graph}
    shapes = {}
    for sec in graph:
        spec, hf = specs[sec.name]
        width = max((specs[c][0].hidden for c in consumers[sec.name]), default=spec.hidden)
        if spec.vocab > 0:
            unit, per, out = "tokens", 1.0, 2.0 * spec.hidden  # a bf16 hidden state per token
        else:
            unit = _unit_key(sec.name, samples)
            per = _positions_per_unit(sec.name, sec.module, hf)
            pool = int(getattr(sec.module, "pool", 1) or 1)
            out = per / pool * width * 2.0  # its positions, merged, as bf16 LLM vectors
        shapes[sec.name] = SectionShape(
            layers=spec.layers,
            hidden=spec.hidden,
            ffn_hidden=spec.ffn,
            vocab=spec.vocab,
            unit=unit,
            tokens_per_unit=per,
            out_bytes_per_unit=out,
            tp_plan=tp_plans.get(sec.name, False),
            heads=spec.heads,
            kv_heads=spec.kv_heads,
            gated=spec.gated,
        )
    return AnalyticalCostModel(shapes, gpu=gpu)


__all__ = ["analytical_model"]
