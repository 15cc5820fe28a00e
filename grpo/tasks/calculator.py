"""The CPU tools demo: two-digit multiplication with a calculator tool, for the char-level toy model.

The toy model cannot multiply ``37*58`` (a 0.4M-parameter model trained for seconds), but it can copy:
with the ``compact`` call format a whole tool-using answer is a few dozen characters::

    37*58=<calc>37*58</calc><r>2146</r>2146<eos>
    ^prompt ^assistant turn 1  ^tool      ^assistant turn 2 (the final answer)

- `calc`: the tool (a safe arithmetic evaluator: no ``eval``);
- `calculator_rows` (`rows`: ``data.calculator_max_operand``): the procedural rows ``{"question": "37*58=", "answer": "2146", ...}``;
- `make_calculator_demo_model`: the demo's starting policy (``toy:calc_demo``), supervised on noisy transcripts: it calls the
  tool in about half its samples, and copies operands and results imperfectly, so GRPO has something to
  learn (calling more, copying better);
- `make_calculator_agent_model`: the agent demo's starting policy (``toy:calc_agent``), fitted exactly to
  `agent_targets` (the products of 10..19: a call in a quarter of its answers, the result copied);
- the ablation is the same environment with ``disable_tools=True`` (see `grpo.tasks.tools`).

The environment: ``ToolEnvironment(["grpo.tasks.calculator:calc"], "grpo.tasks.arithmetic:arithmetic_reward",
tool_call_format="compact")``. The plain-text conversation the demo model was trained on is the
concatenation of the prompt, the assistant turns and the tool messages' content, with nothing in between.
"""

from __future__ import annotations

import ast
import operator
import random

from grpo.tasks.rows import Row, split_seed

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("the power is too large (exponent at most 64, base at most 10^6)")
        value = _BINOPS[type(node.op)](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError(f"the result is larger than 10^{len(str(MAX_MAGNITUDE)) - 1}")
        return value
    raise ValueError(f"unsupported expression {ast.unparse(node)!r}: use numbers, + - * / // % ** and ( )")


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "37*58"

    >>> calc("37*58"), calc("(1+2)/4"), calc("12/4")
    ('2146', '0.75', '3')
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot parse {expression!r}: {err.msg}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculator_rows(n: int, seed: int, split: str, min_operand: int = 10, max_operand: int = 99) -> list[dict]:
    """``n`` rows ``"a*b="`` -> ``"a*b"`` with a, b uniform in [min_operand, max_operand].

    >>> calculator_rows(1, seed=0, split="train")
    [{'question': '59*63=', 'answer': '3717', 'source': 'calculator/train:0', 'meta': {}}]
    """
    rng = random.Random(split_seed(seed, split))
    rows = []
    for i in range(n):
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        rows.append({"question": f"{a}*{b}=", "answer": str(a * b), "source": f"calculator/{split}:{i}", "meta": {}})
    return rows


def rows(name: str, data_cfg, n: int, seed: int, split: str) -> list[Row]:
    """The task's rows for ``data.dataset_name=calculator`` (`grpo.tasks.catalogue`)."""
    return calculator_rows(n, seed, split, max_operand=data_cfg.calculator_max_operand)


def perturb(number: int, rng: random.Random) -> int:
    """``number`` with one digit changed (the leading digit never becomes 0).

    >>> perturb(2146, random.Random(0)) != 2146
    True
    """
    digits = list(str(number))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0" and len(digits) > 1)]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def demo_transcript(a: int, b: int, rng: random.Random, p_tool: float, p_call_ok: float,
                    p_copy_ok: float) -> list[tuple[str, bool]]:
    """One noisy supervised transcript as ``[(text, trained), ...]`` after the prompt ``"a*b="``.

    With probability ``p_tool`` the tool path: the call copies the operands (exactly with probability
    ``p_call_ok``, else one digit is off), the tool's result follows (not trained), then the answer copies
    the result (exactly with probability ``p_copy_ok``). Otherwise a direct answer: the product with one
    digit off (the toy cannot multiply, so a direct answer is never trained to be right).

    >>> demo_transcript(37, 58, random.Random(1), 1.0, 1.0, 1.0)
    [('<calc>37*58</calc>', True), ('<r>2146</r>', False), ('2146', True)]
    """
    if rng.random() >= p_tool:
        return [(str(perturb(a * b, rng)), True)]
    x, y = a, b
    if rng.random() >= p_call_ok:
        x, y = (perturb(a, rng), b) if rng.random() < 0.5 else (a, perturb(b, rng))
    result = x * y
    answer = result if rng.random() < p_copy_ok else perturb(result, rng)
    return [(f"<calc>{x}*{y}</calc>", True), (f"<r>{result}</r>", False), (str(answer), True)]


# The agent demo's chat template (configs/cpu_demo_agent.yaml): the conversation as the tools demo's plain text, with
# <eos> ending each assistant turn, as an OpenAI endpoint's turns end: "<bos>37*58=<calc>37*58</calc><eos><r>2146</r>
# 2146<eos>". A tool call is written in the compact format from the message's tool_calls (its arguments' values).
AGENT_CHAT_TEMPLATE = (
    "<bos>{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<{{ c.function.name }}>{% for k, v in c.function.arguments.items() %}{{ v }}"
    "{% endfor %}</{{ c.function.name }}>{% endfor %}<eos>{% elif m.role == 'tool' %}<r>{{ m.content }}</r>"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}"
)


def agent_targets(max_operand: int, p_tool: float, seed: int = 0) -> list[tuple[str, list[tuple[str, bool]], float]]:
    """The agent demo model's target distribution: every prompt ``"a*b="`` (a, b in [10, max_operand]) with two
    conversations, as ``(question, [(text, trained), ...], weight)``: the tool path (the call, the tool's result, not
    trained, then the result copied) at weight ``p_tool``, and a direct answer, the product with one digit off
    (`perturb`, one fixed slip per prompt: the toy cannot multiply), at ``1 - p_tool``.

    >>> tool, direct = agent_targets(10, 0.25)
    >>> tool
    ('10*10=', [('<calc>10*10</calc>', True), ('<r>100</r>', False), ('100', True)], 0.25)
    >>> direct
    ('10*10=', [('170', True)], 0.75)
    """
    rng = random.Random(seed)
    targets = []
    for a in range(10, max_operand + 1):
        for b in range(10, max_operand + 1):
            tool = [(f"<calc>{a}*{b}</calc>", True), (f"<r>{a * b}</r>", False), (str(a * b), True)]
            targets += [(f"{a}*{b}=", tool, p_tool), (f"{a}*{b}=", [(str(perturb(a * b, rng)), True)], 1 - p_tool)]
    return targets


def make_calculator_agent_model(out_dir: str, max_operand: int = 19, p_tool: float = 0.25, steps: int = 300,
                                seed: int = 0, log_every: int = 0) -> str:
    """The agent demo's starting policy (``toy:calc_agent``): the ``small`` toy fitted (`grpo.tasks.toy.fit_exact`) to
    `agent_targets`, its tool calls ending their turn with ``<eos>`` (as an endpoint's turns end) and its tokenizer
    carrying `AGENT_CHAT_TEMPLATE`. On every prompt of the demo (configs/cpu_demo_agent.yaml:
    ``data.calculator_max_operand`` 19, the 100 products of 10..19) it calls the calculator with probability ``p_tool``
    and copies the result, and answers directly, wrongly, otherwise: sampled at temperature 1 it scores about
    ``p_tool``, and GRPO has one behaviour to learn, which each group shows side by side (call the tool).

    Why an exact fit over the demo's 100 products (issue 44): the model was supervised on 1,200 noisy batches of
    products of 10..99 until then, and had to learn to copy the tool's result (an induction circuit that appears
    abruptly during supervision); on one CPU it copied 22 of 32 results and the demo rose 0.28 -> 0.73, on another it
    copied none and the demo stayed at 0 (no group with a mixed reward). The fit converges to each prompt's
    conversations at their weights, a state float rounding barely moves, as toy:demo's (measured on the built model: the call at 0.238-0.252 per prompt,
    the result copied in 100 of 100 greedy answers). 73 CPU-seconds with one thread."""
    from grpo.tasks.toy import build_char_tokenizer, build_tiny_model, fit_exact, save_char_tokenizer

    tok = build_char_tokenizer(AGENT_CHAT_TEMPLATE)
    model = build_tiny_model(tok, size="small", seed=seed)
    rows = []
    for question, turns, weight in agent_targets(max_operand, p_tool, seed):
        ids = tok(question)["input_ids"]
        labels = [-100] * len(ids)
        for text, trained in turns:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            piece += [tok.eos_token_id] if text.startswith("<calc>") else []
            ids, labels = ids + piece, labels + (piece if trained else [-100] * len(piece))
        rows.append((ids + [tok.eos_token_id], labels + [tok.eos_token_id], weight))
    fit_exact(model, tok.pad_token_id, rows, steps, log_every=log_every, name="calculator agent model")
    model.save_pretrained(out_dir, safe_serialization=True)
    save_char_tokenizer(tok, out_dir)
    return out_dir


def make_calculator_demo_model(out_dir: str, p_tool: float = 0.5, p_call_ok: float = 1.0, p_copy_ok: float = 1.0,
                               steps: int = 400, batch_size: int = 32, seed: int = 0, log_every: int = 0) -> str:
    """Build the tools demo's starting policy (the ``small`` toy) into ``out_dir``; returns ``out_dir``.

    Supervised on `demo_transcript` rows (loss on the assistant text and the final ``<eos>`` only). The
    defaults train on clean tool transcripts in half the rows and wrong direct answers in the other half:
    sampled at temperature 1 the model calls the tool in about half its samples and, having learnt to
    copy only approximately in 400 steps, gets about three quarters of those right; direct answers are
    ~never right. Measured (scripts/measure_tools_demo.py, 128 val rows x 4 samples, one thread): tool
    calls in 51% of the samples, reward 0.37 with the tool and 0.002 with tools disabled; 30 steps of a bare
    group-normalised policy gradient take it to 0.81 with the tool (calls in 99.6%) and leave the ablation
    at 0.00. The build takes ~40 CPU-seconds with one thread. Deterministic for a given seed and thread
    count.
    """
    from grpo.tasks.toy import build_char_tokenizer, build_tiny_model, save_char_tokenizer, supervise

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, size="small", seed=seed)
    rng = random.Random(seed)

    def encode_row() -> tuple[list[int], list[int]]:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        ids = tok(f"{a}*{b}=")["input_ids"]
        labels = [-100] * len(ids)
        for text, trained in demo_transcript(a, b, rng, p_tool, p_call_ok, p_copy_ok):
            piece = tok(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if trained else [-100] * len(piece)
        return ids + [tok.eos_token_id], labels + [tok.eos_token_id]

    supervise(model, tok.pad_token_id, encode_row, steps, batch_size, log_every=log_every,
              name="calculator demo model")
    model.save_pretrained(out_dir, safe_serialization=True)
    save_char_tokenizer(tok, out_dir)
    return out_dir
