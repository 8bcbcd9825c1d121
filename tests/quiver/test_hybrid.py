"""HybridSampler routing by PSGS, CPU-only fallback, and calibration (fit, threshold, manifest)."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from quiver.graph import CSRTopo
from quiver.hybrid import (
    Calibration,
    HybridSampler,
    _crossover,
    _empirical_threshold,
    _fit_line,
    calibrate,
    plot_calibration,
    read_calibration,
    write_calibration,
)
from quiver.workload import psgs


@pytest.fixture(scope="module")
def topo() -> CSRTopo:
    rng = np.random.default_rng(0)
    n = 3000
    w = 1.0 / np.arange(1, n + 1) ** 0.8
    w /= w.sum()
    src = rng.permutation(n)[rng.choice(n, size=30000, p=w)]
    dst = rng.permutation(n)[rng.choice(n, size=30000, p=w)]
    return CSRTopo(edge_index=np.stack([src, dst]), num_nodes=n, orientation="in", coalesce=False)


SIZES = [5, 3]


def test_routes_by_batch_psgs_against_threshold(topo):
    table = psgs(topo, SIZES)
    order = torch.argsort(table)
    small, large = order[:4], order[-4:]
    threshold = float(table[large].sum()) - 1e-3  # only the large batch reaches it
    h = HybridSampler(topo, SIZES, threshold, gpu_device="cpu", seed=0)
    assert h.route(small) == ("cpu", pytest.approx(float(table[small].sum())))
    assert h.route(large)[0] == "gpu"
    for seeds, path in [(small, "cpu"), (large, "gpu"), (small, "cpu")]:
        n_id, bs, adjs = h.sample(seeds)
        assert h.last_path == path and bs == seeds.numel()
        assert torch.equal(n_id[:bs], seeds)  # seeds first, as GraphSageSampler
        assert len(adjs) == len(SIZES)
    assert h.stats() == {"cpu": {"batches": 2, "seeds": 8}, "gpu": {"batches": 1, "seeds": 4}}


def test_threshold_extremes(topo):
    seeds = torch.tensor([1, 2, 3])
    assert HybridSampler(topo, SIZES, 0.0, gpu_device="cpu").route(seeds)[0] == "gpu"
    assert HybridSampler(topo, SIZES, math.inf, gpu_device="cpu").route(seeds)[0] == "cpu"


def test_both_paths_sample_valid_subgraphs(topo):
    """Whichever path runs, every sampled edge exists in the graph."""
    ip, ix = topo.numpy()
    edges = set(zip(ix.tolist(), np.repeat(np.arange(topo.node_count), np.diff(ip)).tolist()))
    h = HybridSampler(topo, SIZES, 50.0, gpu_device="cpu", seed=1)
    table = psgs(topo, SIZES)
    for seeds in [torch.tensor([int(torch.argmin(table))]), torch.arange(0, 3000, 7)]:
        out = h.sample_subgraph(seeds)
        src, dst = out.n_id[out.src], out.n_id[out.dst]
        assert all((s, d) in edges for s, d in zip(src.tolist(), dst.tolist()))
    assert h.stats()["cpu"]["batches"] == 1 and h.stats()["gpu"]["batches"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cpu_only_without_cuda_says_so_once(topo, caplog):
    with caplog.at_level(logging.WARNING, logger="quiver.hybrid"):
        h = HybridSampler(topo, SIZES)  # no threshold needed: there is no second path
        for _ in range(3):
            h.sample(torch.arange(500))
    msgs = [r.getMessage() for r in caplog.records if "CUDA" in r.getMessage()]
    assert len(msgs) == 1 and "CPU" in msgs[0]
    assert h.gpu_device is None and h.stats()["gpu"]["batches"] == 0
    assert h.stats()["cpu"]["batches"] == 3


def test_user_errors(topo):
    with pytest.raises(ValueError):
        HybridSampler(topo, SIZES, gpu_device="cpu")  # a second path needs a threshold
    with pytest.raises(ValueError):
        HybridSampler(topo, SIZES, -1.0, gpu_device="cpu")
    with pytest.raises(ValueError):
        HybridSampler(topo, SIZES, 1.0, gpu_device="cpu", psgs_table=torch.ones(5))
    h = HybridSampler(topo, SIZES, 1.0, gpu_device="cpu")
    with pytest.raises(ValueError):
        h.route([topo.node_count])
    with pytest.raises(ValueError):
        h.sample(torch.tensor([0.5]))


# ---------------------------------------------------------------------- calibration


def test_fit_recovers_a_line_and_crossover():
    x = np.geomspace(1, 1e5, 40)
    y_cpu = 1e-4 + 2e-7 * x
    y_gpu = 2e-3 + 1e-8 * x
    rng = np.random.default_rng(0)
    fc = _fit_line(x, y_cpu * rng.uniform(0.97, 1.03, x.size))
    fg = _fit_line(x, y_gpu * rng.uniform(0.97, 1.03, x.size))
    assert fc["a"] == pytest.approx(1e-4, rel=0.1) and fc["b"] == pytest.approx(2e-7, rel=0.05)
    true_cross = (2e-3 - 1e-4) / (2e-7 - 1e-8)
    assert _crossover(fc, fg, 1e5) == pytest.approx(true_cross, rel=0.1)
    # GPU never better / always better
    assert _crossover({"a": 1, "b": 1}, {"a": 2, "b": 2}, 10) == math.inf
    assert _crossover({"a": 2, "b": 2}, {"a": 1, "b": 1}, 10) == 0.0
    assert _crossover({"a": 2, "b": 1}, {"a": 1, "b": 1}, 10) == 0.0


def test_empirical_threshold_minimises_measured_total():
    pts = {
        "cpu": [[10, 1.0, 1], [20, 2.0, 2], [30, 5.0, 3], [40, 9.0, 4]],
        "gpu": [[10, 3.0, 1], [20, 3.0, 2], [30, 3.0, 3], [40, 3.0, 4]],
    }
    assert _empirical_threshold(pts) == 25.0
    pts["gpu"] = [[x, 100.0, b] for x, _, b in pts["cpu"]]
    assert _empirical_threshold(pts) == math.inf
    pts["gpu"] = [[x, 0.1, b] for x, _, b in pts["cpu"]]
    assert _empirical_threshold(pts) == 0.0


def test_calibrate_measures_both_paths_and_round_trips_the_manifest(topo, tmp_path):
    cal = calibrate(topo, SIZES, gpu_device="cpu", max_batch=64, repeats=2, seed=0)
    assert len(cal.points["cpu"]) == len(cal.points["gpu"]) > 10
    batch = sorted({b for *_, b in cal.points["cpu"]})
    assert batch[0] == 1 and batch[-1] == 64
    assert all(t > 0 for _, t, _ in cal.points["cpu"] + cal.points["gpu"])
    # the stored threshold is what the measured points say: the crossover of lines fitted to
    # them, and the empirical threshold minimises their measured total (a calibration that
    # mixed up the paths, or fitted other points, fails)
    for path in ("cpu", "gpu"):
        a = np.asarray(cal.points[path])
        want = _fit_line(a[:, 0], a[:, 1])
        assert cal.fits[path] == pytest.approx(want)
    x_max = max(p[0] for p in cal.points["cpu"])
    assert cal.threshold == _crossover(cal.fits["cpu"], cal.fits["gpu"], x_max)
    assert cal.empirical_threshold == _empirical_threshold(cal.points)
    assert cal.predict("cpu", 100.0) == pytest.approx(
        cal.fits["cpu"]["a"] + 100.0 * cal.fits["cpu"]["b"]
    )
    assert cal.sizes == SIZES and "torch" in cal.gpu_path
    # the manifest keeps its other keys; the write is atomic (no temp file left behind)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"name": "test", "fanouts": SIZES}))
    write_calibration(manifest, cal)
    assert json.loads(manifest.read_text())["name"] == "test"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    back = read_calibration(tmp_path)
    assert back.threshold == cal.threshold and back.fits == cal.fits
    png = plot_calibration(cal, tmp_path / "cal.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a threshold read back from the manifest drives a sampler
    h = HybridSampler(topo, SIZES, back.threshold, gpu_device="cpu")
    assert h.threshold == back.threshold


def test_infinite_threshold_survives_json(tmp_path):
    cal = Calibration(
        math.inf,
        {"cpu": {"a": 0, "b": 1}, "gpu": {"a": 1, "b": 1}},
        math.inf,
        [2],
        "c",
        "g",
        {"cpu": [], "gpu": []},
    )
    write_calibration(tmp_path / "manifest.json", cal)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["calibration"]["threshold"] is None
    assert read_calibration(tmp_path / "manifest.json").threshold == math.inf
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError):
        read_calibration(tmp_path / "other.json")
    with pytest.raises(FileNotFoundError):
        read_calibration(tmp_path / "missing")


def test_calibrate_cli_writes_manifest_and_plot(tmp_path, capsys):
    from quiver.cli import main
    from quiver.datasets import synthetic

    d = tmp_path / "tiny"
    synthetic("tiny", seed=0, out=d)
    before = json.loads((d / "manifest.json").read_text())
    rc = main(["calibrate", str(d), "--max-batch", "16", "--repeats", "1", "--device", "cpu"])
    assert rc == 0
    after = json.loads((d / "manifest.json").read_text())
    assert {k: v for k, v in after.items() if k != "calibration"} == before
    cal = read_calibration(d)
    assert cal.sizes == before["fanouts"] and len(cal.points["cpu"]) > 5
    assert (d / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "threshold" in out and "manifest.json" in out
    # user mistakes: one line, exit code 2
    assert main(["calibrate", str(tmp_path / "nope")]) == 2
    assert main(["calibrate", str(d), "--sizes", "a,b"]) == 2
    assert "error" in capsys.readouterr().err
