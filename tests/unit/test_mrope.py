"""Vision-language models with multimodal rotary positions (Qwen2-VL's and Qwen2.5-VL's 3-D M-RoPE,
``get_rope_index``): the trainer's padded forwards and the hf backend give each row the positions the model gives the
row alone (grpo/system/vision.py `multimodal_positions`); what is not proven (packing, shared prompts, Qwen3-VL) is
refused by name."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from grpo.config import MasterConfig
from grpo.system import vision
from tests.helpers.vision_rows import qwen_prompts_and_media as prompts_and_media
from tests.helpers.vision_rows import qwen  # noqa: F401 (fixture)


def own_forward_logprobs(model, processor, ids: list[int], media: dict | None) -> torch.Tensor:
    """Row ``ids`` alone through the model as transformers runs it: no padding, the model's own positions from the
    processor's ``mm_token_type_ids`` (``get_rope_index`` inside the forward); logprobs of tokens 1..n-1."""
    ids_1n = torch.tensor([ids])
    types = (ids_1n == processor.image_token_id).long()
    logits = model(input_ids=ids_1n, mm_token_type_ids=types, **(media or {})).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids_1n[0, 1:, None])[:, 0]


def padded(rows: list[list[int]], side: str, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids_bt = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask_bt = torch.zeros_like(ids_bt)
    for b, r in enumerate(rows):
        cols = slice(0, len(r)) if side == "right" else slice(T - len(r), T)
        ids_bt[b, cols], mask_bt[b, cols] = torch.tensor(r), 1
    return ids_bt, mask_bt


def with_completions(prompts: list[list[int]]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [p + torch.randint(3, 80, (3 + i,), generator=g).tolist() for i, p in enumerate(prompts)]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_logprobs_of_image_rows_equal_each_rows_own_forward(qwen, side):
    """The trainer's logprob forward on a padded batch of image prompts (different grids, two pictures in a row, a
    text-only row) gives every row what the model gives that row alone with its own M-RoPE positions."""
    from grpo.system.engines import FrozenModel
    from grpo.system.training import forward_logprobs

    qwen_dir, processor, model = qwen
    prompts, media = prompts_and_media(qwen_dir, processor)
    assert [m["image_grid_thw"].tolist() for m in media[:3]] == [[[1, 4, 4]], [[1, 6, 2]], [[1, 2, 6], [1, 4, 4]]]
    assert media[3] is None and all(set(m) == {"pixel_values", "image_grid_thw"} for m in media[:3])
    rows = with_completions(prompts)
    ids_bt, mask_bt = padded(rows, side)
    with torch.no_grad():
        got_bt = forward_logprobs(FrozenModel(copy.deepcopy(model), torch.device("cpu")), ids_bt, mask_bt,
                                  media=media)
        for b, (row, m) in enumerate(zip(rows, media)):
            want = own_forward_logprobs(model, processor, row, m)
            cols = torch.nonzero(mask_bt[b])[:, 0][1:]   # the row's tokens after its first
            torch.testing.assert_close(got_bt[b, cols], want, atol=1e-5, rtol=0)


def test_the_forwards_positions_are_get_rope_index_of_each_row_alone(qwen):
    """The positions the padded forward hands the text model are, row by row, ``get_rope_index`` of the row unpadded
    (3-D: an image's tokens differ in height and width), 0 on padding."""
    from grpo.system.engines import FrozenModel
    from grpo.system.training import forward_logprobs

    qwen_dir, processor, model = qwen
    prompts, media = prompts_and_media(qwen_dir, processor)
    ids_bt, mask_bt = padded(with_completions(prompts), "left")
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)
    try:
        with torch.no_grad():
            forward_logprobs(FrozenModel(model, torch.device("cpu")), ids_bt, mask_bt, media=media)
    finally:
        hook.remove()
    positions_3bt = seen[0]
    assert positions_3bt.shape == (3, *ids_bt.shape)
    inner = model.model
    for b, m in enumerate(media):
        keep = mask_bt[b] > 0
        ids_1n = ids_bt[b:b + 1, keep]
        types = vision.mm_token_type_ids(inner.config, ids_1n)
        want_3n, _ = inner.get_rope_index(ids_1n, types, image_grid_thw=m["image_grid_thw"] if m else None)
        assert torch.equal(positions_3bt[:, b, keep], want_3n[:, 0])
        assert not positions_3bt[:, b, ~keep].any()
    image_cols = ids_bt[0] == processor.image_token_id
    assert not torch.equal(positions_3bt[1, 0, image_cols], positions_3bt[2, 0, image_cols])  # really 3-D


def policy_cfg(qwen_dir, **policy):
    base = {"model_name": qwen_dir, "precision": "float32", "generation_batch_size": 8,
            "max_total_sequence_length": 128, "tokenizer": {"chat_template": "default"}, "generation": {"max_new_tokens": 12, "temperature": 1.0}}
    return MasterConfig.model_validate({"policy": {**base, **policy}}).policy


@pytest.mark.parametrize("drop_finished", [True, False])
def test_hf_generation_logprobs_equal_teacher_forced_ones(qwen, drop_finished):
    """The hf backend samples image prompts (left-padded together) with the model's M-RoPE positions in both decode
    loops, the drop-finished one also after a row left the batch: its logprobs equal the trainer's teacher-forced
    ones of the same tokens."""
    from grpo.batch import build_batch
    from grpo.system.chat import load_tokenizer
    from grpo.system.engines import FrozenModel
    from grpo.system.generation.hf import HFGeneration
    from grpo.system.rollout import single_turn
    from grpo.system.training import compute_logprobs

    qwen_dir, processor, model = qwen
    prompts, media = prompts_and_media(qwen_dir, processor)
    cfg = policy_cfg(qwen_dir, generation={"max_new_tokens": 12, "temperature": 1.0,
                                           "hf_drop_finished_rows": drop_finished})
    gen = HFGeneration(cfg, load_tokenizer(cfg), model.config, "cpu", model=copy.deepcopy(model))
    # row 0 ends first: the drop-finished loop takes it out of the batch, the others decode on from [3, B - 1, 1]
    outs = gen.generate(prompts, seeds=list(range(len(prompts))), media=media, max_new_tokens=[2, 12, 12, 12])
    assert [len(o.completion_ids) for o in outs][0] <= 2
    trajs = single_turn(outs)
    for t, m in zip(trajs, media):
        t.media = m
    b = build_batch(trajs, pad_id=0)
    ref_bt = compute_logprobs(FrozenModel(copy.deepcopy(model), torch.device("cpu")), b.input_ids_bt,
                              b.attention_mask_bt, 1.0, micro_batch_size=2, media=b.media)
    mask = b.token_mask_bt > 0
    assert mask.sum() > 10
    torch.testing.assert_close(b.generation_logprobs_bt[mask], ref_bt[mask], atol=1e-4, rtol=0)


def test_packing_and_shared_prompts_stay_refused_by_name_for_an_mrope_model(qwen):
    """Packed rows and shared prompts would give 1-D positions: asked for, both are refused naming the key; at their
    defaults packing gives way (`unpackable_reason`) and the check passes. Qwen2-VL itself loads (`check_positions`)."""
    from grpo.system.packed import check_packable, unpackable_reason

    qwen_dir, _, model = qwen
    with pytest.raises(ValueError, match=f"policy.sequence_packing.enabled: {type(model).__name__} is a "
                                         "vision-language model"):
        check_packable(model)
    assert unpackable_reason(model) is not None
    with pytest.raises(ValueError, match="policy.shared_prompt_forward=true"):
        vision.check_policy(policy_cfg(qwen_dir, shared_prompt_forward=True), model.config)
    vision.check_policy(policy_cfg(qwen_dir), model.config)
    vision.check_positions(model)


def test_an_mrope_model_whose_positions_are_not_computed_is_refused_by_name():
    """Qwen3-VL's ``get_rope_index`` is another (timestamps, interleaved sections): refused at load, not run on
    positions grpo-ds has not checked."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(text_config=dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=1, intermediate_size=64, head_dim=16,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [2, 3, 3]}),
                           vision_config=dict(depth=1, hidden_size=16, out_hidden_size=32, num_heads=2,
                                              intermediate_size=32, deepstack_visual_indexes=[]))
    with pytest.raises(ValueError, match=r"Qwen3VLForConditionalGeneration \(qwen3_vl\) places image tokens "
                                         r"with multimodal \(M-RoPE\) positions that grpo-ds does not compute"):
        vision.check_positions(Qwen3VLForConditionalGeneration(config))


def test_a_zero3_forward_without_images_runs_the_dummy_picture_with_its_own_positions(qwen):
    """Under ZeRO-3 a micro-batch of text rows gets one more row, the dummy picture (`with_dummy_image`): the rows'
    logprobs are those without it, and the extra row (its own image grid) runs through the M-RoPE positions too."""
    from grpo.system.engines import FrozenModel
    from grpo.system.training import forward_logprobs

    class Zero3(FrozenModel):
        @staticmethod
        def zero_optimization_stage() -> int:
            return 3

    _, processor, model = qwen
    ids_bt, mask_bt = padded(with_completions([[1, 20, 21, 22], [1, 30, 31]]), "right")
    with torch.no_grad():
        want = forward_logprobs(FrozenModel(model, torch.device("cpu")), ids_bt, mask_bt)
        dummy = copy.deepcopy(model)
        dummy._grpo_dummy_image = vision.dummy_image(processor)
        assert set(dummy._grpo_dummy_image[1]) == {"pixel_values", "image_grid_thw"}
        seen = []
        dummy.model.language_model.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)
        got = forward_logprobs(Zero3(dummy, torch.device("cpu")), ids_bt, mask_bt)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert seen[0].shape[:2] == (3, 3)   # the dummy row was there, with 3-D positions
