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


def test_out_of_range_port_is_one_line_without_usage(env, capsys):
    d, good = env
    with pytest.raises(SystemExit) as e:
        quiver_main(["serve", str(d / "data"), "--checkpoint", str(good), "--port", "70000"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, err
    assert "--port" in lines[0] and "[0, 65535]" in lines[0] and "usage" not in err


@pytest.mark.parametrize("what", ["plain", "objects"])
def test_foreign_pickle_is_not_a_checkpoint_in_one_line(env, capsys, recwarn, what):
    """A pickle file torch.save did not write: one line, no torch warning, no --trust-pickle."""
    import pickle

    d, _ = env
    path = d / f"{what}.pkl"
    payload = [1.0, 2.0, {"lr": 0.1}]
    if what == "objects":
        payload.append(np.random.default_rng(0))
    path.write_bytes(pickle.dumps(payload, protocol=4))
    line = _serve(capsys, d / "data", "--checkpoint", str(path))
    assert f"{what}.pkl" in line and "not a model checkpoint Quiver can load" in line, line
    assert "--trust-pickle" not in line and "weights_only" not in line, line
    assert not [w for w in recwarn if "pickle" in str(w.message)]


def _flip_bit(path, out, pattern: bytes, bit: int = 0) -> None:
    """``out``: ``path`` with one bit flipped in the middle of its only copy of ``pattern``."""
    data = bytearray(path.read_bytes())
    at = data.find(pattern)
    assert at >= 0 and data.find(pattern, at + 1) < 0
    data[at + len(pattern) // 2] ^= 1 << bit
    out.write_bytes(bytes(data))


def test_bit_flipped_checkpoint_is_corrupted_not_pickled_objects(env, capsys):
    d, good = env
    # a flip inside a class name the unpickler resolves ("torch._utils" -> "torch._uthls")
    # was read as a pickled Python object and the message suggested --trust-pickle
    flipped = d / "flipped.pt"
    _flip_bit(good, flipped, b"torch._utils\n_rebuild_tensor_v2")
    line = _serve(
        capsys, d / "data", "--checkpoint", str(flipped), "--model", "quiver_startup_factory:sage"
    )
    assert "flipped.pt" in line and "corrupted" in line, line
    assert "--trust-pickle" not in line and "pickled Python objects" not in line, line


def test_bit_flipped_weights_are_refused_not_served(env, capsys):
    """A flip inside a tensor's bytes used to load silently, with a wrong weight."""
    import quiver_startup_factory as fac

    d, _ = env
    sd = fac.sage().state_dict()
    sd["convs.0.lin_l.weight"].fill_(0.25)
    clean, flipped = d / "marked.pt", d / "marked_flipped.pt"
    torch.save(sd, clean)
    _flip_bit(clean, flipped, np.full(48, 0.25, np.float32).tobytes(), bit=3)
    line = _serve(
        capsys, d / "data", "--checkpoint", str(flipped), "--model", "quiver_startup_factory:sage"
    )
    assert "marked_flipped.pt" in line and "corrupted" in line and "CRC" in line, line


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_feature_width_mismatch_names_both_widths(env, capsys, tmp_path, precision):
    d, good = env
    import shutil

    data = tmp_path / "data"
    shutil.copytree(d / "data", data)
    np.save(data / "features.npy", np.random.rand(60, 5).astype(np.float32))
    args = ["--checkpoint", str(good), "--model", "quiver_startup_factory:sage"]
    line = _serve(capsys, data, *args, "--fanouts", "3,3", "--precision", precision)
    assert "takes 6 features per node" in line and "has 5" in line, line
    assert "features.npy" in line and "mat1" not in line, line


@pytest.mark.parametrize("text", ['{"epochs": 3}\n', "ciao\n", "weights go here\nline 2\n"])
def test_text_file_as_checkpoint_says_it_is_not_one(env, capsys, text):
    """torch's own error for a text file advises retrying with ``weights_only=False`` (or, for
    text starting with a pickle GLOBAL opcode like ``c``, reads as pickled code): the line
    says instead that the file is text, not a checkpoint, and what was expected."""
    d, _ = env
    notes = d / "notes.pt"
    notes.write_text(text)
    line = _serve(
        capsys, d / "data", "--checkpoint", str(notes), "--model", "quiver_startup_factory:sage"
    )
    first = text.splitlines()[0]
    assert f"--checkpoint {notes} is not a PyTorch checkpoint: it is a text file" in line
    assert repr(first) in line and "expected a file written by torch.save" in line
    assert "weights_only" not in line and "pickled" not in line


def test_hetero_checkpoint_on_a_homogeneous_directory(env, capsys, tmp_path):
    """A heterogeneous model's checkpoint given for a homogeneous dataset used to be reported
    as "2 fanouts but the model has 14 message-passing layers"."""
    from hetero_cases import FACTORY, mag_sage

    d, _ = env
    *_, ckpt = mag_sage(tmp_path)
    line = _serve(capsys, d / "data", "--checkpoint", str(ckpt), "--model", FACTORY)
    assert f"--checkpoint {ckpt} is a heterogeneous model checkpoint (HeteroConv layers)" in line
    assert f"{d / 'data'} is a homogeneous dataset" in line
    assert "message-passing layers" not in line
