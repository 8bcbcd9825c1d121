"""Fixtures shared by the Maestro planner tests."""

import pytest

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
