"""Fixtures shared by the Maestro tests; Hugging Face stays offline (nothing is downloaded:
models are built from configs with random weights, spawned ranks inherit the setting)."""

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from maestro.plan import ScenarioSpec
from maestro.plan.workload import scenario_workload


@pytest.fixture(scope="module")
def kd16():
    """The paper-like KD scenario's workload at 16 GPUs, 4 samples per GPU."""
    return scenario_workload(ScenarioSpec(name="kd", gpus=16, samples_per_gpu=4))


@pytest.fixture(scope="module")
def mllm16():
    """The MLLM-with-audio scenario's workload at 16 GPUs, 4 samples per GPU."""
    return scenario_workload(ScenarioSpec(name="mllm-audio", gpus=16, samples_per_gpu=4))
