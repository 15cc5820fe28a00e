"""A vision-language policy on the real DeepSpeed engine (one rank, gloo): the training step gets each sample's
images (the plain-PyTorch gradient), the vision tower trains or stays frozen as ``policy.vision`` says, deduplicated
and copied media train the same, the batch's row operations keep each sample's images, and packing / shared prompts
refuse a VLM by name."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from grpo.batch import build_batch, concat_batches
from grpo.config import MasterConfig
from grpo.system import engines, vision
from grpo.system.dist import init_distributed
from grpo.system.training import compute_logprobs, forward_logprobs, train_on_batch
from tests.helpers.vision_rows import plain_loss_and_grad_norm, sample_batch, sample_prompts
from tests.helpers.vision_rows import processor, qwen, vlm_dir  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def dist_group():
    rank, _, world, device = init_distributed()
    assert (rank, world, device.type) == (0, 1, "cpu")


def make_cfg(model_dir, **policy) -> MasterConfig:
    base = {"model_name": model_dir, "precision": "float32", "train_global_batch_size": 6,
            "train_micro_batch_size": 2, "logprob_batch_size": 2, "max_grad_norm": 1e6,
            "optimizer": {"lr": 1e-2, "weight_decay": 0.0}}
    return MasterConfig.model_validate({"policy": {**base, **policy},
                                        "grpo": {"num_prompts_per_step": 3, "num_generations_per_prompt": 2}})


@pytest.fixture(scope="module")
def batch(vlm_dir, processor):
    """Six samples, two per prompt (sharing the prompt's media): the one-image rows, a two-image row, a text row."""
    prompts, media = sample_prompts(vlm_dir, processor)
    return sample_batch(prompts, media, [0, 0, 3, 3, 4, 4])


def closure(lp_bt, mb):
    return -(lp_bt * mb.token_mask_bt).sum() / 30.0, {}


def tower_params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in vision.vision_tower(module).named_parameters()}


@pytest.mark.parametrize("train_tower", [True, False])
def test_the_training_step_gets_each_samples_images_and_trains_the_tower_as_configured(vlm_dir, batch, dist_group,
                                                                                      train_tower):
    from transformers import AutoModelForImageTextToText

    engine = engines.build_policy_engine(make_cfg(vlm_dir, vision={"train_vision_tower": train_tower}), 1, 1)
    before = tower_params(engine.module)
    projector = engine.module.model.multi_modal_projector.linear_1.weight.detach().clone()
    out = train_on_batch(engine, batch.micro_batches(2), closure)
    plain = vision.prepare_model(AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32),
                                 train_vision_tower=train_tower)
    loss, norm = plain_loss_and_grad_norm(plain, batch)
    assert out["loss"] == pytest.approx(loss, rel=1e-5)
    assert out["grad_norm"] == pytest.approx(norm, rel=1e-4)
    # LLaVA reads the last layer's hidden states before the tower's post_layernorm: every other tower weight is used
    used = [n for n in before if "post_layernorm" not in n]
    tower_grads = dict(vision.vision_tower(plain).named_parameters())
    after = tower_params(engine.module)
    if train_tower:   # the gradient reaches the tower, and the step moves it
        assert all(tower_grads[n].grad is not None and tower_grads[n].grad.abs().sum() > 0 for n in used)
        assert all(not torch.equal(before[n], after[n]) for n in used)
    else:             # frozen: no gradient, not in the optimizer, unchanged
        assert all(p.grad is None for p in tower_grads.values())
        assert all(torch.equal(before[n], after[n]) for n in before)
    assert not torch.equal(projector, engine.module.model.multi_modal_projector.linear_1.weight)


def test_a_qwen_vl_trains_on_the_engine_with_its_own_positions(qwen, dist_group):
    """Qwen2-VL and Qwen2.5-VL (3-D M-RoPE) load on the engine, and a training step on padded rows with images (three
    image grids, two pictures in a row, a text row) gives the loss and gradient of plain autograd on each row alone,
    the model placing the row's tokens itself."""
    from transformers import AutoModelForImageTextToText

    from tests.helpers.vision_rows import qwen_prompts_and_media

    qwen_dir, qwen_processor, _ = qwen
    prompts, media = qwen_prompts_and_media(qwen_dir, qwen_processor)
    rows = sample_batch(prompts, media, [0, 0, 1, 2, 2, 3])
    engine = engines.build_policy_engine(make_cfg(qwen_dir), 1, 1)
    out = train_on_batch(engine, rows.micro_batches(2), closure)
    plain = vision.prepare_model(AutoModelForImageTextToText.from_pretrained(qwen_dir, dtype=torch.float32))
    loss, norm = plain_loss_and_grad_norm(plain, rows)
    assert out["loss"] == pytest.approx(loss, rel=1e-5)
    assert out["grad_norm"] == pytest.approx(norm, rel=1e-4)


def test_deduplicated_and_copied_media_train_the_same(vlm_dir, batch, dist_group):
    from grpo.system.media import media_bytes, share_media

    shared = batch
    assert shared.media[0] is shared.media[1]                            # stored once per prompt group
    copied = batch.replace(media=share_media(batch.media, dedup=False))
    assert copied.media[0] is not copied.media[1]
    assert media_bytes(copied.media) > media_bytes(shared.media)
    outs = []
    for b in (shared, copied):
        engine = engines.build_policy_engine(make_cfg(vlm_dir), 1, 1)
        outs.append(train_on_batch(engine, b.micro_batches(2), closure))
    assert outs[0]["loss"] == outs[1]["loss"] and outs[0]["grad_norm"] == outs[1]["grad_norm"]


def test_row_operations_keep_each_samples_images(batch):
    media = batch.media
    picked = batch.select([5, 2, 0])
    assert [id(m) if m is not None else None for m in picked.media] == [None, id(media[2]), id(media[0])]
    assert [id(m) if m is not None else None for m in batch.shard(1, 2).media] == [id(media[3]), None, None]
    mbs = batch.micro_batches(4)
    assert [m for mb in mbs for m in mb.media] == media
    text_only = build_batch([t for t in batch.trajectories if t.media is None], pad_id=0)
    assert text_only.media is None
    joined = concat_batches([text_only, batch.select([0, 1])])          # a batch without images joins one with
    assert joined.media == [None, None, media[0], media[1]]


def test_zero3_logprobs_with_images_equal_the_plain_models(vlm_dir, batch, dist_group):
    from transformers import AutoModelForImageTextToText

    engine = engines.build_policy_engine(make_cfg(vlm_dir, deepspeed_config="ds_configs/zero3.json"), 1, 1)
    assert any(getattr(p, "ds_numel", 0) > 0 and p.numel() == 0 for p in engine.module.parameters())
    got = compute_logprobs(engine, batch.input_ids_bt, batch.attention_mask_bt, 1.0, micro_batch_size=4,
                           media=batch.media)
    plain = vision.prepare_model(AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)).eval()
    wrapped = engines.FrozenModel(plain, torch.device("cpu"))
    with torch.no_grad():
        want = forward_logprobs(wrapped, batch.input_ids_bt, batch.attention_mask_bt, media=batch.media)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_packing_and_shared_prompts_refuse_rows_with_images(vlm_dir, batch, dist_group):
    from grpo.system.packed import Packing, check_packable, unpackable_reason
    from grpo.system.shared_prefix import prompt_lengths, shares_prompts

    engine = engines.build_policy_engine(make_cfg(vlm_dir), 1, 1)
    assert "vision-language" in unpackable_reason(engine.module)  # the default gives way at startup
    with pytest.raises(ValueError, match="policy.sequence_packing.enabled: .*vision-language.*dynamic_batching"):
        check_packable(engine.module)
    assert not shares_prompts("auto", engine.module)
    mb = batch.select([0, 1])
    with pytest.raises(ValueError, match="policy.sequence_packing and policy.shared_prompt_forward"):
        forward_logprobs(engine, mb.input_ids_bt, mb.attention_mask_bt, media=mb.media,
                         prompt_lens_b=prompt_lengths(mb.token_mask_bt, mb.attention_mask_bt))
    from grpo.system.training import logprob_forward

    with pytest.raises(ValueError, match="policy.sequence_packing and policy.shared_prompt_forward"):
        logprob_forward(engine, mb.input_ids_bt, mb.attention_mask_bt, media=mb.media, packing=Packing(1, True))


def test_a_vlm_refuses_colocated_vllm_on_the_cpu_and_asked_for_shared_prompts(vlm_dir):
    """vLLM colocated runs a VLM with transformers' modelling on the CPU, which patches the trainer's classes in its
    process: refused; on generation ranks of its own (vLLM or hf) the images go with the prompts."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(vlm_dir)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="policy.generation.backend=vllm with policy.generation.colocated"):
            vision.check_policy(make_cfg(vlm_dir, generation={"backend": "vllm"}).policy, config)
    ranks = {"colocated": {"enabled": False, "resources": {"gpus_per_node": 1}}}  # generation ranks of their own
    vision.check_policy(make_cfg(vlm_dir, generation={"backend": "vllm", **ranks}).policy, config)
    vision.check_policy(make_cfg(vlm_dir, generation=ranks).policy, config)  # hf on them receives the images
    with pytest.raises(ValueError, match="policy.shared_prompt_forward=true"):
        vision.check_policy(make_cfg(vlm_dir, shared_prompt_forward=True).policy, config)
    vision.check_policy(make_cfg(vlm_dir).policy, config)


def test_an_export_of_a_vlm_holds_its_processor_and_loads_as_one(vlm_dir, dist_group, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from grpo.system.chat import load_tokenizer
    from grpo.system.weights import export_hf

    cfg = make_cfg(vlm_dir)
    engine = engines.build_policy_engine(cfg, 1, 1)
    export_hf(engine, str(tmp_path / "hf"), load_tokenizer(cfg.policy))
    proc = AutoProcessor.from_pretrained(tmp_path / "hf")
    assert type(proc.image_processor).__name__ == "CLIPImageProcessorPil" and proc.chat_template
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlavaForConditionalGeneration"


def test_rollout_dumps_show_images_as_placeholders_never_their_bytes(vlm_dir, processor):
    import json

    from grpo.system.dumps import rollout_records
    from grpo.system.rollout import new_trajectories
    from tests.helpers.vision_rows import data_url, dataset, image_row

    url = data_url((250, 10, 10))
    row = dataset(vlm_dir, processor, [image_row("r:0", url, url)])[0]
    trajs = new_trajectories([row], 2)
    assert trajs[0].media is trajs[1].media is row.media              # one copy of the pixels for the group
    text = json.dumps(rollout_records(trajs, "train", 1))
    assert "<image><image>what colour?" in text
    assert url.split(",")[1][:40] not in text and "pixel_values" not in text


@pytest.mark.slow  # two processes under torchrun (about a minute on 2 shared cores)
def test_two_ranks_one_with_images_one_without_train_as_one_process(vlm_dir, processor, tmp_path):
    """ZeRO-3 on 2 ranks, rank 0's micro-batches with images and rank 1's text only: no hang, and the loss, the
    gradient norm and the logprobs of one process on the whole batch."""
    from transformers import AutoModelForImageTextToText

    from tests.helpers.e2e import REPO, launcher, run
    from tests.helpers.vision_dist_step import ORDER

    out = tmp_path / "two.pt"
    run([*launcher("torchrun"), "--standalone", "--nproc_per_node", "2",
         str(REPO / "tests" / "helpers" / "vision_dist_step.py"), vlm_dir, str(out)], timeout=300, threads=1)
    saved = torch.load(out)
    prompts, media = sample_prompts(vlm_dir, processor)
    batch = sample_batch(prompts, media, ORDER)
    plain = vision.prepare_model(AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32))
    loss, norm = plain_loss_and_grad_norm(plain, batch)
    assert saved["world"] == 2
    assert saved["loss"] == pytest.approx(loss, abs=1e-5)
    assert saved["grad_norm"] == pytest.approx(norm, rel=1e-4)
    with torch.no_grad():
        want = forward_logprobs(engines.FrozenModel(plain, torch.device("cpu")), batch.input_ids_bt,
                                batch.attention_mask_bt, media=batch.media)
    torch.testing.assert_close(saved["logprobs"], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lora_tower", [False, True])
def test_lora_adapts_the_vision_tower_only_when_asked(vlm_dir, dist_group, lora_tower):
    cfg = make_cfg(vlm_dir, lora={"enabled": True, "dim": 4}, vision={"lora_vision_tower": lora_tower})
    engine = engines.build_policy_engine(cfg, 1, 1)
    adapted = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    in_tower = {n for n in adapted if ".vision_tower." in n}
    assert adapted and all(".lora_" in n for n in adapted)
    assert bool(in_tower) == lora_tower
    assert any(".language_model." in n for n in adapted)


def test_dynamic_batching_keeps_each_samples_images(vlm_dir, batch, dist_group):
    """NeMo-RL's VLM recipes batch by token budget (dynamic batching): rows regrouped by length keep their images."""
    from transformers import AutoModelForImageTextToText

    from grpo.system.training import TokenBatching, token_micro_batches

    engine = engines.build_policy_engine(make_cfg(vlm_dir), 1, 1)
    mbs = token_micro_batches(batch, TokenBatching(False, 70, 4))
    assert len(mbs) > 1 and sorted(id(m) for mb in mbs for m in mb.media) == sorted(id(m) for m in batch.media)
    out = train_on_batch(engine, mbs, closure, variable=True)
    plain = vision.prepare_model(AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32))
    loss, norm = plain_loss_and_grad_norm(plain, batch)
    assert out["loss"] == pytest.approx(loss, rel=1e-5) and out["grad_norm"] == pytest.approx(norm, rel=1e-4)
