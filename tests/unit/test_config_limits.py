"""Configs that would hang or flood the error path fail fast with a short message (YAML alias bombs, huge
values), configs that would train on nothing fail at load (one sample per prompt under a group baseline), and
a ``toy:`` model that does not exist is named at load, before any directory is locked."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from grpo.config.load import MAX_CONFIG_BYTES, MAX_YAML_VALUES, ConfigError, apply_overrides, load_config
from grpo.registry import _ESTIMATORS, _NEEDS_GROUP, needs_group, register_estimator
from tests.helpers.e2e import REPO, child_env

# policy.bogus holds 9^9 values through nested aliases: a few hundred bytes of YAML.
ALIAS_BOMB = "policy:\n  bogus:\n    a0: &a0 [1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"    a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))
OVERRIDE_BOMB = "policy.bogus=[&a [1,1,1,1,1,1,1,1,1], " + ", ".join(
    f"&{c} [{','.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")) + "]"
ONE_SAMPLE = ["grpo.num_generations_per_prompt=1", "policy.train_micro_batch_size=8",
              "policy.train_global_batch_size=8"]  # cpu_demo: 8 prompts per step


def error_of(fn, *args) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args)
    return str(err.value)


@pytest.mark.parametrize("source, expected", [("/dev/zero", "a character device, not a regular file"),
                                              ("big", f"larger than {MAX_CONFIG_BYTES >> 20} MiB")])
def test_a_config_path_that_never_ends_or_is_huge_is_refused_without_reading_it_whole(tmp_path, source, expected):
    """``--config /dev/zero`` read 10 GB in 30 s, and a 300 MB YAML hung the parser; only regular files are read."""
    path = source if source.startswith("/dev/") else tmp_path / "big.yaml"
    if source == "big":
        path.write_text("a: 1\n" * (MAX_CONFIG_BYTES // 5 + 10))
    message = error_of(load_config, path)
    assert expected in message and len(message) < 300


NEMO_RL_BODY = "policy:\n  dtensor_cfg: {enabled: true}\n"  # recognised as a NeMo-RL recipe (omegaconf loading)
NATIVE_BODY = "grpo: {seed: 3}\n"


def _load_either(path):
    from grpo.config.nemo_rl.recipe import is_nemo_rl_recipe, load_recipe

    return load_recipe(path, []) if is_nemo_rl_recipe(path) else load_config(path, [])


@pytest.mark.parametrize("body", [NEMO_RL_BODY, NATIVE_BODY], ids=["nemo_rl", "native"])
@pytest.mark.parametrize("defaults", ["5", "{a: 1}", "[[a]]", "[base.yaml, 3]", "''", "true"])
def test_every_malformed_defaults_entry_is_a_config_error_naming_the_recipe(tmp_path, body, defaults):
    """Issue 37: ``defaults: 5`` was a TypeError traceback."""
    (tmp_path / "base.yaml").write_text(NATIVE_BODY)
    recipe = tmp_path / "run.yaml"
    recipe.write_text(f"defaults: {defaults}\n{body}")
    message = error_of(_load_either, recipe)
    assert message.startswith(f"{recipe}: defaults: ") and "expected a recipe path or a list of recipe paths" in message


@pytest.mark.parametrize("line", ["  ~: 3", "  [a, b]: 3", "  3.5: {x: 1}"])
def test_an_omegaconf_failure_of_a_nemo_rl_recipe_is_a_config_error(tmp_path, line):
    """Issue 37: a null key in a NeMo-RL recipe was omegaconf's KeyValidationError traceback."""
    recipe = tmp_path / "run.yaml"
    recipe.write_text(NEMO_RL_BODY + line + "\n")
    from grpo.config.nemo_rl.recipe import load_recipe

    with pytest.raises(ConfigError):
        load_recipe(recipe, [])


@pytest.mark.parametrize("nemo_rl", [True, False], ids=["nemo_rl", "native"])
@pytest.mark.parametrize("null", ["~", "null"])
def test_a_null_key_is_one_line_naming_the_file_and_the_key_path(tmp_path, nemo_rl, null):
    """Issue 43 (a): the null key's ConfigError carried OmegaConf's words ("KeyValidationError: Incompatible key type
    'NoneType'"), pydantic's read "policy.None=None: Keys should be strings"; both loaders now name the file and
    the key path that holds it, and say what to write instead. So does an override that holds one."""
    recipe = tmp_path / "run.yaml"
    recipe.write_text("policy:\n" + ("  dtensor_cfg: {enabled: true}\n" if nemo_rl else "")
                      + f"  optimizer:\n    {null}: 3\n")
    expected = (f"{recipe}: policy.optimizer: a null key (~: or null:, holding 3): keys are names; quote 'null' for "
                "the word")
    from grpo.config.nemo_rl.recipe import load_recipe

    assert error_of(_load_either, recipe) == expected  # what the scripts do
    assert error_of(load_recipe, recipe, []) == expected  # NeMo-RL's reader (OmegaConf) on its own
    recipe.write_text(NEMO_RL_BODY)
    assert error_of(load_recipe, recipe, ["++policy.optimizer={~: 3}"]) == expected.replace(f"{recipe}:", "override:")
    assert error_of(load_config, None, ["policy.optimizer={~: 3}"]) == expected.replace(f"{recipe}:", "override:")


def _chain(op: str, first: str, n: int) -> str:
    return NEMO_RL_BODY + f"  x0: {first}\n" + "".join(
        f"  x{i}: ${{{op}:${{policy.x{i - 1}}},${{policy.x{i - 1}}}}}\n" for i in range(1, n))


@pytest.mark.parametrize("body, expected", [
    (_chain("mul", "3", 40), r"policy\.x\d+: cannot interpolate: \$\{mul:\.\.\.\} would make an integer of about"),
    (_chain("add", "ab", 40), r"policy\.x\d+: cannot interpolate: \$\{add:\.\.\.\} would make a value of"),
    (_chain("mul", "[1, 2]", 40), r"policy\.x\d+: cannot interpolate"),
    (NEMO_RL_BODY + "  y0: 1\n" + "".join(f"  y{i}: ${{policy.y{i - 1}}}\n" for i in range(1, 3000)),
     "2,999 interpolations"),
])
def test_interpolation_work_is_bounded(tmp_path, body, expected):
    """Issue 37: 39 chained ${mul:...} kept --check-config at full CPU for good (integers of billions of digits)."""
    from grpo.config.nemo_rl.recipe import load_recipe

    recipe = tmp_path / "run.yaml"
    recipe.write_text(body)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=expected):
        load_recipe(recipe, [])
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("body", [NEMO_RL_BODY, NATIVE_BODY], ids=["nemo_rl", "native"])
def test_a_fifo_named_as_a_recipe_is_refused_at_once(tmp_path, body):
    """Issue 37: a defaults: entry naming a FIFO blocked forever (no writer ever comes). Through the script's
    --check-config, as a user meets it: one error line, exit 2."""
    os.mkfifo(tmp_path / "base.yaml")
    recipe = tmp_path / "run.yaml"
    recipe.write_text("defaults: base.yaml\n" + body)
    for config in (recipe, tmp_path / "base.yaml"):
        p = subprocess.run([sys.executable, "train_grpo.py", "--config", str(config), "--check-config"], cwd=REPO,
                           env=child_env(), capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and p.stderr.strip().splitlines() == [
            f"error: {tmp_path / 'base.yaml'}: a FIFO (named pipe), not a regular file: a recipe is a YAML file on "
            "disk"], p.stderr


@pytest.mark.parametrize("as_parent", [False, True], ids=["config", "parent"])
def test_a_pipe_is_named_for_what_it_is_never_file_not_found(tmp_path, as_parent):
    """Issue 43 (b): a pipe named as the config or as a recipe's parent (``--config <(...)``, ``/dev/stdin``) read
    "--config /proc/<pid>/fd/pipe:[N]: file not found": the path was resolved through /dev/fd's link to a name
    nothing can open. It is read as named: one line saying it is a pipe, at once (nothing waits for a writer)."""
    recipe = tmp_path / "run.yaml"
    recipe.write_text("defaults: /dev/stdin\n" + NATIVE_BODY)
    config = str(recipe) if as_parent else "/dev/stdin"
    p = subprocess.Popen([sys.executable, "train_grpo.py", "--config", config, "--check-config"], cwd=REPO,
                         env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        p.wait(timeout=60)  # stdin stays open: a reader that waited for a writer's end would hang here
    finally:
        p.kill()
    err = p.stderr.read()
    assert p.returncode == 2 and err.strip().splitlines() == [
        "error: /dev/stdin: a FIFO (named pipe), not a regular file: a recipe is a YAML file on disk"], err


def test_a_yaml_alias_bomb_in_a_file_is_refused_at_once(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(ALIAS_BOMB)
    t0 = time.monotonic()
    message = error_of(load_config, cfg)
    assert time.monotonic() - t0 < 10
    assert message.startswith(f"{cfg}, line ") and f"more than {MAX_YAML_VALUES:,} values" in message
    assert len(message) < 500


def test_a_yaml_alias_bomb_on_the_command_line_is_refused_at_once():
    t0 = time.monotonic()
    message = error_of(apply_overrides, {}, [OVERRIDE_BOMB])
    assert time.monotonic() - t0 < 10
    assert message.startswith("override policy.bogus") and "values" in message and len(message) < 500


@pytest.mark.parametrize("value, expected", [
    ("&a [1, *a]", "refers to a collection that contains it"),
    ("[" * 3000, "nested too deep"),
    ("[" * 80 + "]" * 80, "nested more than 64 deep"),
])
def test_recursive_and_deeply_nested_values_are_refused(value, expected):
    assert expected in error_of(apply_overrides, {}, [f"policy.bogus={value}"])


def test_shared_aliases_within_the_bound_still_load(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("defaults: " + str(REPO / "configs" / "cpu_demo.yaml") + "\n"
                   "x: &stop [7, 11]\ngrpo:\n  seed: 3\n")
    with pytest.raises(ConfigError, match=r"x: unknown key \(value \[7, 11\]\)"):
        load_config(cfg)


def test_a_large_bad_value_gives_a_short_message():
    big = str([[1] * 5] * 2000)  # 10k values: under the YAML bound, one validation error per inner list
    t0 = time.monotonic()
    message = error_of(load_config, None, [f"grpo.adv_estimator.reward_weights={big}", "policy.bogus=" + big])
    assert time.monotonic() - t0 < 30
    assert len(message) < 5000 and "more errors" in message
    assert "policy.bogus: unknown key (value [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], " in message and "...]" in message


def test_the_entry_point_reports_an_alias_bomb_in_one_short_line(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(ALIAS_BOMB)
    p = subprocess.run([sys.executable, "train_grpo.py", "--config", str(cfg)], cwd=REPO, env=child_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.startswith(f"error: {cfg}, line ") and len(p.stderr) < 500 and "Traceback" not in p.stderr


# ---- one sample per prompt ----------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", [[], ["grpo.adv_estimator.name=gdpo"],
                                       ["grpo.adv_estimator.name=reinforce_plus_plus"]])
def test_one_generation_per_prompt_is_refused_under_a_group_baseline(estimator):
    message = error_of(load_config, REPO / "configs" / "cpu_demo.yaml",
                       [*ONE_SAMPLE, *estimator])
    assert "grpo.num_generations_per_prompt=1:" in message and "every" in message and ">= 2" in message


def test_one_generation_per_prompt_is_fine_without_a_group_baseline():
    cfg = load_config(REPO / "configs" / "cpu_demo.yaml",
                      [*ONE_SAMPLE, "grpo.adv_estimator.name=reinforce_plus_plus",
                       "grpo.adv_estimator.minus_baseline=false"])
    assert cfg.grpo.num_generations_per_prompt == 1


def test_a_forks_estimator_declares_whether_it_needs_a_group():
    overrides = ONE_SAMPLE
    try:
        register_estimator("fork_grouped")(lambda **kw: None)
        register_estimator("fork_global", needs_group=False)(lambda **kw: None)
        assert needs_group("fork_grouped") and not needs_group("fork_global")
        with pytest.raises(ConfigError, match="'fork_grouped' advantage estimator"):
            load_config(REPO / "configs" / "cpu_demo.yaml", overrides + ["grpo.adv_estimator.name=fork_grouped"])
        load_config(REPO / "configs" / "cpu_demo.yaml", overrides + ["grpo.adv_estimator.name=fork_global"])
    finally:
        for name in ("fork_grouped", "fork_global"):
            _ESTIMATORS.pop(name, None)
            _NEEDS_GROUP.pop(name, None)


# ---- toy models ---------------------------------------------------------------------------------------------
def test_an_unknown_toy_model_is_a_config_error_listing_the_toy_models():
    message = error_of(load_config, REPO / "configs" / "cpu_demo.yaml", ["policy.model_name=toy:nonexistent"])
    assert "policy.model_name='toy:nonexistent': no such toy model" in message and "'toy:demo'" in message
    message = error_of(load_config, REPO / "configs" / "cpu_demo.yaml", [
        "on_policy_distillation.enabled=true", "on_policy_distillation.teacher_model_name=toy:nope"])
    assert "on_policy_distillation.teacher_model_name='toy:nope': no such toy model" in message


def test_the_entry_point_names_an_unknown_toy_model_before_locking_anything(tmp_path):
    p = subprocess.run([sys.executable, "train_grpo.py", "policy.model_name=toy:nonexistent",
                        f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"],
                       cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no such toy model" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()


def test_a_syntax_error_in_a_huge_value_gives_a_short_message(tmp_path):
    value = "[1, " + "2" * 200_000 + "}"
    message = error_of(apply_overrides, {}, [f"policy.x={value}"])
    assert message.startswith("override policy.x='[1, 2222") and "invalid YAML" in message and len(message) < 1000
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"policy:\n  x: {value}\n")
    message = error_of(load_config, cfg)
    assert message.startswith(f"{cfg}, line 2, column ") and "\n    ...2222" in message and len(message) < 1000
