"""The reward model as a ZeRO-3 inference engine sharded over two gloo ranks scores as one process does
(tests/helpers/rm_scoring.py): every rank runs the same number of forwards, dummy batches where it has fewer samples."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.e2e import launcher, run

pytest.importorskip("tiktoken")


@pytest.mark.slow  # two processes building a ZeRO-3 engine: ~70 s on a loaded 2-core machine
def test_two_ranks_under_zero3_score_as_one_process(tmp_path):
    from tests.helpers.reward_models import save_tiny_reward_model

    rm = save_tiny_reward_model(str(tmp_path / "rm"))
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    run([sys.executable, "tests/helpers/rm_scoring.py", rm, str(one), "plain", "6"], threads=1)
    run([*launcher("torchrun"), "--standalone", "--nproc_per_node", "2", "tests/helpers/rm_scoring.py", rm, str(two),
         "zero3", "5,1"], threads=1)
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert (a["placement"], a["world_size"], b["placement"], b["world_size"]) == ("plain", 1, "zero3", 2)
    assert a["rewards"][4] is None and b["rewards"][4] is None  # the failed sample keeps no score
    scores = [r for i, r in enumerate(a["rewards"]) if i != 4]
    assert len(set(scores)) == 6 - 1  # five different scores
    assert scores == pytest.approx([r for i, r in enumerate(b["rewards"]) if i != 4], abs=1e-5)
    # rank 0 scores samples 0-3 in two batches of 2; rank 1 its one sample, then a one-token dummy batch
    assert b["forwards"] == [[2, 2], [1, 1]] and a["forwards"] == [[2, 2, 1]]


@pytest.mark.slow  # two processes starting ZeRO-3: ~30 s on a loaded 2-core machine
def test_a_causal_lm_is_refused_under_zero3_on_every_rank(tmp_path):
    """Issue 43 (6) under ZeRO-3, where each rank loads its shards (transformers' own ZeRO-3 loading path reports the
    missing keys too): both ranks refuse the causal LM by name; none waits for the other."""
    from tests.helpers.reward_models import save_tiny_qwen2_lm

    lm = save_tiny_qwen2_lm(str(tmp_path / "lm"))
    p = run([*launcher("torchrun"), "--standalone", "--nproc_per_node", "2", "tests/helpers/rm_scoring.py", lm,
             str(tmp_path / "out.json"), "zero3", "5,1"], threads=1, timeout=240, check=False)
    assert p.returncode != 0 and not (tmp_path / "out.json").exists()
    refusal = (f"EnvError: env.reward_model.model_name={lm!r}: a Qwen2ForCausalLM checkpoint, not a reward model: "
               "score.weight is not in it")
    assert p.stderr.count(refusal) == 2, p.stderr[-4000:]
