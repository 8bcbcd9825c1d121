"""``quiver prepare --edges``: seeded ``--split`` over labelled nodes, or ``--train/--valid/--test``
files; the manifest's split sizes; ``quiver train-model`` then trains on the dataset."""

import json

import numpy as np
import pytest

from quiver.cli import main as cli_main
from quiver.datasets import load_prepared

N = 200


@pytest.fixture
def edge_files(tmp_path):
    rng = np.random.default_rng(0)
    edges = rng.integers(0, N, (1500, 2))
    np.savetxt(tmp_path / "edges.csv", edges, fmt="%d", delimiter=",")
    labels = rng.integers(0, 3, N)
    labels[:20] = -1  # 180 labelled nodes
    np.save(tmp_path / "labels.npy", labels)
    np.save(tmp_path / "feats.npy", rng.standard_normal((N, 5)).astype(np.float32))
    return tmp_path, labels


def _prepare(tmp_path, name, *extra):
    base = ["prepare", "--edges", str(tmp_path / "edges.csv"), "--num-nodes", str(N)]
    out = tmp_path / name
    rc = cli_main([*base, "--out", str(out), "--no-progress", *extra])
    return rc, out


def test_default_split_when_labels_are_given(edge_files, capsys):
    tmp_path, labels = edge_files
    feats = ["--features", str(tmp_path / "feats.npy"), "--labels", str(tmp_path / "labels.npy")]
    rc, out = _prepare(tmp_path, "d", *feats)
    assert rc == 0 and "splits: train 144, valid 18, test 18" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["split_sizes"] == {"train": 144, "valid": 18, "test": 18}
    ds = load_prepared(out)
    ids = np.concatenate([ds.splits[k].numpy() for k in ("train", "valid", "test")])
    assert len(set(ids.tolist())) == 180 and (labels[ids] >= 0).all()  # disjoint, labelled
    # seeded: the same seed gives the same split, another seed another one
    _, again = _prepare(tmp_path, "d2", *feats)
    assert np.array_equal(load_prepared(again).splits["train"], ds.splits["train"])
    _, other = _prepare(tmp_path, "d3", *feats, "--seed", "1")
    assert not np.array_equal(load_prepared(other).splits["train"], ds.splits["train"])
    # and train-model works on it
    ckpt = tmp_path / "c.pt"
    rc = cli_main(
        [
            "train-model",
            str(out),
            "--out",
            str(ckpt),
            "--epochs",
            "1",
            "--fanouts",
            "3,2",
            "--hidden",
            "8",
            "--batch-size",
            "32",
            "--no-mlp",
        ]
    )
    assert rc == 0 and ckpt.exists() and "validation accuracy" in capsys.readouterr().out


def test_explicit_fractions(edge_files, capsys):
    tmp_path, _ = edge_files
    rc, out = _prepare(
        tmp_path, "d", "--labels", str(tmp_path / "labels.npy"), "--split", "0.5,0.25,0.25"
    )
    assert rc == 0
    assert json.loads((out / "manifest.json").read_text())["split_sizes"] == {
        "train": 90,
        "valid": 45,
        "test": 45,
    }


def test_split_files(edge_files, capsys):
    tmp_path, _ = edge_files
    np.save(tmp_path / "tr.npy", np.arange(20, 120))
    mask = np.zeros(N, bool)
    mask[120:150] = True
    np.save(tmp_path / "va.npy", mask)
    np.save(tmp_path / "te.npy", np.arange(150, 200))
    rc, out = _prepare(
        tmp_path,
        "d",
        "--labels",
        str(tmp_path / "labels.npy"),
        "--train",
        str(tmp_path / "tr.npy"),
        "--valid",
        str(tmp_path / "va.npy"),
        "--test",
        str(tmp_path / "te.npy"),
    )
    assert rc == 0
    sizes = json.loads((out / "manifest.json").read_text())["split_sizes"]
    assert sizes == {"train": 100, "valid": 30, "test": 50}
    assert load_prepared(out).splits["valid"].tolist() == list(range(120, 150))


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--split", "0.8,0.3,0.1"], "summing to at most 1"),
        (["--split", "a,b"], "three comma-separated fractions"),
        (["--split", "0.8,0.1,0.1", "--train", "x.npy"], "not both"),
        (["--train", "missing.npy"], "missing --train file"),
        (["--train", "unlab.npy"], "have no label"),
        (["--train", "oob.npy"], "outside [0, 200)"),
    ],
)
def test_split_errors_are_one_line(edge_files, capsys, extra, match):
    tmp_path, _ = edge_files
    np.save(tmp_path / "unlab.npy", np.arange(0, 30))
    np.save(tmp_path / "oob.npy", np.array([5, 999]))
    extra = [str(tmp_path / e) if e.endswith(".npy") else e for e in extra]
    rc, _ = _prepare(tmp_path, "d", "--labels", str(tmp_path / "labels.npy"), *extra)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and match in err, err


def test_split_without_labels_is_an_error(edge_files, capsys):
    tmp_path, _ = edge_files
    rc, _ = _prepare(tmp_path, "d", "--split", "0.8,0.1,0.1")
    assert rc == 2 and "--split needs --labels" in capsys.readouterr().err
