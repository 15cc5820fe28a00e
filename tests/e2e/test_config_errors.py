"""Config files and overrides that cannot be read fail with a message naming the file (or override) and the
line, never a traceback: YAML syntax errors, bytes that are not UTF-8, an empty config file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpo.config.load import ConfigError, apply_overrides, load_config
from tests.helpers.e2e import REPO, child_env


def error_of(fn, *args) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args)
    return str(err.value)


def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("grpo:\n  seed: 1\n  stop: [1, 2\npolicy:\n  precision: float32\n")
    message = error_of(load_config, bad)
    assert message.startswith(f"{bad}, line 4, column 7: invalid YAML: expected ',' or ']', but got ':' "
                              "(while parsing a flow sequence started at line 3, column 9)")
    bad.write_text("grpo:\n\tseed: 1\n")
    assert f"{bad}, line 2, column 1: invalid YAML" in error_of(load_config, bad)


def test_a_syntax_error_in_an_inherited_recipe_names_that_file(tmp_path):
    (tmp_path / "base.yaml").write_text("grpo:\n  seed: 1\n   x: 2\n")
    (tmp_path / "run.yaml").write_text("defaults: base.yaml\ngrpo:\n  seed: 2\n")
    assert error_of(load_config, tmp_path / "run.yaml").startswith(
        f"{tmp_path / 'base.yaml'}, line 3, column 5: invalid YAML: mapping values are not allowed here")


def test_a_non_utf8_byte_names_line_and_column(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_bytes(b"grpo:\n  seed: 1\ndata:\n  system_prompt: caf\xe9\n")
    assert error_of(load_config, bad) == f"{bad}, line 4, column 21: byte 0xe9 is not UTF-8; save the file as UTF-8"


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "{}\n"])
def test_an_empty_config_file_is_rejected_saying_what_a_config_needs(tmp_path, text):
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    message = error_of(load_config, empty)
    assert message.startswith(f"{empty}: the config file is empty")
    assert "policy.model_name" in message and "configs/cpu_demo.yaml" in message


@pytest.mark.parametrize("override, expected", [
    ("grpo.num_prompts_per_step=[1,2", "override grpo.num_prompts_per_step='[1,2', column 5: invalid YAML: while "
                                       "parsing a flow sequence: expected ',' or ']'"),
    ("data.prompt_template=a: b: c", "override data.prompt_template='a: b: c', column 5: invalid YAML: mapping "
                                     "values are not allowed here"),
    ("data.system_prompt=caf\udce9", "override data.system_prompt: byte 0xe9 is not UTF-8"),
])
def test_a_bad_override_value_is_named(override, expected):
    assert error_of(apply_overrides, {}, [override]).startswith(expected)


@pytest.mark.parametrize("content", [b"", b"grpo: [\n", b"grpo:\n  seed: \xff\n"])
def test_the_entry_point_exits_2_with_the_message_and_no_traceback(tmp_path, content):
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(content)
    code = ("import sys, train_grpo, grpo.run.cli\n"
            "try:\n    grpo.run.cli.load_run_config(sys.argv[1:], train_grpo.DEFAULT_CONFIG)\n"
            "except SystemExit as e:\n    print('EXIT', e.code, 'torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code, "--config", str(cfg)], cwd=REPO, env=child_env(),
                       capture_output=True, text=True, timeout=60)
    assert "EXIT 2 False" in p.stdout, p.stdout + p.stderr
    assert p.stderr.startswith(f"error: {cfg}") and "Traceback" not in p.stderr
