"""Workloads: deterministic data, modality mix, activation sets, seeded init, loss details."""

import math

import pytest
import torch

from maestro import config as C
from maestro.runtime.local import compound_loss
from maestro.workloads import get_workload
from maestro.workloads.data import BigramLanguage, draw_kinds, long_tailed_lengths

KD = """
global_batch = 12
dtype = "float64"
[workload]
name = "kd"
vocab_size = 40
seq_len_min = 4
seq_len_max = 20
teacher_dim = 16
teacher_layers = 2
student_dim = 8
student_layers = 1
heads = 2
{extra}
[sections.teacher]
frozen = true
micro_batch_size = 4
[sections.student]
dp = {dp}
"""

MLLM = """
global_batch = 24
dtype = "float64"
[workload]
name = "mllm"
vocab_size = 40
seq_len_min = 4
seq_len_max = 20
llm_dim = 8
llm_layers = 1
heads = 2
vision_dim = 8
vision_layers = 1
image_patches = 3
patch_dim = 6
audio_dim = 8
audio_frames = 2
frame_dim = 5
mix = { text = 0.4, image = 0.45, "image+audio" = 0.15 }
[sections.vision]
[sections.audio]
[sections.llm]
"""


def kd(extra="", dp=1):
    return C.loads(KD.format(extra=extra, dp=dp))


def test_batches_are_deterministic_and_differ_per_step():
    a, b = get_workload(kd()), get_workload(kd())
    b0, b0again, b1 = a.batch(0), b.batch(0), a.batch(1)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(b0, b0again))
    assert any(
        x["tokens"].shape != y["tokens"].shape or not torch.equal(x["tokens"], y["tokens"])
        for x, y in zip(b0, b1)
    )
    assert [s["id"] for s in b0] == list(range(12))


def test_language_follows_its_bigram_chain():
    lang = BigramLanguage(50, seed=3)
    seqs = lang.sample(torch.Generator().manual_seed(0), [30, 5, 17])
    assert [s.numel() for s in seqs] == [30, 5, 17]
    for s in seqs:
        for a, b in zip(s[:-1].tolist(), s[1:].tolist()):
            assert b in lang.successors[a].tolist()


def test_lengths_are_long_tailed_within_bounds():
    lens = torch.tensor(
        long_tailed_lengths(torch.Generator().manual_seed(0), 4000, 16, 512), dtype=torch.float64
    )
    assert lens.min() >= 16 and lens.max() <= 512
    median, mean = lens.median().item(), lens.mean().item()
    assert mean > 1.2 * median  # right-skewed
    assert (lens > 4 * median).float().mean() > 0.01  # a real tail
    assert (lens == 512).float().mean() < 0.03  # mostly not clipped


def test_modality_mix_matches_shares():
    mix = {"text": 0.4, "image": 0.45, "image+audio": 0.15}
    n = 6000
    kinds = draw_kinds(torch.Generator().manual_seed(1), n, mix)
    for k, p in mix.items():
        got = kinds.count(k) / n
        assert abs(got - p) < 4 * math.sqrt(p * (1 - p) / n), (k, got)


def test_sample_infos_activate_sections_by_modality():
    cfg = C.loads(MLLM)
    wl = get_workload(cfg)
    batch = wl.batch(0)
    graph = wl.graph(build=[])
    infos = wl.sample_infos(batch, graph)
    kinds = {s["kind"] for s in batch}
    assert {"text", "image", "image+audio"} <= kinds
    for s, info in zip(batch, infos):
        assert info.sample_id == s["id"]
        want = (
            {"llm"}
            | ({"vision"} if "image" in s else set())
            | ({"audio"} if "audio" in s else set())
        )
        assert info.sections == want
        assert info.cost["text_tokens"] == s["tokens"].numel()
        assert (
            info.cost["tokens"]
            == s["tokens"].numel() + 3 * info.cost["images"] + 2 * info.cost["audio"]
        )


def test_init_depends_on_seed_and_name_only():
    a = get_workload(kd(dp=1)).build_module("student").state_dict()
    b = get_workload(kd(dp=2)).build_module("student").state_dict()
    for k in a:
        assert torch.equal(a[k], b[k])
    assert a["tok.weight"].dtype == torch.float64
    t = get_workload(kd()).build_module("teacher")
    assert not any(p.requires_grad for p in t.parameters())
    c = get_workload(
        C.loads(KD.format(extra="", dp=1).replace("global_batch", "seed = 1\nglobal_batch"))
    )
    assert not torch.equal(c.build_module("student").state_dict()["tok.weight"], a["tok.weight"])


def test_teacher_is_several_times_the_student():
    wl = get_workload(C.load("examples/kd.toml"))
    n = {s: sum(p.numel() for p in wl.build_module(s).parameters()) for s in ("teacher", "student")}
    assert n["teacher"] >= 3 * n["student"]


def test_top_k_with_full_vocab_equals_full_distribution():
    full, topk = get_workload(kd()), get_workload(kd(extra="top_k = 40"))
    gf, gt = full.graph(), topk.graph()
    batch = full.batch(0)
    torch.testing.assert_close(compound_loss(gf, batch), compound_loss(gt, batch))
    small = get_workload(kd(extra="top_k = 4"))
    out = small.graph()["teacher"].run(batch[:2], {})
    assert out[0]["top_values"].shape == (batch[0]["tokens"].numel() - 1, 4)
    assert out[0]["top_indices"].dtype == torch.int64


def test_kd_loss_is_ce_plus_scaled_kl():
    wl = get_workload(kd(extra="alpha = 0.0"))
    g = wl.graph()
    s = wl.batch(0)[0]
    logits = g["student"].module(s["tokens"][None])[0, :-1]
    want = torch.nn.functional.cross_entropy(logits, s["tokens"][1:], reduction="sum")
    torch.testing.assert_close(compound_loss(g, [s]), want)
    # alpha = 1, T = 2, against an independent computation: F.kl_div of the teacher's
    # tempered distribution from the student's, times alpha * T**2 (Hinton et al.)
    for top_k in (0, 5):
        g2 = get_workload(kd(extra=f"alpha = 1.0\ntemperature = 2.0\ntop_k = {top_k}")).graph()
        s_logits = g2["student"].module(s["tokens"][None])[0, :-1]  # (L-1, V)
        t_logits = g2["teacher"].module(s["tokens"][None])[0, :-1].detach()
        ce = torch.nn.functional.cross_entropy(s_logits, s["tokens"][1:], reduction="sum")
        log_ps = torch.log_softmax(s_logits / 2.0, -1)
        if top_k:
            vals, idx = t_logits.topk(top_k, -1)
            log_pt = torch.log_softmax(vals / 2.0, -1)
            log_ps = log_ps.gather(-1, idx)
        else:
            log_pt = torch.log_softmax(t_logits / 2.0, -1)
        kl = torch.nn.functional.kl_div(log_ps, log_pt, log_target=True, reduction="sum")
        torch.testing.assert_close(compound_loss(g2, [s]), ce + 1.0 * 2.0**2 * kl)
        assert kl > 0


def test_mllm_splices_encoder_tokens_and_predicts_only_text():
    cfg = C.loads(MLLM)
    wl = get_workload(cfg)
    g = wl.graph()
    batch = wl.batch(0)
    s = next(x for x in batch if x["kind"] == "image+audio")
    # one sample alone and inside a padded micro-batch give the same loss
    alone = compound_loss(g, [s])
    together = compound_loss(g, batch)
    parts = sum(compound_loss(g, [x]) for x in batch)
    torch.testing.assert_close(together, parts)
    # the encoders change the loss only for samples that carry their modality
    text = next(x for x in batch if x["kind"] == "text")
    text_before = compound_loss(g, [text])
    with torch.no_grad():
        for p in g["vision"].module.parameters():
            p.add_(0.5)
    assert torch.equal(compound_loss(g, [text]), text_before)
    assert not torch.allclose(compound_loss(g, [s]), alone)


def test_normaliser_counts_predicted_tokens():
    wl = get_workload(kd())
    batch = wl.batch(0)
    assert wl.normaliser(batch) == sum(s["tokens"].numel() - 1 for s in batch)


@pytest.mark.parametrize(
    "name", ["examples/kd.toml", "examples/mllm.toml", "examples/mllm_audio.toml"]
)
def test_example_workloads_build_and_run_one_sample(name):
    wl = get_workload(C.load(name))
    g = wl.graph()
    batch = wl.batch(0)[:2]
    assert torch.isfinite(compound_loss(g, batch))


def test_image_pool_merges_patches_into_fewer_llm_tokens():
    cfg = C.loads(MLLM.replace("patch_dim = 6", "patch_dim = 6\nimage_pool = 3"))
    wl = get_workload(cfg)
    g = wl.graph()
    batch = wl.batch(0)
    s = next(x for x in batch if "image" in x)
    (out,) = g["vision"].run([s], {})
    assert out["embeds"].shape == (1, 8)  # 3 patches -> 1 token of llm_dim
    info = wl.sample_infos([s], g)[0]
    assert info.cost["tokens"] == s["tokens"].numel() + 1 + 2 * info.cost["audio"]
    assert torch.isfinite(compound_loss(g, batch))
    with pytest.raises(ValueError, match=r"workload\.image_pool must be >= 1 and divide"):
        C.loads(MLLM.replace("patch_dim = 6", "patch_dim = 6\nimage_pool = 2"))
