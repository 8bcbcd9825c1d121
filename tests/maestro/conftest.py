"""Fixtures shared by the Maestro tests; Hugging Face stays offline (nothing is downloaded:
models are built from configs with random weights, spawned ranks inherit the setting)."""

import os
import sys

import pytest

# shared test modules of this directory (``dist_cases``) import by name under importlib mode
sys.path.insert(0, os.path.dirname(__file__))

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
