"""NeMo-RL's VLM environment (``nemo_rl/environments/vlm_environment.py``): a weighted sum of named reward functions
(its datasets' rows: `grpo.system.vision.format_record`).

Rewards (``env.name=vlm``, ``env.kwargs.reward_functions``: ``[{name, weight, kwargs}]``), each
``(ground_truth, response) -> (reward, correct or None)`` as NeMo-RL's ``nemo_rl/environments/rewards.py``:

    >>> format_reward("3", "<think>count</think> <answer>3</answer>")
    (1.0, None)
    >>> exact_alnum_reward("Yes.", "<answer> yes </answer>")
    (1.0, True)
    >>> round(bbox_giou_reward("[0, 0, 2, 2]", "<answer>[1, 1, 3, 3]</answer>")[0], 4)  # IoU 1/7, hull 9
    -0.0794
"""

from __future__ import annotations

import re
from functools import lru_cache, partial
from typing import Any, Callable


# --------------------------------------------------------------------------------------------------
# Rewards (nemo_rl/environments/rewards.py)
# --------------------------------------------------------------------------------------------------
def _tagged(response: str, tag: str) -> str | None:
    """The text between the first ``<tag>`` and the last ``</tag>`` (NeMo-RL's greedy match), None without one."""
    match = re.search(rf"<{tag}>([\s\S]*)</{tag}>", response)
    return match.group(1) if match else None


def format_reward(ground_truth: str, response: str, think_tag: str = "think",
                  answer_tag: str = "answer") -> tuple[float, None]:
    """0.25 for a ``<think>...</think>`` span, 0.75 for an ``<answer>...</answer>`` span; says nothing of
    correctness (None)."""
    return 0.25 * (_tagged(response, think_tag) is not None) + 0.75 * (_tagged(response, answer_tag) is not None), None


def _alnum(text: str) -> str:
    return "".join(c for c in text if c.isalnum()).lower()


def exact_alnum_reward(ground_truth: str, response: str, answer_tag: str = "answer") -> tuple[float, bool]:
    """1 when the answer's letters and digits, lower-cased, equal the ground truth's (spaces and punctuation
    dropped from both), else 0."""
    answer = _tagged(response, answer_tag)
    ok = answer is not None and _alnum(answer) == _alnum(ground_truth)
    return float(ok), ok


def _box(text: str) -> tuple[float, float, float, float] | None:
    """``"[x1, y1, x2, y2]"`` (brackets optional) as four floats; None if it is not four numbers."""
    try:
        values = [float(x) for x in text.replace("[", "").replace("]", "").split(",")]
    except ValueError:
        return None
    return tuple(values) if len(values) == 4 else None  # type: ignore[return-value]


def generalized_iou(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, float]:
    """``(IoU, GIoU)`` of boxes ``(x1, y1, x2, y2)``: GIoU = IoU - (hull - union) / hull, the hull the smallest box
    holding both (Rezatofighi et al. 2019); in [-1, 1]. Union and hull are at least 1e-3 (NeMo-RL's floor)."""
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = max(1e-3, area_a + area_b - inter)
    hull = max(1e-3, (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1])))
    iou = inter / union
    return iou, iou - (hull - union) / hull


def bbox_giou_reward(ground_truth: str, response: str, giou_penalty_thres: float = 10.0,
                     answer_tag: str = "answer") -> tuple[float, bool]:
    """The box in the answer against the ground truth's: IoU when IoU >= ``giou_penalty_thres``, else GIoU (so a
    box that misses still learns which way to move); correct when that is above 0.5. No box: 0."""
    answer = _tagged(response, answer_tag)
    gold, pred = _box(ground_truth), (_box(answer) if answer is not None else None)
    if gold is None or pred is None:
        return 0.0, False
    iou, giou = generalized_iou(gold, pred)
    reward = iou if iou >= giou_penalty_thres else giou
    return reward, reward > 0.5


@lru_cache(maxsize=1)
def _math_metric():
    """NeMo-RL's math-verify metric: the gold read as LaTeX, the answer as an expression or LaTeX."""
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    return math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                       pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))


def _math_equal(gold: str, answer: str) -> float:
    """math-verify's score of ``answer`` against ``gold``, both read as ``\\boxed{...}`` (0 on any failure)."""
    verify = _math_metric()
    boxed = lambda x: x if x.startswith("\\boxed{") else "\\boxed{" + x + "}"  # noqa: E731
    try:
        score, _ = verify([boxed(gold)], [boxed(answer)])
    except Exception:
        return 0.0
    return float(score)


def math_expr_reward(ground_truth: str, response: str, tag: str = "answer") -> tuple[float, bool]:
    """math-verify's score of the answer in ``<tag>`` against the ground truth; correct above 0.1."""
    answer = _tagged(response, tag)
    score = _math_equal(ground_truth, answer) if answer is not None else 0.0
    return score, score > 0.1


def _last_boxed(response: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), None without a closed one."""
    start = response.rfind("\\boxed{")
    if start == -1:
        return None
    start += len("\\boxed{")
    depth = 1
    for i, ch in enumerate(response[start:]):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return response[start:start + i].strip()
    return None


def geo3k_reward(ground_truth: str, response: str, format_score: float = 0.1) -> tuple[float, bool]:
    """verl's geo3k reward: ``format_score`` x (a ``</think>`` then a ``\\boxed{}``) + (1 - ``format_score``) x
    (the last boxed answer equals the ground truth under math-verify)."""
    formatted = re.search(r"</think>.*\\boxed\{.*\}", response, re.DOTALL) is not None
    answer = _last_boxed(response)
    correct = answer is not None and _math_equal(ground_truth, answer) > 0.1
    return (1.0 - format_score) * correct + format_score * formatted, correct


REWARD_FUNCTIONS: dict[str, Callable[..., tuple[float, bool | None]]] = {
    "format": format_reward, "exact_alnum": exact_alnum_reward, "math_expr": math_expr_reward,
    "bbox_giou": bbox_giou_reward, "geo3k": geo3k_reward}


def reward_problem(spec: Any, where: str) -> str | None:
    """What is wrong with one ``{name, weight, kwargs}`` entry (None: nothing)."""
    import inspect

    if not isinstance(spec, dict) or spec.get("name") not in REWARD_FUNCTIONS:
        return f"{where}={spec!r}: expected {{name, weight, kwargs}} with name one of {sorted(REWARD_FUNCTIONS)}"
    weight = spec.get("weight")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        return f"{where}.weight={weight!r}: expected a number >= 0"
    extra = set(spec) - {"name", "weight", "kwargs"}
    if extra:
        return f"{where}: unknown keys {sorted(extra)} (expected name, weight, kwargs)"
    params = set(inspect.signature(REWARD_FUNCTIONS[spec["name"]]).parameters) - {"ground_truth", "response"}
    unknown = set(spec.get("kwargs") or {}) - params
    if unknown:
        return f"{where}.kwargs: {sorted(unknown)} are not arguments of {spec['name']} (it takes {sorted(params)})"
    return None


def kwargs_problem(kwargs: dict, where: str = "env.kwargs") -> str | None:
    """What is wrong with env.name=vlm's ``env.kwargs`` (None: ``{"reward_functions": [...]}`` of valid entries
    whose weights sum above 0)."""
    if set(kwargs) != {"reward_functions"}:
        return f"{where}={kwargs!r}: env.name='vlm' takes env.kwargs.reward_functions (a list of {{name, weight, kwargs}})"
    specs = kwargs["reward_functions"]
    if not isinstance(specs, list) or not specs:
        return f"{where}.reward_functions={specs!r}: expected a non-empty list of {{name, weight, kwargs}}"
    problems = [p for i, s in enumerate(specs) if (p := reward_problem(s, f"{where}.reward_functions.{i}"))]
    if problems:
        return "; ".join(problems)
    if sum(float(s["weight"]) for s in specs) <= 0:
        return f"{where}.reward_functions: the weights sum to 0"
    return None


def combine(reward_functions: list[dict]) -> Callable[[str, str], tuple[float, bool]]:
    """NeMo-RL's ``combine_reward_functions``: the weights renormalised to sum to 1, the reward their weighted
    sum; correct when every function that judges correctness (not None) says so."""
    if (problem := kwargs_problem({"reward_functions": reward_functions}, "env.kwargs")) is not None:
        raise ValueError(problem)
    total = sum(float(s["weight"]) for s in reward_functions)
    parts = [(partial(REWARD_FUNCTIONS[s["name"]], **(s.get("kwargs") or {})), float(s["weight"]) / total)
             for s in reward_functions]

    def combined(ground_truth: str, response: str) -> tuple[float, bool]:
        results = [(fn(ground_truth, response), w) for fn, w in parts]
        return sum(r * w for (r, _), w in results), all(c for (_, c), _ in results if c is not None)

    return combined


def vlm_environment(reward_functions: list[dict], timeout_s: float = 10.0):
    """env.name=vlm: a single-turn environment scoring each completion with `combine` (in the trainer process:
    the functions take microseconds, math-verify's a few milliseconds)."""
    from grpo.tasks.reward import RewardEnvironment

    scorer = combine(reward_functions)
    env = RewardEnvironment("grpo.tasks.vlm:vlm_reward", in_process=True, timeout_s=timeout_s)
    env._fn = lambda question, completion, answer, meta: scorer(str(answer), completion)[0]
    return env


def vlm_reward(question, completion: str, answer: str, meta: dict) -> float:
    """env.name=function's form of the default mix (format 0.2, exact_alnum 0.8: the CLEVR recipe's)."""
    return combine([{"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.8}])(answer, completion)[0]
