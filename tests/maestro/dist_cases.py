"""The small KD and MLLM run configs and the comparison with ``reference_train`` that the
real-process exactness tests share (``test_runtime_dist.py``, ``test_colocated_dist.py``)."""

import torch

from maestro.runtime import reference_train
from maestro.workloads import get_workload

KD = """
global_batch = 8
steps = 3
dtype = "{dtype}"
scheduler = "{scheduler}"
monolithic_micro_batch_size = 3
[workload]
name = "kd"
vocab_size = 32
seq_len_min = 4
seq_len_max = 14
teacher_dim = 16
teacher_layers = 2
student_dim = 8
student_layers = 1
heads = 2
top_k = {top_k}
[sections.teacher]
dp = 1
micro_batch_size = 8
frozen = true
[sections.student]
dp = {student_dp}
micro_batch_size = 2
lr = 0.01
"""

MLLM = """
global_batch = 10
steps = 3
seed = 2
dtype = "{dtype}"
scheduler = "{scheduler}"
[workload]
name = "mllm"
vocab_size = 32
seq_len_min = 4
seq_len_max = 14
llm_dim = 8
llm_layers = 1
heads = 2
vision_dim = 8
vision_layers = 1
image_patches = 3
patch_dim = 6
audio_dim = 8
audio_layers = 1
audio_frames = 2
frame_dim = 5
mix = {mix}
[sections.vision]
dp = 1
micro_batch_size = 3
lr = 0.01
{audio}
[sections.llm]
dp = {llm_dp}
micro_batch_size = 2
optimizer = "sgd"
lr = 0.1
"""


def rel_err(saved_dir, graph, name):
    sd = torch.load(saved_dir / f"{name}.pt")
    ref = graph[name].module.state_dict()
    num = sum(((sd[k].double() - ref[k].double()) ** 2).sum() for k in ref)
    den = sum((ref[k].double() ** 2).sum() for k in ref)
    return float((num / den).sqrt())


def moved(cfg, graph, name):
    init = get_workload(cfg).build_module(name).state_dict()
    ref = graph[name].module.state_dict()
    return max(float((ref[k] - init[k]).abs().max()) for k in ref)


def check_equal(cfg, result, tmp_path, tol, sections):
    graph, losses = reference_train(cfg)
    for name in sections:
        assert moved(cfg, graph, name) > 1e-4, f"{name} did not train"
        err = rel_err(tmp_path, graph, name)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(losses), rtol=tol, atol=0
    )
