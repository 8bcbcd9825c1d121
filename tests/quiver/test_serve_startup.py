"""``quiver serve`` start-up mistakes: one line naming the file or flag, exit 2, no traceback."""

import socket
import sys
import textwrap

import numpy as np
import pytest
import torch

from quiver import CSRTopo
from quiver.cli import main as quiver_main
from quiver.datasets import save_prepared

FACTORY = """
from torch_geometric.nn import GraphSAGE


def sage():
    return GraphSAGE(6, 8, 2, 3)


def wide():
    return GraphSAGE(6, 12, 2, 3)


def broken():
    raise RuntimeError("factory exploded")
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("startup")
    (d / "quiver_startup_factory.py").write_text(textwrap.dedent(FACTORY))
    sys.path.insert(0, str(d))
    import quiver_startup_factory as fac

    rng = np.random.default_rng(0)
    ei = torch.from_numpy(rng.integers(0, 60, (2, 300)))
    topo = CSRTopo.from_edge_index(ei, num_nodes=60)
    save_prepared(d / "data", topo, np.random.rand(60, 6), rng.integers(0, 3, 60), {}, {})
    good = d / "sage.pt"
    torch.save(fac.sage().state_dict(), good)
    yield d, good
    sys.path.remove(str(d))


def _serve(capsys, data, *argv):
    rc = quiver_main(["serve", str(data), "--port", "0", *argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_missing_checkpoint(env, capsys):
    d, _ = env
    line = _serve(capsys, d / "data", "--checkpoint", str(d / "nope.pt"))
    assert "--checkpoint" in line and "nope.pt" in line and "no such file" in line


@pytest.mark.parametrize(
    "content,what",
    [(b"\x00\x17garbage bytes" * 50, "random"), (b"", "empty"), ("truncated", "truncated")],
)
def test_garbage_or_truncated_checkpoint(env, capsys, content, what):
    d, good = env
    bad = d / f"{what}.pt"
    bad.write_bytes(good.read_bytes()[:200] if content == "truncated" else content)
    line = _serve(
        capsys, d / "data", "--checkpoint", str(bad), "--model", "quiver_startup_factory:sage"
    )
    assert f"{what}.pt" in line and "not a PyTorch checkpoint" in line


def test_directory_as_checkpoint(env, capsys):
    d, _ = env
    line = _serve(capsys, d / "data", "--checkpoint", str(d))
    assert "is a directory" in line


def test_whole_module_pickle_needs_trust_pickle(env, capsys):
    d, _ = env
    import quiver_startup_factory as fac

    path = d / "whole.pt"
    torch.save(fac.sage(), path)
    line = _serve(capsys, d / "data", "--checkpoint", str(path))
    assert "whole.pt" in line and "--trust-pickle" in line


@pytest.mark.parametrize(
    "spec,msg",
    [
        ("no_such_module_xyz:sage", "cannot import no_such_module_xyz"),
        ("quiver_startup_factory:nope", "has no attribute 'nope'"),
        ("quiver_startup_factory", "package.module:function"),
        ("quiver_startup_factory:broken", "factory exploded"),
    ],
)
def test_bad_factory(env, capsys, spec, msg):
    d, good = env
    line = _serve(capsys, d / "data", "--checkpoint", str(good), "--model", spec)
    assert "--model" in line and msg in line


def test_state_dict_mismatch(env, capsys):
    d, good = env
    line = _serve(
        capsys, d / "data", "--checkpoint", str(good), "--model", "quiver_startup_factory:wide"
    )
    assert "sage.pt" in line and "does not fit" in line and "shape mismatch" in line
    sd = torch.load(good)
    sd.pop(next(iter(sd)))
    partial = d / "partial.pt"
    torch.save(sd, partial)
    line = _serve(
        capsys, d / "data", "--checkpoint", str(partial), "--model", "quiver_startup_factory:sage"
    )
    assert "partial.pt" in line and "missing keys" in line


def test_state_dict_without_model(env, capsys):
    d, good = env
    line = _serve(capsys, d / "data", "--checkpoint", str(good))
    assert "state_dict" in line and "--model" in line


def test_fanouts_per_layer(env, capsys):
    d, good = env
    args = ["--checkpoint", str(good), "--model", "quiver_startup_factory:sage"]
    line = _serve(capsys, d / "data", *args, "--fanouts", "3,3,3")
    assert "--fanouts" in line and "2 message-passing layers" in line
    line = _serve(capsys, d / "data", *args, "--fanouts", "3,x")
    assert "--fanouts" in line


def test_features_with_fewer_rows_than_nodes(env, capsys, tmp_path):
    d, good = env
    import shutil

    data = tmp_path / "data"
    shutil.copytree(d / "data", data)
    np.save(data / "features.npy", np.zeros((10, 6), np.float32))
    line = _serve(capsys, data, "--checkpoint", str(good), "--model", "quiver_startup_factory:sage")
    assert "features.npy" in line and "10 rows" in line


def test_bad_device(env, capsys):
    d, good = env
    args = ["--checkpoint", str(good), "--model", "quiver_startup_factory:sage"]
    line = _serve(capsys, d / "data", *args, "--device", "tpu")
    assert "--device tpu" in line


def test_port_in_use_and_out_of_range(env, capsys):
    d, good = env
    args = ["--checkpoint", str(good), "--model", "quiver_startup_factory:sage"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = quiver_main(["serve", str(d / "data"), *args, "--port", str(port)])
        err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and f"--port {port}" in err
    with pytest.raises(SystemExit) as e:
        quiver_main(["serve", str(d / "data"), *args, "--port", "70000"])
    assert e.value.code == 2 and "[0, 65535]" in capsys.readouterr().err
    rc = quiver_main(["serve", str(d / "data"), *args, "--host", "203.0.113.7"])
    err = capsys.readouterr().err
    assert rc == 2 and "--host 203.0.113.7" in err and len(err.strip().splitlines()) == 1
