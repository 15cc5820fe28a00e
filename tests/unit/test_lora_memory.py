"""What a LoRA run holds (issue 51): real DeepSpeed engines on a tiny Llama, one rank in this process.

A LoRA run keeps no gradient and no optimizer state for a frozen base weight (every ZeRO stage a run can take), holds
the base weights once where the placement generates on the policy module itself (no ZeRO: the colocated hf backend)
and twice where it needs a whole copy to generate from (ZeRO-3: the hf backend's copy), its adapters-off reference
pass keeps no activations, and an adapted linear layer (`grpo.system.engines.in_place_lora_linear`) computes peft's
numbers bit for bit with one temporary instead of three. Measured on the bench model by bench/bench_lora_memory.py.
The same audit on two ZeRO-3 ranks: ``test_two_zero3_ranks_hold_state_for_the_adapters_only`` (slow), which runs
this file under torchrun.

    torchrun --nproc_per_node 2 tests/unit/test_lora_memory.py MODEL_DIR OUT.json   # what that test runs
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def lora_engine(model_dir: str, stage: str, world_size: int = 1, **lora):
    """A LoRA policy engine (`tests.unit.test_lora.lora_cfg`: rank 4) and its config; ``zero1`` runs in bf16 (what
    one 16-bit rank gets: DeepSpeed's BF16_Optimizer)."""
    from grpo.system import engines
    from tests.unit.test_lora import lora_cfg

    cfg = lora_cfg(model_dir, stage, **lora)
    if stage == "zero1":
        policy = {**cfg.policy.model_dump(), "precision": "bfloat16"}
        cfg = type(cfg).model_validate({**cfg.model_dump(), "policy": policy})
    return engines.build_policy_engine(cfg, world_size, total_optimizer_steps=8), cfg


def _storages(tensors) -> dict[tuple, torch.Tensor]:
    """One tensor per distinct storage (by address), empty storages left out."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().nbytes():
            out.setdefault((t.device.type, t.untyped_storage().data_ptr()), t)
    return out


def _tensors_in(obj, depth: int = 3):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth and isinstance(obj, dict):
        for v in [*obj.keys(), *obj.values()]:
            yield from _tensors_in(v, depth - 1)
    elif depth and isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors_in(v, depth - 1)


def optimizer_held_elements(engine) -> int:
    """Elements of every tensor the engine's optimizer holds (its states, and under ZeRO / BF16_Optimizer every
    tensor attribute of DeepSpeed's wrapper: master partitions, flat buffers, gradient partitions and buckets), each
    storage once, the module's own parameters and their ZeRO-3 partitions left out."""
    module = {*_storages(engine.module.parameters()),
              *_storages(p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor"))}
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    held = list(_tensors_in(list(inner.state.values())))
    if inner is not opt:
        held += [t for name, v in vars(opt).items() if name != "optimizer" for t in _tensors_in(v)]
    return sum(t.untyped_storage().nbytes() // t.element_size()
               for key, t in _storages(held).items() if key not in module)


def numels(engine) -> tuple[int, int]:
    """(base elements, adapter elements) of the policy, whole (ZeRO-3: ``ds_numel``)."""
    named = [(n, getattr(p, "ds_numel", p.numel())) for n, p in engine.module.named_parameters()]
    adapters = sum(n for name, n in named if ".lora_" in name)
    return sum(n for _, n in named) - adapters, adapters


def audit_state(engine) -> dict:
    """What the optimizer and the autograd of a trained LoRA engine hold for its frozen base (`audit_state`'s keys:
    ``frozen_with_grad``: frozen parameters with a ``.grad``; ``frozen_in_optimizer``: frozen parameters the
    optimizer steps; ``held``: `optimizer_held_elements`; ``base`` / ``adapters``: `numels`)."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    # the parameters DeepSpeed's wrapper steps: ZeRO-3's fp16_groups, ZeRO-1/2's bit16_groups, BF16_Optimizer's
    groups = [g for name in ("fp16_groups", "bit16_groups", "bf16_groups") for g in getattr(opt, name, [])]
    stepped = {id(p) for g in groups for p in g} | {id(p) for g in inner.param_groups for p in g["params"]}
    frozen = [(n, p) for n, p in engine.module.named_parameters() if ".lora_" not in n]
    base, adapters = numels(engine)
    return {"frozen_with_grad": [n for n, p in frozen if p.grad is not None],
            "frozen_in_optimizer": [n for n, p in frozen if id(p) in stepped],
            "held": optimizer_held_elements(engine), "base": base, "adapters": adapters}


def check_state(audit: dict, ipg_bucket: int = 0) -> None:
    """No gradient and no optimizer state for a frozen parameter: what the optimizer holds is a few copies of the
    adapters (Adam's moments; under ZeRO its fp32 masters, gradient partitions and buffers) plus ZeRO's fixed-size
    reduce bucket, never an element per base weight."""
    assert audit["frozen_with_grad"] == [] and audit["frozen_in_optimizer"] == []
    assert audit["held"] <= 6 * audit["adapters"] + ipg_bucket < audit["base"], audit


def live_tensors() -> list[torch.Tensor]:
    """Every tensor with memory of its own that the garbage collector reaches (a strong reference to each: none of
    their addresses is reused while the list lives). Meta tensors and tensor subclasses without storage (FakeTensor,
    which an earlier test of the same process may leave alive: their data pointer raises) hold no copy of anything."""
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and has_storage(o)]


def has_storage(t: torch.Tensor) -> bool:
    try:
        return not t.is_meta and t.numel() > 0 and t.untyped_storage().nbytes() > 0 and t.data_ptr() >= 0
    except (RuntimeError, NotImplementedError):
        return False


def copies_of_base_weights(weights: dict[str, torch.Tensor], ignore: list[torch.Tensor] = ()) -> dict[str, int]:
    """For each base weight (its whole value, in ``weights``: these tensors themselves are not counted), how many
    distinct tensors the process holds with exactly its values (any shape with its number of elements, e.g. a ZeRO-3
    partition on one rank), views of one storage at one offset counted once. ``ignore``: tensors alive before
    (`live_tensors`; a ZeRO-3 engine of an earlier test outlives it: DeepSpeed's module hooks keep it)."""
    skip = {t.data_ptr() for t in [*weights.values(), *ignore]}
    held = {}
    for obj in live_tensors():
        if obj.data_ptr() not in skip:
            held.setdefault((obj.data_ptr(), obj.numel(), obj.dtype), obj)
    by_numel: dict[int, list[torch.Tensor]] = {}
    for (_, numel, _), t in held.items():
        by_numel.setdefault(numel, []).append(t)
    return {name: sum(1 for t in by_numel.get(w.numel(), []) if t.dtype == w.dtype
                      and torch.equal(t.detach().reshape(-1), w.reshape(-1)))
            for name, w in weights.items()}


def ipg_bucket_elements(engine) -> int:
    """ZeRO-3's reduce bucket (``reduce_bucket_size``: fixed by the config, not by the parameters)."""
    return int(engine.zero_optimization_stage() == 3 and engine.zero_reduce_bucket_size())


@pytest.fixture(scope="module")
def dist_group():
    from grpo.system.dist import init_distributed

    init_distributed()


# --------------------------------------------------------------------------------------------------
# gradients, optimizer states, copies of the base weights
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["zero0", "zero1", "zero3"])
def test_no_gradient_or_optimizer_state_for_a_frozen_base_weight(tiny_model_dir, dist_group, stage):
    from tests.unit.test_lora import train

    engine, _ = lora_engine(tiny_model_dir, stage, dim=1)
    train(engine, 2)
    check_state(audit_state(engine), ipg_bucket_elements(engine))


@pytest.mark.parametrize("stage, copies", [("zero0", 1), ("zero3", 2)])
def test_the_base_weights_are_held_once_unless_generation_needs_its_own_copy(tiny_model_dir, dist_group, stage,
                                                                            copies):
    """No ZeRO: the hf backend generates on the policy module, the reference is the adapters-off pass: one copy.
    ZeRO-3 (one rank here): the partitioned policy and the hf backend's whole copy, nothing more."""
    from grpo.run.serving import build_generation_backend
    from grpo.system import engines
    from grpo.system.chat import load_tokenizer
    from grpo.system.training import compute_logprobs
    from tests.unit.test_lora import gathered, train
    from tests.helpers.dist_train_step import make_batch

    earlier = live_tensors()
    engine, cfg = lora_engine(tiny_model_dir, stage)
    generator = build_generation_backend(cfg, load_tokenizer(cfg.policy), engine, torch.device("cpu"))
    reference = engines.AdaptersOff(engine)
    generator.refit(engine)
    train(engine, 2)
    generator.refit(engine)
    generator.generate([[5, 6, 7], [8, 9]], seeds=[1, 2])
    batch = make_batch(3, engine.module.config.vocab_size)
    compute_logprobs(reference, batch.input_ids_bt, batch.attention_mask_bt, 1.0, 4)
    base = {n: t for n, t in gathered(engine).items() if ".lora_" not in n and t.numel() > 64}  # not the norms
    found = copies_of_base_weights(base, ignore=earlier)
    assert found == {n: copies for n in base}, found


def test_a_lora_run_s_setup_holds_the_base_weights_once(tiny_model_dir, dist_group, tmp_path):
    """`grpo.run.run_setup.setup` of a one-rank fp32 LoRA run (no ZeRO, colocated hf): the reference is the
    adapters-off pass and generation runs on the policy module, so nothing else holds a base weight."""
    from grpo.run.run_setup import setup
    from tests.helpers.e2e import TINY
    from tests.unit.test_lora import gathered

    earlier = live_tensors()
    run = setup(["--config", TINY, f"policy.model_name={tiny_model_dir}", f"logger.log_dir={tmp_path}/logs",
                 "checkpointing.enabled=false", "policy.lora.enabled=true", "policy.lora.dim=1"], TINY,
                asynchronous=False)
    try:
        base = {n: t for n, t in gathered(run.policy).items() if ".lora_" not in n and t.numel() > 64}
        found = copies_of_base_weights(base, ignore=earlier)
        assert found == {n: 1 for n in base}, found
    finally:
        for closable in reversed(run.closables):
            closable.close()


def test_the_adapters_off_reference_pass_keeps_no_activations(tiny_model_dir, dist_group):
    """The reference logprobs run under ``torch.no_grad`` and nothing is saved for a backward (the training forward
    saves: the hook sees it)."""
    from grpo.system import engines
    from grpo.system.training import compute_logprobs, forward_logprobs
    from tests.helpers.dist_train_step import make_batch

    engine, _ = lora_engine(tiny_model_dir, "zero0")
    batch = make_batch(0, engine.module.config.vocab_size)
    saved, grad_modes = [], []
    engine.module.register_forward_pre_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        compute_logprobs(engines.AdaptersOff(engine), batch.input_ids_bt, batch.attention_mask_bt, 1.0, 4)
        assert saved == [] and grad_modes == [False, False]
        forward_logprobs(engine, batch.input_ids_bt, batch.attention_mask_bt)
    assert saved and grad_modes[-1]


# --------------------------------------------------------------------------------------------------
# freed tensors go back to the system (a CPU run's peak RSS is its tensors', not malloc's high-water mark)
# --------------------------------------------------------------------------------------------------
_FREED_AFTER_SETUP = r"""
import os, re, sys
import torch
from grpo.run.run_setup import setup

def rss_mib():
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+)", f.read(), re.M).group(1)) / 1024

model_dir, tiny, log_dir = sys.argv[1:4]
run = setup(["--config", tiny, f"policy.model_name={model_dir}", f"logger.log_dir={log_dir}",
             "checkpointing.enabled=false", "policy.lora.enabled=true", "policy.lora.dim=1"], tiny, asynchronous=False)
big = torch.ones(2**22)  # 16 MiB, freed: glibc's own threshold would rise to it and heap every smaller block
del big
tensors_8mib = [torch.ones(2**21) for _ in range(32)]
before = rss_mib()
del tensors_8mib[::2]  # 16 of them, between live ones (a heap cannot give back a hole)
print(f"freed {before - rss_mib():.0f} MiB", flush=True)
for closable in reversed(run.closables):
    closable.close()
os._exit(0)
"""


def test_a_cpu_run_gives_freed_tensors_back_to_the_system(tiny_model_dir, tmp_path):
    """After a CPU run's setup (`grpo.system.host_memory.map_large_allocations`), freeing 16 tensors of 8 MiB among
    live ones lowers the RSS by their 128 MiB, even after a larger block was freed (glibc's default: the heap keeps
    them all, and a LoRA step's peak RSS sat ~340 MB above its live tensors on the bench model). A fresh process:
    malloc's settings are the process's."""
    from tests.helpers.e2e import TINY

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env.update(PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _FREED_AFTER_SETUP, tiny_model_dir, TINY, str(tmp_path / "logs")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    freed_mib = float(proc.stdout.split("freed ")[-1].split()[0])
    assert freed_mib >= 0.9 * 128, proc.stdout[-500:]


# --------------------------------------------------------------------------------------------------
# the adapted layers: peft's numbers, one temporary
# --------------------------------------------------------------------------------------------------
def _tiny_peft_models(model_dir: str):
    """(ours, peft's): the same tiny model with the same adapters (B random, so they matter), through
    `grpo.system.engines.apply_lora` and through peft's own layers."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo.config import LoraConfig
    from grpo.system import engines

    lora = LoraConfig(enabled=True, dim=4, alpha=8, dropout=0.0)
    ours = engines.apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora, seed=3)
    stock = engines.peft_lora_config(lora)
    stock._custom_modules = None  # peft's own LoRA Linear
    theirs = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), stock,
                            autocast_adapter_dtype=False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def test_an_adapted_layer_computes_peft_s_numbers_bit_for_bit(tiny_model_dir):
    """Logits, gradients and three AdamW steps equal to peft's own layers exactly; adapters off too."""
    ours, theirs = _tiny_peft_models(tiny_model_dir)
    assert type(ours.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "InPlaceLoraLinear"
    ids = torch.randint(3, ours.config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.05) for m in (ours, theirs)]
    for _ in range(3):
        logits = []
        for model, opt in zip((ours, theirs), optimizers):
            out = model(input_ids=ids).logits
            out.log_softmax(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            logits.append(out.detach())
        assert torch.equal(*logits)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    with torch.no_grad(), ours.disable_adapter(), theirs.disable_adapter():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def _new_tensors_of_numel(fn, numel: int) -> int:
    """How many new storages of ``numel`` elements the aten ops under ``fn()`` allocate (an in-place op or a view
    allocates none: its output's storage is an input's)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            leaves = tree_leaves((args, kwargs))
            inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
            if (isinstance(out, torch.Tensor) and out.numel() == numel
                    and out.untyped_storage().data_ptr() not in inputs):
                Count.n += 1
            return out

    with Count():
        fn()
    return Count.n


def test_an_adapted_layer_makes_one_temporary_of_its_output_s_size(tiny_model_dir):
    """peft's ``result + lora_B(lora_A(x)) * scaling`` makes three [tokens, out] tensors besides the base layer's
    output (the product, the scaled product, the sum); ours makes the product only, with or without grad."""
    ours, theirs = _tiny_peft_models(tiny_model_dir)
    q_proj = ours.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(4, 9, q_proj.in_features, requires_grad=True)
    numel = 4 * 9 * q_proj.out_features
    assert _new_tensors_of_numel(lambda: theirs.base_model.model.model.layers[0].self_attn.q_proj(x), numel) == 4
    assert _new_tensors_of_numel(lambda: q_proj(x), numel) == 2  # the base layer's output and B's
    with torch.no_grad():
        assert _new_tensors_of_numel(lambda: q_proj(x), numel) == 2


# --------------------------------------------------------------------------------------------------
# two ZeRO-3 ranks (gloo), this file under torchrun
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow  # two processes start DeepSpeed: ~30 s
def test_two_zero3_ranks_hold_state_for_the_adapters_only(tiny_model_dir, tmp_path):
    """Each rank: no gradient or optimizer state for a frozen weight; its share of each base weight partitioned;
    one whole copy, the hf backend's (what ZeRO-3 generation needs)."""
    out = tmp_path / "audit.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           tiny_model_dir, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    audits = json.loads(out.read_text())
    assert len(audits) == 2
    for audit in audits:
        check_state(audit, audit["ipg_bucket"])
        assert set(audit["copies"].values()) == {1}, audit["copies"]  # the generation copy; partitions are halves


def _two_rank_audit(model_dir: str, out_path: str) -> None:
    """torchrun's worker: a ZeRO-3 LoRA engine with the colocated hf backend, two training steps on each rank's half,
    then each rank's `audit_state` and `copies_of_base_weights`, gathered into ``out_path`` by rank 0."""
    import warnings

    warnings.filterwarnings("ignore")
    from grpo.batch import micro_batches, select_rows
    from grpo.run.serving import build_generation_backend
    from grpo.system import engines, weights
    from grpo.system.chat import load_tokenizer
    from grpo.system.dist import all_gather_objects, init_distributed
    from grpo.system.training import train_on_batch
    from tests.helpers.dist_train_step import batch_loss, make_batch

    rank, _, world, _ = init_distributed()
    engine, cfg = lora_engine(model_dir, "zero3", world_size=world, dim=1)
    generator = build_generation_backend(cfg, load_tokenizer(cfg.policy), engine, torch.device("cpu"))
    for step in range(2):
        batch = make_batch(step, engine.module.config.vocab_size)
        n = float(batch.token_mask_bt.sum())
        mine = select_rows(batch, slice(rank * 4, (rank + 1) * 4))
        train_on_batch(engine, micro_batches(mine, 4), lambda lp, mb, n=n: (batch_loss(lp, mb, n), {}))
        generator.refit(engine)
    base = {n: t.clone() for b in weights.iter_gathered_params(engine) for n, t in b
            if ".lora_" not in n and t.numel() > 64}
    audit = {**audit_state(engine), "ipg_bucket": ipg_bucket_elements(engine),
             "copies": copies_of_base_weights(base)}
    del base
    audits = all_gather_objects([audit])
    if rank == 0:
        Path(out_path).write_text(json.dumps(audits))
    engines.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _two_rank_audit(*sys.argv[1:3])
    from grpo.system.engines import exit_process

    exit_process(0)

