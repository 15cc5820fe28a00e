"""grpo.rewards: scaling, DAPO overlong shaping, stop-properly penalty, reward-penalty detectors."""

import pytest
import torch

from grpo.config import RewardPenaltyConfig, RewardPenaltyTokenIdsConfig, RewardScalingConfig, RewardShapingConfig
from grpo.rewards import (
    Turn,
    apply_reward_penalties,
    final_answer,
    has_duplicated_reasoning,
    has_empty_final_answer,
    has_malformed_think_tags,
    has_malformed_think_token_ids,
    has_repeated_lines,
    has_unwanted_tokens,
    scale_rewards,
    shape_overlong_rewards,
    split_turn,
)

T = ("<think>", "</think>")


def one_turn(*texts_and_ids) -> list[list[Turn]]:
    """Single-turn samples: ``one_turn("text", ("text", [ids]), ...)``."""
    return [[Turn(*x) if isinstance(x, tuple) else Turn(x)] for x in texts_and_ids]


# ----------------------------------------------------------------------------------------------
# scale_rewards
# ----------------------------------------------------------------------------------------------
def test_scale_rewards_by_hand():
    cfg = RewardScalingConfig(enabled=True, source_min=0.0, source_max=2.0, target_min=-1.0, target_max=1.0)
    torch.testing.assert_close(scale_rewards(torch.tensor([-5.0, 0.0, 0.5, 2.0, 9.0]), cfg),
                               torch.tensor([-1.0, -1.0, -0.5, 1.0, 1.0]))


def test_scale_rewards_disabled_is_identity():
    r = torch.tensor([-5.0, 3.0])
    assert scale_rewards(r, RewardScalingConfig(enabled=False, target_max=10.0)) is r


# ----------------------------------------------------------------------------------------------
# shape_overlong_rewards
# ----------------------------------------------------------------------------------------------
def test_overlong_buffer_by_hand():
    # L_max 100, L_buf 20, P 1: free up to 80 tokens, -0.5 at 90, -1 at 100, -1.5 at 110 (no cap, as NeMo-RL)
    cfg = RewardShapingConfig(enabled=True, overlong_buffer_length=20, overlong_buffer_penalty=1.0,
                              max_response_length=100)
    out = shape_overlong_rewards(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]), [10, 80, 90, 100, 110], None, cfg)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.5, -1.0, -0.5]))


def test_overlong_penalty_scale():
    cfg = RewardShapingConfig(enabled=True, overlong_buffer_length=10, overlong_buffer_penalty=0.5,
                              max_response_length=50)
    out = shape_overlong_rewards(torch.tensor([0.0]), torch.tensor([45]), None, cfg)
    torch.testing.assert_close(out, torch.tensor([-0.25]))


def test_stop_properly_penalty():
    cfg = RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.25)
    out = shape_overlong_rewards(torch.tensor([1.0, 1.0, -2.0]), [5, 5, 5], torch.tensor([True, False, True]), cfg)
    torch.testing.assert_close(out, torch.tensor([0.25, 1.0, -0.5]))
    with pytest.raises(ValueError, match="truncated"):
        shape_overlong_rewards(torch.tensor([1.0]), [5], None, cfg)


def test_stop_properly_and_overlong_buffer_together_are_rejected_at_load():
    # NeMo-RL silently lets the coefficient replace the buffer; we refuse the ambiguous config.
    with pytest.raises(ValueError, match="not both"):
        RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.0, overlong_buffer_length=10,
                            overlong_buffer_penalty=1.0, max_response_length=20)


def test_shaping_disabled_is_identity():
    r = torch.tensor([1.0])
    assert shape_overlong_rewards(r, [10_000], [True], RewardShapingConfig()) is r


# ----------------------------------------------------------------------------------------------
# Detectors
# ----------------------------------------------------------------------------------------------
def test_repeated_lines():
    line = "Let me compute the sum again."
    assert has_repeated_lines(f"{line} {line} {line}", min_chars=20, min_repeats=3)
    assert has_repeated_lines(f"{line}\n\n{line}\n  {line}  \nDone.", min_chars=20, min_repeats=3)
    assert not has_repeated_lines(f"{line} {line}", min_chars=20, min_repeats=3)
    assert not has_repeated_lines("ok. ok. ok. ok.", min_chars=20, min_repeats=3)  # too short to count
    assert not has_repeated_lines("First step one.\nSecond step two.\nThird step three.", 5, 2)


@pytest.mark.parametrize(
    "text, starts_in_think, reasoning, content",
    [
        ("<think>a</think> 4", False, "a", " 4"),
        ("a</think>4", True, "a", "4"),  # the open tag was in the prompt
        ("<think>a</think>", False, "a", None),  # nothing after the block: no content item
        ("<think>a</think>\n\n", False, "a", "\n\n"),  # whitespace is content (blank)
        ("<think>never closed", False, "never closed", None),
        ("never closed", True, "never closed", None),
        ("4", False, None, "4"),
        ("", False, None, None),
        ("<think>a</think>b</think>c", False, "a", "b</think>c"),  # content: after the first close tag
    ],
)
def test_split_turn_like_a_reasoning_parser(text, starts_in_think, reasoning, content):
    assert split_turn(text, *T, starts_in_think) == (reasoning, content)


# NeMo-RL's cases (tests/unit/experience/test_reward_penalties.py, TestPenalizeDuplicatedReasoning), a reasoning
# item followed by a message item being one turn here.
@pytest.mark.parametrize(
    "turns, duplicated",
    [
        (["<think>The answer is 42</think>The answer is 42"], True),  # test_exact_match_penalized
        (["<think>Let me think about this</think>The answer is 42"], False),  # test_different_text_not_penalized
        (["<think>  hello world  </think>hello world"], True),  # test_whitespace_stripped_before_compare
        (["<think></think>"], False),  # test_empty_reasoning_not_penalized
        (["<think>  </think>   "], False),  # blank on both sides
        (["The answer is 42"], False),  # test_no_reasoning_item_not_penalized
        (["<think>I need to call a tool</think>"], False),  # reasoning only (NeMo-RL: then a function_call)
        # test_multi_turn_first_pair_matches: any turn
        (["<think>duplicated</think>duplicated", "<think>different thinking</think>final answer"], True),
        (["<think>a</think>b", "<think>c</think> c "], True),
        (["<think>The answer is 42", "The answer is 42"], False),  # never closed: no content in that turn
    ],
)
def test_duplicated_reasoning_is_reasoning_equal_to_the_answer(turns, duplicated):
    assert has_duplicated_reasoning([Turn(t) for t in turns], *T) is duplicated


def test_duplicated_reasoning_after_a_template_opened_block():
    assert has_duplicated_reasoning([Turn("It is 4.\n</think>\n\nIt is 4.", starts_in_think=True)], *T)
    assert not has_duplicated_reasoning([Turn("It is 2+2.\n</think>\n\nIt is 4.", starts_in_think=True)], *T)


@pytest.mark.parametrize(
    "text, starts_in_think, malformed",
    [
        ("plain answer", False, False),
        ("<think>reason</think> answer", False, False),
        ("<think>a</think><think>b</think> x", False, True),  # two pairs
        ("<think>a<think>b</think></think>", False, True),  # nested
        ("</think> x <think>", False, True),  # close before open
        ("<think> never closed", False, True),
        ("only close </think> x", False, True),
        ("reasoning</think> answer", True, False),  # the open tag was in the prompt
        ("<think>again</think> answer", True, True),
        ("no close at all", True, True),
    ],
)
def test_malformed_think_tags(text, starts_in_think, malformed):
    assert has_malformed_think_tags(text, "<think>", "</think>", starts_in_think) is malformed


def test_malformed_think_token_ids():
    assert not has_malformed_think_token_ids([5, 12, 7, 13, 9], 12, 13)
    assert has_malformed_think_token_ids([12, 13, 12, 13], 12, 13)
    assert not has_malformed_think_token_ids([7, 13, 9], 12, 13, starts_in_think=True)


@pytest.mark.parametrize(
    "text, starts_in_think, empty",
    [
        ("", False, True),
        ("   \n", False, True),
        ("42", False, False),
        ("<think>hmm</think>\n  ", False, True),
        ("<think>hmm</think> 42", False, False),
        ("<think>still thinking", False, True),
        ("thinking</think>", True, True),
        ("thinking</think> 7", True, False),
        ("thinking with no close", True, True),
    ],
)
def test_empty_final_answer(text, starts_in_think, empty):
    assert has_empty_final_answer([Turn(text, (), starts_in_think)], *T) is empty


# NeMo-RL's cases (TestPenalizeEmptyFinalAnswer): the final answer is the last content, walking back over
# turns that produced none.
@pytest.mark.parametrize(
    "turns, answer",
    [
        (["<think>thinking</think>"], None),  # no content at all
        (["<think>thinking</think>   "], ""),  # test_whitespace_only_penalized
        (["<think>thinking</think>The answer is 42"], "The answer is 42"),
        (["<think>a</think>answer", "<think>b</think>"], "answer"),  # test_message_before_tool_call_uses_last_message
        (["<think>a</think>answer", "<think>b</think>\n"], ""),  # the last content is blank
        (["<think>a</think>answer", "<think>cut off while thinking"], "answer"),
        ([], None),  # test_empty_output_items_penalized
    ],
)
def test_final_answer_is_the_last_content(turns, answer):
    turns = [Turn(t) for t in turns]
    assert final_answer(turns, *T) == answer
    assert has_empty_final_answer(turns, *T) is (not answer)


def test_unwanted_tokens():
    assert has_unwanted_tokens([1, 2, 3], [3, 99])
    assert has_unwanted_tokens(torch.tensor([1, 99]), [3, 99])
    assert not has_unwanted_tokens([1, 2], [3])


# ----------------------------------------------------------------------------------------------
# apply_reward_penalties
# ----------------------------------------------------------------------------------------------
def test_apply_reward_penalties_zeroes_and_flags():
    cfg = RewardPenaltyConfig(
        penalize_duplicated_reasoning=True, penalize_empty_final_answer=True, penalize_unwanted_tokens=True,
        penalize_malformed_think_tag=True, penalize_repeated_lines=True, repeated_line_min_chars=10,
        repeated_line_min_repeats=2, token_ids=RewardPenaltyTokenIdsConfig(unwanted=[666]),
    )
    turns = one_turn(
        ("<think>fine</think> 4", [1, 2]),  # clean
        ("<think>x</think>", [1]),  # empty answer
        ("<think>a</think><think>b</think> 4", [1]),  # malformed (in one turn)
        ("<think>I should check.\nI should check.</think> 4", [1]),  # repeated lines
        ("<think>fine</think> 4", [1, 666]),  # unwanted id
        ("<think>It is 4</think>It is 4", [1]),  # reasoning equal to the answer
    )
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.5, 2.0, 1.0])
    out, flags, metrics = apply_reward_penalties(rewards, turns, cfg)
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert flags["empty_final_answer"].tolist() == [False, True, False, False, False, False]
    assert flags["malformed_think_tag"].tolist() == [False, False, True, False, False, False]
    assert flags["repeated_lines"].tolist() == [False, False, False, True, False, False]
    assert flags["unwanted_tokens"].tolist() == [False, False, False, False, True, False]
    assert flags["duplicated_reasoning"].tolist() == [False, False, False, False, False, True]
    # each enabled detector's rate under NeMo-RL's metric name (rollouts.py, _PENALTY_METRICS)
    assert metrics == pytest.approx({
        "reasoning_equal_to_final_answer_rate": 1 / 6, "empty_final_answer_rate": 1 / 6, "unwanted_token_rate": 1 / 6,
        "malformed_think_tag_rate": 1 / 6, "repeated_lines_rate": 1 / 6, "reward_penalty_rate": 5 / 6})
    assert torch.equal(rewards, torch.tensor([1.0, 1.0, 1.0, 0.5, 2.0, 1.0]))  # input untouched


def test_apply_reward_penalties_only_enabled_detectors():
    cfg = RewardPenaltyConfig(penalize_empty_final_answer=True)
    out, flags, metrics = apply_reward_penalties(torch.tensor([1.0, 1.0]), one_turn("<think>a</think><think>", ""),
                                                 cfg)
    assert set(flags) == {"empty_final_answer"} and set(metrics) == {"empty_final_answer_rate", "reward_penalty_rate"}
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0]))  # the first is malformed, but that detector is off
    assert apply_reward_penalties(torch.tensor([1.0]), one_turn(""), RewardPenaltyConfig())[2] == {}


def test_think_tags_are_checked_per_turn():
    """Issue 20: thinking once in each of two turns is well formed (it was malformed on the turns joined)."""
    cfg = RewardPenaltyConfig(penalize_malformed_think_tag=True)
    samples = [
        [Turn("<think>a</think>x"), Turn("<think>b</think>y")],  # well formed, twice
        [Turn("<think>a</think>x"), Turn("<think>b</think>y</think>")],  # the second turn closes twice
        [Turn("<think>a</think>x<think>b</think>y")],  # two blocks in one turn
        [Turn("a</think>x", starts_in_think=True), Turn("b</think>y", starts_in_think=True)],  # template-opened
        [Turn("a</think>x", starts_in_think=True), Turn("b</think>y")],  # the second turn's prompt opened nothing
    ]
    out, flags, _ = apply_reward_penalties(torch.ones(5), samples, cfg)
    assert flags["malformed_think_tag"].tolist() == [False, True, True, False, True]
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0]))


def test_unwanted_tokens_in_any_turn():
    """NeMo-RL's cases (TestPenalizeUnwantedTokens): anywhere in a generated message, the last token included."""
    cfg = RewardPenaltyConfig(penalize_unwanted_tokens=True, token_ids=RewardPenaltyTokenIdsConfig(unwanted=[2, 99]))
    samples = [[Turn("a", [300, 2, 400])], [Turn("a", [300, 400, 2])], [Turn("a", [300, 400])],
               [Turn("a", [300]), Turn("b", [99])]]
    out, flags, _ = apply_reward_penalties(torch.ones(4), samples, cfg)
    assert flags["unwanted_tokens"].tolist() == [True, True, False, True]


def test_apply_reward_penalties_think_token_ids():
    cfg = RewardPenaltyConfig(penalize_malformed_think_tag=True,
                              token_ids=RewardPenaltyTokenIdsConfig(think_open=12, think_close=13))
    # Text is fine but the ids show two think blocks (e.g. tags decoded away as special tokens).
    out, flags, _ = apply_reward_penalties(torch.tensor([1.0, 1.0]), one_turn(("answer", [12, 5, 13, 12, 13]),
                                                                              ("answer", [12, 5, 13])), cfg)
    assert flags["malformed_think_tag"].tolist() == [True, False]
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0]))
    # per turn on ids too: one block in each of two turns is fine
    out, _, _ = apply_reward_penalties(torch.tensor([1.0]), [[Turn("x", [12, 5, 13]), Turn("y", [12, 6, 13])]], cfg)
    assert out.tolist() == [1.0]
    out2, _, _ = apply_reward_penalties(torch.tensor([1.0]), one_turn(("x", [5, 13])), RewardPenaltyConfig(
        penalize_malformed_think_tag=True), tokenizer_think_ids=(12, 13))
    torch.testing.assert_close(out2, torch.tensor([0.0]))


def test_think_ids_come_from_a_tokenizer_with_one_token_per_tag_and_configured_ids_win():
    """NeMo-RL's resolve_reward_penalty_config: ids inferred only when each tag is one token; explicit ids win."""
    from grpo.rewards import malformed_thinking_flags, single_token_think_ids

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def encode(self, text, add_special_tokens=False):
            assert not add_special_tokens
            return self.vocab[text]

    assert single_token_think_ids(Tok({"<think>": [12], "</think>": [13]}), *T) == (12, 13)
    assert single_token_think_ids(Tok({"<think>": [12, 98], "</think>": [13]}), *T) is None
    turn = [Turn("x", [50, 5, 51, 50, 51])]  # two blocks in ids 50/51
    cfg = RewardPenaltyConfig(token_ids=RewardPenaltyTokenIdsConfig(think_open=50, think_close=51))
    assert malformed_thinking_flags(turn, cfg, tokenizer_think_ids=(12, 13)).tolist() == [True]
    assert malformed_thinking_flags(turn, RewardPenaltyConfig(), tokenizer_think_ids=(12, 13)).tolist() == [False]


def test_apply_reward_penalties_length_mismatch():
    with pytest.raises(ValueError, match="turns of 1 samples"):
        apply_reward_penalties(torch.tensor([1.0, 1.0]), one_turn("a"), RewardPenaltyConfig())


# ----------------------------------------------------------------------------------------------
# Chat templates that open the thinking block in the prompt
# ----------------------------------------------------------------------------------------------
QWEN3_PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                "<|im_end|>\n<|im_start|>assistant\n<think>\n")  # a Qwen3 thinking template's generation prompt


def test_prompt_starts_in_think():
    from grpo.rewards import prompt_starts_in_think

    assert prompt_starts_in_think(QWEN3_PROMPT, "<think>", "</think>")
    # thinking off: the template writes an empty, closed block
    assert not prompt_starts_in_think(QWEN3_PROMPT + "\n</think>\n\n", "<think>", "</think>")
    assert not prompt_starts_in_think("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<think>", "</think>")
    # an earlier turn's closed block, then this turn's open tag
    multi = ("<|im_start|>assistant\n<think>a</think>4<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n"
             "<|im_start|>assistant\n<think>\n")
    assert prompt_starts_in_think(multi, "<think>", "</think>")
    assert not prompt_starts_in_think(multi[: multi.rindex("<think>")], "<think>", "</think>")


def test_correct_answers_after_a_template_opened_think_block_are_not_penalised():
    from grpo.rewards import prompt_starts_in_think

    cfg = RewardPenaltyConfig(penalize_malformed_think_tag=True, penalize_empty_final_answer=True)
    prompts = [QWEN3_PROMPT, QWEN3_PROMPT, "<|im_start|>assistant\n"]
    texts = ["2 plus 2 is 4.\n</think>\n\nThe answer is 4.",  # well formed: the open tag was in the prompt
             "2 plus 2 is 4, and I never close",  # no answer after the block
             "<think>2 plus 2</think>\n\n4"]  # a template that does not open the block
    starts_b = [prompt_starts_in_think(p, cfg.think_open_tag, cfg.think_close_tag) for p in prompts]
    assert starts_b == [True, True, False]
    turns = [[Turn(text, (), start)] for text, start in zip(texts, starts_b)]
    out, flags, _ = apply_reward_penalties(torch.ones(3), turns, cfg)
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, 1.0]))
    assert flags["malformed_think_tag"].tolist() == [False, True, False]
    assert flags["empty_final_answer"].tolist() == [False, True, False]
    # without the per-turn flags the first correct answer would be zeroed as malformed
    out_blind, _, _ = apply_reward_penalties(torch.ones(3), one_turn(*texts), cfg)
    assert out_blind[0] == 0.0


def test_malformed_thinking_flags_stand_alone():
    """For grpo.malformed_thinking_advantage without reward_penalties.penalize_malformed_think_tag: the flags
    only, from the text and (when known) the think token ids, with no reward changed."""
    from grpo.rewards import malformed_thinking_flags

    cfg = RewardPenaltyConfig()  # no penalty switched on
    texts = ["why</think> 4", "why</think> 4", "<think>a</think><think>b</think> 4", "4"]
    ids = [[5, 13, 9], [5, 13, 9], [12, 5, 13, 12, 13], [9]]
    flags = malformed_thinking_flags([Turn(*x) for x in zip(texts, ids, [True, False, False, False])], cfg)
    assert flags.dtype == torch.bool and flags.tolist() == [False, True, True, False]
    # token ids catch tags the text does not show (decoded away as special tokens)
    flags = malformed_thinking_flags([Turn("4", [12, 5, 13, 12, 13]), Turn("why</think> 4", [5, 13, 9], True)], cfg,
                                     tokenizer_think_ids=(12, 13))
    assert flags.tolist() == [True, False]
    assert malformed_thinking_flags([Turn("4", [9])], cfg).tolist() == [False]  # default: no block opened


# ----------------------------------------------------------------------------------------------
# GDPO's components: penalties, scaling, shaping (the scalar reward's steps)
# ----------------------------------------------------------------------------------------------
def test_penalize_and_scale_components():
    from grpo.rewards import penalize_components

    comps = torch.tensor([[1.0, 0.5], [1.0, 2.0], [0.0, -1.0]])
    flags = {"empty_final_answer": torch.tensor([False, True, False]),
             "unwanted_tokens": torch.tensor([False, False, False])}
    torch.testing.assert_close(penalize_components(comps, flags),
                               torch.tensor([[1.0, 0.5], [0.0, 0.0], [0.0, -1.0]]))
    assert torch.equal(penalize_components(comps, {}), comps)
    cfg = RewardScalingConfig(enabled=True, source_min=0.0, source_max=1.0, target_min=0.0, target_max=10.0)
    torch.testing.assert_close(scale_rewards(comps, cfg), torch.tensor([[10.0, 5.0], [10.0, 10.0], [0.0, 0.0]]))


def test_shape_overlong_components():
    from grpo.rewards import shape_overlong_components

    comps = torch.tensor([[1.0, 0.5], [0.0, 0.5], [1.0, 0.0]])
    cfg = RewardShapingConfig(enabled=True, overlong_buffer_length=20, overlong_buffer_penalty=1.0,
                              max_response_length=100)
    out = shape_overlong_components(comps, [10, 90, 100], None, cfg)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.5, 0.0], [0.0, 0.5, -0.5], [1.0, 0.0, -1.0]]))
    # the sum over components is the shaped scalar reward
    torch.testing.assert_close(out.sum(1), shape_overlong_rewards(comps.sum(1), [10, 90, 100], None, cfg))
    stop = RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.0)
    torch.testing.assert_close(shape_overlong_components(comps, [5] * 3, [False, True, False], stop),
                               torch.tensor([[1.0, 0.5], [0.0, 0.0], [1.0, 0.0]]))
    assert shape_overlong_components(comps, [5] * 3, None, RewardShapingConfig()) is comps
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        shape_overlong_components(torch.ones(3), [5] * 3, None, cfg)
