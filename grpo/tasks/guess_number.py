"""Guess the number: the built-in multi-turn task, where the answer depends on what the environment says.

The policy guesses a hidden integer in [0, high] (a row's answer, never shown); after each wrong guess the
environment answers ``+`` (the secret is higher) or ``-`` (lower); a right guess ends the episode with reward
1, and ``grpo.max_rollout_turns`` wrong ones with reward 0. A guess that is not one integer in range is
answered ``?`` and costs its turn. With 4 turns and secrets in 0..9, bisection always wins, while a policy
that ignores the answers covers at most 4 of the 10 secrets: reward 0.4 at best (0.34 guessing uniformly at
random). So reward above 0.4 is only reachable by reading the observations.

In plain text (the char-level toy), a 3-turn conversation reads ``<bos>guess 0-9:4<eos>+7<eos>-5<eos>``:
prompt, then guess / answer / guess / ... (the last answer, ``=``, ends it and is not appended).

    >>> env = GuessNumberEnvironment()
    >>> ret = env.step([[{"role": "user", "content": "guess 0-9:"}, {"role": "assistant", "content": "4"}]],
    ...                [{"answer": "7", "meta": {"high": 9}}])
    >>> ret.observations, ret.rewards.tolist(), ret.terminateds.tolist()
    ([{'role': 'user', 'content': '+'}], [0.0], [False])
"""

from __future__ import annotations

import random
import re

from grpo.tasks.interface import Environment, EnvironmentReturn
from grpo.tasks.rows import Row, split_seed

_INTEGER = re.compile(r"^\s*(-?\d+)\s*$")


def prompt_text(high: int) -> str:
    return f"guess 0-{high}:"


def feedback(guess: int | None, secret: int, high: int) -> str:
    """The environment's answer: "=" right, "+" the secret is higher, "-" lower, "?" not a guess in range.

        >>> [feedback(g, 5, 9) for g in (5, 2, 8, None, 12)]
        ['=', '+', '-', '?', '?']
    """
    if guess is None or not 0 <= guess <= high:
        return "?"
    return "=" if guess == secret else ("+" if secret > guess else "-")


def parse_guess(text: str) -> int | None:
    """The guess in an assistant message: the whole message must be one integer.

        >>> parse_guess("7"), parse_guess(" 12 "), parse_guess("7 or 8")
        (7, 12, None)
    """
    m = _INTEGER.match(text)
    return int(m.group(1)) if m else None


class GuessNumberEnvironment(Environment):
    """One turn of the game for each sample (see the module docstring). Metadata: the row's
    ``{"answer", "meta": {"high"}}``; rewards 1 for the right guess."""

    def step(self, message_logs, metadata):
        import torch

        obs, rewards, done = [], [], []
        for log, md in zip(message_logs, metadata):
            secret, high = int(md["answer"]), int((md.get("meta") or {}).get("high", 9))
            answer = feedback(parse_guess(log[-1]["content"]), secret, high)
            obs.append({"role": "user", "content": answer})
            rewards.append(1.0 if answer == "=" else 0.0)
            done.append(answer == "=")
        n = len(message_logs)
        return EnvironmentReturn(observations=obs, metadata=list(metadata), next_stop_strings=[None] * n,
                                 rewards=torch.tensor(rewards), terminateds=torch.tensor(done), answers=[None] * n)


def guess_number_rows(n: int, high: int, seed: int, split: str) -> list[dict]:
    """``n`` rows: the same prompt, a secret uniform in [0, high] as the answer (train and val streams differ)."""
    rng = random.Random(split_seed(seed, split))
    return [{"question": prompt_text(high), "answer": str(rng.randint(0, high)), "source": f"guess_number/{split}:{i}",
             "meta": {"high": high}} for i in range(n)]


def rows(name: str, data_cfg, n: int, seed: int, split: str) -> list[Row]:
    """The task's rows for ``data.dataset_name=guess_number`` (``data.guess_number_high``: the largest secret)."""
    return guess_number_rows(n, data_cfg.guess_number_high, seed, split)


# --------------------------------------------------------------------------------------------------
# The demo's starting policy (toy:guess_number)
# --------------------------------------------------------------------------------------------------
def bisection_game(secret: int, high: int, turns: int) -> list[int]:
    """The guesses of the player that reads every answer: the middle of the range the answers so far allow
    (at most 4 guesses for secrets in 0..9, so it always wins the demo's 4-turn game).

        >>> bisection_game(6, 9, 4), bisection_game(0, 9, 4)
        ([4, 7, 5, 6], [4, 1, 0])
    """
    lo, hi, guesses = 0, high, []
    while len(guesses) < turns:
        guesses.append((lo + hi) // 2)
        if guesses[-1] == secret:
            break
        lo, hi = (guesses[-1] + 1, hi) if guesses[-1] < secret else (lo, guesses[-1] - 1)
    return guesses


def blind_game(secret: int, high: int, turns: int, rng: random.Random) -> list[int]:
    """The guesses of a player that ignores every answer: uniform in [0, high] each turn (wins 1 - 0.9**4 =
    34% of the demo's games); it stops at the right guess.

        >>> blind_game(6, 9, 4, random.Random(0))
        [6]
    """
    guesses = []
    while len(guesses) < turns and (not guesses or guesses[-1] != secret):
        guesses.append(rng.randint(0, high))
    return guesses


def make_guess_number_model(out_dir: str, high: int = 9, turns: int = 4, p_bisect: float = 0.2,
                            steps: int = 400, seed: int = 0) -> str:
    """Build the multi-turn demo's starting policy: the ``small`` toy model supervised on games of two players,
    tokenised exactly as a rollout tokenises them in plain text, loss on the guesses only: with probability
    ``p_bisect`` a game of the player that bisects (`bisection_game`), otherwise one of the player that ignores
    the answers (`blind_game`).

    It learns the format and both players, so sampled at temperature 1 it wins about 0.34 + 0.66 ``p_bisect`` of
    the games (some 47% at 0.2: well under the 0.6 the demo must reach), and GRPO has one behaviour to strengthen,
    which each step's groups show side by side: bisecting (first guess 4, then reading "+"/"-") wins every game.
    Why two whole players rather than one that mixes per turn (the demo until issue 35: bisect 15%, blind 50%,
    uniform in the allowed range 35%): the informed-uniform guesses ask a 0.4M-parameter model to track an interval
    through any history, which it learned only partly, differently with each library version's initialisation, and
    GRPO then had little to sharpen (0.42 -> 0.44 in 200 steps on a fresh install); the bisector's 15 positions are
    learned exactly.
    Why 0.2 rather than 0.1: at 0.1 a step's 16 groups hold few bisected games, and one seed of three moved only
    0.36 -> 0.57 in 200 steps (the others 0.88); more bisected games in each group give GRPO its signal sooner.
    """
    from grpo.tasks.toy import build_char_tokenizer, build_tiny_model, save_char_tokenizer, supervise

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, size="small", seed=seed)
    rng = random.Random(seed)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = tok(prompt_text(high))["input_ids"]

    def transcript() -> tuple[list[int], list[int]]:
        secret = rng.randint(0, high)
        game = bisection_game(secret, high, turns) if rng.random() < p_bisect else blind_game(secret, high, turns, rng)
        ids, labels = list(prompt), [-100] * len(prompt)
        for k, g in enumerate(game):
            guess = enc(str(g)) + [tok.eos_token_id]
            ids, labels = ids + guess, labels + guess
            answer = feedback(g, secret, high)
            if answer != "=" and k < turns - 1:
                ids, labels = ids + enc(answer), labels + [-100] * len(enc(answer))
        return ids, labels

    supervise(model, tok.pad_token_id, transcript, steps, batch_size=64, name="guess_number model")
    model.save_pretrained(out_dir, safe_serialization=True)
    save_char_tokenizer(tok, out_dir)
    return out_dir
