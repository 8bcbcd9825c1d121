"""The hetero server refuses fanouts that do not match the model's hops, in one line."""

import subprocess
import sys

import pytest
from hetero_cases import mag_sage

from quiver.hetero import HeteroServer
from quiver.hetero.model import hetero_hops
from quiver.serving import ServeConfig


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny MAG-like directory and a 2-layer HeteroConv checkpoint."""
    _, d, module, kw, ckpt = mag_sage(
        tmp_path_factory.mktemp("fan"), scale=0.002, seed=1, out_dim=5
    )
    return d, ckpt, module, kw


def test_hops_are_counted_per_layer_not_per_relation(served):
    from quiver.hetero import examples

    _, _, module, kw = served
    assert hetero_hops(module) == 2
    assert hetero_hops(examples.rgcn(**{**kw, "num_layers": 3})) == 3


@pytest.mark.parametrize("fanouts", [[-1], "-1", [-1, -1, -1], "4,2,1"])
def test_too_few_or_too_many_fanouts_are_refused(served, fanouts):
    d, ckpt, _, _ = served
    with pytest.raises(ValueError, match="but the model has 2 message-passing layers"):
        HeteroServer.from_dataset(d, ckpt, ServeConfig(), fanouts=fanouts, trust_pickle=True)


def test_matching_fanouts_still_serve(served):
    d, ckpt, _, _ = served
    with HeteroServer.from_dataset(
        d, ckpt, ServeConfig(), fanouts="4,2", trust_pickle=True, seed=0, updates=False
    ) as srv:
        assert srv.predict("paper", [0, 1]).values.shape[0] == 2


def test_the_cli_refuses_in_one_line(served):
    d, ckpt, _, _ = served
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "quiver.cli",
            "serve",
            str(d),
            "--checkpoint",
            str(ckpt),
            "--trust-pickle",
            "--fanouts",
            "-1",
            "--port",
            "8799",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "but the model has 2 message-passing layers" in r.stderr
