"""A sample's model calls as training rows (grpo/wings/agents/branches.py): a conversation that rewrites its history
trains as a tree of branches, every generated token once, each row token-exact for every call it trains."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.wings.agents.branches import Branch, Span, branch_messages, grow_branches, realign_point
from grpo.wings.agents.endpoint import CallRecord
from grpo.wings.agents.player import trajectory_messages


def _call(prompt, gen, lp=None):
    lp = lp if lp is not None else [-0.1 * (i + 1) for i in range(len(gen))]
    return CallRecord(list(prompt), list(gen), list(lp), "stop", 0)


def _check_each_generation_trained_once_where_it_was_generated(calls, branches, threshold=0):
    """Every call's generation (or, for a realigned one, its head) is trained in exactly one row, after exactly the
    prompt that call was given, with its own logprobs; nothing else is trained."""
    spans = [(b, s) for b in branches for s in b.generated if s.end > s.start]
    used = set()
    for k, c in enumerate(calls):
        if not c.generation_token_ids:
            continue
        found = [(b, s) for b, s in spans if (id(b), s.start) not in used
                 and b.token_ids[:s.start] == c.prompt_token_ids
                 and b.token_ids[s.start:s.end] == c.generation_token_ids[:s.end - s.start]
                 and s.logprobs == c.generation_log_probs[:s.end - s.start]
                 and (s.end - s.start == len(c.generation_token_ids) or threshold > 0)]
        if not found and threshold > 0:  # a realign cut all of it (counted in realigned_tokens)
            continue
        assert found, f"call {k} is trained in no row"
        used.add((id(found[0][0]), found[0][1].start))
    assert len(used) == len(spans), "a row trains tokens no call generated there"
    assert sum(b.trained_tokens + b.realigned_tokens for b in branches) <= sum(len(c.generation_token_ids)
                                                                               for c in calls)


def test_calls_that_extend_each_other_are_one_branch_equal_to_the_contiguous_trajectory():
    calls = [_call([1, 2], [3, 4]), _call([1, 2, 3, 4, 5, 6], [7]), _call([1, 2, 3, 4, 5, 6, 7, 8], [9, 10])]
    [b] = grow_branches(calls)
    assert b.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] and b.fork_at == 0 and b.calls == 3
    assert branch_messages(b, decode=str) == trajectory_messages(calls, decode=str)[0]


def test_a_compacted_history_is_a_second_branch_and_a_later_call_continues_the_branch_it_extends():
    main1 = _call([1, 2], [3, 4])
    main2 = _call([1, 2, 3, 4, 5], [6])
    compacted = _call([1, 2, 8], [9])             # a summary in place of the history: parts after [1, 2]
    sub_agent = _call([1, 7], [5, 5])             # a conversation of its own: parts after [1]
    resumed = _call([1, 2, 8, 9, 4], [3])         # the compacted conversation goes on
    calls = [main1, main2, compacted, sub_agent, resumed]
    branches = grow_branches(calls)
    assert [(b.token_ids, b.fork_at, b.calls) for b in branches] == [
        ([1, 2, 3, 4, 5, 6], 0, 2), ([1, 2, 8, 9, 4, 3], 2, 2), ([1, 7, 5, 5], 1, 1)]
    assert [b.trained_tokens for b in branches] == [3, 2, 2]  # 7 generated tokens, each trained once
    _check_each_generation_trained_once_where_it_was_generated(calls, branches)


def test_two_choices_of_one_prompt_are_two_branches():
    calls = [_call([1, 2], [3]), _call([1, 2], [4])]
    assert [(b.token_ids, b.fork_at) for b in grow_branches(calls)] == [([1, 2, 3], 0), ([1, 2, 4], 2)]


def test_a_branch_that_trains_nothing_is_no_row_but_the_first_always_is():
    assert [b.token_ids for b in grow_branches([_call([1], [2]), _call([5], [])])] == [[1, 2]]
    assert [b.token_ids for b in grow_branches([_call([1], [])])] == [[1]]


def test_fork_threshold_realigns_a_re_rendered_end_of_the_last_answer_and_forks_a_longer_one():
    first = _call([1, 2], [3, 4, 5, 6])
    re_rendered = _call([1, 2, 3, 4, 5, 9, 7], [8])  # the answer's last token came back as another one
    [b] = grow_branches([first, re_rendered], fork_threshold_tokens=2)
    # the row keeps the exact tokens both calls saw: the cut token (6) is trained nowhere, and counted
    assert (b.token_ids, b.realigned_tokens, [(s.start, s.end) for s in b.generated]) == (
        [1, 2, 3, 4, 5, 9, 7, 8], 1, [(2, 5), (7, 8)])
    assert b.generated[0].logprobs == first.generation_log_probs[:3]
    assert len(grow_branches([first, re_rendered], fork_threshold_tokens=1)) == 2  # 1 token is not < 1
    assert len(grow_branches([first, re_rendered])) == 2  # the default: every rewrite is a branch
    rewritten_prompt = _call([1, 7, 3, 4, 5, 6, 7], [8])  # parts before the last answer: always a branch
    assert len(grow_branches([first, rewritten_prompt], fork_threshold_tokens=100)) == 2


def test_realign_point_is_only_inside_the_last_answer():
    b = Branch([1, 2, 3, 4, 5], [Span(1, 2, [-.1]), Span(3, 5, [-.2, -.3])])
    assert realign_point(b, [1, 2, 3, 4, 0], 5) == 4
    assert realign_point(b, [1, 2, 3, 0], 5) == 3
    assert realign_point(b, [1, 2, 0], 5) is None  # inside the context before the last answer


_tokens = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), _tokens, _tokens), min_size=1, max_size=7),
       st.sampled_from([0, 0, 2, 5]))
def test_any_sequence_of_calls_trains_each_generation_once_token_exact(plan, threshold):
    """Calls that extend an earlier call (``how`` 0), rewrite its end (1), or start from a prefix of one (2, 3): every
    generation trained in one row only, after exactly its own prompt."""
    calls, seen = [], []
    for how, cut, tail, gen in plan:
        if not seen or how >= 2:
            base = (seen[cut % len(seen)][:cut] if seen else [])
        elif how == 1:
            base = seen[cut % len(seen)][:-1 - cut % 3]
        else:
            base = seen[cut % len(seen)]
        prompt = base + tail + [6]  # a prompt is never empty
        calls.append(_call(prompt, gen))
        seen.append(prompt + gen)
    branches = grow_branches(calls, threshold)
    _check_each_generation_trained_once_where_it_was_generated(calls, branches, threshold)
    if threshold == 0:
        assert sum(b.realigned_tokens for b in branches) == 0
        assert sum(b.trained_tokens for b in branches) == sum(len(c.generation_token_ids) for c in calls)
