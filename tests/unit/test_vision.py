"""Vision-language models (grpo/system/vision.py, grpo/tasks/visual.py): the tiny LLaVA loads from its directory,
rows with images become the processor's ids and tensors, the hf backend generates with them, the trainer's forwards
take them, and the batch keeps each sample's images."""

from __future__ import annotations

import base64
import copy
import io
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
from PIL import Image

from grpo.config import MasterConfig
from grpo.system import vision
from grpo.tasks.rows import DataError
from grpo.tasks.visual import IMAGE_SIZE, IMAGE_TOKEN, IMAGE_TOKENS
from tests.helpers.vision_rows import data_url, dataset, image_row, png, sample_prompts
from tests.helpers.vision_rows import processor, vlm, vlm_dir  # noqa: F401 (fixtures)


def policy_cfg(vlm_dir, **policy):
    base = {"model_name": vlm_dir, "precision": "float32", "generation_batch_size": 8, "max_total_sequence_length": 128,
            "tokenizer": {"chat_template": "default"}, "generation": {"max_new_tokens": 12, "temperature": 1.0}}
    return MasterConfig.model_validate({"policy": {**base, **policy}}).policy


# ------------------------------------------------------------------------------------------------ the model
def test_the_tiny_vlm_loads_as_image_text_to_text_with_a_pil_processor(vlm_dir, tiny_model_dir, processor):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    assert vision.auto_model_class(AutoConfig.from_pretrained(vlm_dir)) is AutoModelForImageTextToText
    assert vision.auto_model_class(AutoConfig.from_pretrained(tiny_model_dir)) is AutoModelForCausalLM
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"  # no torchvision needed
    with pytest.raises(ImportError):
        import torchvision  # noqa: F401  (the point: the processor works without it)
    config = AutoConfig.from_pretrained(vlm_dir)
    assert vision.vision_token_ids(config) == [processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)]


# ------------------------------------------------------------------------------------------------ data rows
def test_a_row_with_images_gives_the_processors_ids_and_tensors(vlm_dir, processor, tmp_path):
    path = tmp_path / "red.png"
    path.write_bytes(png((255, 0, 0)))
    rows = [image_row("r:0", str(path)),                                # a local path
            image_row("r:1", data_url((0, 0, 255)), {"bytes": png((0, 255, 0)), "path": None}),  # data: URL, datasets
            {"question": [{"role": "user", "content": "no image here"}], "answer": "x", "source": "r:2", "meta": {}}]
    ds = dataset(vlm_dir, processor, rows)
    one, two, text = ds[0], ds[1], ds[2]
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    imgs = [Image.open(io.BytesIO(png(c))).convert("RGB") for c in ((0, 0, 255), (0, 255, 0))]
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what colour?"}]}],
        add_generation_prompt=True, tokenize=False)
    # the template's text as is (a chat template writes its own special tokens: this one none)
    expected = processor(text=[rendered], images=imgs, add_special_tokens=False, return_tensors="pt")
    assert two.prompt_ids == expected["input_ids"][0].tolist()
    assert torch.equal(two.media["pixel_values"], expected["pixel_values"])
    assert two.prompt_ids.count(image_id) == 2 * IMAGE_TOKENS            # each image expanded once
    assert one.prompt_ids.count(image_id) == IMAGE_TOKENS and one.media["pixel_values"].shape == (1, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert text.media is None and image_id not in text.prompt_ids
    assert two.prompt_messages[0]["content"] == "<image><image>what colour?"  # text shows placeholders, no bytes
    assert two.question == "<image><image>what colour?"


@pytest.mark.parametrize("image, says", [("/nonexistent/cat.png", "no such file"),
                                         ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot be decoded"),
                                         ({"bytes": b"not an image", "path": None}, "cannot be decoded")])
def test_a_row_whose_image_is_missing_or_undecodable_is_refused_naming_it(vlm_dir, processor, image, says):
    rows = [image_row("good:0", data_url((1, 2, 3))), image_row("bad.jsonl:7", image)]
    with pytest.raises(DataError, match=f"bad.jsonl:7: image .*{says}"):
        dataset(vlm_dir, processor, rows)
    skipped = dataset(vlm_dir, processor, rows, on_bad_row="skip")
    assert len(skipped) == 1 and skipped.num_bad_images == 1


def test_a_row_with_images_for_a_text_model_is_refused(tiny_model_dir):
    from grpo.system.data import PromptDataset, PromptFormatter
    from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer

    cfg = MasterConfig.model_validate({})
    formatter = PromptFormatter(build_char_tokenizer(SIMPLE_CHAT_TEMPLATE), cfg.data, SIMPLE_CHAT_TEMPLATE)
    with pytest.raises(DataError, match="r:3: the row has images but policy.model_name is a text model"):
        PromptDataset([image_row("r:3", data_url((9, 9, 9)))], formatter)


def test_file_rows_accept_content_parts_and_name_a_bad_part():
    from grpo.system.data import check_record

    good = {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                      {"type": "text", "text": "hi"}]}], "answer": "1"}
    assert check_record(good, "messages", "answer") is None
    bad = {"messages": [{"role": "user", "content": [{"type": "picture", "url": "a.png"}]}], "answer": "1"}
    assert "message 0: content part 0" in check_record(bad, "messages", "answer")


# ------------------------------------------------------------------------------------------------ generation
def hf_gen(vlm_dir, vlm, **policy):
    from grpo.system.generation.hf import HFGeneration

    cfg = policy_cfg(vlm_dir, **policy)
    return HFGeneration(cfg, _tokenizer(vlm_dir), vlm.config, "cpu", model=copy.deepcopy(vlm))


def _tokenizer(vlm_dir):
    from grpo.system.chat import load_tokenizer

    return load_tokenizer(policy_cfg(vlm_dir))


@pytest.mark.parametrize("drop_finished", [True, False])
def test_hf_generation_logprobs_equal_teacher_forced_ones_on_image_prompts(vlm_dir, vlm, processor, drop_finished):
    from grpo.batch import build_batch
    from grpo.system.engines import FrozenModel
    from grpo.system.rollout import single_turn
    from grpo.system.training import compute_logprobs

    prompts, media = sample_prompts(vlm_dir, processor)
    gen = hf_gen(vlm_dir, vlm, generation={"max_new_tokens": 12, "temperature": 1.0,
                                           "hf_drop_finished_rows": drop_finished})
    outs = gen.generate(prompts, seeds=list(range(len(prompts))), media=media)
    assert all(o.prompt_ids == p for o, p in zip(outs, prompts))     # the prompt as given: expanded once, not again
    trajs = single_turn(outs)
    for t, m in zip(trajs, media):
        t.media = m
    b = build_batch(trajs, pad_id=0)
    assert b.media is not None and b.media[4] is None
    ref_bt = compute_logprobs(FrozenModel(copy.deepcopy(vlm), torch.device("cpu")), b.input_ids_bt,
                              b.attention_mask_bt, 1.0, micro_batch_size=2, media=b.media)
    mask = b.token_mask_bt > 0
    assert mask.sum() > 10
    assert torch.allclose(b.generation_logprobs_bt[mask], ref_bt[mask], atol=1e-4)
    # the images matter: the same tokens scored with the rows' images swapped give other logprobs
    swapped = compute_logprobs(FrozenModel(copy.deepcopy(vlm), torch.device("cpu")), b.input_ids_bt,
                               b.attention_mask_bt, 1.0, micro_batch_size=2, media=[media[1], media[0]] + media[2:])
    assert not torch.allclose(swapped[:2][mask[:2]], ref_bt[:2][mask[:2]], atol=1e-3)


def test_a_prompt_expanded_twice_is_refused_by_the_model(vlm_dir, vlm, processor):
    """The guard behind "expanded once": a prompt whose placeholders were expanded again does not reach sampling."""
    prompts, media = sample_prompts(vlm_dir, processor)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    twice = [t for tok in prompts[0] for t in ([tok] * IMAGE_TOKENS if tok == image_id else [tok])]
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        hf_gen(vlm_dir, vlm, max_total_sequence_length=400).generate([twice], seeds=[0], media=[media[0]])


def test_image_placeholder_ids_are_never_sampled(vlm_dir, vlm, processor):
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    model = copy.deepcopy(vlm)
    with torch.no_grad():  # the placeholder made the likeliest token everywhere
        model.lm_head.weight[image_id] = model.lm_head.weight.abs().max(dim=0).values * 50
    prompts, media = sample_prompts(vlm_dir, processor)
    unbanned = copy.deepcopy(model)
    unbanned.lm_head._forward_hooks.clear()
    from grpo.system.generation.hf import HFGeneration

    cfg = policy_cfg(vlm_dir)
    free = HFGeneration(cfg, _tokenizer(vlm_dir), unbanned.config, "cpu", model=unbanned)
    assert any(image_id in o.completion_ids for o in free.generate(prompts, list(range(5)), media=media))
    banned = HFGeneration(cfg, _tokenizer(vlm_dir), model.config, "cpu", model=model)
    outs = banned.generate(prompts, list(range(5)), media=media)
    assert all(image_id not in o.completion_ids and o.completion_ids for o in outs)
    assert all(torch.isfinite(torch.tensor(o.logprobs)).all() for o in outs)


def test_the_copy_a_hf_backend_builds_bans_the_placeholders(vlm_dir, vlm):
    from grpo.system.generation.hf import HFGeneration

    gen = HFGeneration(policy_cfg(vlm_dir), _tokenizer(vlm_dir), vlm.config, "cpu")
    assert type(gen.model).__name__ == "LlavaForConditionalGeneration"
    assert gen.model._grpo_banned_ids == vision.vision_token_ids(vlm.config)


def test_a_trajectory_with_images_round_trips_a_checkpoint_without_pickle(vlm_dir, processor, tmp_path):
    from grpo.system.rollout import new_trajectories

    row = dataset(vlm_dir, processor, [image_row("r:0", data_url((1, 2, 3)))])[0]
    traj = new_trajectories([row], 1)[0]
    torch.save({"t": traj.to_dict()}, tmp_path / "t.pt")
    back = type(traj).from_dict(torch.load(tmp_path / "t.pt", weights_only=True)["t"])
    assert torch.equal(back.media["pixel_values"], row.media["pixel_values"]) and back.token_ids() == row.prompt_ids


def _sources(tmp_path) -> dict:
    """An image part's value of each kind the data path reads, the same picture but for the JPEG's loss."""
    Image.new("RGBA", (20, 12), (10, 200, 30, 128)).save(tmp_path / "a.png")
    Image.new("RGB", (20, 12), (200, 10, 30)).save(tmp_path / "a.jpg", quality=70)
    raw = (tmp_path / "a.png").read_bytes()
    return {"data_url": data_url((1, 2, 3)), "bytes": raw, "datasets_bytes": {"bytes": raw, "path": None},
            "datasets_path": {"bytes": None, "path": str(tmp_path / "a.png")}, "path": str(tmp_path / "a.jpg"),
            "file_url": f"file://{tmp_path / 'a.png'}", "pil_rgba": Image.open(tmp_path / "a.png"),
            "other_header": "data:application/octet-stream;base64," + base64.b64encode(raw).decode()}


def test_an_image_part_of_any_kind_is_a_data_url_the_endpoint_decodes_to_the_data_paths_picture(tmp_path):
    """`image_data_url`: what an agent is sent for a row's picture; the endpoint (openai_images) reads it to the very
    pixels `load_image` gives the data path, a file's own bytes kept (a JPEG is not re-encoded)."""
    from grpo.config import HttpServerConfig
    from grpo.wings.agents.openai_images import decode_image, image_bytes

    settings = HttpServerConfig()
    for kind, value in _sources(tmp_path).items():
        url = vision.image_data_url(value, "row 0")
        picture = decode_image(image_bytes(url, "messages.0.content.0", settings), "m", settings.max_image_pixels)
        assert picture.tobytes() == vision.load_image(value, "row 0").tobytes(), kind
    jpeg = vision.image_data_url(str(tmp_path / "a.jpg"), "row 0")
    assert jpeg.startswith("data:image/jpeg;base64,")
    assert base64.b64decode(jpeg.partition(",")[2]) == (tmp_path / "a.jpg").read_bytes()


@pytest.mark.parametrize("value, says", [("/no/such.png", "no such file"), (b"not an image", "cannot be read"),
                                         ("https://example.com/a.png", "not fetched")])
def test_an_image_part_that_cannot_be_sent_is_refused_naming_the_row(value, says):
    with pytest.raises(DataError, match=f"row 7: .*{says}"):
        vision.image_data_url(value, "row 7")


def test_a_trajectory_of_a_row_with_a_pil_picture_checkpoints_without_its_prompt_parts(vlm_dir, processor, tmp_path):
    """A row's image values (a PIL image from a hub dataset) are what an agent is shown, never a checkpoint's: a
    stored trajectory loads with ``weights_only``."""
    from grpo.system.rollout import new_trajectories

    row = dataset(vlm_dir, processor, [image_row("r:0", Image.new("RGB", (20, 12), (9, 9, 9)))])[0]
    traj = new_trajectories([row], 1)[0]
    assert traj.prompt_parts is row.prompt_parts and isinstance(row.prompt_parts[0][0]["image"], Image.Image)
    torch.save({"t": traj.to_dict()}, tmp_path / "t.pt")
    back = type(traj).from_dict(torch.load(tmp_path / "t.pt", weights_only=True)["t"])
    assert back.prompt_parts is None and back.token_ids() == row.prompt_ids


def test_qwen2_vls_vision_tower_is_found_and_its_positions_are_computed():
    """Qwen2-VL's tower is ``model.visual``; its 3-D M-RoPE positions are computed (tests/unit/test_mrope.py), so it
    loads."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(text_config=dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=1, intermediate_size=64, bos_token_id=1,
                                            eos_token_id=2),
                           vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2))
    vision.check_positions(Qwen2VLForConditionalGeneration(config))
    assert vision.vision_tower_path(Qwen2VLForConditionalGeneration(config)) == "model.visual"


def test_a_local_jsonl_of_nemo_rl_image_rows_loads_through_the_data_path(vlm_dir, processor, tmp_path):
    """NeMo-RL's VLM row format in a local file (a user message of image and text parts; an image as a path next to
    the file, or a data: URL) goes through `load_rows` and `PromptDataset` like any other file; a missing image names
    the file's line."""
    import json

    from grpo.system.data import load_rows

    (tmp_path / "img.png").write_bytes(png((0, 0, 200)))
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "img.png")},
                                                       {"type": "text", "text": "colour?"}]}], "answer": "blue"},
            {"messages": [{"role": "user", "content": [{"type": "image", "image": data_url((200, 0, 0))},
                                                       {"type": "text", "text": "colour?"}]}], "answer": "red"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = MasterConfig.model_validate({"data": {"dataset_name": str(path), "input_key": "messages",
                                                "output_key": "answer", "num_train_samples": 2}}).data
    loaded = load_rows(cfg, "train", seed=0)
    ds = dataset(vlm_dir, processor, loaded)
    assert [r.answer for r in ds] == ["blue", "red"] and all(r.media["pixel_values"].shape[0] == 1 for r in ds)
    (tmp_path / "img.png").unlink()
    with pytest.raises(DataError, match=r"train.jsonl:1: image .*img.png.*: no such file"):
        dataset(vlm_dir, processor, load_rows(cfg, "train", seed=0))


def test_a_dataset_keeps_its_image_rows_values_not_their_pixels_and_renders_them_when_drawn(vlm_dir, processor,
                                                                                         tmp_path):
    """The rows' media are not held for the run (a dataset of 70K pictures would hold every picture's pixel values):
    an item is rendered again when drawn, to the tensors the first rendering made; a picture deleted after loading
    fails the draw naming the row."""
    import json

    from grpo.system.data import load_rows
    from grpo.system.vision import render_prompt

    (tmp_path / "img.png").write_bytes(png((0, 0, 200)))
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "img.png")},
                                                      {"type": "text", "text": "colour?"}]}], "answer": "blue"}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row) + "\n")
    cfg = MasterConfig.model_validate({"data": {"dataset_name": str(path), "input_key": "messages",
                                                "output_key": "answer", "num_train_samples": 1}}).data
    ds = dataset(vlm_dir, processor, load_rows(cfg, "train", seed=0))
    assert ds.items[0].media is None  # what the dataset holds for the run
    first, again = ds[0], ds[0]
    assert first.media is not again.media and torch.equal(first.media["pixel_values"], again.media["pixel_values"])
    chat_row = ds.items[0]
    _, eager = render_prompt(processor, ds_chat(ds), [{"role": "user", "content": row["messages"][0]["content"]}], "x")
    assert torch.equal(first.media["pixel_values"], eager["pixel_values"]) and first.prompt_ids == chat_row.prompt_ids
    (tmp_path / "img.png").unlink()
    with pytest.raises(DataError, match=r"train.jsonl:1: image .*img.png.*: no such file"):
        ds[0]


def ds_chat(ds):
    formatter, _, _ = next(iter(ds._render.values()))
    return formatter.chat


def test_a_hub_datasets_image_columns_are_read_undecoded():
    """`undecoded`: an image column (and a list of them) gives the stored bytes, which the data path reads to the same
    picture, instead of a decoded PIL image held per row."""
    import datasets

    from grpo.system.data import undecoded
    from grpo.system.vision import load_image

    img = Image.new("RGB", (8, 6), (1, 2, 3))
    features = datasets.Features({"image": datasets.Image(), "images": datasets.List(datasets.Image()),
                                  "problem": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"image": [img], "images": [[img, img]], "problem": ["x"]}, features=features)
    row = undecoded(ds)[0]
    assert set(row["image"]) == {"bytes", "path"} and set(row["images"][1]) == {"bytes", "path"}
    assert load_image(row["image"], "w").tobytes() == img.tobytes() == load_image(row["images"][1], "w").tobytes()
    text = datasets.Dataset.from_dict({"problem": ["x"]})
    assert undecoded(text) is text
