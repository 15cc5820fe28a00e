"""Several trainers' endpoints over the generation ranks (`grpo.wings.agents.lockstep`): real gloo processes,
each a trainer whose backend is a real collective (tests/helpers/lockstep_peer.py). The loop's calls, an async
producer's weight loads and endpoint batches that only some trainers have all generate, in an order every trainer
agrees on; a trainer that closes ends the others' calls with an error, never a hang."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from grpo.wings.agents.lockstep import pick_round
from tests.helpers.e2e import REPO, child_env, free_port


def trainers(world: int, mode: str) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.lockstep_peer", str(port), str(r), str(world),
                               mode], cwd=REPO, env=child_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a trainer hung")
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


@pytest.mark.parametrize("world", [2, 3])
def test_loop_calls_producer_loads_and_one_trainers_endpoint_batches_generate_together(world):
    outs = trainers(world, "busy")
    logs = [o["log"] for o in outs]
    assert all(log == logs[0] for log in logs)  # every trainer made the same calls in the same order
    for rank, o in enumerate(outs):
        # the loop's rollout: lockstep_max agreed, every generate its own samples back
        assert [most for most, _ in o["rollout"]] == [world] * 5
        assert [outs_ for _, outs_ in o["rollout"]] == [[[10 * s + rank, 10]] * (rank + 1) for s in range(5)]
        assert len(o["loads"]) == 3 and o["loads"] == sorted(o["loads"])
        assert o["after_close"].startswith("the run is ending")
    solo = {name: [x for n, x in outs[0]["solo"] if n == name] for name in ("a", "b")}
    assert solo == {"a": [[[k, 10]] for k in range(3)], "b": [[[k, 10]] for k in range(2)]}  # train profile
    assert outs[-1]["solo"] == [["v", [[100 * (world - 1), 5]]]]  # val profile (temperature 0.5) on the last rank
    generates = [e for e in logs[0] if e[0] == "generate"]
    assert len(generates) >= 5 + 2  # the rollout's five, at least one solo round of each profile
    # a solo round is the endpoints' batch of the trainers that have one; the others take part with none
    assert any(e[2][0] > 0 and all(n == 0 for n in e[2][1:]) for e in generates)
    in_flight = [e for e in logs[0] if e == ["load_staged", True]]
    assert len(in_flight) == len(generates)  # the in-flight load inside every generate ran at once


def test_a_trainer_that_closes_ends_the_others_calls_with_an_error():
    outs = trainers(2, "close-early")
    assert outs[1] == {"closed": True}
    assert outs[0]["error"].startswith("the run is ending") and outs[0]["seconds"] < 30


def test_trainers_with_and_without_agent_samples_make_the_same_weight_loads():
    """Issue 52, finding 4: the rollout loaded the newest weights before its agent samples only where it had some; with
    generation ranks a load is a collective of the trainers, so the trainer with none went on to the rollout's
    gather and the other waited in its load for ever."""
    outs = trainers(2, "agents")
    assert outs[0]["log"] == outs[1]["log"]  # the same calls in the same order on both trainers
    assert outs[0]["samples"] == outs[1]["samples"]  # the same rollout, gathered
    (task0, error0, reward0, version0), (task1, error1, reward1, version1) = outs[0]["samples"]
    assert (task0, error0, reward0) == ("agent", None, 1.0) and (task1, error1, reward1) == ("echo", None, 1.0)
    loads = [e for e in outs[0]["log"] if e == ["load_staged", False]]
    # the window's load (version 1), the chunk's (2; the in-flight load inside its generate makes 3), the agents' (4)
    assert len(loads) == 3 and (version1, version0) == (2, 4)


def test_rounds_alternate_sections_and_solo_batches():
    idle = (False, [], [])
    assert pick_round([idle, idle], 0, False) == ("idle", None)
    both = [(False, ["MainThread", "grpo-generation"], []), (False, ["grpo-generation", "MainThread"], [])]
    assert [pick_round(both, k, False)[1] for k in range(2)] == ["MainThread", "grpo-generation"]
    assert pick_round([(False, ["MainThread"], []), (False, ["grpo-generation"], [])], 0, False) == ("idle", None)
    both_profiles = [(False, [], ["train", "val"]), (False, [], ["val"])]
    assert [pick_round(both_profiles, k, False) for k in range(2)] == [("solo", "train"), ("solo", "val")]
