"""The generation ranks' reset command asks the backend (`GenerationBackend.reset_prefix_cache`), never probes it."""

from grpo.system.generation.base import GenerationBackend
from grpo.system.generation.server import _run_reset


class Recording(GenerationBackend):
    def __init__(self, fail: bool = False):
        self.resets, self.fail = 0, fail

    def reset_prefix_cache(self) -> None:
        self.resets += 1
        if self.fail:
            raise RuntimeError("blocks still held")


def test_the_reset_command_calls_the_backends_own_reset():
    backend = Recording()
    assert _run_reset(backend) == ("ok", None)
    assert backend.resets == 1


def test_a_refused_reset_is_answered_as_an_error_naming_it():
    assert _run_reset(Recording(fail=True)) == ("error", "RuntimeError: blocks still held")


def test_a_backend_that_caches_nothing_resets_as_a_no_op():
    assert _run_reset(GenerationBackend.__new__(GenerationBackend)) == ("ok", None)
