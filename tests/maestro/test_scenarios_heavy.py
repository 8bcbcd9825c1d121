"""The paper-like scenarios (issue 30, item 5): their statistics are what the docs state."""

from __future__ import annotations

import statistics

import pytest

from maestro.plan.workload import ScenarioSpec, scenario_workload
from maestro.sim.scenarios import HEAVY_BATCH, HEAVY_SHAPES, build


def test_kd_teacher_is_ten_times_the_student_and_lengths_reach_32k():
    sc = build("kd-72b", 256)
    shapes = sc.cost_model.shapes
    assert shapes["teacher"].params >= 10 * shapes["student"].params
    lens = [s.cost["tokens"] for s in sc.samples]
    assert len(lens) == HEAVY_BATCH["kd-72b"]
    assert min(lens) >= 64 and max(lens) <= 32768
    assert statistics.median(lens) == pytest.approx(2048, rel=0.15)
    # long tail: log-normal sigma 1 puts ~2% beyond 16k (8x the median)
    assert 0.005 < sum(t > 16384 for t in lens) / len(lens) < 0.05


def test_mllm_vl_dynamic_resolution():
    sc = build("mllm-vl", 256)
    vit = sc.cost_model.shapes["vision"]
    assert 0.6e9 < vit.params < 0.75e9  # Qwen2-VL's ViT: ~0.67B
    img = [s for s in sc.samples if "vision" in s.sections]
    text_only = 1 - len(img) / len(sc.samples)
    assert text_only == pytest.approx(0.3, abs=0.03)
    counts = [s.cost["images"] for s in img]
    assert min(counts) == 1 and max(counts) == 4
    assert sum(c == 1 for c in counts) / len(counts) == pytest.approx(0.7, abs=0.04)
    for s in img:
        per = s.cost["vision_tokens"] / s.cost["images"]
        assert 4 <= per <= 16384
        # the sum of squares of k images lies between k * mean^2 and (k * mean)^2
        k, vt, sq = s.cost["images"], s.cost["vision_tokens"], s.cost["vision_sq"]
        assert vt * vt / k - 1e-6 <= sq <= vt * vt + 1e-6
    per_image = [s.cost["vision_tokens"] for s in img if s.cost["images"] == 1]
    # log-uniform over [4, 16384]: the median near sqrt(4 * 16384) = 256
    assert statistics.median(per_image) == pytest.approx(256, rel=0.35)
    # the ViT is a real share of the work now, not the light case's ~6%
    cm = sc.cost_model
    from maestro.costmodel import micro_batch_features

    vis = sum(cm.forward_time("vision", micro_batch_features([s.cost])) for s in img[:200])
    llm = sum(cm.forward_time("llm", micro_batch_features([s.cost])) for s in img[:200])
    assert vis > 0.1 * llm


def test_mllm_internvl_tiles():
    sc = build("mllm-internvl", 256)
    vit = sc.cost_model.shapes["vision"]
    assert 5.5e9 < vit.params < 6.2e9  # InternViT-6B
    assert vit.tokens_per_unit == 1025
    img = [s for s in sc.samples if "vision" in s.sections]
    tiles = [s.cost["tiles"] for s in img]
    assert min(tiles) == 1 and max(tiles) == 12
    for s in img[:50]:
        assert s.cost["tokens"] >= 256 * s.cost["tiles"]


@pytest.mark.parametrize("name", sorted(HEAVY_SHAPES))
def test_heavy_scenarios_keep_their_batch_across_budgets(name):
    small = scenario_workload(ScenarioSpec(name=name, gpus=64))
    big = scenario_workload(ScenarioSpec(name=name, gpus=1024))
    assert len(small.samples) == len(big.samples) == HEAVY_BATCH[name]
    assert [s.cost for s in small.samples] == [s.cost for s in big.samples]


def test_light_aliases_and_unknown_names():
    assert [s.cost for s in build("kd-light", 16).samples] == [
        s.cost for s in build("kd", 16).samples
    ]
    with pytest.raises(ValueError, match="kd-72b"):
        build("kd-999b", 16)


def test_internvl_baselines_run_a_blank_tile_for_text_only_samples():
    wl = scenario_workload(ScenarioSpec(name="mllm-internvl", gpus=256))
    assert wl.baseline_samples is not None and len(wl.baseline_samples) == len(wl.samples)
    for ours, theirs in zip(wl.samples, wl.baseline_samples):
        assert "vision" in theirs.sections
        if "vision" in ours.sections:
            assert theirs == ours
        else:  # one blank tile: the encoder runs, the LLM reads its 256 tokens
            assert theirs.cost["tiles"] == 1
            assert theirs.cost["tokens"] == ours.cost["tokens"] + 256
    assert scenario_workload(ScenarioSpec(name="mllm-vl", gpus=64)).baseline_samples is None
