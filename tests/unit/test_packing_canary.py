"""The CPU twin of the GPU check's packed-versus-padded canary (tests/helpers/packing_canary.py), with sdpa and eager:
packed logprobs equal the padded ones, and one packed sample's tokens do not reach the others."""

import pytest
import torch

from tests.helpers.packing_canary import canary, check


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_padded_and_samples_stay_apart(attn):
    check(canary(attn, torch.device("cpu"), torch.float32), torch.float32)


def test_the_canary_sees_samples_that_mix(monkeypatch):
    """Positions running on across a packed row (no restart) let samples attend to each other: the canary fails."""
    import grpo.packing

    real = grpo.packing.packed_layout

    def running_positions(*args, **kwargs):
        source, positions = real(*args, **kwargs)
        return source, torch.arange(positions.shape[1]).expand_as(positions).clone()

    monkeypatch.setattr("grpo.system.packed.packed_layout", running_positions)
    with pytest.raises(AssertionError):
        check(canary("sdpa", torch.device("cpu"), torch.float32), torch.float32)
