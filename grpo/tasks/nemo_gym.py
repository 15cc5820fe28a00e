"""NeMo-Gym environments (``env.should_use_nemo_gym``): the pure half. Rows, results and trajectories as NeMo-RL's
NeMo-Gym path reads them (``nemo_rl/environments/nemo_gym.py``, ``nemo_rl/experience/rollouts.py``); the HTTP and the
processes are `grpo.wings.gym.rollout` and `grpo.wings.gym.servers`.

The protocol (NeMo-Gym's schema, which the example servers of ``examples/gym/`` speak without Gym installed):

- A **row** (a line of NeMo-RL's ``NemoGymDataset`` file) is ``{"responses_create_params": {"input": [...], "tools":
  [...], ...}, "agent_ref": {"name": <agent server>}, <task fields>...}``. The rollout stamps each row with the run's
  sampling profile (`prepare_row`: ``temperature``, ``top_p``, ``max_output_tokens`` capped by ``max_new_tokens``)
  and its index (``_rowidx``), and POSTs it to its agent server's ``/run``.
- The **agent server** seeds a session on its resources server (``POST /seed_session``), calls the policy (through
  Gym's model server, which calls the run's ``/v1/chat/completions``), runs the tool calls (``POST /<tool>`` on the
  resources server), asks for the reward (``POST /verify``) and answers the verify response: the row's fields, the
  ``response`` (its ``output`` items, the last item of each model call carrying ``prompt_token_ids``,
  ``generation_token_ids``, ``generation_log_probs``), ``reward``, optionally ``reward_components`` (their sum must
  equal ``reward``) and ``instance_config.mask_sample``.
- Answers come back in any order; `regroup` puts them back in row order and refuses a stream that is short, has a
  duplicate or an index out of range. `trajectory_messages` builds the trajectory: per model call, its new prompt
  tokens as an untrained ``user`` message and its generated tokens as a trained ``assistant`` message with their
  logprobs; a call whose prompt does not start with everything seen before is NeMo-RL's non-contiguous error.

What NeMo-RL asserts (a short or duplicated stream, a non-contiguous trajectory, a result without generation,
``reward`` unequal to the sum of ``reward_components``) raises `GymResultError` here and stops the rollout: each means
the servers and the trainer disagree about the protocol. What fails for one sample (no answer, 5xx, a timeout, an
answer that is not a result, token fields that cannot be trained: `check_token_fields`, a generation the run's
endpoint did not make: `grpo.wings.gym.rollout.GymLedger`) is a `grpo.tasks.failures` failure: retried, then
masked, never scored 0.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from collections import defaultdict

from grpo.tasks.failures import reward_problem
from grpo.tasks.function import EnvError
from grpo.tasks.interface import Environment
from grpo.trajectory import Message

GYM_INPUT_KEY = "responses_create_params"
ROW_INDEX_KEY = "_rowidx"  # NeMo-RL's name for a row's index in its rollout batch
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class GymResultError(ValueError):
    """What NeMo-RL asserts about Gym results, broken: the rollout stops (module docstring)."""


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------
def prompt_text(params: dict) -> str:
    """The text of a row's last user message (for logs and the trajectory's question).

        >>> prompt_text({"input": [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"}]})
        '2+2?'
        >>> prompt_text({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})
        'hi'
        >>> prompt_text({"input": "plain"})
        'plain'
    """
    given = params.get("input")
    if isinstance(given, str):
        return given
    for message in reversed(given or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content or "")
    return ""


def check_gym_record(record) -> str | None:
    """The problem with a Gym row as text, or None (NemoGymDataset's rows: ``responses_create_params`` with an
    ``input``, ``agent_ref`` with a ``name``).

        >>> check_gym_record({"responses_create_params": {"input": "x"}, "agent_ref": {"name": "a"}}) is None
        True
        >>> check_gym_record({"responses_create_params": {"input": "x"}})
        "missing agent_ref: expected {'name': <agent server>} (keys: ['responses_create_params'])"
    """
    if not isinstance(record, dict):
        return (f"expected a NeMo-Gym row (an object with responses_create_params and agent_ref), got "
                f"{type(record).__name__}")
    params = record.get(GYM_INPUT_KEY)
    if not isinstance(params, dict) or not isinstance(params.get("input"), (str, list)) or not params["input"]:
        return f"{GYM_INPUT_KEY}: expected an object with a non-empty input (a string or a list of messages)"
    ref = record.get("agent_ref")
    if not isinstance(ref, dict) or not isinstance(ref.get("name"), str) or not ref["name"]:
        return f"missing agent_ref: expected {{'name': <agent server>}} (keys: {sorted(record)})"
    return None


def gym_record_to_row(record: dict, source: str) -> dict:
    """A checked Gym row as a grpo-ds row: the whole record is its ``meta`` (what is posted to ``/run``), its
    question the last user message, its answer the record's ``answer`` if it has one (only shown in logs)."""
    answer = record.get("answer", record.get("expected_answer", ""))
    return {"question": prompt_text(record[GYM_INPUT_KEY]) or json.dumps(record[GYM_INPUT_KEY]["input"])[:2000],
            "answer": answer if isinstance(answer, str) else json.dumps(answer), "source": source,
            "meta": record}


def data_agents(rows) -> dict[str, str]:
    """Agent server name -> the ``source`` of the first row naming it, over grpo-ds rows of Gym records
    (`gym_record_to_row`).

        >>> data_agents([{"source": "d.jsonl:1", "meta": {"agent_ref": {"name": "calc"}}},
        ...              {"source": "d.jsonl:2", "meta": {"agent_ref": {"name": "calc"}}}])
        {'calc': 'd.jsonl:1'}
    """
    first: dict[str, str] = {}
    for row in rows:
        first.setdefault(row["meta"]["agent_ref"]["name"], row["source"])
    return first


def check_data_agents(first_row: dict[str, str], known) -> str | None:
    """The problem, in one line, when the data names agent servers not among ``known`` (the servers' agents), or
    None. ``first_row``: `data_agents`.

        >>> check_data_agents({"calc": "d.jsonl:1"}, ["calc", "other"]) is None
        True
        >>> check_data_agents({"calc": "d.jsonl:1", "calk": "d.jsonl:4"}, ["calc"])
        "the data's agent_ref.name ['calk'] (first at d.jsonl:4) names no agent server of the NeMo-Gym servers (agents: ['calc']): fix the data, or give the servers of that agent (env.nemo_gym.config_paths, agent_urls or head_server_url)"
    """
    unknown = sorted(set(first_row) - set(known))
    if not unknown:
        return None
    where = ", ".join(first_row[a] for a in unknown)
    return (f"the data's agent_ref.name {unknown} (first at {where}) names no agent server of the NeMo-Gym servers "
            f"(agents: {sorted(known)}): fix the data, or give the servers of that agent (env.nemo_gym.config_paths, "
            "agent_urls or head_server_url)")


def prepare_row(row: dict, row_index: int, temperature: float, top_p: float, max_new_tokens: int) -> dict:
    """A copy of ``row`` as NeMo-RL posts it (``_prepare_nemo_gym_rows``): the sampling profile on its
    ``responses_create_params`` (``max_output_tokens``: the row's, capped by ``max_new_tokens``), ``_rowidx`` set.

        >>> r = prepare_row({"responses_create_params": {"input": "x", "max_output_tokens": 64}}, 3, 1.0, 0.9, 32)
        >>> r["responses_create_params"], r["_rowidx"]
        ({'input': 'x', 'max_output_tokens': 32, 'temperature': 1.0, 'top_p': 0.9}, 3)
    """
    row = copy.deepcopy(row)
    params = row[GYM_INPUT_KEY]
    params["temperature"], params["top_p"] = temperature, top_p
    given = params.get("max_output_tokens")
    params["max_output_tokens"] = min(given, max_new_tokens) if given is not None else max_new_tokens
    row[ROW_INDEX_KEY] = row_index
    return row


def regroup(indexed: list[tuple[int, object]], n: int) -> list:
    """The values of ``(row index, value)`` pairs, which arrive in any order, in row order 0..n-1 (NeMo-RL's
    ``_NemoGymStreamAccumulator``): an index that is not an int, out of range or seen twice, or a stream that ends
    before every row arrived, is a `GymResultError`.

        >>> regroup([(1, "b"), (0, "a")], 2)
        ['a', 'b']
        >>> regroup([(0, "a")], 2)
        Traceback (most recent call last):
        ...
        grpo.tasks.nemo_gym.GymResultError: the NeMo-Gym rollout stream ended before all rows arrived: missing row indices [1]
    """
    got: dict[int, object] = {}
    for index, value in indexed:
        if not isinstance(index, int) or isinstance(index, bool):
            raise GymResultError(f"NeMo-Gym row index must be an int, got {type(index).__name__}")
        if not 0 <= index < n:
            raise GymResultError(f"NeMo-Gym returned row index {index} outside the expected range [0, {n})")
        if index in got:
            raise GymResultError(f"NeMo-Gym returned duplicate row index {index}")
        got[index] = value
    missing = sorted(set(range(n)) - set(got))
    if missing:
        raise GymResultError(f"the NeMo-Gym rollout stream ended before all rows arrived: missing row indices "
                             f"{missing}")
    return [got[i] for i in range(n)]


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------
def check_result(result) -> str | None:
    """Why a ``/run`` answer is not a result (an ``env_malformed`` failure), or None.

        >>> check_result({"response": {"output": []}, "reward": 1}) is None
        True
        >>> check_result({"reward": 1})
        "expected a verify response with 'response' (its 'output' list) and a finite 'reward' (in float32)"
    """
    reward = result.get("reward") if isinstance(result, dict) else None
    if not (isinstance(result, dict) and isinstance(result.get("response"), dict)
            and isinstance(result["response"].get("output"), list)
            and reward_problem(reward) is None):  # finite in float32, the dtype rewards train in
        return "expected a verify response with 'response' (its 'output' list) and a finite 'reward' (in float32)"
    comps = result.get("reward_components")
    if comps is not None and (not isinstance(comps, dict) or not all(
            reward_problem(v) is None for v in comps.values())):
        return f"reward_components must map names to finite numbers (in float32), got {str(comps)[:200]}"
    return None


def model_call_items(result: dict) -> list[dict]:
    """The output items of a result that are model calls: those with non-empty ``generation_token_ids`` (the last
    item of each call carries its token fields, as Gym's model server writes them).

        >>> len(model_call_items({"response": {"output": [{"type": "message", "generation_token_ids": [3]},
        ...                                               {"type": "function_call_output"}]}}))
        1
    """
    return [item for item in result["response"]["output"]
            if isinstance(item, dict) and item.get("generation_token_ids")]


def check_token_fields(result: dict, vocab_size: int) -> str | None:
    """Why a result's token fields cannot be trained (an ``env_malformed`` failure of its sample), or None. In each
    model call (`model_call_items`): ``prompt_token_ids`` (absent: none) and ``generation_token_ids`` are lists of
    token ids of the policy's tokenizer, ints in ``[0, vocab_size)``; ``generation_log_probs`` holds one number per
    generated token, each a log-probability: finite and <= 0 (no tolerance above 0: no peer of grpo-ds allows one, and
    a log-softmax never rounds above 0).

        >>> ok = {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.5]}
        >>> check_token_fields({"response": {"output": [ok]}}, vocab_size=10) is None
        True
        >>> check_token_fields({"response": {"output": [{**ok, "generation_token_ids": [12]}]}}, vocab_size=10)
        "model call 1: generation_token_ids[0]=12 is not a token id of the policy's tokenizer (ints in [0, 10))"
        >>> check_token_fields({"response": {"output": [{**ok, "generation_log_probs": [float("inf")]}]}}, 10)
        'model call 1: generation_log_probs[0]=inf is not a log-probability (finite and <= 0)'
    """
    for call, item in enumerate(model_call_items(result), 1):
        fields = {"prompt_token_ids": item.get("prompt_token_ids") or [], "generation_token_ids":
                  item["generation_token_ids"]}
        for name, ids in fields.items():
            if not isinstance(ids, list):
                return f"model call {call}: {name} must be a list of token ids, got {str(ids)[:100]}"
            if not _all_token_ids(ids, vocab_size):
                i, t = next((i, t) for i, t in enumerate(ids) if not _all_token_ids([t], vocab_size))
                return (f"model call {call}: {name}[{i}]={str(t)[:40]} is not a token id of the policy's tokenizer "
                        f"(ints in [0, {vocab_size}))")
        logprobs = item.get("generation_log_probs")
        if not isinstance(logprobs, list) or len(logprobs) != len(fields["generation_token_ids"]):
            got = len(logprobs) if isinstance(logprobs, list) else str(logprobs)[:100]
            return (f"model call {call}: {len(fields['generation_token_ids'])} generation_token_ids but "
                    f"generation_log_probs {got}")
        if not _all_log_probabilities(logprobs):
            i, x = next((i, x) for i, x in enumerate(logprobs) if not _all_log_probabilities([x]))
            return (f"model call {call}: generation_log_probs[{i}]={str(x)[:40]} is not a log-probability "
                    "(finite and <= 0)")
    return None


def _all_token_ids(values: list, vocab_size: int) -> bool:
    """Every value an int (not a bool) in ``[0, vocab_size)``; C-speed over long prompts (a bool's type is bool)."""
    return not values or (set(map(type, values)) == {int} and min(values) >= 0 and max(values) < vocab_size)


def _all_log_probabilities(values: list) -> bool:
    """Every value an int or float (not a bool), finite and <= 0."""
    return not values or (set(map(type, values)) <= {int, float} and all(map(math.isfinite, values))
                          and max(values) <= 0)


def trajectory_messages(result: dict, decode) -> tuple[list[Message], dict]:
    """``(messages, stripped)``: the trajectory of a Gym result (NeMo-RL's ``_postprocess_nemo_gym_to_nemo_rl_result``)
    and a copy of the result without its token fields (what NeMo-RL keeps as ``full_result``).

    Every output item with non-empty ``generation_token_ids`` is one model call: its ``prompt_token_ids`` must start
    with every token seen so far (else `GymResultError`, NeMo-RL's non-contiguous assertion); the rest of its prompt
    becomes an untrained ``user`` message, its generated tokens a trained ``assistant`` message with their logprobs.
    A result with no such item is a `GymResultError` too. ``result`` is one `check_token_fields` passed.

        >>> item = lambda p, g: {"type": "message", "prompt_token_ids": p, "generation_token_ids": g,
        ...                      "generation_log_probs": [-0.1] * len(g)}
        >>> res = {"response": {"output": [item([1, 2], [3]), {"type": "function_call_output"},
        ...                                item([1, 2, 3, 4], [5])]}}
        >>> msgs, stripped = trajectory_messages(res, decode=str)
        >>> [(m.role, m.token_ids, m.trained) for m in msgs]
        [('user', [1, 2], False), ('assistant', [3], True), ('user', [4], False), ('assistant', [5], True)]
        >>> "prompt_token_ids" in stripped["response"]["output"][0]
        False
        >>> trajectory_messages({"response": {"output": [item([1, 2], [3]), item([9, 9, 9], [5])]}}, decode=str)
        Traceback (most recent call last):
        ...
        grpo.tasks.nemo_gym.GymResultError: non-contiguous messages in a NeMo-Gym result (model call 2): its prompt does not start with the 3 tokens seen before it: a tokenization that merges tokens across messages, or a history the agent cut or rewrote (reasoning stripped)
    """
    stripped = copy.deepcopy(result)
    seen: list[int] = []
    messages: list[Message] = []
    for call, item in enumerate(model_call_items(stripped), 1):
        prompt, generated = list(item.pop("prompt_token_ids", None) or []), list(item.pop("generation_token_ids"))
        logprobs = [float(x) for x in item.pop("generation_log_probs")]
        if prompt[:len(seen)] != seen:
            raise GymResultError(
                f"non-contiguous messages in a NeMo-Gym result (model call {call}): its prompt does not start with "
                f"the {len(seen)} tokens seen before it: a tokenization that merges tokens across messages, or a "
                "history the agent cut or rewrote (reasoning stripped)")
        new = prompt[len(seen):]
        messages.append(Message("user", decode(new), new))
        messages.append(Message("assistant", decode(generated), generated, logprobs))
        seen = prompt + generated
    if not messages:
        types = [o.get("type") if isinstance(o, dict) else type(o).__name__ for o in result["response"]["output"]]
        raise GymResultError(
            f"NeMo Gym returned a result with no generation data (output item types {types}): the first prompt may "
            "exceed policy.max_total_sequence_length, or the model server does not return token ids (Gym's model "
            "server needs return_token_id_information: true, as vllm_model_for_training.yaml sets)")
    return messages, stripped


def reward_of(result: dict) -> tuple[float, dict[str, float] | None]:
    """``(reward, reward_components)`` of a result; components must sum to the reward (NeMo-RL's
    ``validate_reward_components_match_scalar``, rel 1e-5, abs 1e-6) or it is a `GymResultError`.

        >>> reward_of({"reward": 1.5, "reward_components": {"a": 1.0, "b": 0.5}})
        (1.5, {'a': 1.0, 'b': 0.5})
        >>> reward_of({"reward": 1.0, "reward_components": {"a": 0.5}})
        Traceback (most recent call last):
        ...
        grpo.tasks.nemo_gym.GymResultError: a NeMo-Gym verify result has reward=1.0 but its reward_components sum to 0.5 ({'a': 0.5}): a multi-reward verifier must set reward = sum(reward_components.values())
    """
    reward = float(result["reward"])
    comps = result.get("reward_components")
    if not comps:
        return reward, None
    comps = {str(k): float(v) for k, v in comps.items()}
    total = sum(comps.values())
    if not math.isclose(reward, total, rel_tol=1e-5, abs_tol=1e-6):
        raise GymResultError(f"a NeMo-Gym verify result has reward={reward} but its reward_components sum to {total} "
                             f"({comps}): a multi-reward verifier must set reward = sum(reward_components.values())")
    return reward, comps


def mask_of(result: dict) -> bool:
    """NeMo-RL's ``_extract_mask_sample_flags``: ``instance_config.mask_sample``.

        >>> mask_of({"instance_config": {"mask_sample": True}}), mask_of({})
        (True, False)
    """
    return bool((result.get("instance_config") or {}).get("mask_sample", False))


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------
def single_metric(values: list[float], key: str) -> dict[str, float]:
    """NeMo-RL's ``calculate_single_metric`` without the histogram: mean, max, min, median, stddev (left out for one
    value, where NeMo-RL's is nan: metrics.jsonl stays plain JSON).

        >>> single_metric([1, 3], "x")
        {'x/mean': 2.0, 'x/max': 3.0, 'x/min': 1.0, 'x/median': 2.0, 'x/stddev': 1.4142135623730951}
    """
    out = {f"{key}/mean": sum(values) / len(values), f"{key}/max": float(max(values)),
           f"{key}/min": float(min(values)), f"{key}/median": float(statistics.median(values))}
    if len(values) > 1:
        out[f"{key}/stddev"] = statistics.stdev(values)
    return out


def gym_metrics(trajectories) -> dict[str, float]:
    """NeMo-RL's NeMo-Gym rollout metrics (``_postprocess_single_nemo_gym_group``) of the scored samples (failed
    ones left out): turns, total and generated tokens per sample and the longest turn, each as `single_metric`;
    ``natural_termination_rate`` / ``truncation_rate`` (NeMo-RL: a sample truncated when its tokens reach the
    context length); per agent, every numeric top-level field of its results as ``<agent>/<field>/<stat>``."""
    done = [t for t in trajectories if t.scored]
    if not done:
        return {}
    turns = [sum(1 for m in t.messages if m.role == "user") for t in done]
    gen = [t.num_generated_tokens for t in done]
    metrics = {**single_metric(turns, "turns_per_sample"),
               **single_metric([len(t.token_ids()) for t in done], "total_tokens_per_sample"),
               **single_metric(gen, "gen_tokens_per_sample"),
               **single_metric([max((len(m.token_ids) for m in t.messages if m.trained), default=0) for t in done],
                               "max_gen_tokens_per_turn"),
               **single_metric([t.reward for t in done], "total_reward"),
               "natural_termination_rate": sum(not t.truncated for t in done) / len(done),
               "truncation_rate": sum(t.truncated for t in done) / len(done),
               "mean_gen_tokens_per_sample": sum(gen) / len(done)}
    by_agent: dict[str, list[dict]] = defaultdict(list)
    for t in done:
        by_agent[t.metadata.get("agent_name", "?")].append(t.metadata.get("nemo_gym_numbers", {}))
    for agent, numbers in by_agent.items():
        for key in sorted({k for n in numbers for k in n}):
            values = [n[key] for n in numbers if key in n]
            metrics.update(single_metric(values, f"{agent}/{key}"))
    return metrics


def numeric_fields(result: dict) -> dict[str, float]:
    """The top-level numeric (bool, int, float) fields of a result: NeMo-RL's per-agent metrics (the echoed row index
    left out: NeMo-RL logs its mean, which means nothing).

        >>> numeric_fields({"reward": 1, "ok": True, "name": "x", "response": {}, "_rowidx": 7})
        {'reward': 1.0, 'ok': 1.0}
    """
    return {k: float(v) for k, v in result.items() if isinstance(v, (bool, int, float)) and k != ROW_INDEX_KEY}


# --------------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------------
class NemoGymEnvironment(Environment):
    """``env.should_use_nemo_gym``: its samples are played by NeMo-Gym's agent servers over HTTP
    (`grpo.wings.gym.rollout`), never stepped. ``cfg``: the ``env.nemo_gym`` section
    (`grpo.config.NemoGymConfig`); ``agent_urls``: agent name -> base URL, filled when the servers are found
    (`grpo.wings.gym.servers`), with ``ledger``, what the run's endpoint generated for them
    (`grpo.wings.gym.rollout.GymLedger`); ``log_responses``: write the local dump of the results
    (``env.should_log_nemo_gym_responses=false``)."""

    def __init__(self, cfg, log_responses: bool = False):
        self.cfg, self.log_responses = cfg, log_responses
        self.agent_urls: dict[str, str] = dict(cfg.agent_urls)
        self.responses_dir: str | None = None  # <log_dir>/nemo_gym_responses, set by the run
        self.ledger = None  # the endpoint's generations for the servers (grpo.wings.gym.rollout.GymLedger)
        self.invalid_tool_call_patterns = cfg.invalid_tool_call_patterns
        self.thinking_tags = cfg.thinking_tags
        self.effort_levels = cfg.effort_levels

    def step(self, message_logs, metadata):
        raise EnvError("env.should_use_nemo_gym: the samples are played by NeMo-Gym's agent servers "
                       "(grpo.wings.gym.rollout), not stepped")

    def url_of(self, agent: str) -> str:
        """The base URL of agent server ``agent``; EnvError naming the known ones when there is none."""
        if agent not in self.agent_urls:
            raise EnvError(f"a row's agent_ref.name={agent!r} names no agent server (known: {sorted(self.agent_urls)}; "
                           "env.nemo_gym.agent_urls, or the servers of env.nemo_gym.config_paths / head_server_url)")
        return self.agent_urls[agent].rstrip("/")

    def global_post_process_and_metrics(self, batch: dict) -> tuple[dict, dict]:
        """NeMo-RL's Gym rollout metrics (`gym_metrics`) and the failed samples' count."""
        trajs = batch["trajectories"]
        return batch, {**gym_metrics(trajs), "failed_samples": sum(not t.scored for t in trajs)}
