"""Loaders (OGB layout, edge lists, PyG Data) and the ``quiver prepare`` command, on small files
the tests write."""

import gzip
import json
import re

import numpy as np
import pytest
import torch

from quiver.cli import main as cli_main
from quiver.datasets import from_pyg, load_edge_list, load_ogb, load_prepared

EDGES = np.array([[0, 1], [2, 1], [3, 0], [1, 4], [4, 2], [0, 2]])


def _write_gz(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for r in rows:
            f.write(",".join(str(v) for v in np.atleast_1d(r)) + "\n")


def make_ogb(root, edges=EDGES, num_nodes=5, feat_rows=None, labels=None):
    rng = np.random.default_rng(0)
    feats = feat_rows if feat_rows is not None else rng.random((num_nodes, 3)).round(4).tolist()
    labels = labels if labels is not None else [0, 1, "nan", 1, 0][:num_nodes]
    _write_gz(root / "raw" / "edge.csv.gz", edges)
    _write_gz(root / "raw" / "node-feat.csv.gz", feats)
    _write_gz(root / "raw" / "node-label.csv.gz", [[v] for v in labels])
    _write_gz(root / "raw" / "num-node-list.csv.gz", [[num_nodes]])
    for name, ids in (("train", [0, 1]), ("valid", [3]), ("test", [4])):
        _write_gz(root / "split" / "random" / f"{name}.csv.gz", [[i] for i in ids])
    return feats


def _rows(topo):
    ip, ix = topo.indptr.tolist(), topo.indices.tolist()
    return [sorted(ix[ip[v] : ip[v + 1]]) for v in range(topo.node_count)]


def test_load_ogb_directory(tmp_path):
    feats = make_ogb(tmp_path / "ogbn_toy")
    ds = load_ogb(tmp_path / "ogbn_toy")
    assert ds.topo.node_count == 5 and ds.topo.edge_count == 6
    assert _rows(ds.topo) == [[3], [0, 2], [0, 4], [], [1]]  # in-neighbours
    np.testing.assert_allclose(ds.features.numpy(), np.array(feats, dtype=np.float32))
    assert ds.labels.tolist() == [0, 1, -1, 1, 0]  # nan -> unlabelled
    assert ds.splits["train"].tolist() == [0, 1] and ds.splits["test"].tolist() == [4]
    both = load_ogb(tmp_path / "ogbn_toy", undirected=True)
    assert both.topo.edge_count == 12
    assert _rows(both.topo)[3] == [0]


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (
            dict(feat_rows=[[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 3], [1, 2, 3]]),
            ValueError,
            "node-feat.csv.gz: row 3 has 2 values, expected 3",
        ),
        (dict(labels=[0, 1, 1]), ValueError, "node-label.csv.gz has 3 rows"),
        (dict(edges=np.array([[0, 1], [7, 2]])), ValueError, "row 2 holds node id 7"),
    ],
)
def test_load_ogb_reports_bad_files(tmp_path, kwargs, error, match):
    make_ogb(tmp_path, **kwargs)
    with pytest.raises(error, match=match):
        load_ogb(tmp_path)


def test_load_ogb_missing_file(tmp_path):
    make_ogb(tmp_path)
    (tmp_path / "raw" / "node-feat.csv.gz").unlink()
    with pytest.raises(FileNotFoundError, match="node-feat"):
        load_ogb(tmp_path)


def test_edge_lists_txt_csv_npy(tmp_path):
    (tmp_path / "g.txt").write_text("# SNAP style\n" + "\n".join(f"{s}\t{d}" for s, d in EDGES))
    (tmp_path / "g.csv").write_text("src,dst\n" + "\n".join(f"{s},{d}" for s, d in EDGES))
    np.save(tmp_path / "g.npy", EDGES.T)
    np.save(tmp_path / "g_rows.npy", EDGES)
    want = [[3], [0, 2], [0, 4], [], [1]]
    for name in ("g.txt", "g.csv", "g.npy", "g_rows.npy"):
        topo = load_edge_list(tmp_path / name)
        assert _rows(topo) == want, name
    assert load_edge_list(tmp_path / "g.txt", num_nodes=9).node_count == 9
    assert load_edge_list(tmp_path / "g.csv", undirected=True).edge_count == 12


def test_edge_list_errors(tmp_path):
    (tmp_path / "ragged.txt").write_text("0 1\n1 2 3\n")
    with pytest.raises(ValueError, match="row 2 has 3 values"):
        load_edge_list(tmp_path / "ragged.txt")
    (tmp_path / "neg.txt").write_text("0 1\n-1 2\n")
    with pytest.raises(ValueError, match="negative"):
        load_edge_list(tmp_path / "neg.txt")
    with pytest.raises(ValueError, match="row 2 holds node id 4 >= num_nodes"):
        load_edge_list(_write(tmp_path / "ok.txt", "0 1\n4 2\n"), num_nodes=3)
    with pytest.raises(ValueError, match="unsupported"):
        load_edge_list(_write(tmp_path / "g.json", "[]"))
    with pytest.raises(FileNotFoundError):
        load_edge_list(tmp_path / "absent.txt")


def _write(path, text):
    path.write_text(text)
    return path


def test_from_pyg_data():
    from torch_geometric.data import Data

    x = torch.randn(5, 2)
    mask = torch.tensor([True, False, True, False, False])
    data = Data(
        x=x, y=torch.arange(5), edge_index=torch.from_numpy(EDGES.T.copy()), train_mask=mask
    )
    ds = from_pyg(data)
    assert _rows(ds.topo) == [[3], [0, 2], [0, 4], [], [1]]
    assert torch.equal(ds.features, x) and ds.splits["train"].tolist() == [0, 2]
    with pytest.raises(ValueError, match="data.x has 4 rows"):
        from_pyg(Data(x=x[:4], edge_index=data.edge_index, num_nodes=5))


def test_cli_prepare_preset_from_ogb_and_edges(tmp_path, capsys):
    assert (
        cli_main(["prepare", "--dataset", "tiny", "--out", str(tmp_path / "t"), "--no-progress"])
        == 0
    )
    out = capsys.readouterr().out
    assert "200 nodes" in out and "in-degree min" in out
    ds = load_prepared(tmp_path / "t")
    assert ds.features.shape == (200, 8)
    assert json.loads((tmp_path / "t" / "manifest.json").read_text())["name"] == "tiny"

    make_ogb(tmp_path / "ogb")
    assert (
        cli_main(
            [
                "prepare",
                "--from-ogb",
                str(tmp_path / "ogb"),
                "--out",
                str(tmp_path / "o"),
                "--undirected",
                "--no-progress",
            ]
        )
        == 0
    )
    o = load_prepared(tmp_path / "o")
    assert o.topo.edge_count == 12 and o.labels.tolist() == [0, 1, -1, 1, 0]
    assert o.manifest["source"]["undirected"] is True

    np.save(tmp_path / "e.npy", EDGES.T)
    np.save(tmp_path / "f.npy", np.ones((5, 4), np.float32))
    assert (
        cli_main(
            [
                "prepare",
                "--edges",
                str(tmp_path / "e.npy"),
                "--features",
                str(tmp_path / "f.npy"),
                "--out",
                str(tmp_path / "e"),
                "--no-progress",
            ]
        )
        == 0
    )
    e = load_prepared(tmp_path / "e")
    assert e.features.shape == (5, 4) and e.manifest["num_edges"] == 6


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--edges", "{tmp}/nope.txt"], "missing file"),
        (["--edges", "{tmp}/bad.txt"], "row 2 holds node id 9 >= --num-nodes \\(5\\)"),
        (["--edges", "{tmp}/ragged.txt"], "row 2 has 3 values"),
        # without --num-nodes the feature rows are the node count (isolated nodes after the
        # largest id keep theirs), so fewer rows than ids is the edge list's mistake
        (
            ["--edges", "{tmp}/ok.txt", "--features", "{tmp}/f3.npy"],
            "row 2 holds node id 4 >= the --features rows \\(3\\)",
        ),
        (["--dataset", "nope"], "unknown preset"),
    ],
)
def test_cli_prepare_errors_are_one_line(tmp_path, capsys, argv, match):
    (tmp_path / "bad.txt").write_text("0 1\n9 2\n")
    (tmp_path / "ragged.txt").write_text("0 1\n1 2 3\n")
    (tmp_path / "ok.txt").write_text("0 1\n4 2\n")
    np.save(tmp_path / "f3.npy", np.ones((3, 2), np.float32))
    argv = [a.format(tmp=tmp_path) for a in argv]
    extra = ["--num-nodes", "5"] if "bad.txt" in argv[1] else []
    assert (
        cli_main(["prepare", *argv, *extra, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("quiver prepare: error:")
    assert re.search(match, err), err
