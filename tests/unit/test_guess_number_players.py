"""The two players the multi-turn demo's starting policy imitates (grpo/tasks/guess_number.py, issue 35)."""

import random

from grpo.tasks.guess_number import bisection_game, blind_game, feedback


def test_the_bisector_wins_every_game_within_four_turns_by_reading_the_answers():
    for secret in range(10):
        game = bisection_game(secret, 9, 4)
        assert game[-1] == secret and len(game) <= 4, (secret, game)
        # each guess lies in the range the earlier answers allow
        lo, hi = 0, 9
        for guess in game[:-1]:
            assert lo <= guess <= hi
            lo, hi = (guess + 1, hi) if feedback(guess, secret, 9) == "+" else (lo, guess - 1)


def test_the_blind_player_ignores_the_answers_and_wins_about_a_third():
    # Same random stream, different secrets: the same guesses until one of them is right.
    a, b = blind_game(3, 9, 4, random.Random(7)), blind_game(8, 9, 4, random.Random(7))
    n = min(len(a), len(b))
    assert a[:n] == b[:n]
    rng = random.Random(0)
    wins = sum(blind_game(s, 9, 4, rng)[-1] == s for s in (rng.randint(0, 9) for _ in range(4000)))
    assert abs(wins / 4000 - (1 - 0.9 ** 4)) < 0.03  # 0.344, below the 0.4 of the best blind policy
