"""A toy model is rebuilt when its builder's module changes (`grpo.tasks.catalogue.builder_stamp`): the agent demo's
``toy:calc_agent``, which no task names, is stamped with grpo/tasks/calculator.py (where its builder lives), not with
the catalogue's own source."""

import inspect

from grpo.tasks import calculator, catalogue


def test_every_toy_models_stamp_follows_its_builders_module(monkeypatch):
    before = {key: catalogue.builder_stamp(key) for key in ("calc_agent", "calc_demo", "demo")}
    real = inspect.getsource

    def edited(obj):  # calculator.py as if its builder had changed
        return real(obj) + ("\n# edited" if obj is calculator else "")

    monkeypatch.setattr(inspect, "getsource", edited)
    after = {key: catalogue.builder_stamp(key) for key in before}
    assert after["calc_agent"] != before["calc_agent"] and after["calc_demo"] != before["calc_demo"]
    assert after["demo"] == before["demo"]


def test_the_reward_model_demos_stamp_follows_its_builders_module(monkeypatch):
    from grpo.tasks import demo_reward_model

    before = catalogue.builder_stamp("demo_rm")
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: real(obj) + ("\n# edited" if obj is demo_reward_model else ""))
    assert catalogue.builder_stamp("demo_rm") != before
