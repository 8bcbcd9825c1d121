"""``maestro export`` / ``maestro.export``: a trained section out of a checkpoint, as
``save_pretrained`` directories and safetensors, from any layout and format.

Real gloo ranks train a tiny Hugging Face Llama (one sink section) for 2 steps; the export
loads with ``AutoModelForCausalLM.from_pretrained`` and holds exactly the trained weights
(``--save-dir``'s), so its logits equal the trained module's.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import maestro
from maestro import cli
from maestro import config as C
from maestro.runtime import RunOptions, launch

JOB = """
import torch
from torch import nn
from transformers import LlamaConfig

from maestro import Job, Section, hf
from maestro.data import JsonlDataset


def job(config):
    m = config.model
    lm = hf.causal_lm(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ))
    return Job([Section("lm", lm, forward=hf.lm_forward())],
               dataset=JsonlDataset(m["data"]), tokenizer=m.get("tokenizer") or None)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def plain(config):
    def batches(step):
        g = torch.Generator().manual_seed(step)
        return [{"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)}
                for _ in range(config.global_batch)]

    def loss(out, sample):
        return ((out["out"] - sample["y"]) ** 2).sum()

    return Job([Section("net", Net, loss=loss)], batches=batches)
"""

LM = """
global_batch = 4
steps = 2
scheduler = "{scheduler}"
[workload]
name = "job.py:job"
data = "{data}"
tokenizer = "{tokenizer}"
[sections.lm]
micro_batch_size = 1
optimizer = "AdamW"
lr = 0.01
{layout}
"""

PLAIN = """
global_batch = 4
steps = 2
[workload]
name = "job.py:plain"
[sections.net]
micro_batch_size = 2
optimizer = "AdamW"
lr = 0.01
"""


@pytest.fixture(scope="module")
def here(tmp_path_factory):
    """A job file, its JSONL data and a local tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("export_job")
    (d / "job.py").write_text(JOB)
    g = torch.Generator().manual_seed(0)
    with open(d / "train.jsonl", "w") as f:
        for i in range(12):
            n = 6 + i % 5
            f.write(json.dumps({"input_ids": torch.randint(0, 64, (n,), generator=g).tolist()}))
            f.write("\n")
    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(d / "tok")
    return d


def lm_config(here: Path, layout: str, scheduler: str = "fifo", tokenizer: bool = True):
    text = LM.format(
        data=here / "train.jsonl",
        tokenizer=(here / "tok") if tokenizer else "",
        layout=layout,
        scheduler=scheduler,
    )
    path = here / f"run-{abs(hash(text))}.toml"
    path.write_text(text)
    return path


def trained_lm(run: Path, saved: Path):
    """A fresh Llama of the job's shape holding the weights ``--save-dir`` wrote."""
    cfg = C.load(run)
    module = cfg.job().build_module("lm")
    module.load_state_dict(torch.load(saved / "lm.pt"))
    return module.eval()


@pytest.mark.dist
def test_tp2_x_pp2_run_exports_a_from_pretrained_directory(here, tmp_path):
    """``maestro train --export-on-finish lm`` after tp = 2 x pp = 2 (4 ranks): transformers
    loads the directory with the trained weights, bit for bit, and the job's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ck, saved = tmp_path / "ck", tmp_path / "saved"
    run = lm_config(here, "tp = 2\npp = 2")
    argv = ["train", str(run), "--quiet", "--checkpoint-dir", str(ck), "--save-dir", str(saved)]
    assert cli.main([*argv, "--export-on-finish", "lm"]) == 0
    out = ck / "export" / "lm"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    want = torch.load(saved / "lm.pt")
    got = loaded.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    ids = torch.tensor([[3, 17, 5, 42, 8, 60, 1]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trained_lm(run, saved)(ids).logits)
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("w3") == 5

    # the command again: refuses a non-empty --out, then bf16 with --force
    assert cli.main(["export", str(ck), "--section", "lm", "--out", str(out)]) == 2
    args = ["export", str(ck), "--section", "lm", "--out", str(out), "--dtype", "bf16"]
    assert cli.main([*args, "--force"]) == 0
    bf16 = load_file(out / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in bf16.values())
    assert torch.equal(bf16["model.norm.weight"], want["model.norm.weight"].bfloat16())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16


@pytest.mark.dist
def test_sharded_fsdp_checkpoint_exports_the_full_ones_tensors(here, tmp_path):
    """The same fsdp = 2 run, checkpointed full and sharded: the exports are equal tensors."""
    cfg = C.load(lm_config(here, "fsdp = 2", tokenizer=False))
    got = {}
    for fmt in ("full", "sharded"):
        ck = tmp_path / fmt
        opts = RunOptions(
            progress=False, checkpoint_dir=str(ck), checkpoint_every=2, checkpoint_format=fmt
        )
        launch(cfg, 2, opts, timeout_s=240)
        done = maestro.export(ck, "lm", tmp_path / f"out-{fmt}")
        assert (done.kind, done.step, done.tokenizer) == ("hf", 2, False)
        got[fmt] = load_file(done.path / "model.safetensors")
    assert set(got["full"]) == set(got["sharded"])
    for k, v in got["full"].items():
        assert torch.equal(v, got["sharded"][k]), k


@pytest.mark.dist
def test_sharded_cp2_checkpoint_exports_the_trained_weights(here, tmp_path):
    """cp = 2, sharded: the context-parallel ranks' checkpoint exports the trained weights."""
    cfg = C.load(lm_config(here, "cp = 2", tokenizer=False))
    ck, saved = tmp_path / "ck", tmp_path / "saved"
    opts = RunOptions(
        progress=False,
        checkpoint_dir=str(ck),
        checkpoint_every=2,
        checkpoint_format="sharded",
        save_dir=str(saved),
    )
    launch(cfg, 2, opts, timeout_s=240)
    got = load_file(maestro.export(ck, "lm", tmp_path / "out").path / "model.safetensors")
    want = torch.load(saved / "lm.pt")
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.fixture(scope="module")
def plain_run(here, tmp_path_factory):
    """One rank trains the user's own module (``Net``) 2 steps, checkpointing the last."""
    d = tmp_path_factory.mktemp("plain")
    cfg = C.loads(PLAIN, config_dir=here)
    opts = RunOptions(
        progress=False,
        checkpoint_dir=str(d / "ck"),
        checkpoint_every=2,
        save_dir=str(d / "saved"),
    )
    launch(cfg, 1, opts, timeout_s=240)
    return d


@pytest.mark.dist
def test_own_module_exports_safetensors_and_loads_back(plain_run, tmp_path):
    done = maestro.export(plain_run / "ck", "net", tmp_path / "net")
    assert done.kind == "module"
    rec = json.loads((tmp_path / "net" / "maestro_section.json").read_text())
    assert rec["section"] == "net" and rec["factory"] is None  # a job file's class
    assert rec["job"] == "job.py:plain"
    module = maestro.load_section(tmp_path / "net")
    want = torch.load(plain_run / "saved" / "net.pt")
    assert set(module.state_dict()) == set(want)
    for k, v in module.state_dict().items():
        assert torch.equal(v, want[k]), k
    # a factory given by the caller wins
    from torch import nn

    with pytest.raises(RuntimeError, match="Missing key"):
        maestro.load_section(tmp_path / "net", factory=lambda: nn.Linear(4, 1))


@pytest.mark.dist
@pytest.mark.parametrize(
    "case, match",
    [
        ("section", r"has no section 'nope'; known: net"),
        ("missing", r"checkpoint directory .*absent does not exist"),
        ("nonempty", r"output directory .* exists and is not empty; pass --force"),
        ("dtype", r"dtype must be one of float32, fp32, bfloat16, bf16"),
        ("empty", r"holds no complete checkpoint"),
    ],
)
def test_mistakes_are_one_line(plain_run, tmp_path, case, match):
    ck, out = plain_run / "ck", tmp_path / "out"
    kw = {}
    if case == "section":
        args = (ck, "nope", out)
    elif case == "missing":
        args = (tmp_path / "absent", "net", out)
    elif case == "nonempty":
        out.mkdir()
        (out / "x").write_text("keep")
        args = (ck, "net", out)
    elif case == "dtype":
        args, kw = (ck, "net", out), {"dtype": "fp16"}
    else:
        (tmp_path / "ck").mkdir()
        args = (tmp_path / "ck", "net", out)
    with pytest.raises((ValueError, FileNotFoundError), match=match) as e:
        maestro.export(*args, **kw)
    assert "\n" not in str(e.value)
    assert not (tmp_path / ".tmp-out.export").exists()
    if case == "nonempty":
        assert (out / "x").read_text() == "keep"


def test_factory_names_and_a_checkpoint_without_config(tmp_path):
    """Importable factories are named; a lambda is not; a checkpoint that records no config
    asks for --config; an export directory without its record is refused."""
    from torch import nn

    from maestro.export.writers import factory_name
    from maestro.runtime import checkpoint as ck

    assert factory_name(nn.Identity) == "torch.nn.modules.linear:Identity"
    assert factory_name(lambda: nn.Identity()) is None
    ck.save_section(tmp_path, 1, "net", nn.Linear(2, 2), None)
    ck.save_meta(tmp_path, 1, {"next_step": 1})
    ck.commit(tmp_path, 1, ["net"])
    with pytest.raises(ValueError, match="records no run config .* --config RUN.toml"):
        maestro.export(tmp_path, "net", tmp_path / "out")
    with pytest.raises(ValueError, match="has no maestro_section.json"):
        maestro.load_section(tmp_path)
