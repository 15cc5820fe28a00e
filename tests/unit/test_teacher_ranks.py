"""The distillation teacher on ranks of its own (on_policy_distillation.non_colocated_teachers): the padding to the
training width, the rank layout, the config's launch rules, and trainer 0's side against a real teacher rank (a
second process on the teacher bridge: it scores what the training rank's teacher scores; one that cannot load, dies
or hangs stops the trainers with one line, never a wait); teachers by agent or task on a block of teacher ranks each
(trainer 0 against real processes on the teacher bridge that answer what they were sent: the routing and the row
order, an alias's rank that dies or hangs named with its alias)."""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from grpo.config import GenerationConfig, MasterConfig, generation_split_problem, teacher_ranks
from grpo.system.dist import Layout, split_ranks, teacher_block
from grpo.system.teacher import (PEERS, PREFIX, RemoteTeacher, ScoreRequest, TeacherError, build_teacher,
                                 pad_teacher_logprobs)
from grpo.system.bridge import Bridge
from grpo.system.media import pack_media
from tests.helpers.e2e import REPO, child_env, free_port
from tests.helpers.teacher_peer import teacher_config
from tests.helpers.vision_rows import processor, vlm_dir  # noqa: F401 (fixtures)


# ---------------------------------------------------------------- padding to the training width
def test_teacher_logprobs_are_right_padded_with_zeros_to_the_training_width():
    lp_bt = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    padded = pad_teacher_logprobs(lp_bt, 5)
    assert padded.shape == (2, 5) and torch.equal(padded[:, :2], lp_bt) and not padded[:, 2:].any()
    assert pad_teacher_logprobs(lp_bt, 2) is lp_bt  # already the width: as it is


def test_teacher_logprobs_wider_than_the_batch_are_refused_as_nemo_rl_does():
    with pytest.raises(ValueError, match="3 tokens wide, wider than the training batch's 2"):
        pad_teacher_logprobs(torch.zeros(1, 3), 2)


def test_a_request_carries_the_rows_cut_to_the_longest_and_each_image_dict_once():
    image = {"pixel_values": torch.ones(2, 3)}
    batch = ScoreRequest(torch.tensor([[4, 5, 6, 0, 0], [7, 8, 0, 0, 0]]),
                         torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]),
                         torch.tensor([[0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]), [image, image])
    request = ScoreRequest.of(batch)
    assert request.input_ids_bt.tolist() == [[4, 5, 6], [7, 8, 0]]
    assert request.token_mask_bt.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert request.media == pack_media([image, image]) and len(request.media[0]) == 1
    rows = request.rows()
    assert rows.media[0] is rows.media[1] and torch.equal(rows.media[0]["pixel_values"], image["pixel_values"])


# ---------------------------------------------------------------- layout and config
def test_teacher_ranks_sit_between_the_trainers_and_the_generation_ranks():
    assert [split_ranks(r, 6, 2, 3) for r in range(6)] == [
        ("train", 0, 1), ("teach", 0, 3), ("teach", 1, 3), ("teach", 2, 3), ("generate", 0, 2), ("generate", 1, 2)]
    assert [split_ranks(r, 2, 0, 1) for r in range(2)] == [("train", 0, 1), ("teach", 0, 1)]
    assert Layout("teach", 0, 1, 1, 2, 0, None, 1).bridge_rank is None  # not on the generation bridge
    with pytest.raises(ValueError, match="1 generation and 1 teacher ranks of 2 leave none to train"):
        split_ranks(0, 2, 1, 1)


def opd(**nct) -> dict:
    return {"on_policy_distillation": {"enabled": True, "teacher_model_name": "toy:tiny",
                                       "non_colocated_teachers": {"enabled": True, **nct}}}


def test_teacher_ranks_follow_nemo_rl_names_and_defaults():
    assert teacher_ranks(MasterConfig.model_validate(opd()).on_policy_distillation) == 8  # NeMo-RL's 8 x 1
    two = MasterConfig.model_validate({**opd(default_teacher_cfg={"gpus_per_node": 2, "num_nodes": 2}),
                                       "cluster": {"num_nodes": 4, "gpus_per_node": 2}})
    assert teacher_ranks(two.on_policy_distillation) == 4
    off = opd()
    off["on_policy_distillation"]["enabled"] = False  # as NeMo-RL: without distillation, no teacher ranks
    assert teacher_ranks(MasterConfig.model_validate(off).on_policy_distillation) == 0


def test_a_launch_too_small_for_the_teacher_and_generation_ranks_names_both():
    gen = GenerationConfig(colocated={"enabled": False, "resources": {"gpus_per_node": 1}})
    assert generation_split_problem(gen, 3, num_teacher=1) is None
    problem = generation_split_problem(gen, 2, num_teacher=1)
    assert problem == ("policy.generation.colocated.resources: 1 generation ranks and "
                       "on_policy_distillation.non_colocated_teachers.default_teacher_cfg: 1 teacher ranks of the 2 "
                       "the launcher started leave none to train")


@pytest.mark.parametrize("overrides, expected", [
    ({"cluster": {"num_nodes": 1, "gpus_per_node": 2}, **opd(default_teacher_cfg={"gpus_per_node": 2})},
     "default_teacher_cfg.gpus_per_node=2: expected < cluster.gpus_per_node=2 (at least one rank must train)"),
    ({"cluster": {"num_nodes": 1, "gpus_per_node": 4}, **opd(default_teacher_cfg={"gpus_per_node": 2}),
      "policy": {"generation": {"colocated": {"enabled": False, "resources": {"gpus_per_node": 2}}}}},
     "default_teacher_cfg.gpus_per_node=2 + policy.generation.colocated.resources.gpus_per_node=2: expected < "
     "cluster.gpus_per_node=4"),
    ({"cluster": {"num_nodes": 1}, **opd(default_teacher_cfg={"gpus_per_node": 1, "num_nodes": 2})},
     "default_teacher_cfg.num_nodes=2 with cluster.num_nodes=1: expected 1"),
    ({"cluster": {"num_nodes": 2, "gpus_per_node": 8}, **opd(default_teacher_cfg={"gpus_per_node": 4})},
     "default_teacher_cfg.gpus_per_node=4 with cluster.num_nodes=2: expected cluster.gpus_per_node=8"),
    ({"cluster": {"num_nodes": 2, "gpus_per_node": 8}, **opd(default_teacher_cfg={"num_nodes": 2})},
     "default_teacher_cfg.num_nodes=2: expected < cluster.num_nodes=2 (at least one node must train)"),
    ({"cluster": {"num_nodes": 3, "gpus_per_node": 8}, **opd(default_teacher_cfg={"num_nodes": 2}),
      "policy": {"generation": {"colocated": {"enabled": False, "resources": {"gpus_per_node": 8, "num_nodes": 1}}}}},
     "default_teacher_cfg.num_nodes=2: expected < cluster.num_nodes=3 - 1 generation nodes"),
])
def test_teacher_resources_that_do_not_fit_the_cluster_fail_at_load_naming_the_key(overrides, expected):
    with pytest.raises(ValueError) as info:
        MasterConfig.model_validate(overrides)
    assert f"on_policy_distillation.non_colocated_teachers.{expected}" in str(info.value)


def test_teacher_resources_that_fit_load():
    MasterConfig.model_validate({"cluster": {"num_nodes": 1, "gpus_per_node": 4},
                                 **opd(default_teacher_cfg={"gpus_per_node": 1, "micro_batch_size": 2}),
                                 "policy": {"generation": {"colocated": {"enabled": False,
                                                                         "resources": {"gpus_per_node": 2}}}}})
    MasterConfig.model_validate({"cluster": {"num_nodes": 3, "gpus_per_node": 8}, **opd()})


# ---------------------------------------------------------------- trainer 0 and a teacher rank (two processes)
def _teacher_rank(mode: str, model: str = "toy:tiny", policy: str = "toy:tiny"):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.teacher_peer", str(port), mode, model, policy],
                            cwd=REPO, env=child_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    layout = Layout("train", 0, 1, 0, 2, 0, store, num_teacher=1)
    return layout, proc


def _connect(layout, timeout_s: float = 60.0) -> RemoteTeacher:
    layout.store.wait(["peer_up"])
    bridge = Bridge(layout.store, 0, 2, timeout_s, prefix=PREFIX, peers=PEERS)
    return RemoteTeacher(teacher_config("toy:tiny"), layout, bridge)


def _same_as_local(teacher: RemoteTeacher, cfg, batch, local) -> torch.Tensor:
    """The teacher rank's logprobs of ``batch``, checked equal to the training rank's teacher ``local``'s (packing
    settled as the run's setup settles it)."""
    from grpo.system.packed import settle_packing
    from grpo.system.training import frozen_logprobs

    settle_packing(cfg.policy, local.module)

    teacher.submit(batch)
    remote_bt = teacher.result(batch.input_ids_bt.shape[1])
    torch.testing.assert_close(remote_bt, frozen_logprobs(cfg, batch, local, 0, 1), rtol=0, atol=1e-6)
    assert (remote_bt * batch.token_mask_bt).abs().sum() > 0
    return remote_bt


def _rows(seed: int = 0) -> ScoreRequest:
    """Five rows of different lengths, padded two columns wider than the longest (as a batch can be)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 9, 5, 9]
    ids_bt = torch.randint(1, 89, (5, 11), generator=g)
    mask_bt = (torch.arange(11)[None, :] < torch.tensor(lengths)[:, None]).long()
    token_bt = mask_bt * (torch.arange(11)[None, :] >= 2).long()
    return ScoreRequest(ids_bt * mask_bt, mask_bt, token_bt)


def test_a_teacher_rank_scores_what_the_training_ranks_teacher_scores_padded_to_the_batch_width():
    layout, proc = _teacher_rank("serve")
    try:
        teacher = _connect(layout)
        cfg = teacher_config("toy:tiny")
        local = build_teacher(cfg, 0, 1)
        for seed in (0, 1):  # two steps over the same bridge
            remote_bt = _same_as_local(teacher, cfg, _rows(seed), local)
            assert remote_bt.shape == (5, 11) and not remote_bt[:, 9:].any()  # cut to 9 columns, padded back to 11
        teacher.close()
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
    finally:
        proc.kill()


@pytest.mark.slow  # 35 s: two processes load a vision-language model
def test_a_vision_language_teacher_rank_scores_each_row_with_its_images(vlm_dir, processor):
    """Rows with one image, two images and none (two rows per prompt, sharing its images) reach the teacher rank
    with their images: the same logprobs as the teacher on the training rank."""
    from tests.helpers.vision_rows import sample_batch, sample_prompts

    prompts, media = sample_prompts(vlm_dir, processor)
    batch = sample_batch(prompts, media, [0, 0, 3, 3, 4, 4])
    layout, proc = _teacher_rank("serve", vlm_dir, vlm_dir)
    try:
        teacher = _connect(layout)
        cfg = teacher_config(vlm_dir, vlm_dir)
        _same_as_local(teacher, cfg, batch, build_teacher(cfg, 0, 1))
        teacher.close()
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
    finally:
        proc.kill()


def test_a_teacher_that_cannot_load_stops_the_trainers_with_one_line_naming_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    layout, proc = _teacher_rank("serve", str(tmp_path))
    try:
        with pytest.raises(TeacherError) as info:
            _connect(layout)
        message = str(info.value)
        assert message.startswith("starting the teacher ranks: teacher rank 0: could not load "
                                  f"on_policy_distillation.teacher_model_name='{tmp_path}'"), message
        assert "\n" not in message
    finally:
        proc.kill()


def test_a_teacher_rank_that_dies_mid_step_is_named_at_once():
    layout, proc = _teacher_rank("die")
    try:
        teacher = _connect(layout)
        teacher.submit(_rows())
        with pytest.raises(TeacherError, match="teacher logprobs: bridge waiting for teacher rank 0: teacher rank 0 "
                                               "is gone"):
            teacher.result(11)
    finally:
        proc.kill()


def test_a_teacher_rank_that_hangs_times_out_naming_it_and_the_key():
    layout, proc = _teacher_rank("hang")
    try:
        teacher = _connect(layout, timeout_s=3.0)
        teacher.submit(_rows())
        with pytest.raises(TeacherError, match=r"no answer from teacher rank 0 within 3 s "
                                               r"\(on_policy_distillation.non_colocated_teachers.timeout_s\)"):
            teacher.result(11)
    finally:
        proc.kill()


# ---------------------------------------------------------------- teachers by agent or task, a block each
MOPD = {"enabled": True, "teacher_model_by_agent_name": {"a": "toy:tiny", "b": "toy:small", "c": "toy:tiny"},
        "default_teacher_alias": "a"}  # c shares a's checkpoint: two teachers load, a's and b's


def mopd(gpus_per_node: int = 1, **more) -> dict:
    return {"on_policy_distillation": {**MOPD, "non_colocated_teachers": {
        "enabled": True, "default_teacher_cfg": {"gpus_per_node": gpus_per_node}}}, **more}


def test_teachers_by_agent_get_a_block_of_teacher_ranks_each():
    cfg = MasterConfig.model_validate(mopd(gpus_per_node=2))
    assert teacher_ranks(cfg.on_policy_distillation) == 4  # 2 per teacher x 2 loaded teachers (a = c)
    assert [teacher_block(i, 4, 2) for i in range(4)] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert Layout("teach", 1, 2, 4, 5, 0, None, 4, teacher_group=1).teacher_index == 3
    from grpo.system.banner import teacher_blocks
    assert teacher_blocks(cfg.on_policy_distillation) == ": 'a' on teacher ranks 0-1, 'b' on 2-3"


def test_teachers_by_agent_that_do_not_fit_the_launch_fail_naming_the_key_and_the_numbers():
    MasterConfig.model_validate(mopd(cluster={"num_nodes": 1, "gpus_per_node": 3}))  # 2 teachers + 1 trainer
    with pytest.raises(ValueError) as err:
        MasterConfig.model_validate(mopd(cluster={"num_nodes": 1, "gpus_per_node": 2}))
    assert ("on_policy_distillation.non_colocated_teachers.default_teacher_cfg.gpus_per_node=1 x 2 teachers (a, b): "
            "expected < cluster.gpus_per_node=2 (at least one rank must train)") in str(err.value)
    with pytest.raises(ValueError, match=r"default_teacher_cfg.num_nodes=1 x 2 teachers \(a, b\): expected < "
                                         r"cluster.num_nodes=3 - 1 generation nodes"):
        MasterConfig.model_validate(mopd(gpus_per_node=8, cluster={"num_nodes": 3, "gpus_per_node": 8}, policy={
            "generation": {"colocated": {"enabled": False, "resources": {"gpus_per_node": 8, "num_nodes": 1}}}}))
    n = teacher_ranks(MasterConfig.model_validate(mopd()).on_policy_distillation)
    assert generation_split_problem(GenerationConfig(), 2, num_teacher=n, teachers=2) == (
        "on_policy_distillation.non_colocated_teachers.default_teacher_cfg: 2 teacher ranks (1 per teacher x 2 "
        "teachers) of the 2 the launcher started leave none to train")
    with pytest.raises(ValueError, match=r"teacher_overrides=\{'b': \{'gpus_per_node': 4\}\}: expected \{\}"):
        MasterConfig.model_validate({"on_policy_distillation": {**MOPD, "non_colocated_teachers": {
            "enabled": True, "teacher_overrides": {"b": {"gpus_per_node": 4}}}}})


def _mark_ranks(k: int, timeout_s: float = 60.0):
    """Trainer 0's end of a teacher bridge to ``k`` teacher ranks in ``mark`` mode (`tests.helpers.teacher_peer`),
    ``timeout_s`` its wait for an answer."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1 + k, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.teacher_peer", str(port), "mark", str(i), str(k)],
                              cwd=REPO, env=child_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(k)]
    store.wait([f"peer_up{i}" for i in range(k)])
    layout = Layout("train", 0, 1, 0, 1 + k, 0, store, num_teacher=k)
    return RemoteTeacher(MasterConfig.model_validate(mopd()), layout,
                         Bridge(store, 0, 1 + k, timeout_s, prefix=PREFIX, peers=PEERS)), procs


def _keyed_rows(keys: list[str], seed: int = 0):
    """`_rows`-like rows of a `grpo.batch.TrainBatch` whose trajectories are keyed by task ``keys``."""
    from types import SimpleNamespace

    from tests.helpers.batches import train_batch

    g = torch.Generator().manual_seed(seed)
    B, T = len(keys), 9
    lengths = torch.tensor([3 + (5 * b) % 6 for b in range(B)])
    mask_bt = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return train_batch(input_ids_bt=torch.randint(1, 89, (B, T), generator=g) * mask_bt, attention_mask_bt=mask_bt,
                       token_mask_bt=mask_bt.float(), task_names=keys,
                       trajectories=[SimpleNamespace(task_name=k, metadata={}) for k in keys])


def test_rows_of_two_teachers_go_to_their_own_teacher_ranks_and_come_back_in_row_order():
    """Rows keyed b, a, x (default: a), b, c (a's checkpoint): teacher rank 0 (a's block) scores rows 0-based 1, 2,
    4, teacher rank 1 (b's) rows 0 and 3, each only its own; the answers land on their rows, padded to the batch's
    width, two steps running."""
    from tests.helpers.teacher_peer import mark

    teacher, procs = _mark_ranks(2)
    try:
        for seed in (0, 1):
            batch = _keyed_rows(["b", "a", "x", "b", "c"], seed)
            teacher.submit(batch)
            got_bt = teacher.result(12)
            assert got_bt.shape == (5, 12) and not got_bt[:, 9:].any()
            for b, rank in enumerate([1, 0, 0, 1, 0]):
                torch.testing.assert_close(got_bt[b, :9], mark(rank, batch.select([b]))[0], rtol=0, atol=0)
        teacher.close()
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("fault, message", [
    pytest.param("hang", r"no answer from teacher rank 1 \('b'\) within 5 s \(on_policy_distillation\."
                 r"non_colocated_teachers\.timeout_s\)", marks=pytest.mark.slow),  # 8 s: the timeout runs out
    ("die", r"teacher rank 1 \('b'\) is gone")])
def test_a_teacher_rank_that_dies_or_hangs_is_named_with_its_teachers_alias(fault, message):
    """b's rank stops (SIGSTOP: it hangs) or is killed while a's answers: the trainers' one line names b."""
    import signal

    teacher, procs = _mark_ranks(2, timeout_s=5.0)
    try:
        procs[1].send_signal(signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
        teacher.submit(_keyed_rows(["a", "b"]))
        with pytest.raises(TeacherError, match=f"^teacher logprobs: .*{message}") as err:
            teacher.result(9)
        assert "\n" not in str(err.value)
    finally:
        for p in procs:
            p.kill()
