"""Serving precision: fp32 unchanged, bf16 close to it with fp32 logits, ``auto`` measured per
CPU model and recorded in the manifest, bf16 feature storage (``quiver prepare``)."""

import json

import numpy as np
import pytest
import torch

from quiver import CSRTopo
from quiver.cli import main as quiver_main
from quiver.datasets import convert_features, load_prepared, save_prepared
from quiver.feature import Feature
from quiver.models import ModelConfig, _sage_csr, build_model, save_checkpoint
from quiver.precision import (
    PrecisionChoice,
    PrecisionModel,
    cpu_model,
    measure_precision,
    stored_records,
)
from quiver.pyg import GraphSageSampler
from quiver.serving import ServeConfig
from quiver.serving.server import Server

FANOUTS = [4, 4]
N, DIM, CLASSES = 400, 16, 5


def _world(seed=0):
    """A graph whose in-degree never exceeds the fanouts (every neighbour is sampled, so an
    answer does not depend on its batch) and a SAGE model with class-separated inputs."""
    rng = np.random.default_rng(seed)
    dst = np.repeat(np.arange(N), 3)
    src = (dst + rng.integers(1, N, size=dst.size)) % N
    edges = np.unique(np.stack([src, dst]), axis=1)
    topo = CSRTopo.from_edge_index(torch.from_numpy(edges), num_nodes=N)
    labels = rng.integers(0, CLASSES, N)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    x[np.arange(N), labels] += 2.0
    torch.manual_seed(seed)
    model = build_model(ModelConfig("sage", DIM, CLASSES, hidden_dim=32, num_layers=2)).eval()
    return topo, x, labels, model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("precision")
    topo, x, labels, model = _world()
    splits = {"test": np.arange(0, N, 2)}
    save_prepared(d / "data", topo, x, labels, splits, {"fanouts": FANOUTS})
    ckpt = d / "sage.pt"
    save_checkpoint(ckpt, model, {"fanouts": FANOUTS})
    return d, ckpt, model


def _copy_data(world, tmp_path):
    import shutil

    d, ckpt, _ = world
    shutil.copytree(d / "data", tmp_path / "data")
    return tmp_path / "data", ckpt


def _logits(data, ckpt, **kw):
    kw.setdefault("fold", "off")  # the unfolded paths (folding: test_folded.py)
    cfg = ServeConfig(max_batch_nodes=N, max_request_nodes=N)
    with Server.from_dataset(data, ckpt, cfg, seed=0, **kw) as server:
        res = server.predict(list(range(N)), output="logits")
        return np.asarray(res.values), server


def test_fp32_is_todays_path(world):
    d, ckpt, model = world
    got, server = _logits(d / "data", ckpt, precision="fp32")
    assert type(server.engine.model).__name__ == "SampledGNN"  # not wrapped, not converted
    # today's answer: the fp32 model on the sampled subgraph of the same (sorted) seeds
    ds = load_prepared(d / "data")
    n_id, _, adjs = GraphSageSampler(ds.topo, FANOUTS, mode="CPU", seed=0).sample(torch.arange(N))
    with torch.inference_mode():
        want = model(ds.features[n_id], adjs).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert "gather fp32, model fp32" in server.info


def test_bf16_serves_fp32_logits_close_to_fp32(world):
    d, ckpt, _ = world
    ref, _ = _logits(d / "data", ckpt, precision="fp32")
    got, server = _logits(d / "data", ckpt, precision="bf16")
    assert isinstance(server.engine.model, PrecisionModel)
    assert server.engine.features.dtype == torch.bfloat16
    assert got.dtype == np.float32
    agreement = float((got.argmax(1) == ref.argmax(1)).mean())
    assert agreement >= 0.99, agreement
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max() + 0.05


def test_sage_bf16_aggregation_matches_fp32():
    # embedding_bag's mean, empty rows included, against the fp32 CSR product
    torch.manual_seed(0)
    conv = build_model(ModelConfig("sage", 8, 4, hidden_dim=8, num_layers=1)).convs[0].eval()
    dst = torch.tensor([0, 0, 1, 3, 3, 3])  # target 2 has no neighbour
    src = torch.tensor([4, 5, 6, 7, 8, 9])
    x = torch.randn(10, 8)
    with torch.inference_mode():
        want = _sage_csr(conv, x, torch.stack([src, dst]), 4).clone()
        conv16 = PrecisionModel.wrap(conv, torch.bfloat16).module
        got = _sage_csr(conv16, x.bfloat16(), torch.stack([src, dst]), 4)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
        empty = _sage_csr(conv16, x.bfloat16(), torch.empty(2, 0, dtype=torch.long), 4)
        assert empty.shape == (4, 4)


def test_auto_records_choice_with_cpu_model_and_reuses_it(world, tmp_path, monkeypatch):
    data, ckpt = _copy_data(world, tmp_path)
    _, server = _logits(data, ckpt, precision="auto")
    rec = stored_records(json.loads((data / "manifest.json").read_text()), "precision")[-1]
    assert rec["cpu_model"] == cpu_model() and rec["cpu_model"]
    assert rec["gather"] in ("fp32", "bf16") and rec["model"] in ("fp32", "bf16")
    assert set(rec["timings"]["gather"]) == {"fp32", "bf16"}
    assert "measured now" in server.info
    assert f"gather {rec['gather']}, model {rec['model']}" in server.info

    def no_timing(*a, **k):
        raise AssertionError("re-timed although the manifest answers for this CPU")

    monkeypatch.setattr("quiver.precision.measure_precision", no_timing)
    _, server = _logits(data, ckpt, precision="auto")
    assert "from the manifest" in server.info
    # fp32 weights on bf16 rows are a casting PrecisionModel too: ask for its dtype
    m = server.engine.model
    model_is_bf16 = isinstance(m, PrecisionModel) and m.dtype == torch.bfloat16
    assert model_is_bf16 == (rec["model"] == "bf16")


def test_auto_says_why_it_refused_a_bf16_model(world, tmp_path, monkeypatch):
    """A bf16 model whose answers miss the agreement threshold is refused, and the serve
    line says why, measured now and again when read back from the manifest (issue 35)."""
    import functools

    from quiver import precision

    data, ckpt = _copy_data(world, tmp_path)
    strict = functools.partial(precision.measure_precision, min_agreement=1.01)  # unreachable
    monkeypatch.setattr(precision, "measure_precision", strict)
    _, server = _logits(data, ckpt, precision="auto")
    rec = stored_records(json.loads((data / "manifest.json").read_text()), "precision")[-1]
    why = f"bf16 model argmax agreement {rec['agreement']:.4f} < 1.01"
    assert rec["model"] == "fp32" and rec["note"] == why
    assert "model fp32" in server.info and why in server.info and "measured now" in server.info
    _, server = _logits(data, ckpt, precision="auto")
    assert "from the manifest" in server.info and why in server.info


@pytest.mark.parametrize("other", ["cpu", "model"])
def test_auto_rechecks_for_another_cpu_model_or_model(world, tmp_path, monkeypatch, other):
    data, ckpt = _copy_data(world, tmp_path)
    m = json.loads((data / "manifest.json").read_text())
    cpu, model = ("Some Other CPU", "") if other == "cpu" else (cpu_model(), "OtherNet:1:1")
    m["precision"] = PrecisionChoice("bf16", "bf16", cpu_model=cpu, model_id=model).to_json()
    (data / "manifest.json").write_text(json.dumps(m))
    calls = []
    real = measure_precision

    def counting(*a, **k):
        calls.append(1)
        # bf16 must save 99.9% to win: this answer is fp32 whatever this CPU is
        return real(*a, **{**k, "margin": 0.999})

    monkeypatch.setattr("quiver.precision.measure_precision", counting)
    _, server = _logits(data, ckpt, precision="auto")
    assert calls == [1]
    rec = stored_records(json.loads((data / "manifest.json").read_text()), "precision")[-1]
    assert rec["cpu_model"] == cpu_model() and rec["model_id"].startswith("SampledGNN:")
    assert (rec["gather"], rec["model"]) == ("fp32", "fp32")
    assert type(server.engine.model).__name__ == "SampledGNN"


@pytest.mark.parametrize("record", ["other bf16 units", "no flags stored", "other cores"])
def test_auto_rechecks_on_the_same_cpu_name_with_other_units(world, tmp_path, monkeypatch, record):
    """The CPU model name alone ("AMD EPYC") names CPUs with and without bf16 units: a stored
    choice is reused only on a CPU with the same bf16-relevant flags and cores."""
    import os

    from quiver.precision import model_id

    data, ckpt = _copy_data(world, tmp_path)
    stored = PrecisionChoice("bf16", "bf16", cpu_model=cpu_model(), model_id=model_id(world[2]))
    stored = stored.to_json()  # as written before flags and cores were stored
    cores = len(os.sched_getaffinity(0))
    if record == "other bf16 units":  # no CPU reports a flag list with a made-up flag
        stored.update(cpu_flags=["amx_bf16", "avx512_bf16", "made_up_flag"], cpu_cores=cores)
    elif record == "other cores":
        from quiver.precision import cpu_flags

        stored.update(cpu_flags=cpu_flags(), cpu_cores=cores + 1)
    m = json.loads((data / "manifest.json").read_text())
    m["precision"] = stored
    (data / "manifest.json").write_text(json.dumps(m))
    calls = []
    real = measure_precision

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **{**k, "margin": 0.999})  # fp32 whatever this CPU is

    monkeypatch.setattr("quiver.precision.measure_precision", counting)
    _, server = _logits(data, ckpt, precision="auto")
    assert calls == [1] and "measured now" in server.info
    from quiver.precision import machine

    here = machine()
    rec = stored_records(json.loads((data / "manifest.json").read_text()), "precision")[-1]
    assert rec["cpu_flags"] == here["cpu_flags"] and rec["cpu_cores"] == here["cpu_cores"] == cores
    # the same machine reads it back
    _, server = _logits(data, ckpt, precision="auto")
    assert calls == [1] and "from the manifest" in server.info


def test_measure_precision_reports_both_stages(world):
    d, _, model = world
    ds = load_prepared(d / "data")
    sampler = GraphSageSampler(ds.topo, FANOUTS, mode="CPU", seed=0)
    c = measure_precision(sampler, ds.features, model, N, batch_sizes=(8, 64), repeats=2)
    for stage in ("gather", "model"):
        assert all(v > 0 for v in c.timings[stage].values())
    assert set(c.timings["pairs"]) == {"fp32+fp32", "fp32+bf16", "bf16+fp32", "bf16+bf16"}
    assert c.agreement >= 0.99 and c.max_abs_diff < 1.0
    assert c.batch_sizes == [8, 64] and c.cpu_model == cpu_model()
    # a choice bf16 could never pay for stays fp32
    c = measure_precision(sampler, ds.features, model, N, batch_sizes=(8,), margin=0.999)
    assert (c.gather, c.model) == ("fp32", "fp32")


def test_bad_precision_is_one_line_exit_2(world, capsys):
    d, ckpt, _ = world
    rc = quiver_main(
        ["serve", str(d / "data"), "--checkpoint", str(ckpt), "--port", "0", "--precision", "fp16"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "--precision must be one of auto, fp32, bf16" in err[0]


def test_bf16_feature_storage_round_trip_and_serving(world, tmp_path):
    data, ckpt = _copy_data(world, tmp_path)
    fp32 = load_prepared(data).features.clone()
    m = convert_features(data, "bfloat16")
    assert m["dtypes"]["features"] == "bfloat16"
    assert np.load(data / "features.npy", mmap_mode="r").dtype == np.uint16
    ds = load_prepared(data)
    assert ds.features.dtype == torch.bfloat16
    assert torch.equal(ds.features, fp32.to(torch.bfloat16))
    ref, _ = _logits(world[0] / "data", ckpt, precision="fp32")
    for kw in ({}, {"feature_cache": "1M"}):  # plain rows, and quiver.Feature from the file
        got, server = _logits(data, ckpt, precision="fp32", **kw)
        assert server.engine.features.dtype == torch.bfloat16
        assert "gather bf16, model fp32" in server.info
        assert float((got.argmax(1) == ref.argmax(1)).mean()) >= 0.99
    # and back: an fp32 table again, loading as before
    convert_features(data, "float32")
    assert load_prepared(data).features.dtype == torch.float32


def test_old_manifest_without_dtypes_loads_fp32(world, tmp_path):
    data, _ = _copy_data(world, tmp_path)
    m = json.loads((data / "manifest.json").read_text())
    del m["dtypes"]
    (data / "manifest.json").write_text(json.dumps(m))
    assert load_prepared(data).features.dtype == torch.float32


def test_feature_store_gathers_bf16_rows(tmp_path):
    x = torch.randn(50, 6).to(torch.bfloat16)
    ids = torch.tensor([3, 0, 49, 3, 17])
    store = Feature(0, [], 0).from_cpu_tensor(x)
    assert store.dtype == torch.bfloat16 and torch.equal(store[ids], x[ids])
    np.save(tmp_path / "f.npy", x.view(torch.int16).numpy().view(np.uint16))
    for cache in (0, 6 * 2 * 20):  # all rows from the file; a RAM tier and the file
        f = Feature(0, [], 0, host_cache_size=cache).from_mmap(
            tmp_path / "f.npy", dtype=torch.bfloat16
        )
        assert f.dtype == torch.bfloat16 and torch.equal(f[ids], x[ids])
    with pytest.raises(ValueError, match="does not match"):
        Feature(0, [], 0).from_mmap(tmp_path / "f.npy", dtype=torch.float32)


def test_prepare_feature_dtype_bf16_cli(tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "e.npy", rng.integers(0, 30, (2, 90)))
    np.save(tmp_path / "x.npy", rng.standard_normal((30, 4)).astype(np.float32))
    out = tmp_path / "out"
    argv = ["prepare", "--edges", str(tmp_path / "e.npy"), "--num-nodes", "30"]
    argv += ["--features", str(tmp_path / "x.npy"), "--out", str(out), "--no-progress"]
    assert quiver_main([*argv, "--feature-dtype", "bf16"]) == 0
    assert "bfloat16 features" in capsys.readouterr().out
    ds = load_prepared(out)
    want = torch.from_numpy(np.load(tmp_path / "x.npy")).to(torch.bfloat16)
    assert ds.features.dtype == torch.bfloat16 and torch.equal(ds.features, want)


def test_calibrate_checkpoint_records_precision(world, tmp_path, capsys, monkeypatch):
    data, ckpt = _copy_data(world, tmp_path)
    argv = ["calibrate", str(data), "--checkpoint", str(ckpt), "--no-sampling"]
    assert quiver_main([*argv, "--precision-batches", "8,32", "--precision-repeats", "2"]) == 0
    out = capsys.readouterr().out
    rec = stored_records(json.loads((data / "manifest.json").read_text()), "precision")[-1]
    assert rec["cpu_model"] == cpu_model() and rec["batch_sizes"] == [8, 32]
    assert "gather:" in out and "model:" in out and "['precision']" in out
    # the record answers for this checkpoint's weights and fanouts: serve reuses it
    assert rec["weights"] and rec["sizes"]

    def no_timing(*a, **k):
        raise AssertionError("re-timed although quiver calibrate recorded this checkpoint")

    monkeypatch.setattr("quiver.precision.measure_precision", no_timing)
    _, server = _logits(data, ckpt, precision="auto")
    assert "from the manifest" in server.info
