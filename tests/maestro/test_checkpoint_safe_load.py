"""Checkpoint files load with ``weights_only=True``: a pickled callable is refused, never run."""

import os
import random

import pytest
import torch

from maestro.runtime.checkpoint import safe_load

_RAN = []


def _payload():
    _RAN.append(1)
    return {"module": {}}


class _Evil:
    # unpickling calls ``_payload`` under weights_only=False
    def __reduce__(self):
        return (_payload, ())


def test_maestro_state_loads(tmp_path):
    p = tmp_path / "ok.pt"
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    obj = {
        "module": {"w": torch.ones(2)},
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "step": 3,
    }
    torch.save(obj, p)
    got = safe_load(p)
    assert torch.equal(got["module"]["w"], obj["module"]["w"])
    assert got["rng"]["python"] == obj["rng"]["python"]


def test_pickled_callable_refused_and_not_run(tmp_path):
    p = tmp_path / "0000000005.student.pt"
    torch.save({"module": _Evil()}, p)
    with pytest.raises(ValueError) as e:
        safe_load(p)
    assert _RAN == []
    msg = str(e.value)
    assert str(p) in msg and "\n" not in msg
    assert os.path.exists(p)
