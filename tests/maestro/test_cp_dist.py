"""Context parallelism (``cp``) over real gloo ranks equals the single-process step.

Each launch trains 3 steps (float64) and compares every trainable section's weights and the
losses to ``reference_train`` (<= 1e-10 relative). The KD samples are 4..12 tokens long, so
most are not a multiple of ``2 * cp`` (uneven chunks).
"""

import pytest
import torch

from maestro import config as C
from maestro.runtime import RunOptions, launch, reference_train
from maestro.runtime import checkpoint as ck
from maestro.workloads import get_workload

pytestmark = pytest.mark.dist

KD = """
global_batch = 6
steps = 3
dtype = "float64"
scheduler = "{scheduler}"
[workload]
name = "kd"
vocab_size = 32
seq_len_min = 4
seq_len_max = 12
teacher_dim = 16
teacher_layers = 1
student_dim = 16
student_layers = 2
heads = 2
[sections.teacher]
micro_batch_size = 3
frozen = true
{teacher}
[sections.student]
micro_batch_size = 2
lr = 0.01
grad_clip = 0.5
{student}
"""


def _rel_err(saved, ref):
    num = sum(((saved[k].double() - ref[k].double()) ** 2).sum() for k in ref)
    den = sum((ref[k].double() ** 2).sum() for k in ref)
    return float((num / den).sqrt())


def _run_and_compare(tmp_path, text, trained, **opts):
    cfg = C.loads(text)
    res = launch(
        cfg, opts=RunOptions(save_dir=str(tmp_path), progress=False, **opts), timeout_s=300
    )
    graph, losses = reference_train(cfg)
    for name in trained:
        init = get_workload(cfg).build_module(name).state_dict()
        ref = graph[name].module.state_dict()
        assert max(float((ref[k] - init[k]).abs().max()) for k in ref) > 1e-4, name
        err = _rel_err(torch.load(tmp_path / f"{name}.pt"), ref)
        assert err <= 1e-10, f"{name}: relative error {err:.3g}"
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )
    return cfg, res


CASES = {
    # a frozen teacher split over 2 ranks sends whole logits to a plain student
    "kd-teacher_cp2": ("cp = 2", "", "fifo"),
    # the student's sequences split over 2 ranks inside each of 2 FSDP replicas; the teacher's
    # whole logits are cut per share and their padding micro-batches run on both CP ranks
    "kd-student_cp2xfsdp2": ("", "cp = 2\nfsdp = 2", "wavefront"),
    # recompute: the blocks' forwards run again in the backward, ring attention included
    "kd-student_cp2_recompute": ("", "cp = 2\nrecompute = true", "fifo"),
    # both split; the student's 2 CP ranks per each of 2 plain replicas
    "kd-teacher_cp2-student_dp2xcp2": ("cp = 2", "dp = 2\ncp = 2", "fifo"),
    # each CP rank's pipeline: the teacher forward-only over 2 stages, the student 1F1B
    "kd-teacher_pp2xcp2-student_pp2xcp2": ("pp = 2\ncp = 2", "pp = 2\ncp = 2", "fifo"),
    # ZeRO-1 over the 2 replicas x 2 CP ranks (the flat gradient-sum group)
    "kd-student_dp2xcp2_zero1": ("", "dp = 2\ncp = 2\nzero = 1", "fifo"),
    # CP groups of TP groups: the student's heads split over 2 ranks, its sequence over 2
    "kd-teacher_cp2xtp2-student_cp2xtp2": ("cp = 2\ntp = 2", "cp = 2\ntp = 2", "fifo"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_equals_reference(tmp_path, case):
    teacher, student, scheduler = CASES[case]
    text = KD.format(teacher=teacher, student=student, scheduler=scheduler)
    if "pp2" in case:  # a block per stage
        text = text.replace("teacher_layers = 1", "teacher_layers = 2")
    cfg, res = _run_and_compare(tmp_path, text, ["student"])
    if "zero1" in case:  # AdamW's two moments sharded over dp x cp = 4 ranks
        n = sum(p.numel() * 8 for p in get_workload(cfg).build_module("student").parameters())
        for m in [m for m in res["state_bytes"] if m["label"].startswith("student[")]:
            assert abs(m["optimizer"] / (2 * n / 4) - 1) < 0.10, m
    # uneven lengths: most samples are not a multiple of 2 x cp tokens
    lengths = [s["tokens"].numel() for step in range(3) for s in get_workload(cfg).batch(step)]
    assert sum(n % 4 != 0 for n in lengths) > len(lengths) // 2, lengths


def _resume_across(tmp_path, first: str, second: str, trained):
    """2 steps under ``first`` (checkpointed), 2 more resumed under ``second``: weights and all
    4 losses equal the single-process ``reference_train``."""
    d = tmp_path / "ckpt"
    cfg1 = C.loads(first.replace("steps = 3", "steps = 2"))
    launch(cfg1, opts=RunOptions(progress=False, checkpoint_every=2, checkpoint_dir=str(d)))
    found = ck.latest(d)
    assert found is not None and found.next_step == 2
    cfg2 = C.loads(second.replace("steps = 3", "steps = 4"))
    out = tmp_path / "out"
    res = launch(
        cfg2,
        opts=RunOptions(progress=False, checkpoint_dir=str(d), resume=True, save_dir=str(out)),
        timeout_s=300,
    )
    assert res["start_step"] == 2
    graph, losses = reference_train(cfg2)
    for name in trained:
        err = _rel_err(torch.load(out / f"{name}.pt"), graph[name].module.state_dict())
        assert err <= 1e-10, f"{name}: relative error {err:.3g} after resuming"
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )


def test_cp_checkpoint_resumes_under_cp1_and_back(tmp_path):
    """A checkpoint is whole per section: student cp=2 x fsdp=2 -> cp=1, cp=1 -> cp=2, and
    pp=2 x cp=2 -> cp=2."""
    kd = KD.replace("{scheduler}", "fifo")
    _resume_across(
        tmp_path / "a",
        kd.format(teacher="cp = 2", student="cp = 2\nfsdp = 2"),
        kd.format(teacher="", student=""),
        ["student"],
    )
    _resume_across(
        tmp_path / "b",
        kd.format(teacher="", student="dp = 2"),
        kd.format(teacher="", student="cp = 2"),
        ["student"],
    )
    # a pipelined CP section writes one whole file too (its stages gathered once)
    _resume_across(
        tmp_path / "c",
        kd.format(teacher="", student="pp = 2\ncp = 2"),
        kd.format(teacher="", student="cp = 2"),
        ["student"],
    )


def test_hf_kd_teacher_cp2_equals_plain_loop(tmp_path, kd_data):
    """The Hugging Face KD example (Llama, SDPA attention, rotary positions) with its frozen
    teacher at cp = 2 and its student at cp = 2 x dp = 1 beside it: 4 ranks."""
    from test_hf_dist import EXAMPLES, check, plain_kd_loop
    from test_hf_dist import KD as HF_KD

    text = HF_KD.format(dtype="float64", examples=EXAMPLES, data=kd_data, student_dp="1\ncp = 2")
    cfg = C.loads(text.replace("frozen = true", "frozen = true\ncp = 2"))
    res = launch(cfg, 4, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check(cfg, res, tmp_path, plain_kd_loop, 1e-10)


@pytest.fixture(scope="module")
def kd_data(tmp_path_factory):
    from test_hf_dist import make_data

    return make_data("hf_kd", tmp_path_factory.mktemp("kd") / "train.jsonl", 24, 64, 4, 20, seed=3)


def test_a_forward_cp_cannot_split_is_refused_in_one_line(tmp_path):
    """The user-blocks job runs its student once per sample: refused before any update, one
    line naming the section."""
    import test_user_blocks as U

    cfg = C.load(U.write_job(tmp_path, "", "cp = 2", "classes", "{}"))
    with pytest.raises(ValueError, match=r"^sections\.student\.cp") as e:
        launch(cfg, opts=RunOptions(progress=False), timeout_s=120)
    assert "\n" not in str(e.value)


def test_hf_kd_eval_under_cp_equals_eval_without(tmp_path, kd_data):
    """``[eval]``: the held-out loss of a teacher cp=2 / student cp=2 run equals the same
    run's at cp=1 (forward only, whole-sequence sums over the CP group)."""
    from test_hf_dist import EXAMPLES
    from test_hf_dist import KD as HF_KD

    base = HF_KD.format(dtype="float64", examples=EXAMPLES, data=kd_data, student_dp=1)
    base += f'[eval]\ndata = "{kd_data}"\nevery = 3\nbatches = 2\n'
    split = base.replace("frozen = true", "frozen = true\ncp = 2").replace(
        'optimizer = "AdamW"', 'optimizer = "AdamW"\ncp = 2'
    )
    got = [
        launch(C.loads(text), opts=RunOptions(progress=False), timeout_s=240)["eval"]
        for text in (split, base)
    ]
    assert [r["step"] for r in got[0]] == [3]
    a, b = got[0][0]["eval/loss"], got[1][0]["eval/loss"]
    assert abs(a - b) <= 1e-10 * abs(b), (a, b)


def test_bf16_cp_runs_close_to_reference():
    """``dtype = "bfloat16"``: ring attention under autocast stays within bf16 rounding."""
    text = KD.format(teacher="cp = 2", student="cp = 2", scheduler="fifo")
    cfg = C.loads(text.replace('dtype = "float64"', 'dtype = "bfloat16"'))
    res = launch(cfg, opts=RunOptions(progress=False), timeout_s=300)
    _, losses = reference_train(cfg)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), rtol=3e-2, atol=0)


def test_mllm_llm_cp2_beside_vision_dp2_equals_reference(tmp_path):
    """The LLM splits its interleaved text-and-image sequence over 2 ranks (its
    ``SequenceSplit``: an image's tokens may straddle two chunks) while the vision encoder runs
    whole images on 2 plain replicas; text-only samples skip the encoder."""
    from test_parallel_dist import MLLM

    _run_and_compare(tmp_path, MLLM.format(vision="dp = 2", llm="cp = 2"), ["vision", "llm"])


def test_hf_mllm_llm_cp2_equals_plain_loop(tmp_path, mllm_data):
    """The Hugging Face MLLM example (a ViT tower, a Llama with GQA over ``inputs_embeds``):
    its LLM at cp = 2 (image placeholders cut with their embedding rows) beside the vision
    tower at dp = 1: 3 ranks."""
    from test_hf_dist import EXAMPLES, check, plain_mllm_loop
    from test_hf_dist import MLLM as HF_MLLM

    text = HF_MLLM.format(dtype="float64", examples=EXAMPLES, data=mllm_data)
    cfg = C.loads(text.replace("[sections.llm]\ndp = 2", "[sections.llm]\ndp = 1\ncp = 2"))
    assert cfg.sections["llm"].cp == 2
    res = launch(cfg, 3, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check(cfg, res, tmp_path, plain_mllm_loop, 1e-10)


@pytest.fixture(scope="module")
def mllm_data(tmp_path_factory):
    from test_hf_dist import make_data

    return make_data("hf_mllm", tmp_path_factory.mktemp("mllm"), 24, 64, 0.4, 4, 20, 24)


TRAINABLE_PRODUCER_JOB = """
import torch
import torch.nn.functional as F
from torch import nn

from maestro import Job, Section
from maestro.workloads.data import BigramLanguage, long_tailed_lengths, seed_for
from maestro.workloads.layers import Decoder, pad_stack


def job(config):
    language = BigramLanguage(16, config.seed)

    def body(module, samples, inputs):  # a trained decoder: per-token outputs of two kinds
        lg = module(pad_stack([s["tokens"] for s in samples]))
        return [
            {"pred": lg[i, : s["tokens"].numel() - 1], "pos": lg[i, : s["tokens"].numel()]}
            for i, s in enumerate(samples)
        ]

    def head(module, samples, inputs):  # a per-sample sink over them
        outs = []
        for s, got in zip(samples, inputs["body"]):
            ce = F.cross_entropy(module(got["pred"]), s["tokens"][1:], reduction="sum")
            outs.append({"loss": ce + 0.01 * (got["pos"] ** 2).sum()})
        return outs

    def batches(step):
        g = torch.Generator().manual_seed(seed_for("batch", config.seed, step))
        lens = long_tailed_lengths(g, config.global_batch, 4, 11)
        return [{"tokens": t} for t in language.sample(g, lens)]

    return Job(
        [
            Section("body", lambda: Decoder(16, 8, 2, 2, 16), forward=body),
            Section("head", lambda: nn.Linear(16, 16), inputs=["body"], forward=head),
        ],
        batches=batches,
    )
"""


def test_trainable_cp_producer_sends_its_pieces_and_gets_their_gradients(tmp_path):
    """A trained producer at cp = 2 (each CP rank sends its own rows of per-token outputs,
    per position and per prediction; the consumer assembles them) feeding a plain sink; its
    gradients come back whole and each CP rank keeps its rows'."""
    (tmp_path / "cpjob.py").write_text(TRAINABLE_PRODUCER_JOB)
    path = tmp_path / "run.toml"
    path.write_text(
        """
global_batch = 6
steps = 3
dtype = "float64"
scheduler = "fifo"
[workload]
name = "cpjob:job"
[sections.body]
cp = 2
micro_batch_size = 2
lr = 0.01
[sections.head]
micro_batch_size = 3
lr = 0.01
"""
    )
    cfg = C.load(path)
    res = launch(cfg, opts=RunOptions(save_dir=str(tmp_path / "out"), progress=False))
    graph, losses = reference_train(cfg)
    for name in ("body", "head"):
        err = _rel_err(torch.load(tmp_path / "out" / f"{name}.pt"), graph[name].module.state_dict())
        assert err <= 1e-10, f"{name}: relative error {err:.3g}"
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )


def test_sharded_checkpoint_of_cp_x_fsdp_resumes_without_cp(tmp_path):
    """``--checkpoint-format sharded``: the CP ranks of a cp=2 x fsdp=2 student hold the same
    shards; its DCP checkpoint resumes under fsdp=2 alone, exactly."""
    kd = KD.replace("{scheduler}", "fifo")
    d = tmp_path / "ckpt"
    first = C.loads(
        kd.format(teacher="", student="cp = 2\nfsdp = 2").replace("steps = 3", "steps = 2")
    )
    opts = {"checkpoint_dir": str(d), "checkpoint_format": "sharded", "progress": False}
    launch(first, opts=RunOptions(checkpoint_every=2, **opts))
    second = C.loads(kd.format(teacher="", student="fsdp = 2").replace("steps = 3", "steps = 4"))
    out = tmp_path / "out"
    res = launch(second, opts=RunOptions(resume=True, save_dir=str(out), **opts), timeout_s=300)
    assert res["start_step"] == 2
    graph, losses = reference_train(second)
    err = _rel_err(torch.load(out / "student.pt"), graph["student"].module.state_dict())
    assert err <= 1e-10, err
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )
