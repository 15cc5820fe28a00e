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
