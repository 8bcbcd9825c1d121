"""The first SAGE layer folded into the feature table: the same logits and embeddings as the
unfolded model, clear refusals for models and stores it cannot serve, and ``auto`` deciding by
measurement."""

import json

import numpy as np
import pytest
import torch

from quiver import CSRTopo
from quiver.cli import main as quiver_main
from quiver.datasets import save_prepared
from quiver.models import ModelConfig, build_model, save_checkpoint
from quiver.pyg import GraphSageSampler
from quiver.serving import ServeConfig
from quiver.serving import folded as folded_mod
from quiver.serving.folded import FoldedFirstLayer, measure_fold, why_not_foldable
from quiver.serving.server import Server

N, DIM, CLASSES = 500, 12, 5
FANOUTS = [5, 3, 2]


def _graph(seed=0):
    """A skewed graph (answers depend on the sample) with 20 nodes that have no in-edges."""
    rng = np.random.default_rng(seed)
    dst = (N * rng.random(6000) ** 1.5).astype(np.int64)
    src = (N * rng.random(6000) ** 2).astype(np.int64)
    keep = dst >= 20  # nodes 0..19 are isolated targets: an empty neighbour mean
    return CSRTopo.from_edge_index(torch.from_numpy(np.stack([src[keep], dst[keep]])), num_nodes=N)


def _model(kind="sage", layers=3, seed=0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(kind, DIM, CLASSES, hidden_dim=24, num_layers=layers)).eval()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("folded")
    topo = _graph()
    x = np.random.default_rng(1).standard_normal((N, DIM)).astype(np.float32)
    labels = np.random.default_rng(2).integers(0, CLASSES, N)
    save_prepared(d / "data", topo, x, labels, {"test": np.arange(0, N, 2)}, {"fanouts": FANOUTS})
    model = _model()
    save_checkpoint(d / "sage.pt", model, {"fanouts": FANOUTS})
    gcn = _model("gcn")
    save_checkpoint(d / "gcn.pt", gcn, {"fanouts": FANOUTS})
    return d, topo, torch.from_numpy(x), model


@pytest.mark.parametrize("shuffle", [False, True])
def test_folded_first_layer_gives_the_unfolded_logits(world, shuffle):
    _, topo, x, model = world
    fold = FoldedFirstLayer(model, x, dtype=torch.float32, chunk_rows=64)  # several chunks
    sampler = GraphSageSampler(topo, FANOUTS, mode="CPU", seed=3)
    for seeds in (torch.arange(0, 40), torch.tensor([7]), torch.arange(N)):
        n_id, _, adjs = sampler.sample(seeds)
        if shuffle:  # a sampler whose first hop's edges are not grouped by target
            ei, e_id, size = adjs[0]
            perm = torch.randperm(ei.shape[1], generator=torch.Generator().manual_seed(0))
            adjs = [(ei[:, perm], e_id, size)] + list(adjs[1:])
        with torch.inference_mode():
            want_emb, want = model.forward_all(x[n_id], adjs)
            h, rest = fold.gather_layer(n_id, adjs)
            emb, got = fold.tail.forward_all(h, rest)
        assert len(rest) == len(FANOUTS) - 1 and h.shape == (adjs[0][2][1], 24)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(emb, want_emb, atol=1e-5, rtol=1e-5)
    # the isolated seeds (no neighbours) are in the last batch: their mean is 0 on both paths
    assert fold.nbytes == 2 * N * 24 * 4 and fold.shape == (N, 24)


def test_bf16_tables_stay_close_and_agree(world):
    _, topo, x, model = world
    fold = FoldedFirstLayer(model, x, dtype=torch.bfloat16)
    assert fold.left.dtype == torch.bfloat16 and fold.nbytes == 2 * N * 24 * 2
    n_id, _, adjs = GraphSageSampler(topo, FANOUTS, mode="CPU", seed=0).sample(torch.arange(N))
    with torch.inference_mode():
        want = model(x[n_id], adjs)
        h, rest = fold.gather_layer(n_id, adjs)
        got = fold.tail(h, rest)
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) < 0.05
    assert float((got.argmax(1) == want.argmax(1)).float().mean()) >= 0.98


def test_tail_shares_the_models_parameters(world):
    _, _, x, model = world
    fold = FoldedFirstLayer(model, x)
    tail_params = {p.data_ptr() for p in fold.tail.parameters()}
    assert tail_params == {p.data_ptr() for c in model.convs[1:] for p in c.parameters()}


def test_why_not_foldable_names_the_reason():
    from quiver.usermodel import ServedModel

    assert why_not_foldable(_model()) is None
    assert "gcn, not SAGE" in why_not_foldable(_model("gcn"))
    assert "gat, not SAGE" in why_not_foldable(_model("gat"))
    assert "one-layer" in why_not_foldable(_model(layers=1))
    odd = _model()
    odd.convs[0].root_weight = False
    assert "mean aggregation with a root weight" in why_not_foldable(odd)
    assert "takes (x, adjs)" in why_not_foldable(ServedModel(_model(), convention="adjs"))
    assert "not Quiver's own GNN" in why_not_foldable(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="cannot fold this model: its first layer is gcn"):
        FoldedFirstLayer(_model("gcn"), torch.zeros(N, DIM))
    with pytest.raises(ValueError, match="takes 12 features per node; the dataset has 7"):
        FoldedFirstLayer(_model(), torch.zeros(N, 7))


def test_measure_fold_times_both_paths_on_the_same_batches(world):
    _, topo, x, model = world
    fold = FoldedFirstLayer(model, x)
    sampler = GraphSageSampler(topo, FANOUTS, mode="CPU", seed=0)
    folds = {"fp32": fold, "bf16": fold.to(torch.bfloat16)}
    assert folds["bf16"].left.dtype == torch.bfloat16 and folds["bf16"].tail is fold.tail
    m = measure_fold(sampler, x, model, folds, N, batch_sizes=(8, 64), repeats=2)
    assert m["unfolded_s"] > 0 and all(m["folded_s"][k] > 0 for k in folds)
    assert m["agreement"]["fp32"] == 1.0 and m["max_abs_diff"]["fp32"] < 1e-4
    assert m["agreement"]["bf16"] >= 0.95 and 0 < m["max_abs_diff"]["bf16"] < 0.1


def _serve(data, ckpt, **kw):
    cfg = ServeConfig(max_batch_nodes=N, max_request_nodes=N)
    with Server.from_dataset(data, ckpt, cfg, seed=0, **kw) as server:
        logits = np.asarray(server.predict(list(range(N)), output="logits").values)
        emb = np.asarray(server.predict(list(range(0, N, 3)), output="embedding").values)
        return logits, emb, server


def test_served_logits_and_embeddings_match_unfolded(world):
    d, *_ = world
    want, want_emb, plain = _serve(d / "data", d / "sage.pt", fold="off")
    got, got_emb, server = _serve(d / "data", d / "sage.pt", fold="on")
    assert not isinstance(plain.engine.features, FoldedFirstLayer)
    assert isinstance(server.engine.features, FoldedFirstLayer)
    assert "first layer folded into 2 x 500 x 24 fp32 tables" in server.info
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_emb, want_emb, atol=1e-5, rtol=1e-5)
    # bf16 gather: the tables are bf16, the answers close
    got16, _, server16 = _serve(d / "data", d / "sage.pt", fold="on", precision="bf16")
    assert server16.engine.features.dtype == torch.bfloat16
    assert float((got16.argmax(1) == want.argmax(1)).mean()) >= 0.98


def _fresh_data(world, tmp_path):
    """A copy of the world's dataset, with no stored decision in its manifest."""
    import shutil

    d, *_ = world
    shutil.copytree(d / "data", tmp_path / "data")
    return tmp_path / "data"


def _forget_fold(data):
    """Drop the stored ``--fold-first-layer auto`` decision: the next start measures again."""
    m = json.loads((data / "manifest.json").read_text())
    m.pop("fold", None)
    (data / "manifest.json").write_text(json.dumps(m))


def test_auto_folds_only_when_measured_faster(world, monkeypatch, tmp_path):
    d, *_ = world
    data = _fresh_data(world, tmp_path)

    def timed(unfolded, folded, bf16=None):
        def fake(sampler, features, model, folds, *a, **k):
            assert list(folds) == (["fp32"] if bf16 is None else ["fp32", "bf16"])
            times = {"fp32": folded} if bf16 is None else {"fp32": folded, "bf16": bf16}
            return {"unfolded_s": unfolded, "folded_s": times}

        return fake

    monkeypatch.setattr(folded_mod, "measure_fold", timed(2.0, 1.0))
    _, _, server = _serve(data, d / "sage.pt", fold="auto")
    assert isinstance(server.engine.features, FoldedFirstLayer)
    assert "2.00x faster on sampled batches" in server.info
    _forget_fold(data)
    monkeypatch.setattr(folded_mod, "measure_fold", timed(1.0, 0.99))  # within the 5% margin
    _, _, server = _serve(data, d / "sage.pt", fold="auto")
    assert not isinstance(server.engine.features, FoldedFirstLayer)
    assert "first layer not folded (measured 1.01x" in server.info
    # a bf16 gather: auto also tries fp32 tables and keeps the faster
    for fp32_s, bf16_s, kept in ((1.0, 0.5, torch.bfloat16), (0.5, 1.0, torch.float32)):
        _forget_fold(data)
        monkeypatch.setattr(folded_mod, "measure_fold", timed(2.0, fp32_s, bf16_s))
        _, _, server = _serve(data, d / "sage.pt", fold="auto", precision="bf16")
        assert server.engine.features.dtype == kept
        assert "tables 2.00x" in server.info
    # a model that cannot fold is served as it is under auto
    _, _, server = _serve(data, d / "gcn.pt", fold="auto")
    assert "first layer not folded (its first layer is gcn, not SAGE)" in server.info


def test_a_feature_cache_of_every_row_still_folds(world):
    d, *_ = world
    _, _, server = _serve(d / "data", d / "sage.pt", fold="on", feature_cache=N * DIM * 4)
    assert isinstance(server.engine.features, FoldedFirstLayer)


def test_auto_skips_tables_that_do_not_fit(world, monkeypatch):
    d, *_ = world
    from quiver.serving import server as server_mod

    monkeypatch.setattr(server_mod, "_available_ram", lambda: 2 * N * 24 * 4)  # need = all of it
    _, _, server = _serve(d / "data", d / "sage.pt", fold="auto")
    assert "auto folds within half of it" in server.info
    _, _, server = _serve(d / "data", d / "sage.pt", fold="on")  # "on" may use all of it
    assert isinstance(server.engine.features, FoldedFirstLayer)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--checkpoint", "gcn.pt"], "cannot fold: its first layer is gcn, not SAGE"),
        (["--feature-cache", "1K"], "cannot fold: a partial --feature-cache serves the raw"),
    ],
)
def test_fold_on_refusals_are_one_line(world, capsys, extra, message):
    d, *_ = world
    args = ["serve", str(d / "data"), "--checkpoint", str(d / "sage.pt"), "--port", "0"]
    args += ["--fold-first-layer", "on"] + [str(d / a) if a.endswith(".pt") else a for a in extra]
    rc = quiver_main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert message in err[0]


def test_bad_fold_value_is_refused(world):
    d, *_ = world
    with pytest.raises(ValueError, match="--fold-first-layer must be one of auto, on, off"):
        Server.from_dataset(d / "data", d / "sage.pt", fold="maybe")


def test_auto_decisions_are_reused_at_restart(world, monkeypatch, tmp_path):
    """``--precision auto --fold-first-layer auto``: the first start measures both and stores
    them; the next start on this machine reads both back, measures nothing and serves
    bit-identical logits (a restart used to re-measure the fold, and could switch between
    folded and unfolded or between table dtypes)."""
    from quiver import precision

    d, *_ = world
    data = _fresh_data(world, tmp_path)
    calls = []

    def spy(name, real):
        def measured(*a, **k):
            calls.append(name)
            return real(*a, **k)

        return measured

    monkeypatch.setattr(
        precision, "measure_precision", spy("precision", precision.measure_precision)
    )
    monkeypatch.setattr(folded_mod, "measure_fold", spy("fold", folded_mod.measure_fold))
    first, first_emb, s1 = _serve(data, d / "sage.pt", fold="auto", precision="auto")
    assert calls == ["precision", "fold"]
    calls.clear()
    for _ in range(2):  # the second and third starts
        again, again_emb, s2 = _serve(data, d / "sage.pt", fold="auto", precision="auto")
        assert calls == [], s2.info
        np.testing.assert_array_equal(again, first)
        np.testing.assert_array_equal(again_emb, first_emb)
        assert type(s2.engine.features) is type(s1.engine.features)
        assert s2.engine.features.dtype == s1.engine.features.dtype
        assert s2.info.count("from the manifest") == 2, s2.info
    m = json.loads((data / "manifest.json").read_text())
    (fold_rec,), (prec_rec,) = m["fold"], m["precision"]
    assert fold_rec["cpu_flags"] == precision.cpu_flags() == prec_rec["cpu_flags"]
    assert fold_rec["weights"] == prec_rec["weights"] != ""
    # re-measuring the precision on request (quiver calibrate --checkpoint) drops the fold
    # decision measured on top of it: the next start measures the fold again
    precision.write_precision(data, precision.PrecisionChoice.from_json(prec_rec))
    assert "fold" not in json.loads((data / "manifest.json").read_text())
    _serve(data, d / "sage.pt", fold="auto", precision="auto")
    assert calls == ["fold"]


def test_auto_keeps_the_first_fold_decision_whatever_later_timings_say(
    world, monkeypatch, tmp_path
):
    """Fixed timings: the first start measures the folded path faster and folds; a restart
    whose measurement would say otherwise does not measure, and folds the same tables."""
    d, *_ = world
    data = _fresh_data(world, tmp_path)
    timings = iter([(2.0, 1.0), (1.0, 2.0)])  # folded faster, then slower

    def fixed(sampler, features, model, folds, *a, **k):
        unfolded, folded = next(timings)
        return {"unfolded_s": unfolded, "folded_s": dict.fromkeys(folds, folded)}

    monkeypatch.setattr(folded_mod, "measure_fold", fixed)
    first, _, s1 = _serve(data, d / "sage.pt", fold="auto")
    again, _, s2 = _serve(data, d / "sage.pt", fold="auto")
    assert isinstance(s1.engine.features, FoldedFirstLayer)
    assert isinstance(s2.engine.features, FoldedFirstLayer), s2.info
    assert "2.00x faster on sampled batches; auto, from the manifest" in s2.info
    np.testing.assert_array_equal(again, first)
    # a machine with other bf16 units (here: a record naming one more flag) measures again
    m = json.loads((data / "manifest.json").read_text())
    m["fold"][-1]["cpu_flags"] = m["fold"][-1]["cpu_flags"] + ["amx_bf16_elsewhere"]
    (data / "manifest.json").write_text(json.dumps(m))
    _, _, s3 = _serve(data, d / "sage.pt", fold="auto")
    assert not isinstance(s3.engine.features, FoldedFirstLayer)
    assert "first layer not folded (measured 0.50x" in s3.info


def test_two_checkpoints_on_one_directory_each_keep_their_decisions(world, monkeypatch, tmp_path):
    """Two checkpoints of one architecture (other weights) started alternately on one dataset
    directory: each start after its first reads that checkpoint's own precision and fold
    decisions (nothing measured) and serves the same tables; one never overwrites the
    other's (the decisions used to be one manifest slot, which the next model replaced)."""
    from quiver import precision

    d, *_ = world
    data = _fresh_data(world, tmp_path)
    other = _model(seed=1)
    save_checkpoint(tmp_path / "other.pt", other, {"fanouts": FANOUTS})
    ckpts = {"a": d / "sage.pt", "b": tmp_path / "other.pt"}
    calls = []
    # model a: the folded path measured 2x faster; model b: 2x slower
    timings = {"a": (2.0, 1.0), "b": (1.0, 2.0)}
    current = []

    def fixed(sampler, features, model, folds, *a, **k):
        calls.append(("fold", current[-1]))
        unfolded, folded = timings[current[-1]]
        return {"unfolded_s": unfolded, "folded_s": dict.fromkeys(folds, folded)}

    real_precision = precision.measure_precision

    def counted(*a, **k):
        calls.append(("precision", current[-1]))
        return real_precision(*a, **k)

    monkeypatch.setattr(folded_mod, "measure_fold", fixed)
    monkeypatch.setattr(precision, "measure_precision", counted)
    first = {}
    for start, name in enumerate("abab"):
        current.append(name)
        logits, _, server = _serve(data, ckpts[name], fold="auto", precision="auto")
        is_folded = isinstance(server.engine.features, FoldedFirstLayer)
        assert is_folded == (name == "a"), server.info
        if start < 2:
            assert calls == [("precision", name), ("fold", name)]
            first[name] = logits
        else:
            assert calls == [], server.info  # its own decisions, read back
            assert server.info.count("from the manifest") == 2, server.info
            np.testing.assert_array_equal(logits, first[name])
        calls.clear()
    m = json.loads((data / "manifest.json").read_text())
    assert len(m["precision"]) == 2 and len(m["fold"]) == 2
    assert len({r["weights"] for r in m["fold"]}) == 2


def test_decision_records_are_bounded_and_replaced_by_key(tmp_path):
    from quiver import precision

    (tmp_path / "manifest.json").write_text(json.dumps({"name": "x"}))
    for i in range(precision.KEEP_RECORDS + 3):
        rec = precision.PrecisionChoice(**precision.machine(), model_id="M", weights=f"w{i}")
        precision.write_precision(tmp_path, rec)
    again = precision.PrecisionChoice("bf16", "fp32", **precision.machine(), model_id="M")
    again.weights = "w10"
    precision.write_precision(tmp_path, again)  # replaces w10's record, moves it last
    m = json.loads((tmp_path / "manifest.json").read_text())
    weights = [r["weights"] for r in m["precision"]]
    assert len(weights) == precision.KEEP_RECORDS and weights[-1] == "w10"
    assert weights[:-1] == [f"w{i}" for i in range(3, 10)] and m["name"] == "x"
    assert precision.read_precision(m, weights="w10").gather == "bf16"
    assert precision.read_precision(m, weights="w0") is None  # dropped, the oldest
    assert precision.read_precision(m, weights="w4").gather == "fp32"
