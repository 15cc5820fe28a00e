"""A fork's config: `config_cls`, a subclass of MasterConfig with its own section, goes through the same loading,
validation, --help-config and run fingerprint as the built-in sections (no edit of grpo/config/)."""

import pytest
import torch
from pydantic import BaseModel, Field

from grpo.config import MasterConfig
from grpo.config.load import ConfigError, build_config, check_config_cls, config_help, load_config
from grpo.system.rundir import fingerprint_diff, run_fingerprint
from grpo.registry import _ESTIMATORS, _NEEDS_GROUP, register_estimator
from tests.helpers import fork_algo
from tests.helpers.fork_algo import MyConfig

# Importing the fork registers its estimator, at collection, for every test of the session (the unforked config's
# error names the registered estimators): the tests here register it only while they run.
_ESTIMATORS.pop("my_estimator", None), _NEEDS_GROUP.pop("my_estimator", None)


@pytest.fixture(autouse=True)
def fork_estimator():
    register_estimator("my_estimator")(fork_algo.my_estimator)
    yield
    _ESTIMATORS.pop("my_estimator", None), _NEEDS_GROUP.pop("my_estimator", None)


def test_a_fork_section_is_validated_like_the_built_in_ones():
    cfg = load_config(None, ["my_algo.entropy_coef=0.01", "my_algo.baseline=none", "grpo.seed=7"],
                      config_cls=MyConfig)
    assert isinstance(cfg, MyConfig) and cfg.my_algo.entropy_coef == 0.01 and cfg.my_algo.baseline == "none"
    assert cfg.grpo.seed == 7
    assert build_config({}, MyConfig).my_algo.entropy_coef == 0.0  # defaults
    with pytest.raises(ConfigError, match=r"my_algo\.entropy_coeff: unknown key \(value 0\.01\); check the spelling "
                                          r"against tests\.helpers\.fork_algo\.MyConfig"):
        load_config(None, ["my_algo.entropy_coeff=0.01"], config_cls=MyConfig)
    with pytest.raises(ConfigError, match=r"my_algo\.baseline='median'"):
        build_config({"my_algo": {"baseline": "median"}}, MyConfig)
    with pytest.raises(ConfigError, match=r"my_algo\.entropy_coef=-1"):
        build_config({"my_algo": {"entropy_coef": -1}}, MyConfig)
    with pytest.raises(ConfigError, match=r"grpo\.num_prompts_per_stepp: unknown key"):  # built-in sections too
        build_config({"grpo": {"num_prompts_per_stepp": 4}}, MyConfig)
    # The unforked config does not know the section, and says so.
    with pytest.raises(ConfigError, match=r"my_algo: unknown key .*against grpo/config/"):
        build_config({"my_algo": {"entropy_coef": 0.01}})


def test_help_config_shows_the_fork_section():
    text = config_help("my_algo", MyConfig)
    assert "my_algo.entropy_coef  (float, default 0.0)" in text and "Weight of the entropy bonus" in text
    assert "my_algo.baseline  ('group_mean' | 'none', default group_mean)" in text and "grpo." not in text
    assert "my_algo.entropy_coef" in config_help(None, MyConfig) and "my_algo" not in config_help()
    with pytest.raises(ConfigError, match="my_algo"):  # the sections listed include the fork's
        config_help("nosuch", MyConfig)


def test_the_fork_config_round_trips_through_its_dump_and_the_run_fingerprint():
    cfg = build_config({"my_algo": {"entropy_coef": 0.01}}, MyConfig)
    dumped = cfg.model_dump(mode="json")  # what config.json and the run fingerprint hold
    assert build_config(dumped, MyConfig) == cfg
    changed = build_config({"my_algo": {"entropy_coef": 0.02}}, MyConfig).model_dump(mode="json")
    old, new = run_fingerprint(dumped), run_fingerprint(changed)
    assert old["config_sha256"] != new["config_sha256"]
    assert fingerprint_diff(old, new) == ["my_algo.entropy_coef: 0.01 -> 0.02"]


def test_a_config_class_must_be_a_strict_master_config():
    class Loose(BaseModel):  # accepts unknown keys: a misspelt key would pass silently
        x: int = 0

    class LooseConfig(MasterConfig):
        mine: Loose = Field(default_factory=Loose, description="a loose section")

    with pytest.raises(TypeError, match=r"section mine \(.*Loose\) accepts unknown keys; declare it with "
                                        r"extra='forbid'"):
        build_config({}, LooseConfig)
    with pytest.raises(TypeError, match="expected grpo.config.MasterConfig or a subclass"):
        check_config_cls(dict)
    assert check_config_cls(MyConfig) is MyConfig


@pytest.mark.parametrize("baseline", ["group_mean", "none"])
def test_a_fork_estimator_reads_its_section(baseline):
    from grpo.advantages import compute_advantages

    cfg = build_config({"my_algo": {"baseline": baseline}, "grpo": {"adv_estimator": {"name": "my_estimator"}}},
                       MyConfig)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = compute_advantages("my_estimator", group_ids=torch.tensor([0, 0, 1, 1]), rewards=rewards,
                             valid_mask=torch.ones(4), token_mask=torch.ones(4, 2), cfg=cfg.grpo.adv_estimator,
                             master_cfg=cfg)
    expected = rewards if baseline == "none" else torch.tensor([0.5, -0.5, 0.0, 0.0])
    assert torch.equal(adv[:, 0], expected)
