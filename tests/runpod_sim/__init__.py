"""A simulator of Runpod's API for tests (see `api`)."""

from tests.runpod_sim.api import (
    CAPACITY_TEXT,
    DEFAULT_DATA_CENTERS,
    RunpodSim,
    SimGpu,
    SimPod,
    SimRequest,
    default_gpus,
    running_sim,
)

__all__ = [
    "CAPACITY_TEXT",
    "DEFAULT_DATA_CENTERS",
    "RunpodSim",
    "SimGpu",
    "SimPod",
    "SimRequest",
    "default_gpus",
    "running_sim",
]
