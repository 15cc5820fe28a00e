"""NeMo-Gym samples (``env.should_use_nemo_gym``): each row POSTed to its agent server's ``/run``, the answers, which
come back in any order, regrouped by row and turned into trajectories (`grpo.tasks.nemo_gym` has the protocol and
NeMo-RL's checks; ``nemo_rl/experience/rollouts.py`` ``run_async_nemo_gym_rollout`` is the model).

`play_gym` stamps each sample's row with the run's sampling profile (training or validation ``temperature`` /
``top_p``, ``max_output_tokens`` capped by ``policy.generation.max_new_tokens``), opens the run's endpoint for
generation, posts up to ``env.nemo_gym.max_concurrency`` rows at once and fills each trajectory from its answer:
the model calls' tokens (generated ones trained with their logprobs, the rest not), ``reward``,
``reward_components``, ``instance_config.mask_sample``.

A row whose POST fails (no answer, a dropped connection, 5xx / 408 / 429, ``env.nemo_gym.request_timeout_s`` passed,
an answer that is not a verify result) fails the way `grpo.tasks.failures` says: retried within
``grpo.rollout_failure``'s budgets (infra failures with backoff), then its sample is masked (``Trajectory.error``),
never scored 0. So a Gym server that dies mid-rollout costs the samples it held, counted as
``env/nemo_gym/failed_samples``. What NeMo-RL asserts (`grpo.tasks.nemo_gym.GymResultError`) stops the rollout.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import traceback

import httpx

from grpo.gym_rewards import annotate_gym_items
from grpo.tasks.failures import DATA, INFRA, Failure, RetryPolicy, failure_of_exception
from grpo.tasks.nemo_gym import (NemoGymEnvironment, check_result, mask_of, numeric_fields, prepare_row, regroup,
                                 reward_of, trajectory_messages)


async def post_row(client: httpx.AsyncClient, url: str, row: dict, retry: RetryPolicy) -> tuple[dict | None,
                                                                                                Failure | None, int]:
    """``(result, failure, retries)``: POST ``row`` to ``url`` (an agent server's ``/run``) until it answers a verify
    result or ``retry``'s budget for the failure's class is spent."""
    failed = {INFRA: 0, DATA: 0}
    retries = 0
    while True:
        failure = None
        try:
            response = await client.post(url, json=row)
            response.raise_for_status()
            result = response.json()
            problem = check_result(result)
            if problem is None:
                return result, None, retries
            failure = Failure.of("env_malformed", f"{url} answered {str(result)[:500]}: {problem}")
        except httpx.TimeoutException:
            failure = Failure.of("env_timeout", f"{url}: no answer within env.nemo_gym.request_timeout_s")
        except httpx.TransportError as err:
            failure = Failure.of("connection", f"{url}: {type(err).__name__}: {err}")
        except httpx.HTTPStatusError as err:
            failure = failure_of_exception(err, "env_error", f"{url} answered {err.response.status_code}: "
                                                             f"{err.response.text[:2000]}")
        except json.JSONDecodeError as err:
            failure = Failure.of("env_malformed", f"{url} answered something that is not JSON: {err}")
        except Exception as err:  # noqa: BLE001 - whatever else the client raises: classified by its type
            failure = failure_of_exception(err, "env_error", traceback.format_exc())
        failed[failure.kind] += 1
        if not retry.may_retry(failure.kind, failed[failure.kind]):
            return None, failure, retries
        retries += 1
        if failure.kind == INFRA:
            await asyncio.sleep(retry.backoff_s(failed[INFRA]))


async def run_rows(env: NemoGymEnvironment, rows: list[dict], retry: RetryPolicy) -> list[tuple]:
    """Every row posted to its agent server, ``max_concurrency`` at a time; ``(result, failure, retries)`` per row
    in row order, whatever order the answers came back in (`grpo.tasks.nemo_gym.regroup`)."""
    cfg = env.cfg
    gate = asyncio.Semaphore(cfg.max_concurrency)
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=30.0), limits=limits) as client:
        async def one(row: dict):
            async with gate:
                url = env.url_of(row["agent_ref"]["name"]) + "/run"
                return row["_rowidx"], await post_row(client, url, row, retry)

        indexed = [await done for done in asyncio.as_completed([one(r) for r in rows])]
    return regroup(indexed, len(rows))


def fill_gym_trajectory(t, row: dict, outcome: tuple, decode, max_total_len: int, weight_version: int,
                        env: NemoGymEnvironment) -> None:
    """Sample ``t`` (a `grpo.trajectory.Trajectory`) from its row's ``(result, failure, retries)``. Each model call's
    assistant message gets NeMo-RL's flags (invalid tool call, malformed thinking: `grpo.gym_rewards`, read by the
    reward penalties) from ``env``'s ``invalid_tool_call_patterns`` / ``thinking_tags``."""
    result, failure, retries = outcome
    t.retries, t.done = retries, True
    t.metadata = {**(t.metadata or {}), "agent_name": row["agent_ref"]["name"]}
    if failure is not None:
        t.error, t.error_detail, t.failure_kind = failure.reason, failure.detail, failure.kind
        t.reward, t.reward_components = 0.0, None
        return
    flags = annotate_gym_items(result, decode, env.invalid_tool_call_patterns, env.thinking_tags)
    messages, stripped = trajectory_messages(result, decode)  # (a copy, token fields stripped, generation_str kept)
    for message, f in zip([m for m in messages if m.role == "assistant"], flags):
        message.flags = f
    t.messages, t.num_prompt_messages = messages, 1
    t.turns = len(messages) // 2
    t.reward, t.reward_components = reward_of(result)
    t.mask_sample = mask_of(result)
    t.truncated = len(t.token_ids()) >= max_total_len  # NeMo-RL's hit_max_tokens
    t.terminated = not t.truncated
    t.finish_reason = "length" if t.truncated else "stop"
    t.generation_version = weight_version
    t.metadata.update(nemo_gym_numbers=numeric_fields(result), nemo_gym_result=stripped)


def play_gym(env: NemoGymEnvironment, trajs: list, seed_keys: list[tuple], endpoint, retry: RetryPolicy,
             weight_version: int = 0) -> None:
    """Play NeMo-Gym samples ``trajs`` (in place) over the run's ``endpoint``
    (`grpo.system.generation.endpoint.Endpoint`): a sample's row is its data row (``metadata["meta"]``), its
    sampling profile validation's when its seed key says ``val``."""
    gen = endpoint.gen_cfg
    rows = []
    for i, (t, key) in enumerate(zip(trajs, seed_keys, strict=True)):
        sampling = endpoint.sampling("val" if "val" in key else "train")
        rows.append(prepare_row(t.metadata["meta"], i, sampling["temperature"], sampling["top_p"],
                                gen.max_new_tokens))
    with endpoint.serving(weight_version):
        outcomes = asyncio.run(run_rows(env, rows, retry))
    decode = endpoint.tokenizer.decode
    for t, row, outcome in zip(trajs, rows, outcomes):
        fill_gym_trajectory(t, row, outcome, decode, endpoint.max_len, weight_version, env)
    if env.log_responses and env.responses_dir is not None:
        log_responses(env.responses_dir, trajs, seed_keys)


def log_responses(directory: str, trajs: list, seed_keys: list[tuple]) -> None:
    """``env.should_log_nemo_gym_responses``: every result (token fields left out) or failure, one JSON line per
    sample, appended to ``<directory>/<stream>_step_<step>.jsonl``."""
    os.makedirs(directory, exist_ok=True)
    by_file: dict[str, list[str]] = {}
    for t, key in zip(trajs, seed_keys):
        path = os.path.join(directory, f"{key[3]}_step_{key[1]}.jsonl")
        record = {"prompt_index": t.prompt_index, "group_id": t.group_id, "time": time.time(),
                  "result": t.metadata.get("nemo_gym_result"), "error": t.error, "error_detail": t.error_detail}
        by_file.setdefault(path, []).append(json.dumps(record, default=str))
    for path, lines in by_file.items():
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")
