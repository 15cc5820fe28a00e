"""NeMo-RL's VLM rewards (grpo.tasks.vlm) on hand-computed cases, and its dataset rows as grpo-ds rows."""

from __future__ import annotations

import re

import pytest

from grpo.system import vision
from grpo.tasks import vlm


def test_bbox_giou_is_generalized_iou():
    # [0,0,2,2] vs [1,1,3,3]: intersection 1, union 4 + 4 - 1 = 7, hull 3 x 3 = 9: GIoU = 1/7 - 2/9
    reward, correct = vlm.bbox_giou_reward("[0, 0, 2, 2]", "<answer>[1, 1, 3, 3]</answer>")
    assert reward == pytest.approx(1 / 7 - 2 / 9) and not correct
    # disjoint [0,0,1,1] vs [2,0,3,1]: IoU 0, union 2, hull 3 x 1: GIoU = -1/3
    assert vlm.bbox_giou_reward("[0,0,1,1]", "<answer>[2,0,3,1]</answer>")[0] == pytest.approx(-1 / 3)
    assert vlm.bbox_giou_reward("[0,0,1,1]", "<answer> [0, 0, 1, 1] </answer>") == (1.0, True)
    # IoU at or above the threshold: IoU itself (1/7 with threshold 0.1)
    assert vlm.bbox_giou_reward("[0,0,2,2]", "<answer>[1,1,3,3]</answer>", giou_penalty_thres=0.1)[0] == \
        pytest.approx(1 / 7)
    # [0,0,4,4] vs [0,0,4,3]: IoU 12/16 = 0.75 > 0.5: correct
    assert vlm.bbox_giou_reward("[0,0,4,4]", "<answer>[0,0,4,3]</answer>", giou_penalty_thres=0.5) == (0.75, True)
    for bad in ("[1, 2, 3]", "[a, b, c, d]", "no tags [0,0,1,1]"):
        answer = bad if bad.startswith("no tags") else f"<answer>{bad}</answer>"
        assert vlm.bbox_giou_reward("[0,0,1,1]", answer) == (0.0, False)


def test_format_and_exact_alnum():
    assert vlm.format_reward("x", "<think>a</think><answer>b</answer>") == (1.0, None)
    assert vlm.format_reward("x", "<answer>b</answer>") == (0.75, None)
    assert vlm.format_reward("x", "<think>a</think> b") == (0.25, None)
    assert vlm.format_reward("x", "b") == (0.0, None)
    assert vlm.exact_alnum_reward("Yes", "<answer> y-e-s! </answer>") == (1.0, True)
    assert vlm.exact_alnum_reward("12", "<answer>1 2</answer>") == (1.0, True)
    assert vlm.exact_alnum_reward("yes", "<answer>no</answer>") == (0.0, False)
    assert vlm.exact_alnum_reward("yes", "yes") == (0.0, False)  # no answer tags


def test_math_expr_and_geo3k():
    assert vlm.math_expr_reward("0.5", "<answer>\\frac{1}{2}</answer>") == (1.0, True)
    assert vlm.math_expr_reward("0.5", "<answer>3</answer>") == (0.0, False)
    assert vlm.math_expr_reward("0.5", "1/2") == (0.0, False)
    assert vlm.geo3k_reward("4", "<think>..</think> so \\boxed{3} no, \\boxed{{4}}") == (pytest.approx(1.0), True)
    assert vlm.geo3k_reward("4", "\\boxed{4}") == (pytest.approx(0.9), True)  # no </think>: no format part
    assert vlm.geo3k_reward("4", "</think> \\boxed{5}") == (pytest.approx(0.1), False)


def test_combined_weights_renormalise_and_bad_specs_are_named():
    clevr = vlm.combine([{"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.8}])
    assert clevr("3", "<think>t</think><answer>3</answer>") == (pytest.approx(1.0), True)
    assert clevr("3", "<answer>4</answer>") == (pytest.approx(0.2 * 0.75), False)
    assert vlm.combine([{"name": "format", "weight": 1}, {"name": "exact_alnum", "weight": 3}])(
        "3", "<answer>4</answer>")[0] == pytest.approx(0.25 * 0.75)
    refcoco = vlm.combine([{"name": "bbox_giou", "weight": 1, "kwargs": {"giou_penalty_thres": 0.5}}])
    assert refcoco("[0,0,2,2]", "<answer>[1,1,3,3]</answer>")[0] == pytest.approx(1 / 7 - 2 / 9)
    with pytest.raises(ValueError, match="reward_functions.0=.*name one of"):
        vlm.combine([{"name": "bleu", "weight": 1}])
    with pytest.raises(ValueError, match="giou_thres.*not arguments of bbox_giou"):
        vlm.combine([{"name": "bbox_giou", "weight": 1, "kwargs": {"giou_thres": 0.5}}])
    with pytest.raises(ValueError, match="weights sum to 0"):
        vlm.combine([{"name": "format", "weight": 0}])


@pytest.mark.parametrize("kwargs, named", [
    ({}, "env.kwargs={}: env.name='vlm' takes env.kwargs.reward_functions"),
    ({"reward_functions": [{"name": "format", "weight": -1}]}, "env.kwargs.reward_functions.0.weight=-1"),
    ({"reward_functions": [{"name": "format", "weight": 1, "wieght": 2}]}, "unknown keys ['wieght']"),
])
def test_env_vlm_kwargs_are_checked_at_load(kwargs, named):
    from pydantic import ValidationError

    from grpo.config import MasterConfig

    with pytest.raises(ValidationError, match=re.escape(named)):
        MasterConfig.model_validate({"env": {"name": "vlm", "kwargs": kwargs}})
    env = MasterConfig.model_validate({"env": {"name": "vlm", "kwargs": {"reward_functions": [
        {"name": "format", "weight": 1}]}}}).env
    assert env.name == "vlm"


def _png(tmp_path, name, size=(32, 24)):
    from PIL import Image

    path = tmp_path / name
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return str(path)


def test_dataset_rows_become_nemo_rl_messages(tmp_path):
    img = _png(tmp_path, "a.png")
    row = vision.format_record("clevr-cogent", {"image": img, "problem": "How many?",
                                                 "solution": "<answer> 3 </answer>"}, "Q: {}".format)
    assert row == {"messages": [{"role": "user", "content": [{"type": "image", "image": img},
                                                            {"type": "text", "text": "Q: How many?"}]}],
                   "ground_truth": "3"}
    geo = vision.format_record("geometry3k", {"images": [img], "problem": "<image>Find x.", "answer": "7"})
    assert geo["messages"][0]["content"][1]["text"] == "Find x." and geo["ground_truth"] == "7"
    ref = vision.format_record("refcoco", {"image_path": img, "captions": ["red", "the red one"], "bbox": [8, 6, 16, 12],
                                           "split": "val"})
    # box scaled to 0..1000 of a 32x24 picture; a val split takes the longest caption
    assert ref["ground_truth"] == "[250, 250, 500, 500]"
    assert ref["messages"][0]["content"][1]["text"].endswith("phrase: the red one")
    assert ref["messages"][0]["content"][0]["image"].startswith("data:image/png;base64,")
    with pytest.raises(ValueError, match=r"row_format=clevr-cogent: missing \['solution'\]"):
        vision.format_record("clevr-cogent", {"image": img, "problem": "p"})


def test_row_format_reads_a_local_file_of_clevr_columns(tmp_path):
    """data.row_format=clevr-cogent: a .jsonl of CLEVR's columns loads as image rows, the prompt file filled into
    the problem; a row missing a column is named (and skipped with on_bad_row=skip)."""
    import json

    from grpo.config import DataConfig
    from grpo.system.data import load_rows

    img = _png(tmp_path, "a.png")
    (tmp_path / "prompt.txt").write_text("Think. {}")
    lines = [{"image": img, "problem": "How many cubes?", "solution": "<answer>2</answer>"}, {"image": img}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    cfg = DataConfig(train_data_path=str(tmp_path / "train.jsonl"), row_format="clevr-cogent",
                     prompt_file=str(tmp_path / "prompt.txt"), on_bad_row="skip")
    rows = load_rows(cfg, "train", seed=0)
    assert len(rows) == 1 and rows.report.num_skipped == 1 and "missing ['problem', 'solution']" in rows.report.skipped[0]
    assert rows[0]["answer"] == "2"
    assert rows[0]["question"] == [{"role": "user", "content": [{"type": "image", "image": img},
                                                                {"type": "text", "text": "Think. How many cubes?"}]}]
