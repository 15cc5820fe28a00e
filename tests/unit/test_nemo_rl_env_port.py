"""An environment written for NeMo-RL ports unchanged (issue 20): its observations are tokenised as NeMo-RL's
rollout tokenises them (the raw content, no template) under the REAL Qwen2.5 tokenizer and template, they reach the
training batch and stay out of the loss; metadata None keeps the last; a data row's stop strings stop its first
turn; ``global_post_process_and_metrics`` gets NeMo-RL's batch; a role the template drops and a mix of reward
kinds stop the run with a message naming what to change. The environments: tests/helpers/nemo_rl_envs.py."""

from __future__ import annotations

import pytest
import torch

from grpo.config import ClippedPGLossConfig, EnvConfig
from grpo.loss import clipped_pg_loss
from grpo.batch import build_batch
from grpo.system.chat import ChatFormat, ChatFormatError
from grpo.system.generation.base import GenerationBackend, GenerationOutput
from grpo.system.rollout import RolloutError, TurnSettings, generate_rollout
from grpo.tasks.factory import build_environments
from grpo.tasks.function import EnvError
from grpo.tasks.router import Environments
from grpo.tasks.rows import PromptRow
from tests.helpers.nemo_rl_envs import DeclaredDictRewards, DictRewards, HintEnvironment

# What a NeMo-RL environment writes when it wants its observation to read as a user turn under Qwen's format:
# the turn's own markup and the next assistant header (NeMo-RL appends nothing).
QWEN_HINT = "<|im_start|>user\nThe answer is {answer}.<|im_end|>\n<|im_start|>assistant\n"
QWEN_AGAIN = "<|im_start|>user\nNo.<|im_end|>\n<|im_start|>assistant\n"


class ScriptedGenerator(GenerationBackend):
    """Turn k of every sample generates ``replies[k]`` then <|im_end|> (a stop); records each call's prompts and
    stop strings."""

    def __init__(self, tok, replies):
        self.tok, self.replies = tok, replies
        self.prompts, self.stops = [], []

    def generate(self, prompt_ids, seeds, *, greedy=False, max_new_tokens=None, stop_strings=None, sampling=None):
        turn = len(self.prompts)
        self.prompts.append([list(p) for p in prompt_ids])
        self.stops.append(list(stop_strings))
        text = self.replies[min(turn, len(self.replies) - 1)]
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [GenerationOutput(list(p), ids[:cap], [-0.5] * len(ids[:cap]), "stop", text)
                for p, cap in zip(prompt_ids, max_new_tokens)]

    def wake_up(self):
        pass

    def sleep(self):
        pass


def qwen_rows(chat, tasks=("hint",), **extra) -> list[PromptRow]:
    out = []
    for i, task in enumerate(tasks):
        messages = [{"role": "user", "content": f"What is {i}+7? Say the number."}]
        ids = chat.prompt_token_ids(messages)
        out.append(PromptRow(index=i, question=messages[0]["content"], answer=str(i + 7), task_name=task,
                             prompt_messages=[{**m, "token_ids": t} for m, t in zip(messages, ids)],
                             prompt_ids=[t for m in ids for t in m], extra=dict(extra)))
    return out


def rollout(envs, chat, tok, replies, rows, generations=2, max_turns=3, max_total_len=256):
    gen = ScriptedGenerator(tok, replies)
    r = generate_rollout(rows, generations, gen, envs, chat, TurnSettings(max_turns, max_total_len, chunk_size=64),
                         base_seed=0, step=1, gen_batch=0, stream="train", rank=0, world_size=1)
    return r, gen


def find(seq: list[int], sub: list[int]) -> list[int]:
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub]


# --------------------------------------------------------------------------------------------------
# Observations: NeMo-RL's raw content, under the real template, in the batch and out of the loss
# --------------------------------------------------------------------------------------------------
def test_a_nemo_rl_environment_trains_with_qwen25_and_its_observation_tokens_are_in_the_batch(qwen25):
    chat = ChatFormat(qwen25, "default")
    cfg = EnvConfig(name="class", env_class="tests.helpers.nemo_rl_envs:HintEnvironment",
                    kwargs={"hint": QWEN_HINT, "again": QWEN_AGAIN})
    envs = build_environments(cfg)
    assert envs.observation_format("class") == "raw"  # auto: NeMo-RL's way for a class environment
    rows = qwen_rows(chat, tasks=("class",))
    r, gen = rollout(envs, chat, qwen25, ["I think 5.", "Then 6.", "It is 7."], rows)
    t = r.trajectories[0]
    assert [m.role for m in t.messages] == ["user", "assistant", "environment", "assistant", "environment",
                                            "assistant"]
    assert t.reward == 1.0 and t.terminated and t.turns == 3

    # The observation's tokens are its content tokenised alone (NeMo-RL's rollouts.py), the specials included.
    hint = qwen25(QWEN_HINT.format(answer="7"), add_special_tokens=False)["input_ids"]
    assert hint[0] == 151644 and 151645 in hint  # <|im_start|> ... <|im_end|>: the environment's own markup
    assert t.messages[2].token_ids == hint and t.messages[4].token_ids == qwen25(QWEN_AGAIN, add_special_tokens=False)[
        "input_ids"]
    # The next turn is generated right after them: turn 2's prompt = turn 1's + generated + observation.
    generated = t.messages[1].token_ids
    assert generated[-1] == qwen25.eos_token_id
    assert gen.prompts[1][0] == gen.prompts[0][0] + generated + hint

    # In the training batch: at their place in the sample's input ids, and masked out of the loss.
    batch = build_batch(r.trajectories, qwen25.pad_token_id)
    ids = batch.input_ids_bt[0].tolist()
    start = len(t.messages[0].token_ids) + len(generated)
    assert find(ids, hint) == [start]
    assert batch.token_mask_bt[0, start:start + len(hint)].sum() == 0
    assert batch.token_mask_bt[0, start - len(generated):start].tolist() == [1.0] * len(generated)
    # The loss's gradient reaches the generated tokens and never the observation's.
    logprobs = torch.full(batch.input_ids_bt.shape, -0.5, requires_grad=True)
    advantages = torch.ones(batch.input_ids_bt.shape)
    loss, _ = clipped_pg_loss(logprobs, logprobs.detach(), advantages, batch.token_mask_bt, batch.sample_mask_b,
                              ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
    loss.backward()
    assert logprobs.grad[0, start:start + len(hint)].abs().sum() == 0
    assert (logprobs.grad[0, start - len(generated):start] != 0).all()

    # global_post_process_and_metrics got NeMo-RL's batch and its metrics are logged.
    assert r.metrics["env/class/success_rate"] == 1.0
    assert r.metrics["env/class/num_problems_in_batch"] == 2.0
    assert r.metrics["env/class/fraction_of_samples_properly_ended"] == 1.0


def test_metadata_none_keeps_the_last_per_sample():
    from grpo.tasks.toy import build_char_tokenizer

    tok = build_char_tokenizer()
    chat = ChatFormat(tok)
    env = HintEnvironment()
    envs = Environments({"hint": env}, 5, {"hint": "raw"})
    rows = [PromptRow(0, "3+4=", "7", "hint", [{"role": "user", "content": "3+4=", "token_ids": tok("3+4=")["input_ids"]}],
                      tok("3+4=")["input_ids"])]
    r, _ = rollout(envs, chat, tok, ["5", "6", "7"], rows, generations=1)
    assert env.seen[1] == [{"answer": "7", "hints_given": 1}]   # what turn 1 returned
    assert env.seen[2] == [{"answer": "7", "hints_given": 1}]   # turn 2 returned None: kept
    t = r.trajectories[0]
    assert t.reward == 1.0 and t.metadata == {"answer": "7", "hints_given": 1}  # the last turn returned None too
    # Raw observations, nothing added around them (plain text has no template anyway).
    assert tok.decode(t.token_ids(), skip_special_tokens=False) == "<bos>3+4=5<eos>=7 6<eos>again 7<eos>"


# --------------------------------------------------------------------------------------------------
# chat_template: a role the template drops is an error, not a silent loss
# --------------------------------------------------------------------------------------------------
def test_observation_format_chat_template_with_a_role_qwen25_drops_stops_the_run_naming_it(qwen25):
    chat = ChatFormat(qwen25, "default")
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert chat.observation_text(history, [{"role": "user", "content": "OBS"}], "<|im_end|>") == (
        "\n<|im_start|>user\nOBS<|im_end|>\n<|im_start|>assistant\n")
    # Qwen2.5's template writes nothing for role "environment": the observation would be gone without a word.
    assert "OBS" not in qwen25.apply_chat_template(history + [{"role": "environment", "content": "OBS"}],
                                                   tokenize=False, add_generation_prompt=True)
    with pytest.raises(ChatFormatError, match="renders nothing for a message of role 'environment'"):
        chat.observation_text(history, [{"role": "environment", "content": "OBS"}], "<|im_end|>")
    cfg = EnvConfig(name="class", env_class="tests.helpers.nemo_rl_envs:HintEnvironment",
                    observation_format="chat_template")
    envs = build_environments(cfg)
    assert envs.observation_format("class") == "chat_template"
    with pytest.raises(RolloutError) as err:
        rollout(envs, chat, qwen25, ["5"], qwen_rows(chat, tasks=("class",)))
    msg = str(err.value)
    assert "'environment'" in msg and "'class'" in msg and "HintEnvironment" in msg
    assert "observation_format: raw" in msg


# --------------------------------------------------------------------------------------------------
# Per-row stop strings
# --------------------------------------------------------------------------------------------------
def test_a_rows_stop_strings_stop_its_first_turn_then_the_environments_next_stop_strings(qwen25):
    chat = ChatFormat(qwen25, "default")
    env = HintEnvironment(hint=QWEN_HINT, again=QWEN_AGAIN, stop_strings=["</guess>"])
    envs = Environments({"hint": env}, 5, {"hint": "raw"})
    rows = qwen_rows(chat, tasks=("hint", "hint"))
    rows[0].extra["stop_strings"] = ["</answer>"]
    rows[1].meta["stop_strings"] = ["</final>"]  # a file row's column lands in meta
    r, gen = rollout(envs, chat, qwen25, ["5", "6", "7"], rows)
    assert gen.stops[0] == [["</answer>"]] * 2 + [["</final>"]] * 2
    assert gen.stops[1] == [["</guess>"]] * 4  # NeMo-RL: next_stop_strings replace them
    assert r.trajectories[0].stop_strings == ["</answer>"]
    bad = qwen_rows(chat, tasks=("hint",), stop_strings="</answer>")
    with pytest.raises(ValueError, match="stop_strings='</answer>': expected a list of strings"):
        rollout(envs, chat, qwen25, ["5"], bad)


# --------------------------------------------------------------------------------------------------
# Mixed reward kinds
# --------------------------------------------------------------------------------------------------
def test_dict_rewards_from_one_environment_and_scalar_from_another_stop_the_run_naming_both(qwen25):
    chat = ChatFormat(qwen25, "default")
    envs = Environments({"parts": DictRewards(), "hint": HintEnvironment(QWEN_HINT, QWEN_AGAIN)}, 5,
                        {"parts": "raw", "hint": "raw"})
    with pytest.raises(RolloutError) as err:
        rollout(envs, chat, qwen25, ["7"], qwen_rows(chat, tasks=("parts", "hint")))
    msg = str(err.value)
    assert "'parts' (DictRewards) returned dict rewards" in msg and "'hint' (HintEnvironment) returned scalar" in msg
    # One kind throughout is fine: components reach the trajectory and NeMo-RL's batch keys.
    envs = Environments({"parts": DictRewards()}, 5, {"parts": "raw"})
    r, _ = rollout(envs, chat, qwen25, ["7"], qwen_rows(chat, tasks=("parts",)))
    assert r.trajectories[0].reward_components == {"reward/correctness": 1.0, "reward/format": 0.0}


def test_mixed_reward_kinds_known_at_load_fail_at_load():
    cfg = EnvConfig(name="class", env_class="tests.helpers.nemo_rl_envs:DeclaredDictRewards",
                    tasks={"arithmetic": {"name": "arithmetic"}})
    with pytest.raises(EnvError, match=r"'class' \(DeclaredDictRewards\) gives dict rewards and environment "
                                       r"'arithmetic' \(RewardEnvironment\) gives scalar"):
        build_environments(cfg)
    assert isinstance(build_environments(cfg.model_copy(update={"tasks": {}})).envs["class"], DeclaredDictRewards)


# --------------------------------------------------------------------------------------------------
# NeMo-RL's batch for global_post_process_and_metrics, and grpo-ds's trajectories beside it
# --------------------------------------------------------------------------------------------------
def test_global_post_process_gets_nemo_rls_batch_keys_and_may_replace_trajectories():
    from grpo.tasks.toy import build_char_tokenizer

    tok = build_char_tokenizer()
    seen = {}

    class Keeps(HintEnvironment):
        def global_post_process_and_metrics(self, batch):
            seen.update(batch)
            batch["trajectories"] = [t.__class__(**{**t.__dict__, "reward": 5.0}) for t in batch["trajectories"]]
            return batch, {"n": torch.tensor(len(batch["idx"])), "table": "ignored"}

    envs = Environments({"hint": Keeps()}, 5, {"hint": "raw"})
    ids = tok("3+4=")["input_ids"]
    rows = [PromptRow(3, "3+4=", "7", "hint", [{"role": "user", "content": "3+4=", "token_ids": ids}], ids,
                      extra={"stop_strings": ["x"]})]
    r, _ = rollout(envs, ChatFormat(tok), tok, ["7"], rows, generations=2)
    assert {"message_log", "extra_env_info", "task_name", "idx", "stop_strings", "length", "batch_max_length",
            "loss_multiplier", "total_reward", "truncated", "rewards", "is_end", "prompt_lengths",
            "generation_lengths", "text", "trajectories"} <= set(seen)
    assert seen["idx"] == [3, 3] and seen["task_name"] == ["hint", "hint"] and seen["stop_strings"] == [["x"], ["x"]]
    assert seen["total_reward"].tolist() == [1.0, 1.0] and seen["is_end"].tolist() == [True, True]
    assert seen["length"].tolist() == [len(ids)] * 2 and seen["text"][0].tolist() == ids
    log = seen["message_log"][0]
    assert [m["role"] for m in log] == ["user", "assistant"] and log[0]["token_ids"].tolist() == ids
    assert log[1]["generation_logprobs"].tolist() == [-0.5, -0.5]
    assert seen["generation_lengths"].tolist() == [len(ids) + 2] * 2
    assert [t.reward for t in r.trajectories] == [5.0, 5.0]  # the returned trajectories replace the samples'
    assert r.metrics == {"env/hint/n": 2.0}
