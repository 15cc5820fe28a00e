"""Fork points: a copy of train_grpo.py that registers its own advantage estimator runs it through the unchanged
config system; the config reference (--help-config) covers every field."""

import sys
from pathlib import Path

from tests.helpers.e2e import REPO, TINY, paths, run, train_rows

ESTIMATOR = '''
import torch
from grpo.advantages import register_estimator


@register_estimator("quarter")
def quarter(*, group_ids, rewards, valid_mask, token_mask, cfg, **extra):
    """Every sample gets advantage 0.25: visible in train/advantages/mean."""
    return torch.full_like(rewards, 0.25)

'''


def test_a_forked_script_registers_an_estimator_and_trains_with_it(tmp_path):
    source = (REPO / "train_grpo.py").read_text()
    head, sep, rest = source.partition("DEFAULT_CONFIG = ")
    fork = tmp_path / "my_train.py"  # outside grpo/: the user's copy of the script
    fork.write_text(head + ESTIMATOR + sep + rest.replace('os.path.dirname(os.path.abspath(__file__))', repr(str(REPO))))
    run([sys.executable, str(fork), "--config", TINY, *paths(tmp_path, "grpo.max_num_steps=2",
                                                              "checkpointing.enabled=false",
                                                              "grpo.adv_estimator.name=quarter")])
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2]
    assert all(r["train/advantages/mean"] == 0.25 for r in rows.values())
    # The unchanged script does not know the name, and says which ones it knows, before loading anything.
    p = run([sys.executable, "train_grpo.py", "--config", TINY, "grpo.adv_estimator.name=quarter"], check=False)
    assert p.returncode == 2 and "grpo.adv_estimator.name='quarter'" in p.stderr and "reinforce_plus_plus" in p.stderr


def test_help_config_prints_every_field_with_a_description():
    from grpo.config_load import config_fields

    fields = config_fields()
    assert len(fields) > 150
    undocumented = [key for key, _, _, description in fields if not description.strip()]
    assert undocumented == [], f"config fields without a description: {undocumented}"
    p = run([sys.executable, "train_grpo.py", "--help-config"], timeout=60)
    for key, type_name, _, description in fields:
        assert f"{key}  ({type_name}," in p.stdout and description in p.stdout, key
    p = run([sys.executable, "train_grpo.py", "--help-config", "loss_fn"], timeout=60)
    assert "loss_fn.ratio_clip_c" in p.stdout and "grpo." not in p.stdout
    p = run([sys.executable, "train_grpo.py", "--help-config", "nosuch"], check=False, timeout=60)
    assert p.returncode == 2 and "sections:" in p.stderr


def test_the_readme_config_reference_matches_the_config():
    """README's config reference is generated from the models: regenerate it with scripts/config_reference.py."""
    from scripts.config_reference import reference_markdown

    readme = (REPO / "README.md").read_text()
    assert reference_markdown() in readme, "README's config reference is stale: run python scripts/config_reference.py"
