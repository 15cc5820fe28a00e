"""NeMo-Gym samples (``env.should_use_nemo_gym``): each row POSTed to its agent server's ``/run``, the answers, which
come back in any order, regrouped by row and turned into trajectories (`grpo.tasks.nemo_gym` has the protocol and
NeMo-RL's checks; ``nemo_rl/experience/rollouts.py`` ``run_async_nemo_gym_rollout`` is the model).

`play_gym` stamps each sample's row with the run's sampling profile (training or validation ``temperature`` /
``top_p``, ``max_output_tokens`` capped by ``policy.generation.max_new_tokens``), opens the run's endpoint for
generation, posts up to ``env.nemo_gym.max_concurrency`` rows at once and fills each trajectory from its answer:
the model calls' tokens (generated ones trained with their logprobs, the rest not), ``reward``,
``reward_components``, ``instance_config.mask_sample``.

A result is trained only when it is the policy's: its token fields well formed
(`grpo.tasks.nemo_gym.check_token_fields`: token ids of the policy's tokenizer, logprobs finite and <= 0) and every
model call in it a generation the run's endpoint made for the Gym servers and no other sample claimed (`GymLedger`):
a server that is not the run's (another run's Gym, a decoy on its port) or a result rewritten or replayed is refused.

A row whose POST fails (no answer, a dropped connection, 5xx / 408 / 429, ``env.nemo_gym.request_timeout_s`` passed,
an answer that is not a verify result or is refused as above: ``env_malformed``, naming the agent server and the row)
fails the way `grpo.tasks.failures` says: retried within ``grpo.rollout_failure``'s budgets (infra failures with
backoff), then its sample is masked (``Trajectory.failure``), never scored 0. So a Gym server that dies mid-rollout
costs the samples it held, counted as ``env/nemo_gym/failed_samples``. What NeMo-RL asserts
(`grpo.tasks.nemo_gym.GymResultError`) stops the rollout.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager

import httpx

from grpo.wings.gym.rewards import annotate_gym_items
from grpo.tasks.failures import DATA, INFRA, Failure, RetryPolicy, failure_of_exception
from grpo.tasks.nemo_gym import (NemoGymEnvironment, check_result, check_token_fields, mask_of, model_call_items,
                                 numeric_fields, prepare_row, regroup, reward_of, trajectory_messages)


# Where a claimed result keeps the images of its model calls until its trajectory takes them (`GymLedger.claim`): the
# endpoint's tensors, never JSON; popped before the result is stored or logged.
MEDIA_KEY = "_grpo_media"


class GymLedger:
    """What the run's endpoint generated for the Gym servers, and which sample each generation went to.

    The servers call the endpoint under a key of their own (``key``: a session of the endpoint,
    `grpo.wings.agents.endpoint.Endpoint.open_session`), so the endpoint records every call they make; ``take()``
    returns the records made since its last call (`Endpoint.take_records`). A result is the policy's only when each of
    its model calls (`grpo.tasks.nemo_gym.model_call_items`) is one of those records, with the same prompt tokens and
    generated tokens and logprobs equal within a float32 round trip (``rel_tol`` / ``abs_tol`` 1e-6), that no other
    result claimed (`claim`): a decoy or another run's server cannot call the endpoint with this key, and a generation
    backs one sample only. The servers' calls carry no sample of their own (Gym's model server sends one key for all),
    so a generation may back any one sample of the rollouts then open.

    Records belong to plays (`opened`, one per `play_gym`; the async loop's training and validation rollouts may
    overlap): a record no open play can claim (taken before the oldest open play opened; every one once none is open)
    is forgotten, so a retried row's first try or a straggling call is never kept nor claimable later.
    """

    def __init__(self, take: Callable[[], list], key: str = "", restart: Callable[[], None] = lambda: None):
        self.key, self._take, self._restart = key, take, restart
        self._lock = threading.Lock()
        self._pool: dict[tuple, list[tuple[int, object]]] = {}  # (prompt, generated) -> [(epoch taken, record)]
        self._epoch = 0
        self._open: dict[int, int] = {}  # open play -> the epoch it opened at
        self._plays = 0

    @classmethod
    def of(cls, endpoint, seed: int) -> GymLedger:
        """The ledger of a new session of ``endpoint`` (its key is what the Gym servers call with), its calls seeded
        by the run's ``seed`` and their prompts (``seed_by_prompt``: the servers' concurrent calls reach the endpoint
        in no fixed order), so a launch samples what the last one did."""
        key = endpoint.open_session(f"nemo_gym:{seed}", seed_by_prompt=True)
        return cls(lambda: endpoint.take_records(key), key, lambda: endpoint.restart_prompt_counts(key))

    def _pull(self) -> None:
        for record in self._take():
            key = (tuple(record.prompt_token_ids), tuple(record.generation_token_ids))
            self._pool.setdefault(key, []).append((self._epoch, record))

    def _forget(self) -> None:
        """Pull, then drop the records no open play can claim (taken before the oldest open play opened)."""
        self._pull()
        floor = min(self._open.values(), default=self._epoch + 1)
        kept = {k: [(e, r) for e, r in held if e >= floor] for k, held in self._pool.items()}
        self._pool = {k: held for k, held in kept.items() if held}

    def _open_play(self) -> int:
        """A new play; one that opens alone restarts the seeds' per-prompt counts, so that a validation before it at
        the same weight version (whose sampling may equal training's) leaves its seeds as a resume finds them."""
        with self._lock:
            if not self._open:
                self._restart()
            self._forget()
            self._epoch += 1
            play, self._plays = self._plays, self._plays + 1
            self._open[play] = self._epoch
            return play

    def _close_play(self, play: int) -> None:
        with self._lock:
            del self._open[play]
            self._forget()

    @contextmanager
    def opened(self):
        """A play, open while the block runs."""
        play = self._open_play()
        try:
            yield
        finally:
            self._close_play(play)

    def claim(self, result: dict) -> str | None:
        """Claim the generations behind ``result``'s model calls (a result `check_token_fields` passed); the problem,
        with nothing claimed, when one is not an unclaimed record. A claimed result gets its last call's images
        (``CallRecord.media``: every picture of its conversation, the calls being contiguous) under `MEDIA_KEY`,
        whatever the server put there, for `fill_gym_trajectory`."""
        with self._lock:
            self._pull()
            chosen: list[tuple[tuple, tuple[int, object]]] = []
            for call, item in enumerate(model_call_items(result), 1):
                prompt, generated = item.get("prompt_token_ids") or [], item["generation_token_ids"]
                key = (tuple(prompt), tuple(generated))
                free = [h for h in self._pool.get(key, []) if all(h is not c for _, c in chosen)]
                if not free:
                    return (f"model call {call} ({len(prompt)} prompt tokens, {len(generated)} generated) is no "
                            "generation the run's endpoint made for the Gym servers in this rollout, or one another "
                            "sample claimed: a server that is not the run's, or a result rewritten or replayed")
                same = [h for h in free if all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in
                                               zip(h[1].generation_log_probs, item["generation_log_probs"]))]
                if not same:
                    return (f"model call {call}: its generation_log_probs are not the ones the run's endpoint "
                            f"returned for these tokens (first: {item['generation_log_probs'][:3]} against "
                            f"{free[0][1].generation_log_probs[:3]})")
                chosen.append((key, same[0]))
            for key, held in chosen:
                self._pool[key] = [h for h in self._pool[key] if h is not held]
        result[MEDIA_KEY] = chosen[-1][1][1].media if chosen else None
        return None


def result_problem(result, vocab_size: int, ledger: GymLedger) -> str | None:
    """Why a ``/run`` answer is not a result the run trains on (`grpo.tasks.nemo_gym.check_result`,
    `grpo.tasks.nemo_gym.check_token_fields`, then `GymLedger.claim`, which claims its generations when it passes),
    or None."""
    return check_result(result) or check_token_fields(result, vocab_size) or ledger.claim(result)


async def post_row(client: httpx.AsyncClient, url: str, row: dict, retry: RetryPolicy,
                   check: Callable[[object], str | None], where: str) -> tuple[dict | None, Failure | None, int]:
    """``(result, failure, retries)``: POST ``row`` to ``url`` (an agent server's ``/run``) until it answers a result
    ``check`` passes (it says why not) or ``retry``'s budget for the failure's class is spent; ``where`` names the
    server and the row in the failure."""
    failed = {INFRA: 0, DATA: 0}
    retries = 0
    while True:
        failure = None
        try:
            response = await client.post(url, json=row)
            response.raise_for_status()
            result = response.json()
            problem = check(result)
            if problem is None:
                return result, None, retries
            failure = Failure.of("env_malformed", f"{where}: {problem}; it answered {str(result)[:500]}")
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


async def run_rows(env: NemoGymEnvironment, rows: list[dict], retry: RetryPolicy, check: Callable[[object], str | None],
                   labels: list[str]) -> list[tuple]:
    """Every row posted to its agent server, ``max_concurrency`` at a time, its answer checked by ``check``
    (`post_row`); ``(result, failure, retries)`` per row in row order, whatever order the answers came back in
    (`grpo.tasks.nemo_gym.regroup`). ``labels[i]`` names row i in failures."""
    cfg = env.cfg
    gate = asyncio.Semaphore(cfg.max_concurrency)
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=30.0), limits=limits) as client:
        async def one(row: dict):
            async with gate:
                agent = row["agent_ref"]["name"]
                url = env.url_of(agent) + "/run"
                where = f"NeMo-Gym agent server {agent!r} ({url}), {labels[row['_rowidx']]}"
                return row["_rowidx"], await post_row(client, url, row, retry, check, where)

        indexed = [await done for done in asyncio.as_completed([one(r) for r in rows])]
    return regroup(indexed, len(rows))


def fill_gym_trajectory(t, row: dict, outcome: tuple, decode, max_total_len: int, weight_version: int,
                        env: NemoGymEnvironment) -> None:
    """Sample ``t`` (a `grpo.trajectory.Trajectory`) from its row's ``(result, failure, retries)``. Each model call's
    assistant message gets NeMo-RL's flags (invalid tool call, malformed thinking: `grpo.wings.gym.rewards`, read by the
    reward penalties) from ``env``'s ``invalid_tool_call_patterns`` / ``thinking_tags``."""
    result, failure, retries = outcome
    media = result.pop(MEDIA_KEY, None) if result is not None else None
    t.retries, t.done = retries, True
    t.metadata = {**(t.metadata or {}), "agent_name": row["agent_ref"]["name"]}
    if failure is not None:
        t.fail(failure)
        return
    flags = annotate_gym_items(result, decode, env.invalid_tool_call_patterns, env.thinking_tags)
    messages, stripped = trajectory_messages(result, decode)  # (a copy, token fields stripped, generation_str kept)
    for message, f in zip([m for m in messages if m.role == "assistant"], flags):
        message.flags = f
    t.messages, t.num_prompt_messages, t.media = messages, 1, media  # the pictures the endpoint rendered
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
    (`grpo.wings.agents.endpoint.Endpoint`): a sample's row is its data row (``metadata["meta"]``), its
    sampling profile validation's when its seed key says ``val``."""
    gen = endpoint.gen_cfg
    rows = []
    for i, (t, key) in enumerate(zip(trajs, seed_keys, strict=True)):
        sampling = endpoint.sampling("val" if "val" in key else "train")
        rows.append(prepare_row(t.metadata["meta"], i, sampling["temperature"], sampling["top_p"],
                                gen.max_new_tokens))
    if env.ledger is None:
        raise RuntimeError("NeMo-Gym samples need the servers' ledger (env.ledger: GymLedger, set where the servers "
                           "are found: grpo.wings.gym.servers.start_gym_servers)")
    vocab_size = endpoint.vocab_size  # the tokenizer's ids and a padded embedding's rows
    labels = [f"{key[3]} data row {t.prompt_index}" for t, key in zip(trajs, seed_keys)]  # e.g. "train data row 17"
    with env.ledger.opened(), endpoint.serving(weight_version):
        outcomes = asyncio.run(run_rows(env, rows, retry, lambda r: result_problem(r, vocab_size, env.ledger),
                                        labels))
    decode = endpoint.tokenizer.decode
    for t, row, outcome in zip(trajs, rows, outcomes):
        fill_gym_trajectory(t, row, outcome, decode, endpoint.max_len, weight_version, env)
    if env.log_responses and env.responses_dir is not None:
        log_responses(env.responses_dir, trajs, seed_keys)


def log_responses(directory: str, trajs: list, seed_keys: list[tuple]) -> None:
    """``env.should_log_nemo_gym_responses=false`` (NeMo-Gym does not log them itself): every result (token fields
    left out) or failure, one JSON line per sample, appended to ``<directory>/<stream>_step_<step>.jsonl``."""
    os.makedirs(directory, exist_ok=True)
    by_file: dict[str, list[str]] = {}
    for t, key in zip(trajs, seed_keys):
        path = os.path.join(directory, f"{key[3]}_step_{key[1]}.jsonl")
        record = {"prompt_index": t.prompt_index, "group_id": t.group_id, "time": time.time(),
                  "result": t.metadata.get("nemo_gym_result"), "error": t.failure and t.failure.reason,
                  "error_detail": t.failure and t.failure.detail}
        by_file.setdefault(path, []).append(json.dumps(record, default=str))
    for path, lines in by_file.items():
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")
