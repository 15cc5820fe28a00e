"""GPU-only tests (run by scripts/gpu_check.sh on a GPU machine): every test here is skipped with the reason
"no CUDA device" where CUDA is absent.

tests/conftest.py sets DS_ACCELERATOR=cpu for the CPU suite; with a CUDA device these tests need
DeepSpeed's CUDA accelerator, so that default is dropped here (before anything imports deepspeed: run
these files on their own, as gpu_check.sh does, not after CPU tests in the same process).
"""

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") == "cpu":
    del os.environ["DS_ACCELERATOR"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here + os.sep):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def nccl_group():
    """This process as a one-rank NCCL group on cuda:0."""
    from grpo.system.dist import init_distributed

    rank, _, world, device = init_distributed()
    assert (rank, world, device.type) == (0, 1, "cuda")
    return device
