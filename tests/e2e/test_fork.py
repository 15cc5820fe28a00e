"""Fork points: a copy of train_grpo.py that registers its own advantage estimator runs it through the unchanged
config system; a copy that adds a config section, an estimator reading it and an entropy bonus in the loss
(`tests.helpers.fork_algo`) trains without an edit of grpo/; a copy that adds a turn-level stopping rule for
multi-turn rollouts passes it to ``setup``; the config reference (--help-config) covers every field."""

import sys
from pathlib import Path

import pytest

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


# The two lines a fork changes in its copy of train_grpo.py, and the import of what it adds (outside grpo/).
FORK_EDITS = {"description=__doc__)": "description=__doc__, config_cls=MyConfig)",
              "loss_fn=clipped_pg_loss_fn)": "loss_fn=entropy_bonus_loss)"}
FORK_IMPORT = "from tests.helpers.fork_algo import MyConfig, entropy_bonus_loss  # the fork's additions\n\n"


def fork_script(tmp_path: Path) -> Path:
    """The user's copy of train_grpo.py: the real script with `FORK_EDITS` and `FORK_IMPORT`."""
    source = (REPO / "train_grpo.py").read_text()
    for old, new in FORK_EDITS.items():
        assert source.count(old) == 1, f"train_grpo.py no longer reads {old!r} once: update the fork test and docs"
        source = source.replace(old, new)
    head, sep, rest = source.partition("DEFAULT_CONFIG = ")
    fork = tmp_path / "my_train.py"
    fork.write_text(head + FORK_IMPORT + sep + rest.replace("os.path.dirname(os.path.abspath(__file__))",
                                                            repr(str(REPO))))
    return fork


@pytest.mark.slow  # default-suite twin: test_a_forked_script_registers_an_estimator_and_trains_with_it
def test_a_fork_adds_a_config_section_an_estimator_and_an_entropy_bonus(tmp_path):
    fork = fork_script(tmp_path)
    recipe = tmp_path / "my.yaml"  # the fork's keys in a YAML recipe beside the built-in ones
    recipe.write_text(f"defaults: {TINY}\n"
                      "grpo: {max_num_steps: 2, adv_estimator: {name: my_estimator}}\n"
                      "checkpointing: {enabled: false}\n"
                      "my_algo: {entropy_coef: 0.5, baseline: none}\n")
    # The new keys are validated like the others: a misspelt one fails before any model loads, naming it.
    p = run([sys.executable, str(fork), "--config", str(recipe), "my_algo.entropy_coeff=0.1"], check=False, timeout=60)
    assert p.returncode == 2 and "my_algo.entropy_coeff: unknown key" in p.stderr, p.stderr
    p = run([sys.executable, str(fork), "--help-config", "my_algo"], timeout=60)
    assert "my_algo.entropy_coef  (float, default 0.0)" in p.stdout and "my_algo.baseline" in p.stdout

    runs = {}
    for coef in ("0.5", "0"):
        out = tmp_path / f"coef_{coef}"
        run([sys.executable, str(fork), "--config", str(recipe), *paths(out, f"my_algo.entropy_coef={coef}")])
        runs[coef] = train_rows(out)
    bonus, plain = runs["0.5"], runs["0"]
    assert sorted(bonus) == sorted(plain) == [1, 2]
    first, first0 = bonus[1], plain[1]
    # The estimator read my_algo.baseline=none: every sample's advantage is its reward (no group baseline).
    hist = first["train/advantages/histogram"]
    assert min(hist) >= 0 and abs(sum(hist) / len(hist) - first["train/reward"]) < 1e-6
    # The entropy metric is logged; step 1 starts from the same weights and rollouts in both runs, so the
    # entropies agree and the loss differs by the bonus alone: coef x the step's token-mean entropy.
    assert first["train/entropy"] > 0 and abs(first["train/entropy"] - first0["train/entropy"]) < 1e-6
    assert first["train/mean_total_reward"] == first0["train/mean_total_reward"]
    drop = first0["train/loss"] - first["train/loss"]
    assert 0.5 * 0.5 * first["train/entropy"] < drop < 2 * 0.5 * first["train/entropy"], (drop, first["train/entropy"])
    assert bonus[2]["train/loss"] != plain[2]["train/loss"]


TURN_STOP = '''

def stop_after_the_first_turn(t) -> bool:
    """The fork's turn-level stopping rule: a sample ends after its first environment step."""
    return t.turns >= 1

'''
MULTITURN = ["grpo.max_rollout_turns=3", "env.name=class", "env.env_class=tests.helpers.multiturn_envs:HintThenCheck",
             "policy.max_total_sequence_length=32"]


def test_a_fork_adds_a_turn_level_stopping_rule_in_its_copy_of_the_script(tmp_path):
    """HintThenCheck always takes two turns (a hint, then the scored answer): with the fork's rule every sample ends
    after the first, so no sample is scored (reward 0) and each has one turn."""
    source = (REPO / "train_grpo.py").read_text()
    old = "description=__doc__)"
    assert source.count(old) == 1, f"train_grpo.py no longer reads {old!r} once: update the fork test and docs"
    head, sep, rest = source.replace(old, "description=__doc__, turn_stop=stop_after_the_first_turn)").partition(
        "DEFAULT_CONFIG = ")
    fork = tmp_path / "my_train.py"
    fork.write_text(head + TURN_STOP + sep + rest.replace("os.path.dirname(os.path.abspath(__file__))", repr(str(REPO))))
    run([sys.executable, str(fork), "--config", TINY, *MULTITURN,
         *paths(tmp_path, "grpo.max_num_steps=1", "checkpointing.enabled=false")], timeout=600)
    row = train_rows(tmp_path)[1]
    assert row["train/avg_turns_per_sample"] == 1.0 and row["train/mean_total_reward"] == 0.0, row


def test_both_scripts_have_the_lines_a_fork_changes():
    """The async script forks the same way: one setup call and one train call to edit."""
    for script in ("train_grpo.py", "train_async_grpo.py"):
        source = (REPO / script).read_text()
        for old in FORK_EDITS:
            assert source.count(old) == 1, f"{script} no longer reads {old!r} once: update the fork test and docs"
        assert "with timed(timing, \"train\"):" in source


def test_help_config_prints_every_field_with_a_description():
    from grpo.config.load import config_fields

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


def test_the_docs_config_reference_matches_the_config():
    """docs/configs.md's config reference is generated from the models: regenerate it with
    `python scripts/config_reference.py --write`."""
    from scripts.config_reference import PAGE, reference_markdown

    page = (REPO / PAGE).read_text()
    assert reference_markdown() in page, (
        f"{PAGE}'s config reference is stale: run python scripts/config_reference.py --write")
