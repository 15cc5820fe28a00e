"""A trainer for tests/unit/test_lockstep.py: ``python -m tests.helpers.lockstep_peer PORT RANK WORLD MODE``.

Each process is one trainer with `grpo.wings.agents.lockstep.LockstepGeneration` over `Collective`, a stand-in
for `RemoteGeneration` whose every call is a real collective of the trainers over its own gloo group (and which
fails loudly when the trainers do not agree on a call or on its sampling profile). It prints one JSON line.

busy: the main thread makes the rollout's calls (lockstep_max, then generate, at rank-dependent moments), a thread
named like the async producer loads weights, and the endpoint batches (`generate_solo`) come from two threads on
rank 0 only, plus one validation batch on the last rank; every generate makes an in-flight load inside it (a call
made from inside a section or a solo round).
close-early: the last rank closes at once; the others' next section must fail with RolloutError, not hang.
agents: one async-loop rollout (`grpo.system.rollout.generate_rollout` with in-flight weight updates) per trainer,
each with its real endpoint and `AgentPlayer` over the lockstep; the agent sample falls to trainer 0 only (the other
plays a one-turn environment), and the weights come through the async producer's `load_newest` (a collective of the
trainers with generation ranks: every trainer must make the same loads).
"""

from __future__ import annotations

import datetime
import json
import random
import sys
import threading
import time

import torch
import torch.distributed as dist

from grpo.config import GenerationConfig
from grpo.system.generation.base import GenerationBackend, GenerationOutput
from grpo.wings.agents.lockstep import LockstepGeneration
from grpo.system.rollout import RolloutError


class Collective(GenerationBackend):
    """Every call is a collective of the trainers; ``log`` is what it saw (the same on every trainer)."""

    loads_staged_weights = True  # as RemoteGeneration: weights come from the stage, in a collective

    def __init__(self, gen_cfg):
        self.group = dist.new_group(backend="gloo")
        self.sampling, self.version, self.log = gen_cfg.sampling(), 0, []

    def _gather(self, item):
        parts = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, item, group=self.group)
        return parts

    def generate(self, prompt_ids, seeds, *, greedy=False, max_new_tokens=None, stop_strings=None, sampling=None):
        sampling = sampling or self.sampling
        parts = self._gather(("generate", sampling.temperature, list(map(list, prompt_ids)), list(seeds)))
        if len({(p[0], p[1]) for p in parts}) != 1:
            raise AssertionError(f"the trainers disagree on the call: {[(p[0], p[1]) for p in parts]}")
        self.log.append(("generate", parts[0][1], [len(p[2]) for p in parts]))
        if self.in_flight is not None:
            self.in_flight()
        temp = int(sampling.temperature * 10)
        return [GenerationOutput(list(p), [s, temp, self.version], [0.0] * 3, "stop", "") for p, s in
                zip(prompt_ids, seeds)]

    def lockstep_max(self, n_local):
        parts = self._gather(("lockstep_max", n_local))
        if {p[0] for p in parts} != {"lockstep_max"}:
            raise AssertionError(f"the trainers disagree on the call: {parts}")
        self.log.append(("lockstep_max",))
        return max(p[1] for p in parts)

    def load_staged(self, stage, mid_request=False):
        parts = self._gather(("load_staged", mid_request))
        if len(set(parts)) != 1:
            raise AssertionError(f"the trainers disagree on the call: {parts}")
        self.version += 1
        self.log.append(("load_staged", mid_request))
        return self.version


def busy(rank: int, world: int, gen: LockstepGeneration, inner: Collective) -> dict:
    gen.in_flight = lambda: gen.load_staged(None, mid_request=True)  # as the async producer hooks it
    out: dict = {"solo": [], "rollout": [], "loads": []}
    rng = random.Random(rank)

    def endpoint(name: str, profile: str, n: int, delay: float) -> None:
        time.sleep(delay)
        for k in range(n):
            outs = gen.generate_solo(profile, [[rank, k]], [100 * rank + k], [4], [None])
            out["solo"].append((name, [o.completion_ids[:2] for o in outs]))
            time.sleep(rng.random() * 0.05)

    def producer() -> None:
        for _ in range(3):
            out["loads"].append(gen.load_staged(None))
            time.sleep(rng.random() * 0.05)

    threads = [threading.Thread(target=producer, name="grpo-generation")]
    if rank == 0:
        threads += [threading.Thread(target=endpoint, args=("a", "train", 3, 0.0)),
                    threading.Thread(target=endpoint, args=("b", "train", 2, 0.03))]
    if rank == world - 1:
        threads.append(threading.Thread(target=endpoint, args=("v", "val", 1, 0.05)))
    for t in threads:
        t.start()
    for step in range(5):
        time.sleep(rng.random() * 0.05)
        most = gen.lockstep_max(rank + 1)
        outs = gen.generate([[step, rank]] * (rank + 1), [10 * step + rank] * (rank + 1))
        out["rollout"].append((most, [o.completion_ids[:2] for o in outs]))
    for t in threads:
        t.join()
    dist.barrier()  # every trainer's calls are done: a trainer that closes stops every driver
    gen.close()
    try:
        gen.generate([[0]], [0])
        out["after_close"] = "generated"
    except RolloutError as err:
        out["after_close"] = str(err)
    out["log"] = inner.log
    return out


def close_early(rank: int, world: int, gen: LockstepGeneration) -> dict:
    if rank == world - 1:
        gen.close()
        return {"closed": True}
    t0 = time.monotonic()
    try:
        gen.generate([[1]], [1])
        return {"error": None}
    except RolloutError as err:
        return {"error": str(err), "seconds": time.monotonic() - t0}


class AgentCollective(Collective):
    """`Collective` whose completions are tokens of the char tokenizer ("7", then EOS), as an endpoint decodes them."""

    def __init__(self, gen_cfg, tokenizer):
        super().__init__(gen_cfg)
        self.tokenizer = tokenizer

    def generate(self, prompt_ids, seeds, **kw):
        outs = super().generate(prompt_ids, seeds, **kw)
        ids = self.tokenizer("7", add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [GenerationOutput(o.prompt_ids, list(ids), [-0.5] * len(ids), "stop", "7") for o in outs]


class ProducerWeights:
    """The async producer's weight source with generation ranks: `grpo.run.producer.RolloutProducer.load_newest` itself,
    over this trainer's backend and endpoint (a load through the endpoint, a collective of the trainers)."""

    from grpo.run.producer import RolloutProducer

    load_newest = RolloutProducer.load_newest

    def __init__(self, generator, agents):
        import types

        self.generator, self.stage, self.version = generator, None, -1
        self.run = types.SimpleNamespace(player=agents)


class OneTurn:
    """Ends every sample after its first turn, rewarding 1."""

    def step(self, message_logs, metadata):
        from grpo.tasks.interface import EnvironmentReturn

        n = len(message_logs)
        return EnvironmentReturn([{"role": "user", "content": ""}] * n, metadata, [None] * n, torch.ones(n),
                                 torch.ones(n, dtype=torch.bool), [None] * n)


def agents(rank: int, world: int, gen: LockstepGeneration, inner: Collective) -> dict:
    from grpo.config import MasterConfig
    from grpo.wings.agents.player import AgentPlayer
    from grpo.system.chat import ChatFormat
    from grpo.wings.agents.endpoint import Endpoint
    from grpo.system.rollout import TurnSettings, generate_rollout
    from grpo.wings.agents.environment import AgentEnvironment
    from grpo.tasks.router import Environments
    from grpo.tasks.rows import PromptRow

    tok = inner.tokenizer
    cfg = MasterConfig.model_validate({"policy": {
        "model_name": "toy:tiny", "max_total_sequence_length": 64,
        "generation": {"max_new_tokens": 4, "temperature": 1.0, "val_temperature": 0.5,
                       "port_range_low": 26000, "port_range_high": 26999,
                       "http_server": {"batch_window_s": 0.01, "max_wait_s": 30.0},
                       "vllm_cfg": {"http_server_serving_chat_kwargs": {"tool_parser": "compact"}}}}})  # calc_agent's
    endpoint = Endpoint(cfg, gen, tok)
    endpoint.start()
    player = AgentPlayer(endpoint)
    gen.in_flight = lambda: gen.load_staged(None, mid_request=True)  # as the async producer hooks it
    envs = Environments({"echo": OneTurn(), "agent": AgentEnvironment(fn="tests.helpers.agent_fns:calc_agent")},
                        step_timeout_s=30)

    def row(i: int, task: str) -> PromptRow:
        ids = tok(f"q{i}")["input_ids"]
        return PromptRow(index=i, question=f"q{i}", answer="7", task_name=task,
                         prompt_messages=[{"role": "user", "content": f"q{i}", "token_ids": ids}], prompt_ids=ids)

    # sample 0 (an agent's) is trainer 0's share, sample 1 (a one-turn environment's) trainer 1's (rank_slice)
    rollout = generate_rollout([row(0, "agent"), row(1, "echo")], 1, gen, envs, ChatFormat(tok),
                               TurnSettings(max_turns=1, max_total_len=64, chunk_size=4, max_new_tokens=4),
                               base_seed=3, step=1, gen_batch=0, stream="train", rank=rank, world_size=world,
                               weights=ProducerWeights(gen, player), player=player)
    dist.barrier()  # every trainer's rollout is done: a trainer that closes stops every driver
    endpoint.close()
    gen.close()
    return {"samples": [(t.task_name, t.failure and t.failure.reason, t.reward, t.generation_version)
                        for t in rollout.trajectories],
            "log": inner.log}


def main() -> None:
    port, rank, world, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cfg = GenerationConfig(temperature=1.0, val_temperature=0.5)
    if mode == "agents":
        from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer

        inner = AgentCollective(cfg, build_char_tokenizer(SIMPLE_CHAT_TEMPLATE))
    else:
        inner = Collective(cfg)
    gen = LockstepGeneration(inner, cfg)
    modes = {"busy": lambda: busy(rank, world, gen, inner), "close-early": lambda: close_early(rank, world, gen),
             "agents": lambda: agents(rank, world, gen, inner)}
    result = modes[mode]()
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
