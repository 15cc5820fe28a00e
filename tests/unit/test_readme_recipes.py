"""docs/nemo_rl.md's NeMo-RL recipe summary (counts, refused keys, translated keys) is what the code gives on NeMo-RL's
own recipes (a NeMo-RL checkout at 7ea279a, given as NEMO_RL_CHECKOUT: its recipes are not copied here): regenerate
it with `python scripts/check_nemo_rl_recipes.py --readme /path/to/NeMo-RL` when the rules change and paste it into
the page. Translating the 219 recipes takes ~30-60 s."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import check_nemo_rl_recipes as check  # noqa: E402


@pytest.mark.slow  # 30-90 s: every recipe translated
@pytest.mark.skipif(check.CHECKOUT is None, reason="NEMO_RL_CHECKOUT (a NeMo-RL checkout at 7ea279a) is not set")
def test_readme_recipe_summary_is_what_the_code_gives():
    page = (REPO / check.SUMMARY_PAGE).read_text()
    start, end = page.index(check.README_BEGIN), page.index(check.README_END) + len(check.README_END)
    assert page[start:end] == check.readme_summary(), (
        f"{check.SUMMARY_PAGE}'s recipe summary is stale: rerun `python scripts/check_nemo_rl_recipes.py --readme` "
        "and paste it")


def test_the_summary_parses_refused_keys_with_values_that_hold_colons():
    message = ("NeMo-RL recipe: keys grpo-ds cannot honor:\n"
               "        async_rl={'sampler': {'name': 'in_order'}, 'x...: NeMo-RL's streaming trainer\n"
               "        data.train.data_path: cannot interpolate (HF_HOME)\n"
               "        policy.draft.enabled=True: trains a draft model")
    assert check.refused_keys(message) == [("async_rl", "NeMo-RL's streaming trainer"),
                                           ("data.train.data_path", "cannot interpolate (HF_HOME)"),
                                           ("policy.draft.enabled", "trains a draft model")]


def test_the_recipe_check_covers_nemo_rl_s_vlm_recipes(tmp_path, capsys):
    """run_vlm_grpo.py's recipes (examples/configs/vlm_grpo_*.yaml, recipes/vlm/vlm_grpo-*.yaml) are checked too, in a
    section of their own: each passes or fails naming the keys refused."""
    configs = tmp_path / "examples" / "configs"
    (configs / "recipes" / "vlm").mkdir(parents=True)
    for name in ("vlm_grpo_3B.yaml", "vlm_grpo_3B_megatron.yaml", "sft_vlm_3B.yaml", "recipes/vlm/vlm_grpo-q.v1.yaml",
                 "recipes/vlm/mopd-x.yaml", "recipes/vlm/vlm_grpo-s.yaml.disabled"):
        (configs / name).write_text("{}")
    assert [p.name for p in check.vlm_recipes(tmp_path)] == ["vlm_grpo_3B.yaml", "vlm_grpo_3B_megatron.yaml",
                                                             "vlm_grpo-q.v1.yaml"]
    fixtures = REPO / "tests" / "fixtures" / "nemo_rl"
    check.main([str(fixtures)])  # exit 1: the fixture's Gym recipes name the tool parser of NeMo-RL's plugin file
    out = capsys.readouterr().out
    assert "VLM GRPO recipes (1)\npass  configs/vlm_grpo_3B.yaml\n1 of 1 VLM recipes pass, 0 fail" in out, out
    bad = configs / "vlm_grpo_3B.yaml"
    bad.write_text(f"defaults: {fixtures / 'examples' / 'configs' / 'vlm_grpo_3B.yaml'}\npolicy:\n  draft:\n    enabled: true\n")
    assert check.check(tmp_path, [bad], verbose=False) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL  configs/vlm_grpo_3B.yaml\n") and "policy.draft.enabled=True: trains a speculative-decoding draft" in out, out
