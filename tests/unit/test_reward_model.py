"""The reward model as an environment (grpo.wings.reward_model: environment, scorer): NeMo-RL's rendering with
the reward model's own template, scores equal to AutoModelForSequenceClassification's logits on the same text for
batch sizes 1 and 4 and padding on either side, batching, max_model_len, NeMo-RL's metrics; a checkpoint that is no
reward model (a causal LM, another head) and a path that is not there refused by name."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from grpo.config import RewardModelConfig
from tests.helpers.e2e import REPO, child_env

pytest.importorskip("tiktoken")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue, the colour of a clear sky at noon in summer."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "and again"}, {"role": "assistant", "content": "hello again, friend"}],
    [{"role": "user", "content": "Write a number."}, {"role": "assistant", "content": "<think>ok</think>42"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from tests.helpers.reward_models import save_tiny_reward_model

    return save_tiny_reward_model(str(tmp_path_factory.mktemp("rm")))


@pytest.fixture(scope="module")
def hf_model(rm_dir):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def scorers(rm_dir):
    from grpo.wings.reward_model.scorer import RewardModelScorer

    return {side: RewardModelScorer(RewardModelConfig(model_name=rm_dir, precision="float32"), torch.device("cpu"),
                                    side) for side in ("right", "left")}


class Counting:
    """A scorer that records the conversations of each call."""

    def __init__(self, inner):
        self.inner, self.tokenizer, self.calls = inner, inner.tokenizer, []

    def score(self, ids):
        self.calls.append([len(x) for x in ids])
        return self.inner.score(ids)


def test_rendering_is_the_reward_model_s_template_with_its_end_token(rm_dir):
    from grpo.wings.reward_model.environment import render_conversation
    from tests.helpers.qwen_tokenizer import qwen25_tokenizer

    tok = qwen25_tokenizer()
    for conv in CONVERSATIONS:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
        assert text.rstrip("\n").endswith("<|im_end|>")  # Qwen's template ends the turn itself: no EOS added
        assert render_conversation(tok, conv) == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(render_conversation(tok, CONVERSATIONS[0])).startswith("<|im_start|>system\nYou are Qwen")


def test_rendering_adds_bos_and_eos_where_the_template_does_not(rm_dir):
    from grpo.wings.reward_model.environment import render_conversation
    from tests.helpers.qwen_tokenizer import qwen25_tokenizer

    import copy

    tok = copy.deepcopy(qwen25_tokenizer())  # a copy to change
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok.bos_token = "<|endoftext|>"
    ids = render_conversation(tok, CONVERSATIONS[0])
    assert tok.decode(ids) == "<|endoftext|>user: What is 3+4?\nassistant: 7\n<|im_end|>"  # NeMo-RL's BOS and EOS


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_scores_equal_the_classifier_s_logits_on_the_same_text(scorers, hf_model, side, batch_size):
    from grpo.wings.reward_model.environment import RewardModelEnvironment, render_conversation

    s = scorers[side]
    env = RewardModelEnvironment(s, batch_size=batch_size)
    got = env.step([list(c) for c in CONVERSATIONS], [{}] * len(CONVERSATIONS)).rewards
    with torch.no_grad():
        want = torch.tensor([float(hf_model(input_ids=torch.tensor([render_conversation(s.tokenizer, c)])).logits[0, 0])
                             for c in CONVERSATIONS])
    assert want.std() > 0.01  # the texts score differently: the comparison is not of constants
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_scoring_runs_in_batches_of_batch_size(scorers):
    from grpo.wings.reward_model.environment import RewardModelEnvironment

    s = Counting(scorers["right"])
    ret = RewardModelEnvironment(s, batch_size=2).step(CONVERSATIONS, [{"answer": "a"}] * 5)
    assert [len(c) for c in s.calls] == [2, 2, 1]
    assert ret.terminateds.all() and ret.failures == [None] * 5 and ret.metadata == [None] * 5
    assert ret.observations[0]["content"] == f"Environment: {float(ret.rewards[0])}"


def test_a_conversation_over_max_model_len_fails_and_is_not_scored(scorers):
    from grpo.wings.reward_model.environment import RewardModelEnvironment, render_conversation

    s = Counting(scorers["right"])
    lengths = [len(render_conversation(s.tokenizer, c)) for c in CONVERSATIONS]
    limit = sorted(lengths)[2]
    ret = RewardModelEnvironment(s, batch_size=4, max_model_len=limit).step(CONVERSATIONS, [{}] * 5)
    failed = [f is not None for f in ret.failures]
    assert failed == [n > limit for n in lengths] and any(failed)
    assert {f.reason for f in ret.failures if f} == {"env_malformed"} and max(n for c in s.calls for n in c) <= limit


def test_metrics_are_nemo_rl_s_over_the_samples_that_did_not_fail():
    from grpo.wings.reward_model.environment import RewardModelEnvironment
    from grpo.trajectory import Failure, Message, Trajectory

    ts = [Trajectory(0, i, "reward_model", "q", "", [Message("user", "q", [1]), Message("assistant", "a", [2], [0.0])],
                     {}, reward=r, num_prompt_messages=1) for i, r in enumerate([1.0, 3.0, 0.0])]
    ts[2].fail(Failure.of("env_malformed"))
    from grpo.tasks.router import rollout_batch

    _, m = RewardModelEnvironment(None, 1).global_post_process_and_metrics(rollout_batch(ts))
    assert m == {"reward_model_env/num_samples": 2.0, "reward_model_env/mean_reward": 2.0,
                 "reward_model_env/std_reward": pytest.approx(2 ** 0.5), "reward_model_env/min_reward": 1.0,
                 "reward_model_env/max_reward": 3.0}



@pytest.mark.parametrize("split", [[3, 3], [1, 5], [2, 4], [0, 6]])
def test_metrics_of_a_rollout_over_ranks_equal_one_process_s(split):
    """Each rank computes ``reward_model_env/*`` on its share; merged over ranks (`merge_rank_metrics`) they equal
    the metrics of the whole batch in one process (were averages of per-rank values, e.g. num_samples halved)."""
    from grpo.system.rollout import merge_rank_metrics
    from grpo.wings.reward_model.environment import RewardModelEnvironment
    from grpo.tasks.router import rollout_batch
    from grpo.trajectory import Message, Trajectory

    rewards = [0.5, -1.0, 2.0, 3.0, 0.25, 1.0]
    ts = [Trajectory(0, i, "reward_model", "q", "", [Message("user", "q", [1]), Message("assistant", "a", [2], [0.0])],
                     {}, reward=r, num_prompt_messages=1) for i, r in enumerate(rewards)]
    env = RewardModelEnvironment(None, 1)
    whole = env.global_post_process_and_metrics(rollout_batch(ts))[1]
    shares = [ts[:split[0]], ts[split[0]:]]
    merged = merge_rank_metrics([env.global_post_process_and_metrics(rollout_batch(s))[1] for s in shares])
    assert merged == {k: pytest.approx(v) for k, v in whole.items()}

def test_the_config_section_is_nemo_rl_s():
    from pydantic import ValidationError

    from grpo.config import EnvSpec

    spec = EnvSpec.model_validate({"name": "reward_model", "reward_model": {
        "model_name": "m", "tokenizer": {"name": "t"}, "precision": "bfloat16", "batch_size": 4, "max_model_len": 2048,
        "checkpoint_path": None, "reward_model_cfg": {"enabled": True, "reward_model_type": "bradley_terry"}}})
    assert spec.reward_model.tokenizer.name == "t"
    with pytest.raises(ValidationError, match="reward_model_cfg.enabled=False"):
        RewardModelConfig(model_name="m", reward_model_cfg={"enabled": False})
    with pytest.raises(ValidationError, match="reward_model_type"):
        RewardModelConfig(model_name="m", reward_model_cfg={"reward_model_type": "regression"})
    with pytest.raises(ValidationError, match="needs an env.reward_model section"):
        EnvSpec(name="reward_model")


def test_a_toy_reward_model_name_is_checked_at_load():
    """``toy:demo_rm`` (the reward-model demo's, built locally) is a reward model name; a toy name that is not built
    fails at load, naming the key."""
    from pydantic import ValidationError

    assert RewardModelConfig(model_name="toy:demo_rm").model_name == "toy:demo_rm"
    with pytest.raises(ValidationError, match=r"env.reward_model.model_name='toy:nope': no such toy model"):
        RewardModelConfig(model_name="toy:nope")


def test_the_reward_model_demo_config_loads():
    from grpo.config.load import load_config

    cfg = load_config("configs/cpu_demo_reward_model.yaml", [])
    assert cfg.env.name == "reward_model" and cfg.env.reward_model.model_name == "toy:demo_rm"
    assert cfg.policy.model_name == "toy:demo"


# ---- what is no reward model, refused by name (issue 43, items 6 and 18) ------------------------------------------
@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    from tests.helpers.reward_models import save_tiny_qwen2_lm

    return save_tiny_qwen2_lm(str(tmp_path_factory.mktemp("lm")))


def test_a_causal_lm_is_refused_as_a_reward_model_by_its_key(lm_dir, rm_dir):
    """A causal LM loads as ForSequenceClassification with its score head initialised at random (the only sign was
    transformers' load report) and the run trained on noise. transformers' own loading info says the head was not
    in the checkpoint: refused, naming the key that gave the weights."""
    from grpo.wings.reward_model.scorer import RewardModelScorer
    from grpo.tasks.function import EnvError

    with pytest.raises(EnvError) as err:
        RewardModelScorer(RewardModelConfig(model_name=lm_dir, precision="float32"), torch.device("cpu"))
    assert str(err.value).startswith(f"env.reward_model.model_name={lm_dir!r}: a Qwen2ForCausalLM checkpoint, not a "
                                     "reward model: score.weight is not in it (transformers initialised it at random")
    with pytest.raises(EnvError, match=rf"^env.reward_model.checkpoint_path='{lm_dir}': a Qwen2ForCausalLM checkpoint"):
        RewardModelScorer(RewardModelConfig(model_name=rm_dir, checkpoint_path=lm_dir, precision="float32"),
                          torch.device("cpu"))


def test_a_classifier_with_another_number_of_outputs_is_refused_not_a_traceback(tmp_path):
    """A two-label classifier's head does not fit the one output of a Bradley-Terry model: transformers raised its
    RuntimeError (a traceback); now the same refusal, with the shapes."""
    from transformers import Qwen2ForSequenceClassification

    from grpo.wings.reward_model.scorer import RewardModelScorer
    from grpo.tasks.function import EnvError
    from tests.helpers.reward_models import _tiny_qwen2_config

    tok, config = _tiny_qwen2_config(num_labels=2)
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(EnvError, match=r"score.weight is \[2, 64\] in it, \[1, 64\] here \(transformers initialised"):
        RewardModelScorer(RewardModelConfig(model_name=str(tmp_path), precision="float32"), torch.device("cpu"))


@pytest.mark.parametrize("override, message", [
    ("env.reward_model.model_name=/no/such/rm", "env.reward_model.model_name='/no/such/rm': no such directory"),
    ("env.reward_model.checkpoint_path=./no/such/dir", "env.reward_model.checkpoint_path='./no/such/dir': no such"),
    ("env.reward_model.tokenizer.name=README.md", "env.reward_model.tokenizer.name='README.md': a file, not a dir"),
    ("env.tasks={rm: {name: reward_model, reward_model: {model_name: ~/rm}}}",
     "env.tasks.rm.reward_model.model_name='~/rm': no such directory"),
])
def test_a_missing_reward_model_path_fails_the_config_check_in_one_line(override, message):
    """It passed --check-config and failed at load with four tracebacks and Hugging Face's repo-id message, which
    names no key. A name that is not there and cannot be a hub name is a local path that does not exist: refused at
    config load (so --check-config), naming the key and the path; a hub name still passes (checked when it loads)."""
    cmd = [sys.executable, "train_grpo.py", "--config", "configs/cpu_demo_reward_model.yaml", "--check-config"]
    p = subprocess.run([*cmd, override], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[1].strip().startswith(message), p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 2  # "error: invalid config:" + it
    ok = subprocess.run([*cmd, "env.reward_model.model_name=some-org/some-rm"], cwd=REPO, env=child_env(),
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_a_name_that_cannot_load_is_one_line_naming_its_key(tmp_path):
    """Offline (HF_HUB_OFFLINE=1, as the tests run) a hub name not in the cache cannot load, nor can a directory that
    holds no model: one line naming the key and the name, shown by the scripts without a traceback
    (`grpo.run.run.known_error_message`)."""
    from grpo.run.run import known_error_message
    from grpo.wings.reward_model.scorer import RewardModelScorer
    from grpo.tasks.function import EnvError

    with pytest.raises(EnvError) as err:
        RewardModelScorer(RewardModelConfig(model_name="some-org/no-such-rm"), torch.device("cpu"))
    assert str(err.value) == ("env.reward_model.model_name='some-org/no-such-rm': not a local directory, and it cannot "
                              "be loaded as a hub name: not in the Hugging Face cache, and HF_HUB_OFFLINE=1 downloads "
                              "nothing")
    assert known_error_message(err.value) == f"error: {err.value}"
    with pytest.raises(EnvError, match=rf"^env.reward_model.model_name='{tmp_path}': a directory transformers cannot "
                                       "load from: Unrecognized model"):
        RewardModelScorer(RewardModelConfig(model_name=str(tmp_path)), torch.device("cpu"))
