"""The sliding puzzle: NeMo-RL's multi-turn game (``env.sliding_puzzle_game``), same rules, text and rewards.

An n x n board holds tiles 1..n*n-1 and one empty cell (0); solved, it reads 1, 2, ... in rows with the
empty cell at the bottom right. Each turn the policy writes one action inside ``<action>...</action>`` (the
last such tag counts; generation stops at ``</action>``):

- ``up`` / ``down`` / ``left`` / ``right``: the tile next to the empty cell slides that way into it (``up``
  moves the tile below the empty cell);
- ``slide r c``: the tile at row r, column c (from 1) slides into the empty cell, if the two are adjacent;
- ``view``: the board is shown again; no move is counted.

The environment answers with an observation (``<environment>...</environment>``); a move that solves the
board ends the episode with reward 1, every other turn scores 0. Every parsed action but ``view`` counts as
a move, legal or not; once ``max_moves`` moves are spent, the next turn ends the episode with reward 0.
A message without an ``<action>`` tag is answered with the board and a format hint, and costs no move.

Prompts are procedural (``data.dataset_name="sliding_puzzle:size=3,shuffle_moves=10"``): each row draws a
size in [2, size] and an odd number of shuffle moves in [1, shuffle_moves] (+1 when even: an odd number of
moves never returns the empty cell to its corner, so no board starts solved), then shuffles a solved board
with that many random legal moves (so every board is solvable). The board is the row's ``meta["grid"]``;
the environment carries it, and the moves so far, in the sample's metadata from turn to turn.

    >>> env = SlidingPuzzleEnvironment(max_moves=5)
    >>> md = {"question": "...", "answer": "", "meta": {"size": 2, "grid": [[1, 2], [0, 3]]}}
    >>> ret = env.step([[{"role": "assistant", "content": "Easy. <action>left</action>"}]], [md])
    >>> ret.observations[0]["content"], ret.rewards.tolist(), ret.terminateds.tolist()
    ("<environment>\\nCongratulations! You've solved the puzzle!\\n</environment>\\n", [1.0], [True])
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from grpo.tasks.interface import Environment, EnvironmentReturn
from grpo.tasks.rows import Row, split_seed

Grid = list[list[int]]

STOP_STRINGS = ["</action>"]
# The role of the observations. NeMo-RL's environment says "environment" and appends the raw content; a real
# chat template (Qwen2.5's) renders no "environment" turn at all, so the built-in task speaks as "user", as
# guess_number does: visible under a chat template, and in plain text the content is appended as it is.
OBSERVATION_ROLE = "user"
# Direction -> where the moving tile sits, relative to the empty cell ("up": the tile below moves up).
TILE_OFFSET = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}
# The order NeMo-RL's shuffle lists the empty cell's neighbours in: right, down, left, up.
NEIGHBOUR_ORDER = ((0, 1), (1, 0), (0, -1), (-1, 0))


# --------------------------------------------------------------------------------------------------
# The board
# --------------------------------------------------------------------------------------------------
def solved_grid(size: int) -> Grid:
    """The goal board: 1..size*size-1 in rows, the empty cell (0) at the bottom right.

        >>> solved_grid(2)
        [[1, 2], [3, 0]]
    """
    return [[(r * size + c + 1) % (size * size) for c in range(size)] for r in range(size)]


def is_solved(grid: Grid) -> bool:
    """Whether ``grid`` is the goal board.

        >>> is_solved([[1, 2], [3, 0]]), is_solved([[1, 2], [0, 3]])
        (True, False)
    """
    return grid == solved_grid(len(grid))


def empty_cell(grid: Grid) -> tuple[int, int]:
    """(row, column) of the empty cell, from 0.

        >>> empty_cell([[1, 2], [0, 3]])
        (1, 0)
    """
    return next((r, c) for r, row in enumerate(grid) for c, v in enumerate(row) if v == 0)


def slide(grid: Grid, r: int, c: int) -> Grid:
    """A new board with the tile at (r, c) moved into the empty cell (adjacency is the caller's check).

        >>> slide([[1, 2], [0, 3]], 1, 1)
        [[1, 2], [3, 0]]
    """
    er, ec = empty_cell(grid)
    new = [list(row) for row in grid]
    new[er][ec], new[r][c] = grid[r][c], 0
    return new


def shuffled_grid(size: int, moves: int, rng: random.Random) -> Grid:
    """The goal board after ``moves`` random legal moves (each a uniform pick among the empty cell's
    neighbours, so a move may undo the last one); solvable by construction.

        >>> shuffled_grid(2, 1, random.Random(0))
        [[1, 0], [3, 2]]
    """
    grid = solved_grid(size)
    for _ in range(moves):
        er, ec = empty_cell(grid)
        options = [(er + dr, ec + dc) for dr, dc in NEIGHBOUR_ORDER if 0 <= er + dr < size and 0 <= ec + dc < size]
        grid = slide(grid, *rng.choice(options))
    return grid


def render(grid: Grid) -> str:
    """NeMo-RL's board text: a frame, row numbers on the left, column numbers below, the empty cell blank
    (it starts with two newlines, as NeMo-RL's does).

        >>> render([[1, 2], [0, 3]]).split("\\n")
        ['', '', '  +------+', '1 | 1  2 |', '2 |    3 |', '  +------+', '     1  2 ']
    """
    size = len(grid)
    digits = len(str(size * size - 1))
    width = digits + 2
    border = "  +" + "-" * width * size + "+"
    rows = [f"{r + 1} |" + "".join(" " * width if v == 0 else f" {v:>{digits}} " for v in row) + "|"
            for r, row in enumerate(grid)]
    labels = "    " + "".join(f"{c + 1:^{width}}" for c in range(size))
    return "\n".join(["\n", border, *rows, border, labels])


# --------------------------------------------------------------------------------------------------
# The game's text and one action
# --------------------------------------------------------------------------------------------------
def welcome_text(size: int) -> str:
    """The game's introduction (NeMo-RL's ``SlidingPuzzleGameLogic.init``)."""
    return (f"\n===== SLIDING PUZZLE =====\n"
            f"Arrange the {size}x{size} grid by sliding tiles into the empty space.\n"
            f"- The goal is to arrange numbers from 1 to {size * size - 1} in order\n"
            f"- Use 'up', 'down', 'left', 'right' to slide in that direction\n"
            f"- Use 'view' to see the current state of the board")


def prompt_text(grid: Grid) -> str:
    """The first user message: the welcome, the board, the goal and the action syntax (NeMo-RL's driver)."""
    size = len(grid)
    return (f"{welcome_text(size)}\n\n"
            f"Current Board State:\n{render(grid)}\n\n"
            f"Reach the goal state where numbers are ordered 1 through {size * size - 1} "
            f"with the empty space (0) at the bottom right.\n"
            f"Valid actions: 'up', 'down', 'left', 'right', or 'slide row col' (e.g., 'slide 1 2').\n"
            f"After thinking, output your chosen action on a new line starting with '<action></action>' like this:\n"
            f"<action>your_action</action>"
            f"\nIf you just want to see the board, output <action>view</action>"
            f"\nThink carefully step-by-step before acting.\n")


def parse_action(text: str) -> str | None:
    """The action in an assistant message: the stripped text between the last ``<action>`` and the first
    ``</action>`` after it (tags in any case); None when there is no such pair.

        >>> parse_action("first <action>up</action>, no: <ACTION> slide 1 2 </action>"), parse_action("<action>up")
        ('slide 1 2', None)
    """
    lower = text.lower()
    start = lower.rfind("<action>")
    if start == -1:
        return None
    end = lower.find("</action>", start + len("<action>"))
    return None if end == -1 else text[start + len("<action>"):end].strip()


def apply_action(action: str, grid: Grid) -> tuple[str, Grid]:
    """One parsed action other than ``view``: (the game's response, the board after it). An action that
    moves nothing returns the board unchanged with the reason (NeMo-RL's ``SlidingPuzzleGameLogic.step``).

        >>> apply_action("up", [[1, 2], [0, 3]])
        ('Cannot slide up.', [[1, 2], [0, 3]])
        >>> apply_action("slide 2 2", [[1, 2], [0, 3]])
        ("Congratulations! You've solved the puzzle!", [[1, 2], [3, 0]])
    """
    size, (er, ec) = len(grid), empty_cell(grid)
    if action.startswith("slide "):
        try:
            _, row, col = action.split()
            r, c = int(row) - 1, int(col) - 1
        except ValueError:
            return "Invalid input format. Use: slide row col", grid
        if not (0 <= r < size and 0 <= c < size):
            return f"Invalid position. Row/column must be between 1 and {size}.", grid
        if abs(r - er) + abs(c - ec) != 1:
            return "Tile must be adjacent to the empty space.", grid
        response = f"Slid tile {grid[r][c]} into the empty space."
    elif action in TILE_OFFSET:
        r, c = er + TILE_OFFSET[action][0], ec + TILE_OFFSET[action][1]
        if not (0 <= r < size and 0 <= c < size):
            return f"Cannot slide {action}.", grid
        response = f"Slid tile {grid[r][c]} {action}."
    else:
        return "Unknown command. Type 'help' to see available commands.", grid
    new = slide(grid, r, c)
    return ("Congratulations! You've solved the puzzle!" if is_solved(new) else response), new


@dataclass
class Turn:
    """What one assistant message did: the observation's text, the turn's reward, whether the episode ended,
    and the board and move count after it."""

    observation: str
    reward: float
    done: bool
    grid: Grid
    num_moves: int


def play_turn(message: str, grid: Grid, num_moves: int, max_moves: int) -> Turn:
    """One turn of the game (NeMo-RL's ``SlidingPuzzleRunner.process_turn``), in its order: out of moves
    first (the message is not read), then no action, ``view``, or a move (counted, legal or not).

        >>> play_turn("<action>view</action>", [[1, 2], [0, 3]], 0, 5).num_moves
        0
        >>> play_turn("<action>up</action>", [[1, 2], [0, 3]], 5, 5).observation
        '<error>Maximum moves (5) reached.</error>'
    """
    if num_moves >= max_moves:
        return Turn(f"<error>Maximum moves ({max_moves}) reached.</error>", 0.0, True, grid, num_moves)
    action = parse_action(message.strip())
    if action is None:
        text = (f"<environment>\n{render(grid)}\n\nInvalid response format no move made. "
                f"Try <action></action> like this: <action>your_action</action></environment>")
        return Turn(text + "\n", 0.0, False, grid, num_moves)
    if action == "view":
        return Turn(f"<environment>\n{render(grid)}\n\nViewing the board. No move made.</environment>\n", 0.0,
                    False, grid, num_moves)
    response, new = apply_action(action, grid)
    solved = new is not grid and is_solved(new)  # only a move wins (apply_action returns the same board otherwise)
    return Turn(f"<environment>\n{response}\n</environment>\n", 1.0 if solved else 0.0, solved, new, num_moves + 1)


# --------------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------------
class SlidingPuzzleEnvironment(Environment):
    """The game for a batch of samples (see the module docstring). ``max_moves``: moves per episode (NeMo-RL's
    ``env.sliding_puzzle_game.cfg.max_moves``). Metadata: the row's ``{"meta": {"grid"}}`` on the first turn;
    the environment adds ``grid`` (the board now) and ``num_moves`` for the turns after."""

    stop_strings = STOP_STRINGS  # the first turn's stop strings (`grpo.tasks.router.Environments`)

    def __init__(self, max_moves: int = 30, **unknown):
        if unknown:  # NeMo-RL's game_config: the boards are drawn with the data, not by the environment
            raise ValueError(f"env.kwargs {sorted(unknown)}: the sliding puzzle's environment takes max_moves only; "
                             "the boards' size and shuffle moves go in the data: "
                             "data.dataset_name='sliding_puzzle:size=<n>,shuffle_moves=<k>'")
        if int(max_moves) < 1:
            raise ValueError(f"env.kwargs.max_moves={max_moves!r}: expected a positive integer")
        self.max_moves = int(max_moves)

    def step(self, message_logs, metadata):
        import torch

        obs, rewards, done, next_md = [], [], [], []
        for log, md in zip(message_logs, metadata):
            grid = md.get("grid") or (md.get("meta") or {})["grid"]
            message = log[-1]["content"] if log and log[-1]["role"] == "assistant" else ""
            turn = play_turn(message, grid, int(md.get("num_moves", 0)), self.max_moves)
            obs.append({"role": OBSERVATION_ROLE, "content": turn.observation})
            rewards.append(turn.reward)
            done.append(turn.done)
            next_md.append({**md, "grid": turn.grid, "num_moves": turn.num_moves})
        n = len(message_logs)
        return EnvironmentReturn(observations=obs, metadata=next_md, next_stop_strings=[list(STOP_STRINGS)] * n,
                                 rewards=torch.tensor(rewards), terminateds=torch.tensor(done), answers=[None] * n)

    def global_post_process_and_metrics(self, batch):
        """``success_rate``: the share of samples whose total reward is 1, i.e. that solved their board
        (NeMo-RL's ``sliding_puzzle_success_rate``), logged as ``env/<task>/success_rate``; ``batch``: NeMo-RL's
        rollout batch (`grpo.tasks.router.rollout_batch`)."""
        solved = [r == 1.0 for r in batch["total_reward"].tolist()]
        return batch, {"success_rate": sum(solved) / len(solved) if solved else 0.0}


# --------------------------------------------------------------------------------------------------
# The rows
# --------------------------------------------------------------------------------------------------
def parse_dataset_name(name: str) -> tuple[int, int]:
    """``"sliding_puzzle:size=<n>,shuffle_moves=<k>"`` -> (n, k): the largest board size and the most shuffle
    moves (NeMo-RL's ``cfg.game_config.size`` / ``shuffle_moves``); a bad name raises ValueError saying so.

        >>> parse_dataset_name("sliding_puzzle:size=3,shuffle_moves=10")
        (3, 10)
    """
    _, _, rest = name.partition(":")
    fields = dict(part.partition("=")[::2] for part in rest.replace(" ", "").split(",") if part)
    spelling = "expected data.dataset_name='sliding_puzzle:size=<n>,shuffle_moves=<k>' (n >= 2, k >= 1)"
    if sorted(fields) != ["shuffle_moves", "size"] or not all(v.isdigit() for v in fields.values()):
        raise ValueError(f"data.dataset_name={name!r}: {spelling}")
    size, moves = int(fields["size"]), int(fields["shuffle_moves"])
    if size < 2 or moves < 1:
        raise ValueError(f"data.dataset_name={name!r}: {spelling}")
    return size, moves


def draw_game(rng: random.Random, max_size: int, max_shuffle_moves: int) -> tuple[int, int]:
    """One row's (size, shuffle moves), NeMo-RL's driver's draw: moves uniform in [1, max_shuffle_moves] made
    odd (+1 when even, so it may be max_shuffle_moves + 1), size uniform in [2, max_size]."""
    moves = rng.randint(1, max_shuffle_moves)
    moves += 1 - moves % 2
    return rng.randint(2, max_size), moves


def sliding_puzzle_rows(n: int, max_size: int, max_shuffle_moves: int, seed: int, split: str) -> list[Row]:
    """``n`` rows (a prompt with a shuffled board; no answer), deterministic in (seed, split).

        >>> rows = sliding_puzzle_rows(2, 2, 3, seed=0, split="train")
        >>> [r["meta"] for r in rows] == [r["meta"] for r in sliding_puzzle_rows(2, 2, 3, 0, "train")]
        True
    """
    rng = random.Random(split_seed(seed, split))
    rows = []
    for i in range(n):
        size, moves = draw_game(rng, max_size, max_shuffle_moves)
        grid = shuffled_grid(size, moves, rng)
        rows.append({"question": prompt_text(grid), "answer": "", "source": f"sliding_puzzle/{split}:{i}",
                     "meta": {"size": size, "shuffle_moves": moves, "grid": grid}})
    return rows


def rows(name: str, data_cfg, n: int, seed: int, split: str) -> list[Row]:
    """The task's rows for ``data.dataset_name="sliding_puzzle:size=<n>,shuffle_moves=<k>"``."""
    max_size, max_moves = parse_dataset_name(name)
    return sliding_puzzle_rows(n, max_size, max_moves, seed, split)
