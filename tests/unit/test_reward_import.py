"""Reward modules that fail at import: a message with the module's traceback summary, not a raw traceback;
one that hangs at import is checked in a worker with a timeout (`check_reward_fn`), never in the trainer."""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

import pytest

from grpo.tasks.function import EnvError, resolve_reward_fn
from grpo.tasks.pool import ScoringPool, check_reward_fn

RAISES = '''
import math

LIMIT = 3


def helper():
    return {}["missing_setting"]


SETTINGS = helper()


def reward(question, completion, answer, meta):
    return 1.0
'''

HANGS = '''
import time

time.sleep(600)


def reward(question, completion, answer, meta):
    return 1.0
'''


@pytest.fixture
def modules(tmp_path, monkeypatch):
    (tmp_path / "raises_at_import_mod.py").write_text(RAISES)
    (tmp_path / "hangs_at_import_mod.py").write_text(HANGS)
    (tmp_path / "syntax_error_mod.py").write_text("def reward(:\n    pass\n")
    (tmp_path / "good_reward_mod.py").write_text("def reward(q, c, a, m):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get this process's sys.path
    return tmp_path


def test_a_module_that_raises_at_import_gets_a_message_with_its_traceback_summary(modules):
    with pytest.raises(EnvError) as err:
        resolve_reward_fn("raises_at_import_mod:reward")
    message = str(err.value)
    assert message.startswith("env.reward_fn='raises_at_import_mod:reward': importing 'raises_at_import_mod' raised "
                              "KeyError: 'missing_setting'")
    assert f'File "{modules / "raises_at_import_mod.py"}", line 11, in <module>' in message
    assert 'line 8, in helper\n    return {}["missing_setting"]' in message
    assert "importlib" not in message and "_bootstrap" not in message


def test_a_syntax_error_names_file_and_line(modules):
    with pytest.raises(EnvError, match=r"raised SyntaxError: .*syntax_error_mod.py.*line 1"):
        resolve_reward_fn("syntax_error_mod:reward")


def test_a_missing_module_and_a_missing_dependency_are_told_apart(modules):
    with pytest.raises(EnvError, match=r"cannot import 'no_such_mod_xyz' \(No module named 'no_such_mod_xyz'\)"):
        resolve_reward_fn("no_such_mod_xyz:reward")
    (modules / "needs_dep_mod.py").write_text("import not_installed_dep_xyz\n")
    with pytest.raises(EnvError, match=r"importing 'needs_dep_mod' raised ModuleNotFoundError: No module named "
                                       r"'not_installed_dep_xyz'\n.*needs_dep_mod.py\", line 1"):
        resolve_reward_fn("needs_dep_mod:reward")


def test_check_reward_fn_imports_in_a_worker(modules):
    check_reward_fn("good_reward_mod:reward", timeout_s=120)
    assert "good_reward_mod" not in sys.modules  # imported by the worker, not by this process
    with pytest.raises(EnvError, match=r"(?s)cannot load 'raises_at_import_mod:reward':.*KeyError: 'missing_setting'"):
        check_reward_fn("raises_at_import_mod:reward", timeout_s=120)
    assert [p for p in mp.active_children() if p.name == "grpo-reward-worker"] == []


def test_check_reward_fn_times_out_on_a_module_that_hangs_at_import(modules):
    start = time.monotonic()
    with pytest.raises(EnvError, match=r"did not start within 3.0s: importing its module hangs"):
        check_reward_fn("hangs_at_import_mod:reward", timeout_s=3.0)
    assert time.monotonic() - start < 30
    assert [p for p in mp.active_children() if p.name == "grpo-reward-worker"] == []


def test_a_pool_worker_reports_the_import_error_summary(modules):
    pool = ScoringPool("raises_at_import_mod:reward", num_workers=1, timeout_s=5)
    with pytest.raises(EnvError, match=r"(?s)cannot load 'raises_at_import_mod:reward':.*line 11, in <module>"):
        pool.run([{"question": "q", "completion": "c", "answer": "a", "meta": {}}])
    assert pool.pids() == []


def test_a_short_env_timeout_does_not_fail_a_module_that_takes_seconds_to_import(modules):
    """env.timeout_s limits one call; the import check at setup gives a worker at least MIN_IMPORT_TIMEOUT_S to start
    (it used env.timeout_s: with 1 s a run failed at startup on a loaded machine)."""
    from grpo.config import EnvConfig
    from grpo.tasks.factory import build_environment

    (modules / "slow_import_mod.py").write_text("import time\n\ntime.sleep(2)\n\n\n"
                                                "def reward(question, completion, answer, meta):\n    return 1.0\n")
    env = build_environment(EnvConfig(name="function", reward_fn="slow_import_mod:reward", timeout_s=1.0))
    env.shutdown()
