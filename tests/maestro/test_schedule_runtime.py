"""Every scheduler trains the same model: real gloo ranks, float64, parameters compared.

The wavefront schedule reorders samples and re-balances them across replicas; the monolithic
baseline runs the whole model per rank. After the same steps on the same global batches,
every section's parameters and the losses agree to float64 rounding.
"""

from __future__ import annotations

import pytest
import torch

from maestro import config as C
from maestro.runtime import RunOptions, launch
from maestro.runtime.local import reference_train
from maestro.schedule import get_scheduler, validate_schedule
from maestro.workloads import get_workload

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CONFIG = """
global_batch = 12
steps = 2
seed = 3
dtype = "float64"
scheduler = "{scheduler}"
monolithic_micro_batch_size = 2
[workload]
name = "mllm"
vocab_size = 32
seq_len_min = 4
seq_len_max = 20
llm_dim = 8
llm_layers = 1
heads = 2
vision_dim = 8
vision_layers = 1
image_patches = 3
patch_dim = 6
mix = {{ text = 0.4, image = 0.6 }}
[sections.vision]
dp = 1
micro_batch_size = 3
lr = 0.01
[sections.llm]
dp = 1
micro_batch_size = 2
lr = 0.01
"""


def _train(tmp_path, scheduler: str, monolithic: bool = False):
    cfg = C.loads(CONFIG.format(scheduler=scheduler))
    out = tmp_path / (scheduler + ("-mono" if monolithic else ""))
    opts = RunOptions(monolithic=monolithic, save_dir=str(out), progress=False, device="cpu")
    res = launch(cfg, 2, opts, timeout_s=240)
    params = {n: torch.load(out / f"{n}.pt") for n in ("vision", "llm")}
    return res["losses"], params


def test_schedules_differ_but_train_identically(tmp_path):
    cfg = C.loads(CONFIG.format(scheduler="fifo"))
    wl = get_workload(cfg)
    infos = wl.sample_infos(wl.batch(0), wl.graph(build=[]))
    specs = cfg.section_specs()
    fifo = get_scheduler("fifo")(infos, specs)
    wave = get_scheduler("wavefront")(infos, specs)
    validate_schedule(wave, infos, specs)
    assert fifo.order != wave.order, "the test needs schedules that really differ"

    runs = {
        "fifo": _train(tmp_path, "fifo"),
        "wavefront": _train(tmp_path, "wavefront"),
        "monolithic": _train(tmp_path, "fifo", monolithic=True),
    }
    # the reference is one process running the whole model (not the same launch path)
    graph, ref_losses = reference_train(cfg)
    ref = {s.name: s.module.state_dict() for s in graph if not s.frozen}
    init = get_workload(cfg).build_module("vision").state_dict()
    assert any(not torch.equal(init[k], ref["vision"][k]) for k in init), "vision did not train"
    for name, (losses, params) in runs.items():
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-10, atol=0, msg=name
        )
        for sec, sd in params.items():
            for k, v in sd.items():
                torch.testing.assert_close(v, ref[sec][k], rtol=1e-10, atol=1e-12, msg=name)
