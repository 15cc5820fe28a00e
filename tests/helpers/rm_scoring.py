"""The reward models' scoring point (`grpo.wings.reward_model.scorer.RewardModels.score_pending`) on one or more
ranks; run by tests/integration/test_reward_model_zero3.py.

    python tests/helpers/rm_scoring.py RM_DIR OUT.json plain 6            # 1 process: all 6 samples here
    torchrun --nproc_per_node 2 tests/helpers/rm_scoring.py RM_DIR OUT.json zero3 5,1
        # 2 processes, a ZeRO-3 engine sharded over them: rank 0 scores 5 samples, rank 1 one (and dummy batches)

Each rank's samples go through `RewardModelEnvironment.step` (which leaves pending scores: the run's scorers are
deferred), then `score_pending`; sample `FAILED` is a failed one (not scored). Rank 0 writes the rewards
of every sample, in the global order, and each rank's number of forwards, to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, the colour of the sky."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [{"role": "user", "content": "Write a number."}, {"role": "assistant", "content": "<think>ok</think>42"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "and?"},
     {"role": "assistant", "content": "and so on, and so forth"}],
]
FAILED = 4


def main(rm_dir: str, out: str, placement: str, shares: str) -> None:
    from grpo.config import PolicyConfig, RewardModelConfig
    from grpo.system.dist import all_gather_objects, init_distributed
    from grpo.wings.reward_model.scorer import RewardModels
    from grpo.wings.reward_model.environment import RewardModelEnvironment
    from grpo.trajectory import Failure, Trajectory

    torch.manual_seed(0)
    rank, _, world_size, device = init_distributed()
    sizes = [int(x) for x in shares.split(",")]
    start = sum(sizes[:rank])
    mine = list(range(start, start + sizes[rank]))
    rm_cfg = RewardModelConfig(model_name=rm_dir, precision="float32", batch_size=2, placement=placement)
    models = RewardModels(device, PolicyConfig(precision="float32"), world_size)
    env = RewardModelEnvironment(models(rm_cfg), rm_cfg.batch_size)
    models.place()  # as setup does, once the engines are built
    forwards = []
    scorer = models(rm_cfg).scorer
    inner = scorer.score
    scorer.score = lambda ids: forwards.append(len(ids)) or inner(ids)
    logs = [CONVERSATIONS[i] for i in mine]
    ret = env.step(logs, [{"answer": ""} for _ in mine])
    trajs = [Trajectory(i, i, "rm", "q", "", [], md, reward=float(r)) for i, md, r in zip(mine, ret.metadata,
                                                                                         ret.rewards.tolist())]
    for t in trajs:
        if t.prompt_index == FAILED:  # a failed sample keeps no score
            t.fail(Failure.of("env_error"))
    models.score_pending(trajs)
    rewards = all_gather_objects([[t.reward for t in trajs]])
    calls = all_gather_objects([forwards])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rewards": [r for part in rewards for r in part], "forwards": calls,
                       "placement": scorer.placement, "world_size": world_size}, f)
    models.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
