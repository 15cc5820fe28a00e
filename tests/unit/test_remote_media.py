"""Image prompts on generation ranks of their own (policy.generation.colocated.enabled=false): the trainers' generate
command carries each prompt group's media once (`grpo.system.media.pack_media`), the generation rank hands each
prompt its images (`grpo.system.generation.server._run_generate`), and an in-flight continuation keeps its prompt's
images. (The wire and the hf backend end to end: tests/e2e/test_vlm_async_e2e.py.)"""

from __future__ import annotations

import torch

from grpo.system.bridge import from_bytes_tensor, to_bytes_tensor
from grpo.system.generation.base import GenerationBackend, GenerationOutput
from grpo.system.generation.remote import RemoteGeneration, generate_command
from grpo.system.generation.server import _run_generate
from grpo.system.media import media_bytes

G = 4


def picture(seed: int) -> dict:
    return {"pixel_values": torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(seed))}


def group_batch(n_prompts: int = 2):
    """``n_prompts`` prompt groups of G samples, each group's samples holding its prompt's one media dict; a text
    prompt's G samples last (no media)."""
    media = [m for p in range(n_prompts) for m in [picture(p)] * G] + [None] * G
    prompts = [[1, 9, 9, p] for p in range(len(media))]
    return prompts, list(range(len(media))), [4] * len(media), [None] * len(media), media


class Recording(GenerationBackend):
    """A generation rank's backend that records what each generate call received."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, seeds, *, greedy=False, max_new_tokens=None, stop_strings=None, sampling=None,
                 **kw):
        self.calls.append(kw.get("media"))
        return [GenerationOutput(p, [3], [-0.5], "stop", "x") for p in prompt_ids]


def test_a_generate_command_carries_each_groups_images_once_and_the_rank_hands_each_prompt_its_own():
    prompts, seeds, caps, stops, media = group_batch()
    command = generate_command(prompts, seeds, caps, stops, False, None, media, slice(0, len(prompts)))
    wire = to_bytes_tensor(("generate", command)).numel()
    one_picture = media_bytes([media[0]])
    assert 2 * one_picture <= wire < 2 * one_picture + 4096, (wire, one_picture)  # 2 pictures, not 2 x G
    backend = Recording()
    _, arg = from_bytes_tensor(to_bytes_tensor(("generate", command)))  # as the generation rank receives it
    kind, outputs = _run_generate(backend, arg)
    assert kind == "ok" and len(outputs) == len(prompts)
    (got,) = backend.calls
    assert [m is None for m in got] == [m is None for m in media]
    for p in range(2):  # each sample its prompt's pixels; a group's samples one dict again
        mine = got[p * G:(p + 1) * G]
        assert all(m is mine[0] for m in mine) and torch.equal(mine[0]["pixel_values"], media[p * G]["pixel_values"])
    assert got[0] is not got[G]


def test_a_share_of_the_batch_carries_its_own_images_and_text_prompts_none():
    prompts, seeds, caps, stops, media = group_batch()
    share = generate_command(prompts, seeds, caps, stops, False, None, media, slice(G + 2, 2 * G + 2))
    distinct, index = share["media"]
    assert len(distinct) == 1 and index == [0, 0, None, None]
    assert torch.equal(distinct[0]["pixel_values"], media[G]["pixel_values"])
    text_only = generate_command(prompts, seeds, caps, stops, False, None, None, slice(0, 2))
    assert "media" not in text_only
    backend = Recording()
    assert _run_generate(backend, text_only)[0] == "ok" and backend.calls == [None]  # a text model's call as before


def test_a_command_whose_media_do_not_match_its_prompts_is_answered_as_an_error():
    prompts, seeds, caps, stops, media = group_batch()
    command = generate_command(prompts, seeds, caps, stops, False, None, media, slice(0, 3))
    command["prompts"] = command["prompts"][:2]
    kind, message = _run_generate(Recording(), command)
    assert kind == "error" and "media for 3 rows, expected 2" in message


def test_in_flight_continuations_keep_their_prompts_images():
    """Requests decoded 2 tokens a round: the request over picture ``a`` stops in round 0, the one over ``b`` runs to
    its cap of 6 tokens; each round's unfinished request goes back with its own picture."""
    gen = RemoteGeneration.__new__(RemoteGeneration)
    gen.stop_ids, gen.chunk_tokens, gen.version, gen._stale_cache = [0], 2, 0, False
    gen.stats = {"multi_version_samples": 0}
    gen._decode = lambda ids: ""
    a, b = picture(0), picture(1)
    seen = []

    def fake_round(prompts, seeds, caps, stops, *, greedy, sampling, media=None):
        seen.append(media)
        return [GenerationOutput(p, [0] if m is a else [5] * c, [0.0] if m is a else [-1.0] * c,
                                 "stop" if m is a else "length", "") for p, c, m in zip(prompts, caps, media)]

    gen._round, gen.in_flight = fake_round, lambda: None
    out = gen._generate_in_flight([[1, 2, 3], [1, 2, 3]], [1, 2], [6, 6], [None, None], greedy=False, sampling=None,
                                  media=[a, b])
    assert [[id(m) for m in r] for r in seen] == [[id(a), id(b)], [id(b)], [id(b)]]
    assert out[0].completion_ids == [0] and out[1].completion_ids == [5] * 6


def test_the_trainers_generate_call_passes_each_prompts_images_on_and_refuses_a_mismatch():
    """One trainer (no gloo group): `RemoteGeneration.generate` packs the media for the trainers' gather and hands the
    whole batch's, one dict per prompt group again, to the round that goes over the bridge."""
    import pytest

    from grpo.config import MasterConfig
    from grpo.system.dist import Layout

    gen = RemoteGeneration.__new__(RemoteGeneration)
    gen.cfg = MasterConfig.model_validate({})
    gen.layout, gen.group, gen.in_flight = Layout("train", 0, 1, 0, 2, 1), None, None
    gen.sampling = gen.cfg.policy.generation.sampling()
    seen = []

    def fake_round(prompts, seeds, caps, stops, *, greedy, sampling, media=None):
        seen.append(media)
        return [GenerationOutput(p, [5], [-1.0], "length", "") for p in prompts]

    gen._round = fake_round
    prompts, seeds, _, _, media = group_batch()
    assert len(gen.generate(prompts, seeds, media=media)) == len(prompts)
    (got,) = seen
    assert [id(m) for m in got] == [id(m) for m in media]
    gen.generate(prompts[:2], seeds[:2])
    assert seen[-1] is None  # text prompts: no media travel
    with pytest.raises(ValueError, match="2 prompts but media for 3"):
        gen.generate(prompts[:2], seeds[:2], media=media[:3])
