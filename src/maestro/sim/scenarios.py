"""Paper-like workloads for the simulator on analytical GPU presets.

Each scenario is a global batch of ``SampleInfo`` (synthetic modality mix, long-tailed text
lengths), section specs sized for ``gpus`` (``dp`` proportional to each section's estimated
work), and an ``AnalyticalCostModel`` with the sections' transformer shapes:

- ``kd``: a ~33B frozen teacher and a ~7B student (top-64 logits sent per token).
- ``mllm``: a ~630M ViT encoder (256 patches per image, projected to the LLM width) and a
  ~7B LLM; ``text_only`` of the samples have no image.
- ``mllm-audio``: the same plus a ~300M audio encoder; 40% text-only, 45% one image, 15% image
  and audio.

These three are the light cases (the teacher only 5x the student, the encoder ~6% of the
compute, lengths up to 8k; ``kd-light`` and ``mllm-light`` name them too). The paper-like
heavy cases, at a fixed global batch whatever the GPU budget (strong scaling):

- ``kd-72b``: a Qwen2.5-72B-like frozen teacher and a Qwen2.5-7B-like student (logit KD, top-64
  logits per token sent), long-tailed lengths up to 32k tokens; 1,024 samples per step.
- ``mllm-vl``: a Qwen2-VL-like dynamic-resolution ViT (~0.67B; 4 to 16,384 visual tokens per
  image, merged 4:1 into the LLM, up to 4 images per sample) with a Qwen2.5-7B-like LLM;
  2,048 samples per step.
- ``mllm-internvl``: an InternViT-6B-like encoder on 1 to 12 tiles of 1,025 tokens (256 LLM
  tokens per tile after pixel shuffle) with the same 7B LLM; 2,048 samples per step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from maestro.costmodel import (
    AnalyticalCostModel,
    CostModel,
    GPUPreset,
    SectionShape,
    micro_batch_features,
    preset,
)
from maestro.schedule.graph import check_sections
from maestro.schedule.types import SampleInfo, SectionSpec

PATCHES_PER_IMAGE = 256
AUDIO_TOKENS = 375  # 30 s clip: 1500 encoder frames pooled 4x into LLM tokens
LLM_HIDDEN = 4096
TOP_K = 64

#: Section shapes (parameters: vision ~0.63B, audio ~0.30B, llm/student ~6.6B, teacher ~34B).
#: The encoders are SigLIP- and Whisper-style towers in the scenarios' Hugging Face jobs, which
#: the runtime has no tensor-parallel plan for (``tp_plan=False``); ``maestro.plan.workload``
#: reads this from the jobs' modules when ``transformers`` is installed.
SHAPES: dict[str, SectionShape] = {
    "vision": SectionShape(
        layers=32,
        hidden=1280,
        ffn_hidden=5120,
        unit="images",
        tokens_per_unit=PATCHES_PER_IMAGE,
        out_bytes_per_unit=PATCHES_PER_IMAGE * LLM_HIDDEN * 2,
        tp_plan=False,
    ),
    "audio": SectionShape(
        layers=24,
        hidden=1024,
        ffn_hidden=4096,
        unit="audio",
        tokens_per_unit=1500,
        out_bytes_per_unit=AUDIO_TOKENS * LLM_HIDDEN * 2,
        tp_plan=False,
    ),
    "llm": SectionShape(layers=32, hidden=4096, ffn_hidden=16512, vocab=32000),
    "student": SectionShape(layers=32, hidden=4096, ffn_hidden=16512, vocab=32000),
    "teacher": SectionShape(
        layers=64,
        hidden=5120,
        ffn_hidden=41472,
        vocab=152064,
        out_bytes_per_unit=TOP_K * 6,  # bf16 value + int32 index per kept logit
    ),
}


# Heavy (paper-like) scenarios. Shapes from the models' config.json (maestro.estimate.models
# presets); the encoders keep tp_plan=False (the runtime has no TP plan for their towers).
QWEN7B = SectionShape(
    layers=28, hidden=3584, ffn_hidden=18944, vocab=152064, heads=28, kv_heads=4, gated=True
)
HEAVY_SHAPES: dict[str, dict[str, SectionShape]] = {
    "kd-72b": {
        "teacher": SectionShape(
            layers=80,
            hidden=8192,
            ffn_hidden=29568,
            vocab=152064,
            heads=64,
            kv_heads=8,
            gated=True,
            out_bytes_per_unit=TOP_K * 6,  # bf16 value + int32 index per kept logit
        ),
        "student": QWEN7B,
    },
    "mllm-vl": {
        "vision": SectionShape(
            layers=32,
            hidden=1280,
            ffn_hidden=5120,
            heads=16,
            unit="vision_tokens",
            sq_key="vision_sq",
            out_bytes_per_unit=3584 * 2 / 4,  # 4 patches merged into one bf16 LLM token
            tp_plan=False,
        ),
        "llm": QWEN7B,
    },
    "mllm-internvl": {
        "vision": SectionShape(
            layers=45,
            hidden=3200,
            ffn_hidden=12800,
            heads=25,
            unit="tiles",
            tokens_per_unit=1025,
            out_bytes_per_unit=256 * 3584 * 2,  # pixel shuffle: 256 LLM tokens per tile
            tp_plan=False,
        ),
        "llm": QWEN7B,
    },
}
#: samples per step of the heavy scenarios, the same for every GPU budget
HEAVY_BATCH = {"kd-72b": 1024, "mllm-vl": 2048, "mllm-internvl": 2048}
#: every scenario name (``kd-light`` and ``mllm-light`` are aliases of ``kd`` and ``mllm``)
NAMES = ("kd", "mllm", "mllm-audio", "kd-light", "mllm-light", *HEAVY_SHAPES)
ALIASES = {"kd-light": "kd", "mllm-light": "mllm"}


def vl_samples(num_samples: int, text_only: float = 0.3, seed: int = 0) -> list[SampleInfo]:
    """A dynamic-resolution MLLM batch: ``text_only`` of the samples have no image, the others
    1 image (70%) or 2-4 (30%), each of 4 to 16,384 visual tokens (log-uniform: thumbnails
    to 2k x 2k images at 14-pixel patches); the LLM reads text plus a quarter of the visual
    tokens (2x2 merge)."""
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(text_lengths(rng, num_samples, median=384, hi=8192)):
        if rng.random() < text_only:
            out.append(SampleInfo(i, frozenset({"llm"}), {"tokens": t}))
            continue
        k = 1 if rng.random() < 0.7 else rng.randint(2, 4)
        imgs = [int(math.exp(rng.uniform(math.log(4), math.log(16384)))) for _ in range(k)]
        vt = float(sum(imgs))
        cost = {
            "tokens": t + sum(math.ceil(v / 4) for v in imgs),
            "images": k,
            "vision_tokens": vt,
            "vision_sq": float(sum(v * v for v in imgs)),
        }
        out.append(SampleInfo(i, frozenset({"vision", "llm"}), cost))
    return out


def internvl_samples(num_samples: int, text_only: float = 0.3, seed: int = 0) -> list[SampleInfo]:
    """An InternVL batch: ``text_only`` of the samples have no image; the others 1 to 12 tiles
    (uniform, InternVL's dynamic tiling of 448-pixel tiles plus a thumbnail), 256 LLM tokens
    per tile."""
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(text_lengths(rng, num_samples, median=384, hi=8192)):
        if rng.random() < text_only:
            out.append(SampleInfo(i, frozenset({"llm"}), {"tokens": t}))
            continue
        tiles = rng.randint(1, 12)
        out.append(
            SampleInfo(
                i,
                frozenset({"vision", "llm"}),
                {"tokens": t + 256 * tiles, "images": 1, "tiles": tiles},
            )
        )
    return out


def blank_tiles(samples: list[SampleInfo]) -> list[SampleInfo]:
    """``samples`` as InternVL's fine-tuning script runs them: a text-only sample gets one
    blank tile (its encoder runs, and 256 more LLM tokens), so every sample runs the ViT."""
    out = []
    for s in samples:
        if "vision" in s.sections:
            out.append(s)
            continue
        cost = {**s.cost, "tokens": s.cost["tokens"] + 256, "images": 1, "tiles": 1}
        out.append(SampleInfo(s.sample_id, s.sections | {"vision"}, cost))
    return out


def kd_long_samples(num_samples: int, seed: int = 0) -> list[SampleInfo]:
    """A long-context KD batch: log-normal lengths (median 2,048) clipped to [64, 32,768]."""
    rng = random.Random(seed)
    return [
        SampleInfo(i, frozenset({"teacher", "student"}), {"tokens": t})
        for i, t in enumerate(text_lengths(rng, num_samples, median=2048, lo=64, hi=32768))
    ]


@dataclass
class Scenario:
    """A simulated workload.

    Args:
        name: scenario name.
        samples: the global batch.
        sections: section specs (``dp`` sums to the GPU count).
        cost_model: the analytical cost model.
        baseline_samples: the same batch as a conventional trainer runs it, when that
            differs (``mllm-internvl``: InternVL's fine-tuning script feeds a text-only sample
            one blank 448-pixel tile, so its encoder runs on every sample); ``None``: as
            ``samples``.
    """

    name: str
    samples: list[SampleInfo]
    sections: list[SectionSpec]
    cost_model: CostModel
    baseline_samples: list[SampleInfo] | None = None


def text_lengths(
    rng: random.Random,
    n: int,
    median: float = 384,
    sigma: float = 1.0,
    lo: int = 32,
    hi: int = 4096,
) -> list[int]:
    """Long-tailed (log-normal, clipped) text lengths in tokens."""
    mu = math.log(median)
    return [int(min(hi, max(lo, rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def mllm_samples(
    num_samples: int, text_only: float = 0.4, audio: float = 0.0, seed: int = 0
) -> list[SampleInfo]:
    """An MLLM batch: ``text_only`` samples have no image, ``audio`` have an image and audio.

    LLM ``tokens`` count text plus the image (256) and audio (375) tokens the LLM consumes.
    """
    if not 0 <= text_only <= 1 or not 0 <= audio <= 1 - text_only:
        raise ValueError(f"need 0 <= text_only ({text_only}) and 0 <= audio <= 1 - text_only")
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(text_lengths(rng, num_samples)):
        u = rng.random()
        if u < text_only:
            out.append(SampleInfo(i, frozenset({"llm"}), {"tokens": t}))
        elif u < text_only + audio:
            tok = t + PATCHES_PER_IMAGE + AUDIO_TOKENS
            out.append(
                SampleInfo(
                    i,
                    frozenset({"vision", "audio", "llm"}),
                    {"tokens": tok, "images": 1, "audio": 1},
                )
            )
        else:
            out.append(
                SampleInfo(
                    i, frozenset({"vision", "llm"}), {"tokens": t + PATCHES_PER_IMAGE, "images": 1}
                )
            )
    return out


def kd_samples(num_samples: int, seed: int = 0) -> list[SampleInfo]:
    """A KD batch: every sample runs teacher and student on the same tokens."""
    rng = random.Random(seed)
    return [
        SampleInfo(i, frozenset({"teacher", "student"}), {"tokens": t})
        for i, t in enumerate(text_lengths(rng, num_samples, median=1024, hi=8192))
    ]


def proportional_dp(
    samples: Sequence[SampleInfo], sections: Sequence[SectionSpec], cost_model: CostModel, gpus: int
) -> list[SectionSpec]:
    """Give each section ``dp`` proportional to its estimated step work (at least 1).

    Work is the forward (and, if trainable, backward) time of the section's samples cut into
    full micro-batches in data order. Largest remainders get the leftover GPUs.
    """
    check_sections(sections)
    if gpus < len(sections):
        raise ValueError(f"need at least one GPU per section: {gpus} < {len(sections)}")
    work = []
    for sec in sections:
        costs = [s.cost for s in samples if sec.name in s.sections]
        w = 0.0
        for k in range(0, len(costs), sec.micro_batch_size):
            f = micro_batch_features(costs[k : k + sec.micro_batch_size])
            w += cost_model.forward_time(sec.name, f)
            if not sec.frozen:
                w += cost_model.backward_time(sec.name, f)
        work.append(w)
    total = sum(work) or 1.0
    spare = gpus - len(sections)
    share = [w / total * spare for w in work]
    dp = [1 + int(s) for s in share]
    rest = gpus - sum(dp)
    for k in sorted(range(len(sections)), key=lambda k: share[k] - int(share[k]), reverse=True)[
        :rest
    ]:
        dp[k] += 1
    return [replace(sec, dp=d) for sec, d in zip(sections, dp)]


def build(
    name: str,
    gpus: int,
    num_samples: int | None = None,
    gpu: str | GPUPreset = "H100",
    seed: int = 0,
    text_only: float = 0.4,
) -> Scenario:
    """Build a named scenario for ``gpus`` GPUs.

    Args:
        name: one of ``NAMES``.
        gpus: total GPUs; sections get ``dp`` proportional to their work.
        num_samples: global batch (default: ``HEAVY_BATCH`` for the heavy scenarios, else 8
            per GPU).
        gpu: GPU preset name or object.
        seed: seed of the synthetic batch.
        text_only: text-only share of ``mllm`` (``mllm-audio`` uses 0.4).
    """
    g = preset(gpu) if isinstance(gpu, str) else gpu
    name = ALIASES.get(name, name)
    n = num_samples if num_samples is not None else HEAVY_BATCH.get(name, 8 * gpus)
    if n < 1:
        raise ValueError(f"num_samples must be >= 1, got {n}")
    if name in HEAVY_SHAPES:
        to = 0.3 if text_only == 0.4 else text_only  # (0.4 is the light cases' default)
        if name == "kd-72b":
            samples = kd_long_samples(n, seed)
            secs = [
                SectionSpec("teacher", dp=1, micro_batch_size=1, frozen=True, token_budget=32768),
                SectionSpec(
                    "student", inputs=("teacher",), dp=1, micro_batch_size=1, token_budget=32768
                ),
            ]
        else:
            samples = (vl_samples if name == "mllm-vl" else internvl_samples)(n, to, seed)
            secs = [
                SectionSpec("vision", dp=1, micro_batch_size=4),
                SectionSpec(
                    "llm", inputs=("vision",), dp=1, micro_batch_size=1, token_budget=32768
                ),
            ]
        cm = AnalyticalCostModel(dict(HEAVY_SHAPES[name]), gpu=g)
        base = blank_tiles(samples) if name == "mllm-internvl" else None
        return Scenario(name, samples, proportional_dp(samples, secs, cm, gpus), cm, base)
    if name == "kd":
        samples = kd_samples(n, seed)
        secs = [
            SectionSpec("teacher", dp=1, micro_batch_size=8, frozen=True, token_budget=16384),
            SectionSpec(
                "student", inputs=("teacher",), dp=1, micro_batch_size=2, token_budget=8192
            ),
        ]
    elif name in ("mllm", "mllm-audio"):
        audio = 0.15 if name == "mllm-audio" else 0.0
        to = 0.4 if name == "mllm-audio" else text_only
        samples = mllm_samples(n, to, audio, seed)
        secs = [SectionSpec("vision", dp=1, micro_batch_size=32)]
        if audio:
            secs.append(SectionSpec("audio", dp=1, micro_batch_size=16))
        secs.append(
            SectionSpec(
                "llm",
                inputs=tuple(s.name for s in secs),
                dp=1,
                micro_batch_size=4,
                token_budget=8192,
            )
        )
    else:
        raise ValueError(f"unknown scenario {name!r}; choose one of: {', '.join(NAMES)}")
    cm = AnalyticalCostModel({s.name: SHAPES[s.name] for s in secs}, gpu=g)
    return Scenario(name, samples, proportional_dp(samples, secs, cm, gpus), cm)
