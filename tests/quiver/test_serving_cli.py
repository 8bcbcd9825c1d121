"""`quiver train-model`, `quiver serve` (a real process, SIGTERM drain) and `quiver bench`."""

import csv
import signal

import pytest

from quiver.cli import main as quiver_main
from quiver.serving.client import Client, wait_until_ready
from quiver.serving.http import spawn_serve


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from quiver.datasets import synthetic

    d = tmp_path_factory.mktemp("tiny")
    synthetic("tiny", seed=0, out=d)
    ckpt = d / "ckpt.pt"
    rc = quiver_main(
        [
            "train-model",
            str(d),
            "--out",
            str(ckpt),
            "--epochs",
            "2",
            "--fanouts",
            "5,3",
            "--batch-size",
            "32",
            "--hidden",
            "16",
        ]
    )
    assert rc == 0 and ckpt.exists()
    return d, ckpt


def test_train_model_reports_accuracy(trained, capsys):
    d, _ = trained
    rc = quiver_main(
        [
            "train-model",
            str(d),
            "--out",
            str(d / "c2.pt"),
            "--epochs",
            "1",
            "--fanouts",
            "4,2",
            "--hidden",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "validation accuracy: sage" in out and "features-only MLP" in out


def test_train_model_bad_input_is_one_line_error(tmp_path, capsys):
    rc = quiver_main(["train-model", str(tmp_path / "nope"), "--out", str(tmp_path / "c.pt")])
    err = capsys.readouterr().err
    assert rc == 2 and "error" in err and "Traceback" not in err


def test_serve_process_answers_and_drains_on_sigterm(trained, tmp_path, capsys):
    d, ckpt = trained
    proc, url = spawn_serve(d, ckpt, "--slo-ms", "1000")
    try:
        client = Client(url, timeout=10)
        wait_until_ready(client.url, proc=proc)
        body = client.predict([0, 5, 199])
        assert len(body["values"]) == 3
        # the load generator over HTTP against the same process
        csv_path = tmp_path / "u.csv"
        args = ["bench", "--url", url, "--rates", "30", "--duration", "1", "--sizes", "1-4"]
        rc = quiver_main(args + ["--slo-ms", "1000", "--csv", str(csv_path)])
        out = capsys.readouterr().out
        assert rc == 0 and "sustained throughput" in out
        (row,) = list(csv.DictReader(open(csv_path)))
        assert int(row["errors"]) == 0 and int(row["ok"]) + int(row["late"]) == int(row["sent"])
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "listening on http://127.0.0.1" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bench_in_process_writes_csv_and_plot(trained, tmp_path, capsys):
    d, ckpt = trained
    rc = quiver_main(
        [
            "bench",
            str(d),
            "--checkpoint",
            str(ckpt),
            "--rates",
            "20,60",
            "--duration",
            "1",
            "--sizes",
            "1-8",
            "--csv",
            str(tmp_path / "r.csv"),
            "--plot",
            str(tmp_path / "r.png"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "sustained throughput" in out
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert [float(r["offered_rps"]) for r in rows] == [20.0, 60.0]
    assert all(int(r["errors"]) == 0 and int(r["sent"]) > 0 for r in rows)
    assert (tmp_path / "r.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["bench", "--rates", "0"], "--rates must be positive"),
        (["bench", "--sizes", "a-b"], "--sizes"),
        (["bench"], "DATASET_DIR and --checkpoint"),
    ],
)
def test_bench_bad_options(argv, msg, capsys):
    assert quiver_main(argv) == 2
    assert msg in capsys.readouterr().err


def test_server_device_option(trained):
    import torch

    from quiver.serving.server import Server

    d, ckpt = trained
    with Server.from_dataset(d, ckpt, device="cpu") as server:
        assert "model on cpu" in server.info
        assert server.predict([1, 2]).values.shape == (2,)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            Server.from_dataset(d, ckpt, device="cuda")


@pytest.mark.parametrize("feature_cache", [0, 4096])
def test_served_logits_equal_an_offline_forward(trained, feature_cache):
    """``Server.from_dataset`` serves what the checkpoint's model computes offline on the
    dataset's own features: all-neighbour fanouts make sampling deterministic, so the served
    logits must equal ``model(x[n_id], adjs)`` of the same sampler's output (a server serving
    wrong or zero features, or the wrong rows from its RAM cache, fails)."""
    import numpy as np
    import torch

    from quiver.datasets import load_prepared
    from quiver.models import load_checkpoint
    from quiver.pyg import GraphSageSampler
    from quiver.serving.server import Server

    d, ckpt = trained
    ds = load_prepared(d)
    model, _ = load_checkpoint(ckpt)
    model.eval()
    nodes = [3, 17, 0, 42, 17, 99]
    with Server.from_dataset(
        d, ckpt, device="cpu", fanouts=[-1, -1], feature_cache=feature_cache, sampler_threads=1
    ) as server:
        got = server.predict(nodes, output="logits").values
    n_id, bs, adjs = GraphSageSampler(ds.topo, [-1, -1], mode="CPU", seed=0).sample(
        torch.tensor(sorted(set(nodes)))
    )
    with torch.no_grad():
        want = model(torch.as_tensor(np.asarray(ds.features))[n_id].float(), adjs)
    row = {n: i for i, n in enumerate(sorted(set(nodes)))}
    want = want.numpy()[[row[n] for n in nodes]]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 1e-3  # a real signal, not zeros


@pytest.mark.parametrize(
    "argv,dest",
    [
        (["serve", "data", "--checkpoint", "m.pt2", "--fanouts", "-1,-1"], "fanouts"),
        (["bench", "data", "--checkpoint", "m.pt2", "--fanouts", "-1,-1"], "fanouts"),
        (["train-model", "data", "--out", "c.pt", "--fanouts", "-1,-1"], "fanouts"),
        (["calibrate", "data", "--sizes", "-1,-1"], "sizes"),
        (["partition", "data", "--hosts", "2", "--sizes", "-1,-1"], "sizes"),
    ],
)
def test_negative_fanout_lists_parse_as_the_readme_writes_them(argv, dest):
    """``--fanouts -1,-1`` (argparse alone takes ``-1,-1`` for an option) means ``=-1,-1``."""
    from quiver.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    assert getattr(args, dest) == "-1,-1"
    assert "data" in vars(args).values()
    # followed by another option, mixed signs, and the forms that already worked
    args = parser.parse_args([*argv[:-1], "5,-1", "--seed", "-1"])
    assert getattr(args, dest) == "5,-1" and (argv[0] != "serve" or args.seed == -1)
    assert getattr(parser.parse_args([*argv[:-2], f"--{dest}=-1,-1"]), dest) == "-1,-1"
    assert getattr(parser.parse_args([*argv[:-1], "-1"]), dest) == "-1"
