"""NeMo-RL's vlm_grpo_3B.yaml (a verbatim copy in tests/fixtures/nemo_rl/examples/configs) passes `--check-config`:
its CLEVR-CoGenT data, vlm_hf_data_processor, VLM environment and grpo.debug_payload_metrics each get a fate."""

import sys

import pytest

from grpo.config.load import ConfigError
from grpo.config.nemo_rl.recipe import load_recipe
from tests.helpers.e2e import REPO, run

CONFIGS = REPO / "tests" / "fixtures" / "nemo_rl" / "examples" / "configs"
RECIPE = CONFIGS / "vlm_grpo_3B.yaml"


def test_vlm_grpo_3b_passes_check_config():
    p = run([sys.executable, "train_grpo.py", "--config", str(RECIPE), "--check-config"], timeout=120)
    assert "ignored: grpo.debug_payload_metrics: NeMo-RL's telemetry" in p.stdout, p.stdout[-2000:]
    assert "translated: env.clevr-cogent.reward_functions: -> env.name='vlm'" in p.stdout


def test_vlm_recipe_translation():
    cfg, table = load_recipe(RECIPE)
    assert (cfg.data.dataset_name, cfg.data.train_split, cfg.data.row_format) == (
        "MMInstruction/Clevr_CoGenT_TrainA_70K_Complex", "train", "clevr-cogent")  # NeMo-RL's hub names, by split
    assert (cfg.data.val_data_path, cfg.data.val_split) == ("MMInstruction/Clevr_CoGenT_ValA", "train")
    assert cfg.data.prompt_file.endswith("examples/prompts/clevr_cogent_cot.txt")
    assert cfg.env.name == "vlm" and cfg.env.kwargs == {"reward_functions": [
        {"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.8}]}
    assert cfg.grpo.deduplicate_multimodal_data is False
    # a local file of the dataset's rows (grpo-ds's data_path), geometry3k's env section chosen by env_name
    cfg, _ = load_recipe(RECIPE, ["+data.train.data_path=/tmp/geo.jsonl", "data.train.dataset_name=geometry3k",
                                  "data.validation.dataset_name=geometry3k", "data.validation.split=test",
                                  "data.default.env_name=geometry3k"])
    assert (cfg.data.train_data_path, cfg.data.row_format, cfg.data.val_data_path, cfg.data.val_split) == (
        "/tmp/geo.jsonl", "geometry3k", "hiyouga/geometry3k", "test")
    assert [f["name"] for f in cfg.env.kwargs["reward_functions"]] == ["format", "math_expr"]


@pytest.mark.parametrize("overrides, refused", [
    (["data.validation.split=valC"], "data.validation.split='valC': clevr-cogent has the splits ['train', 'valA', 'valB']"),
    (["data.default.processor=math_hf_data_processor"], "data.train.processor='math_hf_data_processor': NeMo-RL formats"),
    (["data.train.dataset_name=refcoco"], "data.train.dataset_name='refcoco': NeMo-RL's refcoco downloads COCO"),
    (["env.clevr-cogent.reward_functions=[{name: bleu, weight: 1}]"], "env.clevr-cogent.reward_functions.0="),
    (["env.clevr-cogent.reward_functions=[{name: bbox_giou, weight: 1, kwargs: {thres: 1}}]"], "not arguments of bbox_giou"),
])
def test_vlm_recipe_refusals_name_the_key(overrides, refused):
    with pytest.raises(ConfigError) as err:
        load_recipe(RECIPE, overrides)
    assert refused in str(err.value), str(err.value)


def test_a_list_of_image_datasets_becomes_sources_each_with_its_columns_and_environment():
    """NeMo-RL's data.train as a list (CLEVR-CoGenT and Geometry3K, each its env_name): data.train_sources with each
    dataset's row_format and task, one VLM environment per env_name (NeMo-RL's task_to_env)."""
    train = ("[{dataset_name: clevr-cogent, split: train, env_name: clevr-cogent}, "
             "{dataset_name: geometry3k, split: train, env_name: geometry3k, data_path: /tmp/geo.jsonl}]")
    cfg, table = load_recipe(RECIPE, [f"data.train={train}", "data.validation=null"])
    clevr, geo = cfg.data.train_sources
    assert (clevr.dataset_name, clevr.split, clevr.row_format, clevr.task_name) == (
        "MMInstruction/Clevr_CoGenT_TrainA_70K_Complex", "train", "clevr-cogent", "clevr-cogent")
    assert (geo.dataset_name, geo.row_format, geo.task_name) == ("/tmp/geo.jsonl", "geometry3k", "geometry3k")
    assert clevr.prompt_file.endswith("clevr_cogent_cot.txt") and geo.prompt_file == clevr.prompt_file
    assert (cfg.env.name, cfg.env.task_name) == ("vlm", "clevr-cogent")
    assert [f["name"] for f in cfg.env.kwargs["reward_functions"]] == ["format", "exact_alnum"]
    assert list(cfg.env.tasks) == ["geometry3k"] and cfg.env.tasks["geometry3k"].name == "vlm"
    assert [f["name"] for f in cfg.env.tasks["geometry3k"].kwargs["reward_functions"]] == ["format", "math_expr"]
    assert ("ignored", "env.refcoco", "not the data's env_name (clevr-cogent): unused, as in NeMo-RL") in table
    with pytest.raises(ConfigError, match=r"env.geometry3k.reward_functions=None: NeMo-RL's VLMEnvironment needs"):
        load_recipe(RECIPE, [f"data.train={train}", "data.validation=null", "env.geometry3k=null"])


def test_policy_is_vlm_must_name_the_checkpoints_kind():
    """NeMo-RL's ``policy.is_vlm`` translates as it is; at model load a checkpoint of the other kind fails naming the
    key (null follows the checkpoint), so a recipe that asks for a VLM never trains a text model silently."""
    from transformers import LlamaConfig, LlavaConfig

    from grpo.config.policy import PolicyConfig
    from grpo.system.vision import check_policy

    text, vlm = LlamaConfig(), LlavaConfig()
    for asked, model_config in ((None, text), (False, text), (None, vlm), (True, vlm)):
        check_policy(PolicyConfig(model_name="toy:tiny", is_vlm=asked), model_config)
    with pytest.raises(ValueError, match=r"policy.is_vlm=true: toy:tiny is a text model"):
        check_policy(PolicyConfig(model_name="toy:tiny", is_vlm=True), text)
    with pytest.raises(ValueError, match=r"policy.is_vlm=false: toy:tiny is a vision-language model"):
        check_policy(PolicyConfig(model_name="toy:tiny", is_vlm=False), vlm)
