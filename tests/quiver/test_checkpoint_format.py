"""One checkpoint format for Quiver's models and the user's: ``state_dict`` + ``factory`` +
``factory_kwargs`` (+ ``fanouts``). ``quiver train-model`` writes it, ``quiver serve`` loads it
with or without ``--model``, and the format before it (``{"config", "state_dict", "fanouts"}``)
still loads and serves the same logits."""

import sys
import textwrap
from dataclasses import asdict

import numpy as np
import pytest
import torch

from quiver.cli import main as quiver_main
from quiver.datasets import load_prepared, synthetic
from quiver.models import FACTORY, load_checkpoint
from quiver.pyg import GraphSageSampler
from quiver.serving.server import Server
from quiver.usermodel import load_served_model, save_model

NODES = [3, 17, 0, 42, 17, 99]

USER_FACTORY = """
from torch_geometric.nn import GraphSAGE

CALLS = []


def sage(hidden=8, num_layers=2):
    CALLS.append((hidden, num_layers))
    return GraphSAGE(8, hidden, num_layers, 4)
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A ``quiver train-model`` checkpoint and the same weights in the old format."""
    d = tmp_path_factory.mktemp("ckfmt")
    synthetic("tiny", seed=0, out=d)
    new = d / "new.pt"
    argv = ["train-model", str(d), "--out", str(new), "--epochs", "1", "--fanouts", "3,2"]
    argv += ["--batch-size", "32", "--hidden", "16", "--max-steps-per-epoch", "3", "--no-mlp"]
    assert quiver_main(argv) == 0
    ckpt = torch.load(new, weights_only=True)
    old = d / "old.pt"
    torch.save(
        {
            "config": ckpt["factory_kwargs"],
            "state_dict": ckpt["state_dict"],
            "fanouts": ckpt["fanouts"],
            "val_acc": ckpt["val_acc"],
        },
        old,
    )
    return d, new, old


def _served_logits(d, ckpt, **kw):
    kw.setdefault("fold", "off")  # exact equality below; folding has its own tests
    with Server.from_dataset(d, ckpt, fanouts=[-1, -1], sampler_threads=1, **kw) as server:
        return server.predict(NODES, output="logits").values


def test_train_model_writes_the_factory_format(trained):
    d, new, _ = trained
    ckpt = torch.load(new, weights_only=True)  # plain data: no pickled code
    assert ckpt["factory"] == FACTORY == "quiver.models:sampled_gnn"
    assert "config" not in ckpt and ckpt["fanouts"] == [3, 2]
    model, _ = load_checkpoint(new)
    assert ckpt["factory_kwargs"] == asdict(model.cfg)
    assert set(ckpt["state_dict"]) == set(model.state_dict())
    _, info = load_served_model(new)
    assert info["fanouts"] == [3, 2] and info["convention"] == "adjs" and info["in_dim"] == 8


def test_new_and_old_format_serve_identical_logits_equal_offline(trained):
    d, new, old = trained
    got_new = _served_logits(d, new)
    got_old = _served_logits(d, old)
    np.testing.assert_array_equal(got_new, got_old)  # the format changed, not the model
    # and both equal the trained model run offline on the same (all-neighbour) sample
    ds = load_prepared(d)
    model, _ = load_checkpoint(old)
    uniq = sorted(set(NODES))
    n_id, _, adjs = GraphSageSampler(ds.topo, [-1, -1], mode="CPU", seed=0).sample(
        torch.tensor(uniq)
    )
    with torch.no_grad():
        want = model(torch.as_tensor(np.asarray(ds.features))[n_id].float(), adjs).numpy()
    row = {n: i for i, n in enumerate(uniq)}
    np.testing.assert_allclose(got_new, want[[row[n] for n in NODES]], atol=1e-5)


def test_load_checkpoint_reads_both_formats(trained):
    _, new, old = trained
    m_new, c_new = load_checkpoint(new)
    m_old, c_old = load_checkpoint(old)
    assert c_new["config"] == c_old["config"]
    for k, v in m_new.state_dict().items():
        assert torch.equal(v, m_old.state_dict()[k]), k


@pytest.fixture
def user_factory(tmp_path):
    (tmp_path / "ckfmt_user_factory.py").write_text(textwrap.dedent(USER_FACTORY))
    sys.path.insert(0, str(tmp_path))
    import ckfmt_user_factory as fac

    yield fac
    sys.path.remove(str(tmp_path))
    sys.modules.pop("ckfmt_user_factory", None)


def test_user_model_in_the_same_format(user_factory, tmp_path):
    """A user's PyG model saved with ``save_model``: its factory is called with the recorded
    kwargs, but only once the user confirms it (``--model``) or trusts the file."""
    fac = user_factory
    torch.manual_seed(0)
    module = fac.sage(hidden=12, num_layers=2).eval()
    path = tmp_path / "user.pt"
    spec = "ckfmt_user_factory:sage"
    save_model(path, module, spec, {"hidden": 12, "num_layers": 2}, fanouts=[4, 4])
    with pytest.raises(ValueError, match=f"names its factory {spec}.*pass --model {spec}"):
        load_served_model(path)
    fac.CALLS.clear()
    for kw in ({"model": spec}, {"trust_pickle": True}):
        served, info = load_served_model(path, **kw)
        assert fac.CALLS[-1] == (12, 2) and info["fanouts"] == [4, 4]
        x, ei = torch.randn(10, 8), torch.randint(0, 10, (2, 30))
        with torch.no_grad():
            assert torch.equal(served.module(x, ei), module(x, ei))


def test_save_model_refuses_what_would_not_load(tmp_path):
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="package.module:function"):
        save_model(tmp_path / "a.pt", m, "no_colon")
    with pytest.raises(ValueError, match="factory_kwargs must hold only"):
        save_model(tmp_path / "a.pt", m, "pkg.mod:f", {"act": torch.nn.ReLU()})


@pytest.mark.parametrize(
    "content,match",
    [
        ({"factory": 3}, "'factory' must be 'package.module:function'"),
        ({"factory": FACTORY, "factory_kwargs": [1]}, "'factory_kwargs' must be a dict"),
        ({"factory": FACTORY, "factory_kwargs": {"kind": "mlp"}}, "calling the factory"),
        ({"config": {"kind": "sage", "in_dim": 0, "out_dim": 2}}, "calling the factory"),
    ],
)
def test_bad_recorded_factory_is_one_line(tmp_path, content, match):
    path = tmp_path / "bad.pt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, **content}, path)
    with pytest.raises(ValueError, match=match) as e:
        load_served_model(path)
    assert "\n" not in str(e.value) and "bad.pt" in str(e.value)
