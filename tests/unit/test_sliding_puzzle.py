"""grpo.tasks.sliding_puzzle: NeMo-RL's sliding puzzle game (rules, observation text, rewards, termination), its
environment on hand-made assistant messages, and its procedural prompts (deterministic by seed)."""

from __future__ import annotations

import doctest
import random
from collections import deque

import pytest

import grpo.tasks.sliding_puzzle as sp
from grpo.tasks.interface import check_return
from grpo.tasks.sliding_puzzle import (SlidingPuzzleEnvironment, apply_action, draw_game, is_solved, parse_action,
                                       parse_dataset_name, play_turn, render, shuffled_grid, sliding_puzzle_rows,
                                       solved_grid)

BOARD = [[1, 2, 3], [4, 0, 6], [7, 5, 8]]  # two moves from solved: up (5), then left (8)


def test_doctests():
    assert doctest.testmod(sp).failed == 0


def solution_length(grid) -> int | None:
    """Fewest moves from ``grid`` to the goal (breadth-first over the boards), None if unreachable."""
    goal, size = solved_grid(len(grid)), len(grid)
    start = tuple(map(tuple, grid))
    seen, queue = {start: 0}, deque([start])
    while queue:
        board = queue.popleft()
        if [list(r) for r in board] == goal:
            return seen[board]
        (er, ec), = [(r, c) for r in range(size) for c in range(size) if board[r][c] == 0]
        for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0)):
            if 0 <= er + dr < size and 0 <= ec + dc < size:
                nxt = tuple(map(tuple, sp.slide([list(r) for r in board], er + dr, ec + dc)))
                if nxt not in seen:
                    seen[nxt] = seen[board] + 1
                    queue.append(nxt)
    return None


# --------------------------------------------------------------------------------------------------
# The game
# --------------------------------------------------------------------------------------------------
def test_solved_grid_and_detection():
    assert solved_grid(3) == [[1, 2, 3], [4, 5, 6], [7, 8, 0]]
    assert is_solved(solved_grid(4)) and not is_solved(BOARD)


@pytest.mark.parametrize("action,response,board", [
    ("up", "Slid tile 5 up.", [[1, 2, 3], [4, 5, 6], [7, 0, 8]]),      # the tile below the empty cell moves up
    ("down", "Slid tile 2 down.", [[1, 0, 3], [4, 2, 6], [7, 5, 8]]),  # the tile above moves down
    ("left", "Slid tile 6 left.", [[1, 2, 3], [4, 6, 0], [7, 5, 8]]),  # the tile to the right moves left
    ("right", "Slid tile 4 right.", [[1, 2, 3], [0, 4, 6], [7, 5, 8]]),
    ("slide 3 2", "Slid tile 5 into the empty space.", [[1, 2, 3], [4, 5, 6], [7, 0, 8]]),
    ("slide 2 1", "Slid tile 4 into the empty space.", [[1, 2, 3], [0, 4, 6], [7, 5, 8]]),
    ("slide   1   2", "Slid tile 2 into the empty space.", [[1, 0, 3], [4, 2, 6], [7, 5, 8]]),
])
def test_moves(action, response, board):
    assert apply_action(action, BOARD) == (response, board)
    assert BOARD == [[1, 2, 3], [4, 0, 6], [7, 5, 8]]  # the input board is never changed


@pytest.mark.parametrize("action,response", [
    ("slide 1 1", "Tile must be adjacent to the empty space."),
    ("slide 2 2", "Tile must be adjacent to the empty space."),  # the empty cell itself
    ("slide 0 2", "Invalid position. Row/column must be between 1 and 3."),
    ("slide 2 4", "Invalid position. Row/column must be between 1 and 3."),
    ("slide 1", "Invalid input format. Use: slide row col"),
    ("slide 1 2 3", "Invalid input format. Use: slide row col"),
    ("slide a b", "Invalid input format. Use: slide row col"),
    ("slide", "Unknown command. Type 'help' to see available commands."),  # "slide " with its space starts a slide
    ("Up", "Unknown command. Type 'help' to see available commands."),     # actions are case-sensitive
    ("help", "Unknown command. Type 'help' to see available commands."),
])
def test_invalid_moves_change_nothing(action, response):
    assert apply_action(action, BOARD) == (response, BOARD)


@pytest.mark.parametrize("action", ["up", "down", "left", "right"])
def test_a_direction_off_the_board_cannot_slide(action):
    corner = {"up": [[1, 2], [3, 0]], "left": [[1, 2], [3, 0]], "down": [[0, 1], [3, 2]], "right": [[0, 1], [3, 2]]}
    assert apply_action(action, corner[action]) == (f"Cannot slide {action}.", corner[action])


def test_the_solving_move_congratulates():
    response, board = apply_action("left", [[1, 2, 3], [4, 5, 6], [7, 0, 8]])
    assert response == "Congratulations! You've solved the puzzle!" and is_solved(board)


def test_render_is_nemo_rls_board():
    assert render(BOARD) == ("\n\n  +---------+\n1 | 1  2  3 |\n2 | 4     6 |\n3 | 7  5  8 |\n  +---------+\n"
                             "     1  2  3 ")
    wide = render(shuffled_grid(4, 0, random.Random(0)))  # two digits: cells 4 wide
    assert "1 |  1   2   3   4 |" in wide and "4 | 13  14  15     |" in wide and wide.endswith("     1   2   3   4  ")


@pytest.mark.parametrize("text,action", [
    ("<action>up</action>", "up"),
    ("I think... <action> slide 1 2 </action>", "slide 1 2"),
    ("<ACTION>left</Action>", "left"),
    ("<action>up</action> then <action>down</action>", "down"),  # the last one counts
    ("<action>down</action><action>up", None),                   # the last opening tag is never closed
    ("up", None), ("<action>up", None), ("", None),
])
def test_parse_action(text, action):
    assert parse_action(text) == action


# --------------------------------------------------------------------------------------------------
# Shuffling and rows
# --------------------------------------------------------------------------------------------------
def test_shuffle_is_reproducible_by_seed_and_solvable():
    boards = [shuffled_grid(3, 9, random.Random(seed)) for seed in range(30)]
    assert boards == [shuffled_grid(3, 9, random.Random(seed)) for seed in range(30)]
    assert len({str(b) for b in boards}) > 5
    for b in boards:
        assert sorted(v for row in b for v in row) == list(range(9))
        assert solution_length(b) <= 9  # reachable from the goal in 9 moves, so solvable in 9 at most


@pytest.mark.parametrize("seed", range(20))
def test_draw_game_odd_moves_never_start_solved(seed):
    rng = random.Random(seed)
    size, moves = draw_game(rng, max_size=3, max_shuffle_moves=4)
    assert 2 <= size <= 3 and moves in (1, 3, 5)  # 4 is drawn as 5, as NeMo-RL's driver does
    grid = shuffled_grid(size, moves, rng)
    assert not is_solved(grid) and solution_length(grid) % 2 == 1


def test_rows_are_deterministic_by_seed_and_split():
    rows = sliding_puzzle_rows(50, 3, 6, seed=7, split="train")
    assert rows == sliding_puzzle_rows(50, 3, 6, seed=7, split="train")
    assert rows != sliding_puzzle_rows(50, 3, 6, seed=8, split="train")
    assert rows != sliding_puzzle_rows(50, 3, 6, seed=7, split="val")
    assert {r["meta"]["size"] for r in rows} == {2, 3}
    r = rows[0]
    assert r["source"] == "sliding_puzzle/train:0" and r["answer"] == "" and set(r["meta"]) == {"size", "shuffle_moves",
                                                                                                "grid"}
    assert r["question"] == sp.prompt_text(r["meta"]["grid"]) and render(r["meta"]["grid"]) in r["question"]
    assert "<action>your_action</action>" in r["question"] and "'slide row col'" in r["question"]


def test_dataset_name():
    assert parse_dataset_name("sliding_puzzle:size=2,shuffle_moves=3") == (2, 3)
    assert parse_dataset_name("sliding_puzzle:shuffle_moves=10, size=5") == (5, 10)
    for bad in ("sliding_puzzle:", "sliding_puzzle:size=3", "sliding_puzzle:size=1,shuffle_moves=3",
                "sliding_puzzle:size=3,shuffle_moves=0", "sliding_puzzle:size=3,shuffle_moves=x",
                "sliding_puzzle:size=3,shuffle_moves=2,max_moves=4"):
        with pytest.raises(ValueError, match="sliding_puzzle:size=<n>,shuffle_moves=<k>"):
            parse_dataset_name(bad)


def test_rows_through_the_data_config():
    from grpo.config import DataConfig
    from grpo.system.data import load_rows

    cfg = DataConfig(dataset_name="sliding_puzzle:size=2,shuffle_moves=3", num_train_samples=6, num_val_samples=2)
    train, val = load_rows(cfg, "train", seed=1), load_rows(cfg, "val", seed=1)
    assert len(train) == 6 and len(val) == 2 and train[0]["meta"]["size"] == 2
    assert list(train) == sliding_puzzle_rows(6, 2, 3, seed=1, split="train")


# --------------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------------
def row_metadata(grid):
    """A sample's first-turn metadata, as the rollout builds it from a row."""
    return {"question": sp.prompt_text(grid), "answer": "", "meta": {"size": len(grid), "grid": grid},
            "task_name": "sliding_puzzle"}


def play(env, grid, messages):
    """Step one sample through ``messages`` (threading the metadata as the rollout does); the checked returns."""
    md, log, out = row_metadata(grid), [{"role": "user", "content": "prompt"}], []
    for text in messages:
        log.append({"role": "assistant", "content": text})
        ret = check_return(env.step([list(log)], [md]), 1)
        out.append(ret)
        if bool(ret.terminateds[0]):
            break
        md = ret.metadata[0]
        log += ret.observations[0]
    return out


def test_step_moves_then_solves():
    rets = play(SlidingPuzzleEnvironment(max_moves=5), BOARD, ["<action>up</action>", "<action>left</action>",
                                                               "<action>up</action>"])
    assert len(rets) == 2  # solved on the second turn
    first, second = rets
    assert first.observations[0] == [{"role": "user", "content": "<environment>\nSlid tile 5 up.\n</environment>\n"}]
    assert first.rewards.tolist() == [0.0] and first.terminateds.tolist() == [False]
    assert first.metadata[0]["grid"] == [[1, 2, 3], [4, 5, 6], [7, 0, 8]] and first.metadata[0]["num_moves"] == 1
    assert first.metadata[0]["meta"]["grid"] == BOARD  # the row's board stays as it was
    assert second.observations[0][0]["content"] == ("<environment>\nCongratulations! You've solved the puzzle!\n"
                                                    "</environment>\n")
    assert second.rewards.tolist() == [1.0] and second.terminateds.tolist() == [True]
    assert first.next_stop_strings == [["</action>"]] and first.answers == [None]


def test_step_ends_at_max_moves_on_the_turn_after():
    msgs = ["<action>up</action>", "<action>down</action>", "<action>slide 9 9</action>", "<action>left</action>"]
    rets = play(SlidingPuzzleEnvironment(max_moves=2), BOARD, msgs)
    assert [r.terminateds.tolist() for r in rets] == [[False], [False], [True]]
    assert [r.metadata[0]["num_moves"] for r in rets] == [1, 2, 2]
    # The third message is not read: its (illegal) slide is not answered, the game is over.
    assert rets[2].observations[0][0]["content"] == "<error>Maximum moves (2) reached.</error>"
    assert sum(r.rewards.item() for r in rets) == 0.0


def test_illegal_moves_count_as_moves():
    rets = play(SlidingPuzzleEnvironment(max_moves=2), BOARD, ["<action>slide 1 1</action>", "<action>jump</action>",
                                                               "<action>up</action>"])
    assert rets[0].observations[0][0]["content"] == ("<environment>\nTile must be adjacent to the empty space.\n"
                                                     "</environment>\n")
    assert rets[1].observations[0][0]["content"] == ("<environment>\nUnknown command. Type 'help' to see available "
                                                     "commands.\n</environment>\n")
    assert rets[2].terminateds.tolist() == [True] and rets[2].observations[0][0]["content"].startswith("<error>")


def test_malformed_action_shows_the_board_and_costs_no_move():
    rets = play(SlidingPuzzleEnvironment(max_moves=1), BOARD, ["I slide up", "<action>up", "<action>view</action>",
                                                               "<action>up</action>"])
    hint = ("<environment>\n" + render(BOARD) + "\n\nInvalid response format no move made. Try <action></action> "
            "like this: <action>your_action</action></environment>\n")
    assert [r.observations[0][0]["content"] for r in rets[:2]] == [hint, hint]
    assert rets[2].observations[0][0]["content"] == ("<environment>\n" + render(BOARD) + "\n\nViewing the board. "
                                                     "No move made.</environment>\n")
    assert [r.metadata[0]["num_moves"] for r in rets] == [0, 0, 0, 1]
    assert [r.metadata[0]["grid"] for r in rets[:3]] == [BOARD] * 3
    assert [r.terminateds.tolist() for r in rets] == [[False]] * 4 and rets[3].rewards.tolist() == [0.0]


def test_step_batches_samples_independently():
    env = SlidingPuzzleEnvironment(max_moves=3)
    near = [[1, 2, 3], [4, 5, 6], [7, 0, 8]]
    logs = [[{"role": "assistant", "content": m}] for m in ("<action>left</action>", "<action>left</action>", "hm")]
    ret = check_return(env.step(logs, [row_metadata(near), row_metadata(BOARD), row_metadata(near)]), 3)
    assert ret.rewards.tolist() == [1.0, 0.0, 0.0] and ret.terminateds.tolist() == [True, False, False]
    assert [m["num_moves"] for m in ret.metadata] == [1, 1, 0]


def test_success_rate_metric():
    import torch

    env = SlidingPuzzleEnvironment()
    batch = {"total_reward": torch.tensor([1.0, 0.0, 1.0, 0.0])}
    assert env.global_post_process_and_metrics(batch) == (batch, {"success_rate": 0.5})


def test_environment_kwargs():
    from grpo.config import EnvConfig
    from grpo.tasks.factory import build_environment

    env = build_environment(EnvConfig(name="sliding_puzzle", kwargs={"max_moves": 7}))
    assert isinstance(env, SlidingPuzzleEnvironment) and env.max_moves == 7 and env.stop_strings == ["</action>"]
    with pytest.raises(ValueError, match="data.dataset_name='sliding_puzzle:size=<n>,shuffle_moves=<k>'"):
        SlidingPuzzleEnvironment(max_moves=7, size=3, shuffle_moves=10)
    with pytest.raises(ValueError, match="max_moves"):
        SlidingPuzzleEnvironment(max_moves=0)


def test_observations_are_visible_under_qwen25s_chat_template(qwen25):
    """The observation's role renders as a turn in a real template (Qwen2.5 renders no "environment" turn)."""
    tok = qwen25
    obs = play(SlidingPuzzleEnvironment(), BOARD, ["<action>up</action>"])[0].observations[0][0]
    conversation = [{"role": "user", "content": "p"}, {"role": "assistant", "content": "<action>up</action>"}, obs]
    assert obs["content"] in tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
