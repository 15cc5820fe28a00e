"""A vision-language run's images in the async replay deque (grpo/system/replay.py) and its checkpoint: a prompt
group's samples reference one media dict, in the deque, in the saved file (once per group, loadable with
``torch.load(weights_only=True)``) and after a resume, as the synchronous path's rollouts do."""

import io

import torch

from grpo.batch import build_batch
from grpo.system.replay import GroupInfo, ReplayBuffer, groups_from_trajectories, trajectories_from_groups
from grpo.system.media import media_bytes
from grpo.trajectory import Message, Trajectory

G = 3  # samples per prompt


def picture(seed: int) -> dict:
    """One prompt's media as a LLaVA processor makes it: 48 KiB of pixels."""
    return {"pixel_values": torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(seed))}


def vlm_rollout(media: list[dict]) -> list[Trajectory]:
    """G samples per prompt, each prompt's samples holding its one media dict (`grpo.system.rollout`'s way)."""
    return [Trajectory(p, 20 + p, "visual", "q", "a", [Message("user", "<image>q", [1, 5, 5, 2]),
                                                       Message("assistant", "red", [7, 8], [-0.5, -0.25])],
                       {}, reward=float(i % 2), media=m)
            for p, m in enumerate(media) for i in range(G)]


def saved(buf: ReplayBuffer) -> bytes:
    f = io.BytesIO()
    torch.save(buf.state_dict(), f)
    return f.getvalue()


def test_a_groups_images_are_stored_once_in_the_deque_and_its_checkpoint_and_come_back_shared():
    media = [picture(0), picture(1)]
    one_picture = media_bytes(media[:1])
    groups = groups_from_trajectories(vlm_rollout(media), GroupInfo())
    for g, m in zip(groups, media):  # in the deque: the rollout's dict itself, never a copy per sample
        assert all(t["media"] is m for t in g.trajectories)
    buf = ReplayBuffer(max_age_steps=1)
    buf.put(groups, [0, 0], target_version=1)

    data = saved(buf)
    assert len(data) < 2 * one_picture + 16_384, (len(data), one_picture)  # two pictures, not 2 x G
    back = ReplayBuffer(max_age_steps=1)
    back.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))
    assert len(saved(back)) < 2 * one_picture + 16_384  # a resumed run saves them once again (not the file's exact
    # size: the pickle around the pictures moves with every field a sample gains)
    entries, _ = back.take(step=1, n=2)
    trajs = trajectories_from_groups([e.group for e in entries])
    for p, m in enumerate(media):
        mine = [t.media for t in trajs if t.group_id == p]
        assert len(mine) == G and all(x is mine[0] for x in mine)
        assert torch.equal(mine[0]["pixel_values"], m["pixel_values"])
    batch = build_batch(trajs, pad_id=0)  # the step's batch: one dict per prompt, shared by its rows
    assert media_bytes(batch.media) == 2 * one_picture


def test_payload_figures_count_a_groups_picture_once_as_held_and_once_per_sample_as_logical():
    """NeMo-RL's multimodal payload names (grpo.debug_payload_metrics) for the step's training batch."""
    from grpo.system.media import payload_metrics, share_media

    media = [picture(0), picture(1)]
    batch = build_batch(vlm_rollout(media), pad_id=0)
    one = media_bytes(media[:1])
    m = payload_metrics(batch.media, "policy_train")
    assert m["payload_bytes/policy_train/physical_media_total"] == 2 * one
    assert m["payload_bytes/policy_train/logical_media_total"] == 2 * G * one
    assert m["payload_bytes/policy_train/estimated_saved_total"] == 2 * (G - 1) * one
    assert m["payload_counts/policy_train/physical_segments_total"] == 2  # one pixel_values tensor per prompt
    assert m["payload_counts/policy_train/logical_segments_total"] == 2 * G
    assert m["payload_ratio/policy_train/physical_to_logical"] == 1 / G
    copied = share_media(batch.media, dedup=False)  # a copy per sample: nothing shared
    assert payload_metrics(copied, "policy_train")["payload_ratio/policy_train/physical_to_logical"] == 1.0
    assert payload_metrics(None, "policy_train") == payload_metrics([None, None], "policy_train") == {}
