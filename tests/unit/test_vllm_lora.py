"""The vLLM backend with policy.lora: engine arguments, adapter-only weight sync (a new adapter id per weight
version, the old one removed, its files deleted), generation with the newest adapters.

Fast tests use a stand-in for vllm (no import, no engine). The slow test runs vllm-cpu (which has LoRA: its
``PunicaWrapperCPU``) in its own process, as tests/helpers/vllm_sampling_check.py does (closing an in-process
engine takes torch.distributed down with it):

    python tests/unit/test_vllm_lora.py MODEL_DIR    # one JSON line per weight version
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.helpers.fake_vllm import install_fake_vllm

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["1+2=", "hello there", "a", "xyz 12", "What is 7*6?", "ok", "(3*4)-5=", "Z"]
SEEDS = [11, 22, 33, 44, 55, 66, 77, 88]
VERSIONS = 3


def lora_cfg(model_dir: str, **lora):
    from grpo.config.load import build_config

    return build_config({
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "seed": 5},
        "policy": {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 64,
                   "train_global_batch_size": 8, "train_micro_batch_size": 8, "logprob_batch_size": 8,
                   "generation_batch_size": 8, "lora": {"enabled": True, "dim": 8, "alpha": 16, **lora},
                   "generation": {"backend": "vllm", "max_new_tokens": 16,
                                  "vllm_cfg": {"enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20}}},
    })


def peft_model(model_dir: str, r: int = 8, alpha: int = 16, target_modules="all-linear"):
    """A peft model built here (the fast tests' stand-in for the policy engine's module): adapters on every linear
    layer but the head by default."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules)).eval()


def randomize_adapters(model, seed: int) -> None:
    """New adapter weights (B nonzero, so each version changes the model's outputs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def adapter_source(model):
    """(tensors, peft config) as grpo.system.weights' ``adapter_state_dict`` / ``peft_config_dict`` give them."""
    from peft import get_peft_model_state_dict

    return {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}, model.peft_config["default"].to_dict()


# --------------------------------------------------------------------------------------------------
# Fast: engine arguments and config checks
# --------------------------------------------------------------------------------------------------
def test_engine_kwargs_with_lora(tiny_model_dir):
    from grpo.system.generation.vllm_params import llm_kwargs

    def kwargs(cfg):
        return llm_kwargs(cfg, model="m", tokenizer="m", rank=0, world_size=1, on_cpu=True, sleep_mode_available=False)

    kw = kwargs(lora_cfg(tiny_model_dir, dim=12))
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"], kw["max_cpu_loras"]) == (True, 16, 1, 2)
    off = kwargs(lora_cfg(tiny_model_dir, enabled=False))
    assert not {"enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras"} & set(off)


@pytest.mark.parametrize("change, message", [
    ({"lora": {"dim": 600}}, "ranks up to 512"),
    ({"generation": {"vllm_cfg": {"sleep_level": 2}}}, "use sleep_level=1"),
    ({"generation": {"vllm_cfg": {"vllm_kwargs": {"max_loras": 4}}}}, "max_loras"),
])
def test_config_refuses_what_vllm_lora_cannot_do(tiny_model_dir, change, message):
    from grpo.config import PolicyConfig

    base = {"model_name": tiny_model_dir, "lora": {"enabled": True}, "generation": {"backend": "vllm"}}
    PolicyConfig.model_validate(base)
    merged = {k: ({**base[k], **v} if k in base else v) for k, v in change.items()}
    if "generation" in change:
        merged["generation"] = {"backend": "vllm", **change["generation"]}
    with pytest.raises(ValueError, match=message):
        PolicyConfig.model_validate({**base, **merged})
    PolicyConfig.model_validate({**base, **merged, "generation": {**merged.get("generation", {}), "backend": "hf"}})


def test_adapter_config_for_vllm_loads_in_peft(tiny_model_dir, tmp_path):
    """The written layout is peft's save_pretrained layout: peft loads it back to the same adapters."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from grpo.system.generation.vllm import write_adapter

    model = peft_model(tiny_model_dir)
    randomize_adapters(model, 1)
    tensors, config = adapter_source(model)
    write_adapter(str(tmp_path / "a"), tensors, config)
    written = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert written["r"] == 8 and written["lora_alpha"] == 16 and "init_lora_weights" not in written
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, str(tmp_path / "a")))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


# --------------------------------------------------------------------------------------------------
# Fast: adapter versions with a stand-in engine
# --------------------------------------------------------------------------------------------------
class FakeEngine:
    """``llm.llm_engine``'s LoRA calls (vllm 0.32 v1/engine/llm_engine.py), recording them; ``add_lora`` checks
    the files are there, as vLLM reads them at that call."""

    def __init__(self):
        self.loaded: dict[int, str] = {}
        self.calls: list[tuple] = []

    def add_lora(self, request) -> bool:
        assert os.path.isfile(os.path.join(request.lora_path, "adapter_model.safetensors"))
        self.calls.append(("add", request.lora_int_id))
        self.loaded[request.lora_int_id] = request.lora_path
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(("remove", lora_id))
        return self.loaded.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loaded)


def make_request(**kw):
    return types.SimpleNamespace(**kw)


def test_adapter_id_per_version_old_one_removed(tiny_model_dir, tmp_path):
    from grpo.system.generation.vllm import AdapterSync

    model = peft_model(tiny_model_dir)
    llm = types.SimpleNamespace(llm_engine=FakeEngine())
    sync = AdapterSync(llm, rank=0, root=str(tmp_path), make_request=make_request)
    paths = []
    for version in range(1, 4):
        randomize_adapters(model, version)
        request = sync.sync(*adapter_source(model))
        assert (request.lora_int_id, request.lora_name) == (version, f"policy-v{version}")
        assert sync.request is request and llm.llm_engine.list_loras() == {version}
        assert os.listdir(sync.dir) == [f"v{version}"]  # the previous version's files are gone
        paths.append(request.lora_path)
    assert llm.llm_engine.calls == [("add", 1), ("add", 2), ("remove", 1), ("add", 3), ("remove", 2)]
    sync.close()
    assert not os.path.exists(sync.dir)


def test_failed_load_keeps_the_old_version(tiny_model_dir, tmp_path):
    from grpo.system.generation.vllm import AdapterSync

    model = peft_model(tiny_model_dir)
    engine = FakeEngine()
    sync = AdapterSync(types.SimpleNamespace(llm_engine=engine), root=str(tmp_path), make_request=make_request)
    first = sync.sync(*adapter_source(model))
    engine.add_lora = lambda request: False
    with pytest.raises(RuntimeError, match="version 2"):
        sync.sync(*adapter_source(model))
    assert sync.request is first and engine.list_loras() == {1} and os.listdir(sync.dir) == ["v1"]
    sync.close()


class FakeLLM:
    """vllm.LLM with LoRA calls and a ``generate`` that records the lora_request it gets."""

    def __init__(self, **kwargs):
        self.kwargs, self.llm_engine, self.generated_with = kwargs, FakeEngine(), []

    def sleep(self, level=1):
        pass

    def wake_up(self, tags=None):
        pass

    def reset_prefix_cache(self):
        return True  # vLLM's answer when no request holds a KV block

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        self.generated_with.append(lora_request.lora_int_id)
        step = {5: types.SimpleNamespace(logprob=-1.0)}
        out = types.SimpleNamespace(token_ids=[5], logprobs=[step], finish_reason="length")
        return [types.SimpleNamespace(outputs=[out]) for _ in prompts]


def test_backend_syncs_adapters_and_generates_with_the_newest(monkeypatch, tiny_model_dir, char_tokenizer):
    """refit with policy.lora loads the adapters (never base weights) and generate passes the newest version."""
    from grpo.system import weights
    from grpo.system.generation import vllm as backend

    install_fake_vllm(monkeypatch, FakeLLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm.inputs", types.SimpleNamespace(TokensPrompt=dict))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", types.SimpleNamespace(LoRARequest=make_request))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state",
                        types.SimpleNamespace(destroy_model_parallel=lambda: None))
    monkeypatch.setattr(backend, "push_buckets", lambda *a: pytest.fail("base weights pushed with policy.lora"))
    model = peft_model(tiny_model_dir)
    monkeypatch.setattr(weights, "adapter_state_dict", lambda engine: adapter_source(engine.module)[0])
    gen = backend.VllmGeneration(lora_cfg(tiny_model_dir), char_tokenizer, None, torch.device("cpu"))
    try:
        assert gen.llm.kwargs["enable_lora"] and gen.llm.kwargs["max_lora_rank"] == 8
        engine = types.SimpleNamespace(module=model)
        for version in (1, 2, 3):
            randomize_adapters(model, version)
            gen.refit(engine)
            gen.generate([[1, 5], [1, 6]], [0, 1])
            gen.sleep()
        assert gen.llm.generated_with == [1, 2, 3]
        assert gen.llm.llm_engine.list_loras() == {3}
        scratch = gen.adapters.dir
    finally:
        gen.close()
    assert not os.path.exists(scratch)


# --------------------------------------------------------------------------------------------------
# Slow: vllm-cpu's LoRA against the peft model, over several weight versions
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    """The demo size (head size 32: vLLM's CPU attention has no kernel for the tiny model's 16)."""
    from grpo.tasks.toy import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("small_model")), size="small", seed=3)


@pytest.mark.slow  # ~40 s (vllm import and engine start); fast twins: the stand-in tests above
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_cpu_generates_with_the_newest_adapters(small_model_dir):
    proc = subprocess.run([sys.executable, __file__, small_model_dir], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["version"] for r in rows] == list(range(1, VERSIONS + 1))
    for r in rows:
        assert abs(r["err"] - 1.0) <= 1e-3, r  # vLLM sampled from the peft model's distribution
        assert r["loaded"] == [r["version"]] and r["files"] == [f"v{r['version']}"], r
        assert r["tokens"] > 50, r
        if r["version"] > 1:
            assert r["err_previous_adapters"] > 1.01, r  # ... of the newest adapters, not the previous ones


@pytest.mark.slow  # ~50 s; fast twin: test_backend_syncs_adapters_and_generates_with_the_newest
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_train_grpo_with_lora_on_vllm(tmp_path):
    """train_grpo.py, the CPU vLLM demo with policy.lora: the engine samples from the trained adapters each step."""
    from tests.helpers.e2e import metrics, paths, run

    run([sys.executable, "train_grpo.py", "--config", str(REPO / "configs" / "cpu_vllm_tiny.yaml"),
         "grpo.max_num_steps=3", "policy.lora.enabled=true", *paths(tmp_path)], timeout=600)
    train = {r["step"]: r for r in metrics(tmp_path) if "train/loss" in r}
    assert sorted(train) == [1, 2, 3]
    for step, r in train.items():
        assert 1.0 <= r["train/token_mult_prob_error"] <= 1.001, (step, r["train/token_mult_prob_error"])


def mult_prob_error(model, outputs, pad_id: int, temperature: float) -> tuple[float, int]:
    """clipped_pg_loss's token_mult_prob_error with prev = the trainer's `forward_logprobs` of ``model``, and the
    number of generated tokens."""
    from grpo.batch import build_batch
    from grpo.config.load import build_config
    from grpo.loss import clipped_pg_loss
    from grpo.system.rollout import single_turn
    from grpo.system.training import forward_logprobs

    b = build_batch(single_turn(outputs), pad_id)
    with torch.no_grad():
        prev_bt = forward_logprobs(model, b.input_ids_bt, b.attention_mask_bt, temperature)
    cfg = build_config({"loss_fn": {"reference_policy_kl_penalty": 0.0}}).loss_fn
    _, metrics = clipped_pg_loss(prev_bt, prev_bt, torch.zeros(len(outputs)), b.token_mask_bt,
                                 torch.ones(len(outputs)), cfg, generation_logprobs=b.generation_logprobs_bt)
    return metrics["token_mult_prob_error"], int(b.token_mask_bt.sum())


def main(model_dir: str) -> None:
    """VERSIONS weight versions of a LoRA policy engine (grpo.system.engines, policy.lora): new adapters, refit
    (adapter sync through grpo.system.weights' adapter_state_dict / peft_config_dict), generate, compare with the
    engine's logprobs."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from peft import set_peft_model_state_dict
    from transformers import AutoTokenizer

    from grpo.system import engines
    from grpo.system.dist import init_distributed
    from grpo.system.generation.vllm import VllmGeneration

    cfg = lora_cfg(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    init_distributed()
    policy = engines.build_policy_engine(cfg, world_size=1, total_optimizer_steps=10)  # one rank fp32: no ZeRO
    model = policy.module
    gen = VllmGeneration(cfg, tok, policy, "cpu")
    temperature = cfg.policy.generation.temperature
    previous = None
    for version in range(1, VERSIONS + 1):
        randomize_adapters(model, 100 + version)  # as if trained
        seconds = gen.refit(policy)
        outputs = gen.generate([tok(p)["input_ids"] for p in PROMPTS], SEEDS)
        err, tokens = mult_prob_error(policy, outputs, tok.pad_token_id, temperature)
        row = {"version": version, "err": err, "tokens": tokens, "sync_s": seconds,
               "loaded": sorted(gen.llm.llm_engine.list_loras()), "files": sorted(os.listdir(gen.adapters.dir))}
        if previous is not None:
            current = adapter_source(model)[0]
            set_peft_model_state_dict(model, previous)
            row["err_previous_adapters"] = mult_prob_error(policy, outputs, tok.pad_token_id, temperature)[0]
            set_peft_model_state_dict(model, current)
        previous = adapter_source(model)[0]
        print(json.dumps(row), flush=True)
        gen.sleep()
    gen.close()


if __name__ == "__main__":
    main(sys.argv[1])
    from grpo.system import engines

    engines.shutdown()
    engines.exit_process(0)  # vLLM's teardown of an in-process engine is slow and not under test


def test_adapters_move_to_disk_with_a_warning_when_the_scratch_directory_lacks_room(tiny_model_dir, tmp_path, caplog):
    """/dev/shm in a container is 64 MiB unless raised: before each write the scratch directory is checked for room
    for two versions of the adapters; without it they are staged on disk (a warning says where and why), and with no
    room there either the sync fails naming both."""
    from grpo.system.generation.vllm import AdapterSync, adapter_bytes

    model = peft_model(tiny_model_dir)
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    size = adapter_bytes(adapter_source(model)[0])
    free = {str(shm): size, str(disk): 10 * size}  # room for one version in "shm": not for the two kept at once
    sync = AdapterSync(types.SimpleNamespace(llm_engine=FakeEngine()), root=str(shm), make_request=make_request,
                       fallback_root=str(disk), free_bytes=lambda d: free[str(Path(d).parent) if "grpo-lora" in d else d])
    with caplog.at_level("WARNING"):
        first = sync.sync(*adapter_source(model))
    assert first.lora_path.startswith(str(disk)) and os.path.isfile(os.path.join(first.lora_path, "adapter_config.json"))
    assert "MiB free, the adapters need" in caplog.text and str(disk) in caplog.text and "--shm-size" in caplog.text
    sync.sync(*adapter_source(model))  # the disk directory has room: no second move
    assert sync.request.lora_path.startswith(str(disk)) and caplog.text.count("staging them in") == 1
    sync.close()
    assert not any(disk.iterdir()) and not any(shm.iterdir())

    free[str(disk)] = 0
    full = AdapterSync(types.SimpleNamespace(llm_engine=FakeEngine()), root=str(shm), make_request=make_request,
                       fallback_root=str(disk), free_bytes=lambda d: free[str(Path(d).parent) if "grpo-lora" in d else d])
    with pytest.raises(RuntimeError, match="no room to stage the LoRA adapters for vLLM: .*shm.* has .*disk has 0.0 MiB"):
        full.sync(*adapter_source(model))
    full.close()
