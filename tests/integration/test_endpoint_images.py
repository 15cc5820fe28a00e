"""The endpoint with images (issue 47), on loopback, driven by the official ``openai`` client (raw HTTP for what a
client cannot send): a vision-language policy (``toy:tiny_vlm``, LLaVA) answers ``image_url`` parts with the token
fields, renders them exactly as the data path renders a row (/tokenize and the recorded images equal it), splices a
history whose first turn had a picture, takes a picture in a tool result, and a trajectory played over it trains
token-exact; every bad image is a clear 4xx (grpo/wings/agents/endpoint.py, openai_images.py)."""

from __future__ import annotations

import base64
import http.server
import json
import threading
import time

import httpx
import openai
import pytest
import torch

from grpo.batch import build_batch
from grpo.config import MasterConfig
from grpo.system.data import PromptDataset, PromptFormatter
from grpo.system.generation.hf import HFGeneration
from grpo.system.rollout import new_trajectories
from grpo.system.training import forward_logprobs
from grpo.tasks.factory import build_environments
from grpo.tasks.rows import PromptRow
from grpo.tasks.toy import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model
from grpo.tasks.visual import IMAGE_TOKENS
from grpo.wings.agents.endpoint import Endpoint
from grpo.wings.agents.player import AgentPlayer, prompts_shown
from tests.helpers.image_agents import MODEL, TEMPLATE, data_url, image_part, mult_prob_error, vlm_endpoint
from tests.helpers.vision_rows import image_row, png, text_row
from tests.helpers.vision_rows import qwen  # noqa: F401 (fixture: the tiny Qwen2-VL, then the tiny Qwen2.5-VL)

RED, BLUE = data_url((255, 0, 0)), data_url((0, 0, 255))
QUESTION = [{"role": "user", "content": [image_part(RED), {"type": "text", "text": "colour?"}]}]
BODY_LIMIT = 40_000


def _cfg(**http_server) -> MasterConfig:
    return MasterConfig.model_validate({
        "policy": {"model_name": MODEL, "precision": "float32", "max_total_sequence_length": 96,
                   "tokenizer": {"chat_template": TEMPLATE},
                   "generation": {"max_new_tokens": 6, "port_range_low": 25000, "port_range_high": 25999,
                                  "http_server": {"batch_window_s": 0.05, "max_body_bytes": BODY_LIMIT,
                                                  **http_server}}},
        "env": {"name": "agent", "agent": {"fn": "tests.helpers.image_agents:picture_agent"}}})


@pytest.fixture(scope="module")
def served():
    ep = vlm_endpoint(_cfg(max_image_pixels=64 * 64))
    yield ep
    ep.close()


def _client(ep, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=key or ep.api_key, max_retries=0, timeout=60)


def _post(ep, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(ep.base_url.removesuffix("/v1") + path, content=content, timeout=60,
                      headers={"Authorization": f"Bearer {ep.api_key}", "Content-Type": "application/json"})


def _data_path(ep, messages: list[dict]) -> tuple[list[int], dict]:
    """The data path's (ids, media) for ``messages`` written as a data row (image parts ``{"type": "image"}``)."""
    row = [{"role": m["role"], "content": [{"type": "image", "image": p["image_url"]["url"]} if p["type"] == "image_url"
                                           else p for p in m["content"]]} for m in messages]
    formatter = PromptFormatter(ep.tokenizer, ep.cfg.data, TEMPLATE, processor=ep.processor)
    prompt, media = formatter.prompt_messages_and_media(row, "row 0")
    return [t for m in prompt for t in m["token_ids"]], media


def test_an_image_request_answers_the_token_fields_rendered_as_the_data_path_renders_the_row(served):
    image_id = served.tokenizer.convert_tokens_to_ids("<image>")
    key = served.open_session("s0")
    with served.serving(weight_version=3):
        r = _client(served, key).chat.completions.create(model=MODEL, messages=QUESTION, top_p=1.0, logprobs=True)
    [record] = served.close_session(key)
    extra = r.choices[0].message.model_extra
    gen, lps = extra["generation_token_ids"], extra["generation_log_probs"]
    assert 1 <= len(gen) <= 6 and len(lps) == len(gen) and all(-9999.0 <= x <= 0 for x in lps)
    assert image_id not in gen and r.model_extra["weight_version"] == 3
    assert extra["prompt_token_ids"].count(image_id) == IMAGE_TOKENS  # the placeholder expanded, once
    ids, media = _data_path(served, QUESTION)
    tokens = _post(served, "/tokenize", {"model": MODEL, "messages": QUESTION}).json()["tokens"]
    assert tokens == extra["prompt_token_ids"] == ids == record.prompt_token_ids
    assert torch.equal(record.media["pixel_values"], media["pixel_values"])  # the very tensors the data path makes


def test_a_history_with_a_picture_in_turn_one_is_spliced_and_a_tool_result_takes_a_picture(served):
    image_id = served.tokenizer.convert_tokens_to_ids("<image>")
    c = _client(served)
    with served.serving():
        first = c.chat.completions.create(model=MODEL, messages=QUESTION, top_p=1.0, logprobs=True, seed=1)
        msg = first.choices[0].message
        history = QUESTION + [msg.model_dump(exclude_none=True)]
        second = c.chat.completions.create(model=MODEL, messages=history + [
            {"role": "user", "content": "and now?"}], top_p=1.0, logprobs=True, seed=2)
        third = c.chat.completions.create(model=MODEL, messages=history + [
            {"role": "tool", "tool_call_id": "call_0", "content": [{"type": "text", "text": "look:"},
                                                                   image_part(BLUE)]}],
            top_p=1.0, logprobs=True, seed=3)
    seen = msg.model_extra["prompt_token_ids"] + msg.model_extra["generation_token_ids"]
    for later, pictures in ((second, 1), (third, 2)):
        prompt = later.choices[0].message.model_extra["prompt_token_ids"]
        assert prompt[:len(seen)] == seen  # the model's own tokens, then the new turn
        assert prompt.count(image_id) == pictures * IMAGE_TOKENS


def _noise_png(side: int) -> bytes:
    """A PNG of random pixels (it does not compress: its size grows with ``side``)."""
    from PIL import Image
    import io

    noise = torch.randint(0, 256, (side, side, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise.numpy()).save(buf, format="PNG")
    return buf.getvalue()


def _png_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("content, words", [
    ([image_part("https://example.com/cat.png")], "allow_remote_images=false"),
    ([image_part("data:image/png;base64,@@not base64@@")], "base64 cannot be decoded"),
    ([image_part("data:text/plain;base64,aGk=")], "is not a base64 image"),
    ([image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode())], "cannot be read"),
    ([image_part(_png_url(_noise_png(16)[:400]))], "image file is truncated"),
    ([image_part("/etc/passwd")], "neither a data: URL nor an http(s) URL"),
    ([{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}], "without a url"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "of type 'input_audio'"),
    ([image_part(data_url((0, 0, 0), size=(65, 64)))], "content.0: the image is 65x64 = 4160 pixels, over the 4096"),
    ([image_part(data_url((0, 0, 0), size=(48, 48)))] * 2, "content.1: the image is 48x48 = 2304 pixels, over the 1792"),
    ([image_part(RED), {"type": "text", "text": "<image> twice"}], "image placeholder '<image>' 2 time(s) for 1 picture(s)"),
    ([image_part("data:image/png;base64,AAAA")] * 97, "97 image parts, more than"),
])
def test_a_bad_image_part_is_a_400_naming_it(served, content, words):
    with served.serving(), pytest.raises(openai.BadRequestError) as err:
        _client(served).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                top_p=1.0)
    assert words in err.value.body["message"], err.value.body
    assert err.value.body["message"].startswith("messages"), err.value.body


def test_a_history_whose_tokens_lost_their_picture_is_a_400(served):
    with served.serving():
        first = _client(served).chat.completions.create(model=MODEL, messages=QUESTION, top_p=1.0, logprobs=True)
    msg = first.choices[0].message.model_dump(exclude_none=True)
    image_id = served.tokenizer.convert_tokens_to_ids("<image>")
    msg["prompt_token_ids"] = [t for t in msg["prompt_token_ids"] if t != image_id]
    with served.serving(), pytest.raises(openai.BadRequestError) as err:
        _client(served).chat.completions.create(model=MODEL, messages=QUESTION + [msg, {"role": "user",
                                                                                        "content": "?"}], top_p=1.0)
    assert "0 image placeholder(s) where the request's images take 4" in err.value.body["message"]


def test_an_image_over_the_body_limit_is_a_413_and_the_server_goes_on(served):
    big = _png_url(_noise_png(120))
    assert len(big) > BODY_LIMIT
    with served.serving(), pytest.raises(openai.APIStatusError) as err:
        _client(served).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            image_part(big)]}], top_p=1.0)
    assert err.value.status_code == 413 and "max_body_bytes" in err.value.body["message"]
    with served.serving():  # the next request is served
        assert _client(served).chat.completions.create(model=MODEL, messages=QUESTION, top_p=1.0).choices


def test_a_text_only_policy_answers_an_image_part_400_naming_it():
    cfg = _cfg()
    cfg.policy.tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    tok = build_char_tokenizer(SIMPLE_CHAT_TEMPLATE)
    model = build_tiny_model(tok)
    ep = Endpoint(cfg, HFGeneration(cfg.policy, tok, model.config, "cpu", model=model), tok)
    ep.start()
    try:
        with ep.serving(), pytest.raises(openai.BadRequestError) as err:
            _client(ep).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
                {"type": "text", "text": "colour?"}, image_part(RED)]}], top_p=1.0)
        assert err.value.body["param"] == "messages.0.content.1"
        assert "messages.0.content.1: an image part" in err.value.body["message"]
        assert "text model" in err.value.body["message"]
    finally:
        ep.close()


class _Pictures(http.server.BaseHTTPRequestHandler):
    """Serves a small PNG at /small.png, a large body at /large.png, and at /drip.png a body a byte every 0.2 s."""

    def do_GET(self):
        url = RED if self.path != "/large.png" else data_url((0, 9, 0), size=(64, 64)) * 40
        body = base64.b64decode(url.partition(",")[2]) if self.path != "/large.png" else url.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path != "/drip.png":
            self.wfile.write(body)
            return
        try:
            for i in range(len(body)):
                self.wfile.write(body[i:i + 1])
                self.wfile.flush()
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):  # the endpoint gave up on it, as it should
            pass

    def log_message(self, *args):
        pass


def test_remote_images_are_fetched_only_where_the_run_allows_them_and_bounded():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{server.server_address[1]}"
    ep = vlm_endpoint(_cfg(allow_remote_images=True, max_image_bytes=2_000, read_timeout_s=1.0))
    try:
        remote = [{"role": "user", "content": [image_part(f"{root}/small.png"), {"type": "text", "text": "colour?"}]}]
        tokens = _post(ep, "/tokenize", {"model": MODEL, "messages": remote}).json()["tokens"]
        assert tokens == _data_path(ep, QUESTION)[0]  # the same picture as the data: URL
        r = _post(ep, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": [
            image_part(f"{root}/large.png")]}]})
        assert r.status_code == 400 and "max_image_bytes" in r.json()["error"]["message"]
        r = _post(ep, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": [
            image_part(f"{root}/small.png".replace(str(server.server_address[1]), "1"))]}]})
        assert r.status_code == 400 and "could not be fetched" in r.json()["error"]["message"]
        t0 = time.monotonic()  # a server that drips its bytes (each within the read timeout) is cut at the deadline
        r = _post(ep, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": [
            image_part(f"{root}/drip.png")]}]})
        assert r.status_code == 400 and "did not arrive within 1 s" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10
    finally:
        ep.close()
        server.shutdown()


def test_an_agents_picture_trajectory_trains_token_exact(served):
    """An agent sends a picture, then a tool result with another: the sample's trajectory is built from the recorded
    tokens and carries both pictures, and the trainer's logprobs of its generated tokens equal the sampler's
    (token_mult_prob_error within 1e-3 of 1)."""
    envs = build_environments(served.cfg.env)
    ids = served.tokenizer("go")["input_ids"]
    rows = [PromptRow(0, "go", "red", "agent", [{"role": "user", "content": "go", "token_ids": ids}], ids)]
    trajs = new_trajectories(rows, 2)
    AgentPlayer(served).play(trajs, [(1, 0, i, "train") for i in range(2)], envs)
    assert all(t.failure is None and not t.mask_sample and t.turns == 2 for t in trajs), [t.failure for t in trajs]
    assert all(t.media["pixel_values"].shape[0] == 2 for t in trajs)
    assert abs(mult_prob_error(served.model, trajs, served.tokenizer.pad_token_id) - 1.0) < 1e-3
    # the pictures are what makes it exact: the tool result's picture swapped for another, the same tokens score
    # otherwise
    batch = build_batch(trajs, served.tokenizer.pad_token_id)
    other = [{"pixel_values": m["pixel_values"].flip(0)} for m in batch.media]
    with torch.no_grad():
        seen_bt = forward_logprobs(served.model, batch.input_ids_bt, batch.attention_mask_bt, media=batch.media)
        swapped_bt = forward_logprobs(served.model, batch.input_ids_bt, batch.attention_mask_bt, media=other)
    mask_bt = batch.token_mask_bt.bool()
    assert not torch.allclose(seen_bt[mask_bt], swapped_bt[mask_bt], atol=1e-5)


def _image_rows(tmp_path) -> list[dict]:
    """A row whose picture is a datasets Image value (bytes), one whose picture is a JPEG file, a text row, a row of
    two pictures (a PIL image, as a hub dataset decodes one, and a data: URL)."""
    from PIL import Image

    Image.new("RGB", (20, 12), (0, 160, 40)).save(tmp_path / "green.jpg", quality=80)
    return [image_row("r:0", {"bytes": png((255, 0, 0)), "path": None}), image_row("r:1", str(tmp_path / "green.jpg")),
            text_row("r:2"), image_row("r:3", Image.new("RGBA", (24, 10), (40, 0, 200, 90)), data_url((1, 2, 3)))]


def test_an_agent_forwarding_an_image_rows_messages_trains_token_exact_on_the_data_paths_ids(served, tmp_path):
    """An agent on an image dataset gets the row's picture as an ``image_url`` part (a data: URL): forwarding the
    row's messages unchanged, its request renders to the row's own ids (/tokenize), its sample's prompt tokens and
    pictures are the row's, and it trains token-exact; a text row's messages stay text."""
    formatter = PromptFormatter(served.tokenizer, served.cfg.data, TEMPLATE, processor=served.processor)
    prompts = PromptDataset(_image_rows(tmp_path), formatter, default_task="agent")
    trajs = new_trajectories(list(prompts), 2)
    shown = prompts_shown(trajs)
    for row, messages in zip(prompts, shown[::2]):
        tokens = _post(served, "/tokenize", {"model": MODEL, "messages": messages}).json()["tokens"]
        assert tokens == row.prompt_ids, row.source
    assert [p["type"] for p in shown[0][0]["content"]] == ["image_url", "text"]
    assert shown[2][0]["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")  # the file's bytes
    assert shown[4] == [{"role": "user", "content": "text only"}]  # a text row as it was
    assert [p["type"] for p in shown[6][0]["content"]] == ["image_url", "image_url", "text"]
    envs = build_environments(MasterConfig.model_validate(
        {"env": {"name": "agent", "agent": {"fn": "tests.helpers.image_agents:forwarding_agent"}}}).env)
    AgentPlayer(served).play(trajs, [(1, 0, i, "train") for i in range(len(trajs))], envs)
    assert all(t.failure is None and t.turns == 1 for t in trajs), [t.failure for t in trajs]
    for t in trajs:
        row = prompts[t.group_id]
        assert t.messages[0].token_ids == row.prompt_ids
        assert (t.media is None) == (row.media is None)
        if row.media is not None:
            assert torch.equal(t.media["pixel_values"], row.media["pixel_values"])
    assert abs(mult_prob_error(served.model, trajs, served.tokenizer.pad_token_id) - 1.0) < 1e-3


def test_a_row_whose_picture_file_is_gone_by_play_time_fails_that_sample_only(tmp_path):
    """A picture read when the data loaded and deleted before the agent plays: that row's samples fail
    (``env_error``, naming the file), once per prompt group; the others are shown."""
    from grpo.tasks.visual import build_vlm_processor, build_vlm_tokenizer

    tok = build_vlm_tokenizer()
    cfg = _cfg()
    formatter = PromptFormatter(tok, cfg.data, TEMPLATE, processor=build_vlm_processor(tok))
    trajs = new_trajectories(list(PromptDataset(_image_rows(tmp_path), formatter)), 2)
    (tmp_path / "green.jpg").unlink()
    shown = prompts_shown(trajs)
    assert shown[2] is shown[3] and shown[2].reason == "env_error" and "green.jpg" in shown[2].detail
    assert shown[0] is shown[1] and shown[0][0]["content"][0]["type"] == "image_url"


def test_a_qwen_vl_policy_renders_its_pictures_as_the_data_path_and_answers_with_its_own_positions(qwen):
    """Another processor (Qwen2-VL's and Qwen2.5-VL's: a picture's placeholder count follows its size, M-RoPE
    positions): /tokenize and the recorded media equal the data path's for two pictures of different shapes, and a
    chat generates on them."""
    from tests.helpers.vision_rows import data_url as sized_url

    _, processor, model = qwen
    cfg = _cfg()
    cfg.policy.tokenizer.chat_template = processor.tokenizer.chat_template
    ep = Endpoint(cfg, HFGeneration(cfg.policy, processor.tokenizer, model.config, "cpu", model=model),
                  processor.tokenizer, processor=processor)
    ep.start()
    messages = [{"role": "user", "content": [image_part(sized_url((0, 0, 255), size=(8, 24))), {"type": "text",
                 "text": "and"}, image_part(sized_url((9, 9, 9), size=(16, 16))), {"type": "text", "text": "?"}]}]
    try:
        formatter = PromptFormatter(ep.tokenizer, cfg.data, ep.chat_template, processor=processor)
        row = [{"role": "user", "content": [{"type": "image", "image": p["image_url"]["url"]} if p["type"] == "image_url"
                                            else p for p in messages[0]["content"]]}]
        prompt, media = formatter.prompt_messages_and_media(row, "row 0")
        key = ep.open_session("q")
        with ep.serving():
            r = _client(ep, key).chat.completions.create(model=MODEL, messages=messages, top_p=1.0, logprobs=True)
        [record] = ep.close_session(key)
        tokens = _post(ep, "/tokenize", {"model": MODEL, "messages": messages}).json()["tokens"]
        assert tokens == record.prompt_token_ids == [t for m in prompt for t in m["token_ids"]]
        assert tokens.count(model.config.image_token_id) == 3 + 4  # 8x24 and 16x16 pixels: 3 and 4 placeholders
        assert all(torch.equal(record.media[k], media[k]) for k in media) and set(record.media) == set(media)
        assert r.choices[0].message.model_extra["generation_token_ids"]
    finally:
        ep.close()
