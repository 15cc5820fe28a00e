#!/usr/bin/env python
"""64 agents over the run's endpoint vs the in-process multi-turn rollout of the same conversations, alternating.

    OMP_NUM_THREADS=2 python bench/bench_agents.py --model bench --rounds 3          # issue 32's benchmark
    python bench/bench_agents.py --model toy --prompts 1 --generations 2 --turns 1 --rounds 1   # a smoke run

One process builds the model and its hf backend once (`grpo.system.generation.hf.HFGeneration`), serves the
endpoint over it on loopback (`grpo.wings.agents.endpoint.Endpoint`, as a run does), then, for each round,
plays the same P x G conversations (8 workload prompts x 8 samples = 64, a GRPO step's shape) both ways, in
alternating order, each through `grpo.system.rollout.generate_rollout`:

- **endpoint**: ``env.name: agent`` (`grpo.wings.agents.player.AgentPlayer`): 64 concurrent agents
  (`scripted_agent`), each with its own `openai.AsyncOpenAI` client (built on one shared SSL context: a client
  that builds its own spends ~60 ms of CPU on it, which is the agent's cost, not the endpoint's) and its own
  key, making T chat completions: the
  prompt, the model's answer, a fixed environment reply, the model's answer, ... The agents send back each
  answer's token fields (``logprobs: true``), so the endpoint splices the model's own tokens (NeMo-RL's way);
- **in-process**: `grpo.system.rollout.run_conversations` with `FixedReply`, an environment that answers every
  turn with the same reply (``observation_format: raw``), ``grpo.max_rollout_turns`` = T.

The two do the same work: the chat template here renders ``<bos>`` + contents with ``<eos>`` after each answer, and
the in-process reply begins with ``<eos>``, so each turn's prompt is token for token the same length on both sides; ``<eos>``
is masked out of the model's logits (a forward hook on ``lm_head``, on both sides), so every turn generates
exactly ``--max-tokens`` tokens. Only the sampled tokens differ (the endpoint seeds a sample's calls by its key,
the rollout by sample and turn). The script checks that every sample has the same token count on both sides.

Per round (stderr): seconds, generated tokens, tokens/s of each side and the backend's batch sizes (what the
endpoint's batcher made of the agents' requests). Last line (stdout): one JSON object with every round and the
ratio of the medians, endpoint tok/s / in-process tok/s. Measurements on a shared CPU are inflated by the
other processes' load: compare only the two sides of one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import ssl
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from grpo.tasks.interface import Environment, EnvironmentReturn  # noqa: E402

# The template of both sides: contents end to end after <bos>, each answer closed by <eos> (the prefix splice
# resumes the template after the N-th <eos>, as NeMo-RL's does).
BENCH_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                       "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
REPLY = " ok. and again:"  # the environment's reply (the agent's next user message)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One SSL context for every agent's client: httpx builds one per client otherwise, even for http://, and
    loading the CA certificates takes ~60 ms of CPU, which paced 64 agents' first calls over seconds."""
    return ssl.create_default_context()


async def scripted_agent(row: dict, base_url: str, api_key: str, model: str) -> float:
    """An agent (``env.agent.fn``) of ``row["meta"]["turns"]`` chat completions of ``max_tokens`` each, the fixed
    ``reply`` between them; the model's answers go back with their token fields (the endpoint keeps its tokens)."""
    import openai

    meta = row["meta"]
    messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    http = openai.DefaultAsyncHttpxClient(verify=_ssl_context())  # ~0.2 ms, not ~60 ms of CPU (module docstring)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http) as client:
        for turn in range(meta["turns"]):
            if turn:
                messages.append({"role": "user", "content": meta["reply"]})
            r = await client.chat.completions.create(model=model, messages=messages, max_tokens=meta["max_tokens"],
                                                     logprobs=True, **row["sampling"])
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
    return 0.0


class FixedReply(Environment):
    """The in-process side's environment: every turn answered with ``<eos>`` + `REPLY` as raw tokens (the
    ``<eos>`` the template puts after an answer, then the agent's reply), reward 0; the turn limit ends the
    sample."""

    def __init__(self, reply: str = "<eos>" + REPLY):
        self.reply = reply

    def step(self, message_logs, metadata):
        n = len(message_logs)
        return EnvironmentReturn([{"role": "user", "content": self.reply}] * n, list(metadata), [None] * n,
                                 torch.zeros(n), torch.zeros(n, dtype=torch.bool), [None] * n)

    def global_post_process_and_metrics(self, batch):
        return batch, {}


class CountingBackend:
    """``backend`` whose ``generate`` calls are recorded (the number of prompts of each): the batches it got."""

    def __init__(self, backend):
        self._backend, self.batches = backend, []

    def generate(self, prompt_ids, *args, **kwargs):
        self.batches.append(len(prompt_ids))
        return self._backend.generate(prompt_ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def suppress_token(model, token_id: int) -> None:
    """Mask ``token_id`` out of the model's logits (every turn then runs to its token cap)."""
    def hook(module, inputs, logits):
        logits[..., token_id] = float("-inf")
        return logits

    model.get_output_embeddings().register_forward_hook(hook)


def load(args):
    """``(tokenizer, model, prompts)``: the benchmark workload's (``--model bench|tiny``) or the toy's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model == "toy":
        from grpo.tasks.toy import build_char_tokenizer, build_tiny_model

        tok = build_char_tokenizer()
        return tok, build_tiny_model(tok), [f"what is {a}+{b}? answer:" for a, b in zip(range(11, 99, 7), range(5, 99))]
    from bench.bench_step import build_workload  # the one builder of the shared workload (no download)

    build_workload(Path(args.workload))
    tok = AutoTokenizer.from_pretrained(f"{args.workload}/tokenizer")
    with open(f"{args.workload}/data/train.jsonl") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    model = AutoModelForCausalLM.from_pretrained(f"{args.workload}/models/{args.model}", dtype=torch.float32)
    return tok, model, prompts


def config(args, env: dict):
    from grpo.config import MasterConfig

    return MasterConfig.model_validate({
        "policy": {"model_name": args.model, "precision": "float32", "generation_batch_size": args.prompts * args.generations,
                   "max_total_sequence_length": args.max_len, "generation": {
                       "max_new_tokens": args.max_tokens, "port_range_low": 23000, "port_range_high": 23999,
                       "http_server": {"batch_window_s": args.batch_window_s},
                       "vllm_cfg": {"http_server_serving_chat_kwargs": {"chat_template": BENCH_CHAT_TEMPLATE}}}},
        "grpo": {"max_rollout_turns": args.turns}, "env": env})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(REPO / "bench_workload"))
    ap.add_argument("--model", default="bench", choices=["bench", "tiny", "toy"],
                    help="bench / tiny: the workload's models (shared/bench/make_workload.py); toy: built in memory")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8, help="samples per prompt: agents = prompts x generations")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32, help="generated tokens per turn (every turn runs to it)")
    ap.add_argument("--max-len", type=int, default=256, help="policy.max_total_sequence_length")
    ap.add_argument("--batch-window-s", type=float, default=0.02, help="policy.generation.http_server.batch_window_s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help=(
        "rounds of both sides run first and not counted (the process's first turns generate ~3x slower, whichever "
        "side plays them: measured with the order swapped)"))
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from grpo.wings.agents.player import AgentPlayer
    from grpo.system.chat import ChatFormat
    from grpo.wings.agents.endpoint import Endpoint
    from grpo.system.generation.hf import HFGeneration
    from grpo.system.rollout import TurnSettings, generate_rollout
    from grpo.tasks.factory import build_environments
    from grpo.tasks.rows import PromptRow
    from grpo.wings import load as load_wings

    torch.set_num_threads(args.threads)
    tok, model, texts = load(args)
    suppress_token(model, tok.eos_token_id)
    meta = {"turns": args.turns, "max_tokens": args.max_tokens, "reply": REPLY}
    agent_cfg = config(args, {"name": "agent", "agent": {"fn": "bench_agents:scripted_agent",
                                                          "max_concurrency": args.prompts * args.generations}})
    class_cfg = config(args, {"name": "class", "env_class": "bench_agents:FixedReply", "observation_format": "raw"})
    backend = CountingBackend(HFGeneration(agent_cfg.policy, tok, model.config, "cpu", model=model))
    endpoint = Endpoint(agent_cfg, backend, tok)
    endpoint.start()
    load_wings()  # env.name=agent is the agents wing's
    sides = {"endpoint": (build_environments(agent_cfg.env), AgentPlayer(endpoint)),
             "in_process": (build_environments(class_cfg.env), None)}
    chat = ChatFormat(tok)
    settings = TurnSettings(args.turns, args.max_len, args.prompts * args.generations, max_new_tokens=args.max_tokens)

    def rows(task: str) -> list:
        out = []
        for i, text in enumerate(texts[:args.prompts]):
            ids = tok(text)["input_ids"]
            out.append(PromptRow(i, text, "", task, [{"role": "user", "content": text, "token_ids": ids}], ids,
                                 meta=meta))
        return out

    def play(side: str, step: int) -> dict:
        envs, agents = sides[side]
        task = "agent" if agents is not None else "class"
        backend.batches = []
        t0 = time.perf_counter()
        r = generate_rollout(rows(task), args.generations, backend, envs, chat, settings, base_seed=42, step=step,
                             gen_batch=0, stream="train", rank=0, world_size=1, player=agents)
        seconds = time.perf_counter() - t0
        failed = [t.failure.detail for t in r.trajectories if not t.scored]
        if failed:
            raise SystemExit(f"error: {side}: {len(failed)} samples failed; the first: {failed[0]}")
        lengths = [len(t.token_ids()) for t in r.trajectories]
        tokens = sum(len(t.completion_ids()) for t in r.trajectories)
        return {"s": round(seconds, 3), "tokens": tokens, "tok_s": round(tokens / seconds, 1),
                "batches": list(backend.batches), "lengths": lengths,
                "turns": sorted({t.turns for t in r.trajectories})}

    results = []
    try:
        for r in range(args.warmup + args.rounds):
            order = ("endpoint", "in_process") if r % 2 == 0 else ("in_process", "endpoint")
            got = {side: play(side, r) for side in order}
            same = sum(a == b for a, b in zip(got["endpoint"].pop("lengths"), got["in_process"].pop("lengths")))
            line = {"round": r + 1 - args.warmup, "first": order[0], **got, "same_length_samples": same,
                    "ratio": round(got["endpoint"]["tok_s"] / got["in_process"]["tok_s"], 3)}
            if r < args.warmup:
                line["round"] = "warmup"
            else:
                results.append(line)
            print(json.dumps(line), file=sys.stderr, flush=True)
    finally:
        endpoint.close()
    n = args.prompts * args.generations
    med = {side: statistics.median(x[side]["tok_s"] for x in results) for side in ("endpoint", "in_process")}
    print(json.dumps({"model": args.model, "agents": n, "turns": args.turns, "max_tokens": args.max_tokens,
                      "threads": args.threads, "batch_window_s": args.batch_window_s, "rounds": results,
                      "endpoint_tok_s_median": med["endpoint"], "in_process_tok_s_median": med["in_process"],
                      "ratio_of_medians": round(med["endpoint"] / med["in_process"], 3),
                      "ratio_median": statistics.median(x["ratio"] for x in results),
                      "same_work": all(x["same_length_samples"] == n for x in results)}))


if __name__ == "__main__":
    main()
