"""Section and SectionGraph: DAG validation, activation, any nn.Module as a section."""

import pytest
import torch
from torch import nn

from maestro.runtime.local import compound_loss
from maestro.sections import Section, SectionGraph


def lin(i=3, o=3):
    return nn.Linear(i, o)


def test_graph_orders_producers_first_and_finds_sinks():
    g = SectionGraph(
        [
            Section("c", lin(), inputs=["a", "b"], loss=lambda o, s: o["out"].sum()),
            Section("a", lin()),
            Section("b", lin(), inputs=["a"]),
        ]
    )
    assert g.names == ["a", "b", "c"]
    assert g.consumers("a") == ["b", "c"] and g.sinks() == ["c"]


def test_unknown_input_duplicate_and_cycle():
    with pytest.raises(ValueError, match="unknown section 'z'"):
        SectionGraph([Section("a", lin(), inputs=["z"])])
    with pytest.raises(ValueError, match="duplicate section names: a"):
        SectionGraph([Section("a", lin()), Section("a", lin())])
    with pytest.raises(ValueError, match="cycle a -> b -> a|cycle b -> a -> b"):
        SectionGraph(
            [
                Section("a", lin(), inputs=["b"]),
                Section("b", lin(), inputs=["a"]),
                Section("c", lin()),
            ]
        )


def test_bad_section_arguments():
    with pytest.raises(ValueError, match="must be an nn.Module or a zero-argument factory"):
        Section("a", lambda x: x)
    with pytest.raises(ValueError, match="must be an nn.Module or a zero-argument factory"):
        Section("a", 3)
    with pytest.raises(ValueError, match="not a string"):
        Section("a", lin(), inputs="b")
    with pytest.raises(ValueError, match="frozen but reads trainable"):
        SectionGraph([Section("a", lin()), Section("b", lin(), inputs=["a"], frozen=True)])
    with pytest.raises(ValueError, match="frozen and has no consumer"):
        SectionGraph([Section("a", lin(), frozen=True)])


def test_plain_modules_chain_matches_direct_computation():
    torch.manual_seed(0)
    enc, head = nn.Linear(4, 3), nn.Linear(3, 1)
    g = SectionGraph(
        [
            Section("enc", enc, activates_on=lambda s: s["id"] % 2 == 0),
            Section(
                "head", head, inputs=["enc"], loss=lambda o, s: (o["out"] - s["y"]).pow(2).sum()
            ),
        ]
    )
    samples = [{"id": i, "x": torch.randn(4), "y": torch.randn(1)} for i in (0, 2, 4)]
    got = compound_loss(g, samples)
    want = sum(((head(enc(s["x"])) - s["y"]) ** 2).sum() for s in samples)
    torch.testing.assert_close(got, want)
    assert g["enc"].activated({"id": 2}) and not g["enc"].activated({"id": 3})
