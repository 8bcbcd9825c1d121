"""The Hugging Face examples under Maestro equal a plain PyTorch loop over the same modules.

Real gloo ranks (``maestro.runtime.launch``) train the ``examples/hf_kd`` and
``examples/hf_mllm`` jobs (tiny sizes set from the TOML) for 3 steps with mixed layouts; the
plain loop below is written the way a user would train the same modules in one process:
whole global batches, padded, one optimizer per trainable model.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from maestro import config as C
from maestro.runtime import RunOptions, launch
from maestro.workloads import get_workload

pytestmark = pytest.mark.dist

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

KD = """
global_batch = 8
steps = 3
dtype = "{dtype}"
scheduler = "wavefront"
[workload]
name = "{examples}/hf_kd/job.py:job"
data = "{data}"
vocab_size = 64
max_length = 32
teacher_hidden = 32
teacher_layers = 2
student_hidden = 16
student_layers = 1
heads = 4
alpha = 0.5
temperature = 2.0
[sections.teacher]
dp = 1
micro_batch_size = 8
frozen = true
[sections.student]
dp = {student_dp}
micro_batch_size = 2
optimizer = "AdamW"
lr = 0.01
"""

MLLM = """
global_batch = 8
steps = 3
seed = 1
dtype = "{dtype}"
scheduler = "wavefront"
[workload]
name = "{examples}/hf_mllm/job.py:job"
data = "{data}"
vocab_size = 64
max_length = 48
llm_hidden = 32
llm_layers = 2
llm_heads = 4
llm_kv_heads = 2
vision_hidden = 16
vision_layers = 1
vision_heads = 2
image_size = 16
patch_size = 8
[sections.vision]
dp = 1
micro_batch_size = 3
optimizer = "AdamW"
lr = 0.01
[sections.llm]
dp = 2
micro_batch_size = 2
optimizer = "AdamW"
lr = 0.01
"""


def make_data(example: str, *args, **kwargs):
    spec = importlib.util.spec_from_file_location(
        f"make_data_{example}", EXAMPLES / example / "make_data.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write(*args, **kwargs)


def pad(seqs):
    """``(B, T, ...)`` right-padded with zeros, and the ``(B, T)`` attention mask."""
    t = max(len(s) for s in seqs)
    out = seqs[0].new_zeros((len(seqs), t, *seqs[0].shape[1:]))
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)], mask[i, : len(s)] = s, 1
    return out, mask


def plain_kd_loop(cfg, steps=3, alpha=0.5, temperature=2.0):
    """A user's own distillation loop over the job's modules and global batches."""
    job = get_workload(cfg)
    teacher, student = job.build_module("teacher"), job.build_module("student")
    opt = torch.optim.AdamW(student.parameters(), lr=0.01, weight_decay=0.0, foreach=False)
    losses = []
    for step in range(steps):
        batch = [job.dataset[i] for i in job.indices(step)]
        ids, mask = pad([s["input_ids"] for s in batch])
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, attention_mask=mask).logits.double()
        s_logits = student(input_ids=ids, attention_mask=mask).logits.double()
        keep = mask[:, 1:].bool()  # (B, T-1): positions with a next token
        tgt = ids[:, 1:][keep]
        s_lg, t_lg = s_logits[:, :-1][keep], t_logits[:, :-1][keep]  # (N, V)
        ce = F.cross_entropy(s_lg, tgt, reduction="sum")
        kl = F.kl_div(
            F.log_softmax(s_lg / temperature, -1),
            F.log_softmax(t_lg / temperature, -1),
            log_target=True,
            reduction="sum",
        )
        loss = (ce + alpha * temperature**2 * kl) / keep.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"student": student}, losses


def plain_mllm_loop(cfg, steps=3):
    """A user's own LLaVA-style loop: encode the images, splice them in, train both models."""
    job = get_workload(cfg)
    vision, llm = job.build_module("vision"), job.build_module("llm")
    opts = [
        torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.0, foreach=False)
        for m in (vision, llm)
    ]
    image_token = cfg.model.vocab_size - 1
    losses = []
    for step in range(steps):
        batch = [job.dataset[i] for i in job.indices(step)]
        with_image = [s for s in batch if "pixel_values" in s]
        pix = torch.stack([s["pixel_values"] for s in with_image]).to(torch.float64)
        img_embeds = dict(zip(map(id, with_image), vision(pix)))  # (N_img, D) per sample
        seqs, labels = [], []
        for s in batch:
            ids = s["input_ids"]
            x = llm.get_input_embeddings()(ids)
            is_img = ids == image_token
            if is_img.any():
                start = int(is_img.nonzero()[0])
                n = int(is_img.sum())
                x = torch.cat([x[:start], img_embeds[id(s)], x[start + n :]])
            seqs.append(x)
            labels.append(ids.masked_fill(is_img, -100))
        embeds, mask = pad(seqs)
        y, _ = pad(labels)
        y = y.masked_fill(mask == 0, -100)
        logits = llm(inputs_embeds=embeds, attention_mask=mask).logits
        lg, tg = logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1)
        loss = F.cross_entropy(lg, tg, ignore_index=-100, reduction="sum") / (tg != -100).sum()
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        losses.append(loss.item())
    return {"vision": vision, "llm": llm}, losses


def rel_err(saved: Path, module) -> float:
    sd, ref = torch.load(saved), module.state_dict()
    num = sum(((sd[k].double() - ref[k].double()) ** 2).sum() for k in ref)
    den = sum((ref[k].double() ** 2).sum() for k in ref)
    return float((num / den).sqrt())


def check(cfg, res, save_dir, plain, tol):
    modules, losses = plain(cfg)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), rtol=tol, atol=0)
    for name, m in modules.items():
        err = rel_err(save_dir / f"{name}.pt", m)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"
    return losses


@pytest.fixture(scope="module")
def kd_data(tmp_path_factory):
    return make_data("hf_kd", tmp_path_factory.mktemp("kd") / "train.jsonl", 24, 64, 4, 20, seed=3)


@pytest.fixture(scope="module")
def mllm_data(tmp_path_factory):
    return make_data("hf_mllm", tmp_path_factory.mktemp("mllm"), 24, 64, 0.4, 4, 20, 24)


def test_hf_kd_mixed_layout_equals_plain_loop_float64(tmp_path, kd_data):
    """teacher dp=1 mbs=8 (frozen), student dp=2 mbs=2, wavefront, 3 ranks."""
    cfg = C.loads(KD.format(dtype="float64", examples=EXAMPLES, data=kd_data, student_dp=2))
    res = launch(cfg, 3, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check(cfg, res, tmp_path, plain_kd_loop, 1e-10)


def test_hf_mllm_mixed_layout_equals_plain_loop_float64(tmp_path, mllm_data):
    """vision dp=1 mbs=3, llm dp=2 mbs=2; text-only samples skip the vision rank."""
    cfg = C.loads(MLLM.format(dtype="float64", examples=EXAMPLES, data=mllm_data))
    job = get_workload(cfg)
    kinds = {"pixel_values" in s for step in range(3) for s in job.batch(step)}
    assert kinds == {True, False}
    res = launch(cfg, 3, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check(cfg, res, tmp_path, plain_mllm_loop, 1e-10)


def test_hf_kd_pipelined_equals_plain_loop_float64(tmp_path, kd_data):
    """teacher pp=2 (frozen, forward only over its 2 decoder layers), student pp=2 (1F1B over
    Hugging Face Llama layers, its padding mask and rotary tables made on both stages), 4
    ranks."""
    text = KD.format(dtype="float64", examples=EXAMPLES, data=kd_data, student_dp="1\npp = 2")
    text = text.replace("student_layers = 1", "student_layers = 2")
    text = text.replace("frozen = true", "frozen = true\npp = 2")
    cfg = C.loads(text)
    res = launch(cfg, 4, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check(cfg, res, tmp_path, plain_kd_loop, 1e-10)
