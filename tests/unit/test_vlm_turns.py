"""Multi-turn environments whose observations carry images (grpo/system/rollout.py, grpo/system/vision.py
`encode_observation`): an observation's image parts are rendered by the processor's chat template as a data row's,
its tokens appended with the placeholders expanded once and its pictures appended to the sample's media, so the
trajectory is the processor's rendering of the whole conversation and training scores what generation sampled; a text
policy given a picture fails that sample, named."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from grpo.config import MasterConfig
from grpo.system import vision
from grpo.tasks.interface import Environment, EnvironmentReturn
from tests.helpers.vision_rows import data_url, image_row
from tests.helpers.vision_rows import processor, qwen, vlm, vlm_dir  # noqa: F401 (fixtures)

FIRST, SECOND = data_url((255, 0, 0), size=(16, 16)), data_url((0, 0, 255), size=(8, 24))


class ShowsAnother(Environment):
    """Turn 1: answers with a second picture and a question (reward 0.25); turn 2: ends the sample (reward 1)."""

    def __init__(self, picture=SECOND):
        self.picture, self.seen = picture, []

    def step(self, message_logs, metadata):
        self.seen.append(copy.deepcopy(message_logs))
        turn = [sum(m["role"] == "assistant" for m in log) for log in message_logs]
        observation = {"role": "user", "content": [{"type": "image", "image": self.picture},
                                                   {"type": "text", "text": "and now?"}]}
        return EnvironmentReturn(observations=[observation] * len(message_logs), metadata=list(metadata),
                                 next_stop_strings=None, rewards=[0.25 if k == 1 else 1.0 for k in turn],
                                 terminateds=[k >= 2 for k in turn], answers=None)


def policy_cfg(model_dir, **policy):
    base = {"model_name": model_dir, "precision": "float32", "generation_batch_size": 8,
            "max_total_sequence_length": 160, "tokenizer": {"chat_template": "default"},
            "generation": {"max_new_tokens": 6, "temperature": 1.0}}
    return MasterConfig.model_validate({"policy": {**base, **policy}}).policy


def play(model_dir, processor, model, env, fmt="chat_template", generations=2, max_total_len=160):
    """One image row played for two turns by the hf backend on ``model`` against ``env``: (trajectories, prompt row)."""
    from grpo.system.chat import load_tokenizer
    from grpo.system.data import PromptDataset, PromptFormatter
    from grpo.system.generation.hf import HFGeneration
    from grpo.system.rollout import TurnSettings, new_trajectories, run_conversations
    from grpo.tasks.router import Environments

    cfg = policy_cfg(model_dir)
    formatter = PromptFormatter(load_tokenizer(cfg), MasterConfig().data, "default", processor=processor)
    row = PromptDataset([image_row("r:0", FIRST, text="colour?")], formatter, default_task="pics")[0]
    trajs = new_trajectories([row], generations)
    gen = HFGeneration(cfg, formatter.tokenizer, model.config, "cpu", model=copy.deepcopy(model))
    envs = Environments({"pics": env}, step_timeout_s=30, observation_formats={"pics": fmt})
    run_conversations(trajs, [(3, 0, i, "train") for i in range(len(trajs))], gen, envs, formatter.chat,
                      TurnSettings(max_turns=3, max_total_len=max_total_len, chunk_size=4, max_new_tokens=6))
    return trajs, row


def whole_conversation(processor, t):
    """The processor's own rendering of sample t's conversation up to its last turn's generation prompt (the first
    turn's completion as its text, special tokens kept), with both pictures: its ``BatchFeature``."""
    said = processor.tokenizer.decode(t.messages[1].token_ids, skip_special_tokens=False)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
                    {"role": "assistant", "content": said},
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and now?"}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    images = [vision.load_image(FIRST, "first"), vision.load_image(SECOND, "second")]
    return processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")


def check_against_whole_conversation(processor, trajs, row):
    """Each sample's ids are the processor's rendering of its whole conversation, then its last completion; its media
    both pictures in order; the prompt row's media (shared by the group) still holds the first alone."""
    for t in trajs:
        assert t.failure is None and t.turns == 2 and t.reward == 1.25
        assert [m.role for m in t.messages] == ["user", "assistant", "user", "assistant"]
        assert t.messages[2].content == vision.IMAGE_MARK + "and now?"   # environments read a picture as <image>
        whole = whole_conversation(processor, t)
        assert t.token_ids() == whole["input_ids"][0].tolist() + t.messages[3].token_ids
        assert t.token_ids().count(processor.image_token_id) == whole["input_ids"][0].eq(processor.image_token_id).sum()
        assert set(t.media) == set(whole) - set(vision.NOT_MEDIA)
        for key, value in t.media.items():
            assert torch.equal(value, whole[key]), key
    first = row.media["pixel_values"]
    assert len(first) < len(whole["pixel_values"]) and torch.equal(first, whole["pixel_values"][:len(first)])
    assert all(t.media is not row.media for t in trajs)


def check_training_scores_what_was_sampled(model, trajs):
    """The trainer's forward over the finished samples (both pictures) gives the logprobs generation sampled with:
    token_mult_prob_error within 1e-3 of 1, every turn's tokens."""
    from grpo.batch import build_batch
    from grpo.logprobs import seq_logprob_error
    from grpo.system.engines import FrozenModel
    from grpo.system.training import compute_logprobs

    b = build_batch(trajs, pad_id=0)
    ref_bt = compute_logprobs(FrozenModel(copy.deepcopy(model), torch.device("cpu")), b.input_ids_bt,
                              b.attention_mask_bt, 1.0, micro_batch_size=2, media=b.media)
    assert int(b.token_mask_bt.sum()) == sum(len(t.completion_ids()) for t in trajs) > 4
    error_b = seq_logprob_error(b.generation_logprobs_bt, ref_bt, b.token_mask_bt)
    assert torch.all((error_b - 1).abs() < 1e-3), error_b


def test_an_image_in_turn_two_is_the_processors_rendering_of_the_whole_conversation(vlm_dir, processor, vlm):
    env = ShowsAnother()
    trajs, row = play(vlm_dir, processor, vlm, env)
    check_against_whole_conversation(processor, trajs, row)
    check_training_scores_what_was_sampled(vlm, trajs)
    assert env.seen[1][0][2] == {"role": "user", "content": vision.IMAGE_MARK + "and now?"}


def test_qwen_vl_positions_with_an_image_in_a_later_turn_are_get_rope_index_of_the_whole_row(qwen):
    """Qwen2-VL / Qwen2.5-VL: the second turn's prefill and the training forward place the tokens with
    ``get_rope_index`` of the whole row, both pictures' grids (4x4, then 6x2 patches) in order."""
    qwen_dir, processor, model = qwen
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)
    try:
        trajs, row = play(qwen_dir, processor, model, ShowsAnother(), generations=1)
    finally:
        hook.remove()
    check_against_whole_conversation(processor, trajs, row)
    t = trajs[0]
    whole = whole_conversation(processor, t)
    assert t.media["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 2]]
    inner = model.model
    ids_1n = whole["input_ids"]
    want_3n, _ = inner.get_rope_index(ids_1n, vision.mm_token_type_ids(inner.config, ids_1n),
                                      image_grid_thw=whole["image_grid_thw"])
    prefills = [p for p in seen if p.shape[-1] == ids_1n.shape[1]]    # the second turn's prefill: the whole row
    assert prefills and torch.equal(prefills[0][:, 0], want_3n[:, 0])
    image_cols = ids_1n[0] == processor.image_token_id
    assert not torch.equal(want_3n[1, 0, image_cols], want_3n[2, 0, image_cols])    # really 3-D
    check_training_scores_what_was_sampled(model, trajs)


def test_a_raw_observation_writes_its_image_as_the_placeholder_expanded_once(vlm_dir, processor, vlm):
    """observation_format raw (NeMo-RL's default for class environments): the content as it is, an image part as the
    processor's placeholder, expanded once with its pixels."""
    trajs, _ = play(vlm_dir, processor, vlm, ShowsAnother(), fmt="raw", generations=1)
    t = trajs[0]
    want = processor(text=["<image>and now?"], images=[vision.load_image(SECOND, "x")], add_special_tokens=False,
                     return_tensors="pt")
    assert t.failure is None and t.messages[2].token_ids == want["input_ids"][0].tolist()
    assert torch.equal(t.media["pixel_values"][1:], want["pixel_values"])
    check_training_scores_what_was_sampled(vlm, trajs)


@pytest.mark.parametrize("picture, says", [
    ("/no/such/picture.png", "no such file"),
    ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot be decoded"),
])
def test_an_observation_image_that_cannot_be_read_fails_its_sample_by_name(vlm_dir, processor, vlm, picture, says):
    trajs, _ = play(vlm_dir, processor, vlm, ShowsAnother(picture), generations=2)
    for t in trajs:
        assert t.failure.reason == "env_malformed" and t.failure.kind == "data" and t.done
        assert "environment 'pics'" in t.failure.detail and says in t.failure.detail
        assert t.media["pixel_values"].shape[0] == 1 and t.reward is None


class WritesThePlaceholder(ShowsAnother):
    def step(self, message_logs, metadata):
        ret = super().step(message_logs, metadata)
        return ret._replace(observations=[{"role": "user", "content": "look: <image>"}] * len(message_logs))


def test_an_observation_whose_text_holds_the_placeholder_fails_its_sample(vlm_dir, processor, vlm):
    """A text observation spelling ``<image>`` would put a placeholder without pixels into the row (the training
    forward would refuse the batch): the sample fails, named."""
    trajs, _ = play(vlm_dir, processor, vlm, WritesThePlaceholder(), generations=1)
    assert trajs[0].failure.reason == "env_malformed" and "holds the image placeholder '<image>'" in trajs[0].failure.detail


def test_an_observation_cut_by_the_length_limit_keeps_no_partial_picture(vlm_dir, processor, vlm):
    """The second picture does not fit: the observation stops before its placeholders and brings no pixels."""
    from grpo.tasks.visual import IMAGE_TOKENS

    probe, _ = play(vlm_dir, processor, vlm, ShowsAnother(), generations=1)
    before = len(probe[0].messages[0].token_ids) + len(probe[0].messages[1].token_ids)
    trajs, _ = play(vlm_dir, processor, vlm, ShowsAnother(), generations=1, max_total_len=before + 6)
    t = trajs[0]
    assert t.truncated and t.done and t.turns == 1 and t.failure is None
    assert processor.image_token_id not in t.messages[2].token_ids and len(t.messages[2].token_ids) <= 6
    assert t.media["pixel_values"].shape[0] == 1 and IMAGE_TOKENS == t.token_ids().count(processor.image_token_id)


class EchoGen:
    """A text policy's generator: "ok" then <eos> for every prompt."""

    def __init__(self, tok):
        self.tok = tok

    def lockstep_max(self, n):
        return n

    def generate(self, prompt_ids, seeds, **kw):
        from grpo.system.generation.base import GenerationOutput

        ids = self.tok("ok", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [GenerationOutput(list(p), ids, [-0.1] * len(ids), "stop", "ok") for p in prompt_ids]


class PictureForSomeone(Environment):
    """Sample 0 of each call gets a picture, the others text; two turns."""

    def step(self, message_logs, metadata):
        turn = [sum(m["role"] == "assistant" for m in log) for log in message_logs]
        pic = {"role": "user", "content": [{"type": "image", "image": FIRST}, {"type": "text", "text": "see?"}]}
        obs = [pic if i == 0 else {"role": "user", "content": "go on"} for i in range(len(message_logs))]
        return EnvironmentReturn(obs, list(metadata), None, [1.0] * len(turn), [k >= 2 for k in turn], None)


def test_a_text_policy_given_an_image_observation_fails_that_sample_not_the_run():
    from grpo.system.chat import ChatFormat
    from grpo.system.rollout import TurnSettings, new_trajectories, run_conversations
    from grpo.tasks.router import Environments
    from grpo.tasks.rows import PromptRow
    from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer

    tok = build_char_tokenizer()
    chat = ChatFormat(tok, SIMPLE_CHAT_TEMPLATE)
    ids = chat.prompt_token_ids([{"role": "user", "content": "hi"}])[0]
    rows = [PromptRow(0, "hi", "x", "pics", [{"role": "user", "content": "hi", "token_ids": ids}], ids)]
    trajs = new_trajectories(rows, 3)
    run_conversations(trajs, [(1, 0, i, "train") for i in range(3)], EchoGen(tok),
                      Environments({"pics": PictureForSomeone()}, step_timeout_s=5), chat,
                      TurnSettings(max_turns=3, max_total_len=200, chunk_size=8, max_new_tokens=4))
    failed, *others = trajs
    assert failed.failure.reason == "env_malformed" and failed.failure.kind == "data" and failed.reward is None
    assert "environment 'pics'" in failed.failure.detail and "text model" in failed.failure.detail
    assert all(t.failure is None and t.turns == 2 and t.reward == 2.0 for t in others)
