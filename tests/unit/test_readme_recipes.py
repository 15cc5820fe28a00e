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
    """run_vlm_grpo.py's recipes (examples/configs/{vlm,audio}_grpo_*.yaml, recipes/vlm/vlm_grpo-*.yaml) and the omni
    MOPD recipes (recipes/vlm/mopd-*.yaml, GRPO with on-policy distillation) are checked too, in a section of their
    own: each passes or fails naming the keys refused. SFT and disabled recipes are not GRPO recipes."""
    configs = tmp_path / "examples" / "configs"
    (configs / "recipes" / "vlm").mkdir(parents=True)
    for name in ("vlm_grpo_3B.yaml", "vlm_grpo_3B_megatron.yaml", "sft_vlm_3B.yaml", "audio_grpo_3B_megatron.yaml",
                 "recipes/vlm/vlm_grpo-q.v1.yaml", "recipes/vlm/mopd-x.yaml", "recipes/vlm/vlm_grpo-s.yaml.disabled"):
        (configs / name).write_text("{}")
    assert [p.name for p in check.vlm_recipes(tmp_path)] == ["vlm_grpo_3B.yaml", "vlm_grpo_3B_megatron.yaml",
                                                             "audio_grpo_3B_megatron.yaml", "vlm_grpo-q.v1.yaml",
                                                             "mopd-x.yaml"]
    fixtures = REPO / "tests" / "fixtures" / "nemo_rl"
    check.main([str(fixtures)])  # exit 1: the fixture's Gym recipes name the tool parser of NeMo-RL's plugin file
    out = capsys.readouterr().out
    assert "VLM GRPO recipes (1)\npass  configs/vlm_grpo_3B.yaml\n1 of 1 VLM recipes pass, 0 fail" in out, out
    bad = configs / "vlm_grpo_3B.yaml"
    bad.write_text(f"defaults: {fixtures / 'examples' / 'configs' / 'vlm_grpo_3B.yaml'}\npolicy:\n  draft:\n    enabled: true\n")
    assert check.check(tmp_path, [bad], verbose=False) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL  configs/vlm_grpo_3B.yaml\n") and "policy.draft.enabled=True: trains a speculative-decoding draft" in out, out


@pytest.mark.parametrize("mode", ["listing", "readme"])
def test_both_modes_judge_a_recipe_on_its_keys_not_on_the_shell(tmp_path, capsys, monkeypatch, mode):
    """A recipe that interpolates HF_HOME (NeMo-RL's NeMo-Gym data paths do) passes in the pass / fail listing as in
    the --readme summary, with HF_HOME unset in the shell: the two counts are the same numbers (the listing said
    166 of 219 where the summary said 170 when only --readme defaulted the variables)."""
    for name in ("HF_HOME", "PERSISTENT_CACHE"):  # unset here, and as they were after the test (the script sets them)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    configs = tmp_path / "examples" / "configs"
    configs.mkdir(parents=True)
    base = REPO / "tests" / "fixtures" / "nemo_rl" / "examples" / "configs" / "grpo_math_1B.yaml"
    (configs / "grpo_math_hf.yaml").write_text(
        f"defaults: {base}\ncheckpointing:\n  checkpoint_dir: ${{oc.env:HF_HOME}}/results\n")
    if mode == "listing":
        check.main([str(tmp_path)])
        assert "1 of 1 LLM recipes pass, 0 fail" in capsys.readouterr().out
    else:
        assert ", 1 of its 1 LLM GRPO recipes pass" in check.readme_summary(tmp_path)


# Recipe files of a NeMo-RL checkout that are not GRPO's (SFT, DPO, reward models, PPO, off-policy and plain
# distillation, evaluation, NeMo-Gym's environment prefetch lists, ModelOpt's quantisation and the fault-tolerance
# launcher's settings): a file or folder name that starts with one of these.
NOT_GRPO = ("sft", "dpo", "rm", "ppo", "distillation", "xtoken", "qa_distillation", "evals", "prefetch_",
            "quant_configs", "ft_launcher")


@pytest.mark.skipif(check.CHECKOUT is None, reason="NEMO_RL_CHECKOUT (a NeMo-RL checkout at 7ea279a) is not set")
def test_the_recipe_check_covers_every_grpo_family_recipe_of_the_checkout():
    """Every YAML recipe under the checkout's examples/ is checked (LLM or VLM section: GRPO, GDPO, DAPO, ProRLv2,
    MOPD, performance/, NeMo-Gym, SWE-bench, ModelOpt's qa_grpo, vision, audio and omni) unless its name says it is
    not a GRPO recipe; none is checked twice."""
    root = check.CHECKOUT
    checked = check.recipes(root) + check.vlm_recipes(root)
    assert len(checked) == len(set(checked))
    missed = [str(p.relative_to(root / "examples")) for p in sorted((root / "examples").rglob("*.yaml"))
              if p not in set(checked)
              and not any(part.startswith(NOT_GRPO) for part in p.relative_to(root / "examples").parts)]
    assert missed == [], missed
    names = {str(p.relative_to(root / "examples")) for p in checked}
    for family in ("recipes/llm/dapo-", "recipes/llm/prorlv2-", "recipes/llm/mopd-", "recipes/llm/performance/",
                   "nemo_gym/", "recipes/vlm/vlm_grpo-", "recipes/vlm/mopd-", "configs/audio_grpo_"):
        assert any(family in n for n in names), family
