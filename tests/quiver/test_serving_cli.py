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
