"""vLLM arguments from the run config, and vLLM outputs as `GenerationOutput`: pure functions.

Nothing here imports vllm; `grpo.system.generation.vllm` builds ``vllm.LLM(**llm_kwargs(...))`` and one
``vllm.SamplingParams(**sampling_kwargs(...))`` per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.system.generation.base import GenerationOutput

# vLLM on the CPU otherwise reserves 92% of RAM for the KV cache.
CPU_DEFAULT_KV_CACHE_BYTES = 256 * 2**20

# A vision-language model on vLLM: no processor cache, as NeMo-RL's VLM recipes set it (``mm_processor_cache_gb: 0``:
# each prompt's images are processed from its own pixels); on the CPU, transformers' modelling code (vLLM's native
# LLaVA imports its Pixtral file, which needs torchvision, absent from the CPU environment). Where vLLM runs
# transformers' modelling it patches transformers' classes in its process (`grpo.system.vision.vision_model_impl`).
VISION_LLM_KWARGS = {"mm_processor_cache_gb": 0}
CPU_VISION_LLM_KWARGS = {**VISION_LLM_KWARGS, "model_impl": "transformers"}

# What vLLM logs at each in-place reload (vllm 0.32 model_executor/model_loader/reload/layerwise.py and
# inplace.py): a warning per layer the push did not touch, the push's duration (info), then the set of
# parameter names it did not load.
RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                  "vllm.model_executor.model_loader.reload.inplace")
PER_PUSH_NOISE = ("Failed to load weights", "Reloading and processing weights took")
PARAMS_NOT_LOADED = "weights were not loaded from checkpoint"

# The ranks a vLLM engine can be built for (vllm 0.32-0.33 config/lora.py ``MaxLoRARanks``); the config refuses
# policy.lora with the vllm backend beyond the last one, sleep_level 2, and vllm_kwargs repeating `lora_llm_kwargs`
# (grpo.config.PolicyConfig._lora_on_vllm).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# adapter_config.json keys that describe the adapter at inference (what vLLM's ``PEFTHelper`` reads); the
# others (dropout, initialisation, peft's bookkeeping) only matter to training.
ADAPTER_CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "exclude_modules", "bias", "modules_to_save",
                       "use_rslora", "use_dora", "lora_bias", "rank_pattern", "alpha_pattern",
                       "layer_replication", "peft_type", "task_type", "base_model_name_or_path")


def llm_kwargs(cfg, *, model: str, tokenizer: str, rank: int, world_size: int, on_cpu: bool,
               sleep_mode_available: bool, hf_overrides: dict | None = None, vision: bool = False) -> dict:
    """Keyword arguments of ``vllm.LLM`` for this rank.

    - seed = grpo.seed + rank // tensor_parallel_size (the ranks of one TP group must agree; every
      request carries its own seed anyway);
    - KV cache: ``vllm_cfg.kv_cache_memory_bytes``, or 256 MiB on the CPU when unset;
    - max_model_len: ``vllm_cfg.max_model_len`` or policy.max_total_sequence_length;
    - ``distributed_executor_backend="external_launcher"`` when world_size > 1 (one engine per rank in
      the trainer's process group); sleep mode only where the platform has it (GPUs);
    - ``logprobs_mode="processed_logprobs"``: logprobs of the distribution actually sampled from;
    - ``hf_overrides``: the model config's changes (``policy.hf_config_overrides`` as
      `grpo.system.model_config.vllm_hf_overrides` resolves them), when there are any;
    - with ``policy.lora.enabled``: vLLM's LoRA support (`lora_llm_kwargs`);
    - ``vision`` (a vision-language model): `VISION_LLM_KWARGS`, on the CPU `CPU_VISION_LLM_KWARGS` (vllm_kwargs
      may change them);
    - then ``vllm_cfg.vllm_kwargs`` (keys the above does not set).
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
        logprobs_mode="processed_logprobs",
        # Sampling comes from policy.generation only, never from the checkpoint's generation_config.json.
        generation_config="vllm",
    )
    if world_size > 1:
        kw["distributed_executor_backend"] = "external_launcher"
    if hf_overrides:
        kw["hf_overrides"] = hf_overrides
    if lora_enabled(cfg):
        kw.update(lora_llm_kwargs(cfg.policy.lora))
    if vision:
        kw.update(CPU_VISION_LLM_KWARGS if on_cpu else VISION_LLM_KWARGS)
    return {**kw, **v.vllm_kwargs}  # the config refuses a key set above (VllmConfig.vllm_kwargs)


def lora_enabled(cfg) -> bool:
    """``policy.lora.enabled``."""
    lora = getattr(cfg.policy, "lora", None)
    return bool(lora is not None and lora.enabled)


def vllm_lora_rank(dim: int) -> int:
    """The smallest rank a vLLM engine can be built for that holds adapters of rank ``dim``.

        >>> vllm_lora_rank(8), vllm_lora_rank(12), vllm_lora_rank(300)
        (8, 16, 320)
    """
    for rank in VLLM_LORA_RANKS:
        if rank >= dim:
            return rank
    raise ValueError(f"policy.lora.dim={dim}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def lora_llm_kwargs(lora_cfg) -> dict:
    """``vllm.LLM`` arguments for adapter-only weight sync (`grpo.system.generation.vllm.AdapterSync`):

    - ``max_lora_rank``: `vllm_lora_rank` of ``policy.lora.dim`` (vLLM sizes its adapter buffers for it);
    - ``max_loras=1``: every request of a batch uses the newest adapters, one slot;
    - ``max_cpu_loras=2``: the new version loads while the old one is still registered, then the old one is
      removed (a failed load leaves the old one serving).

        >>> lora_llm_kwargs(type("L", (), {"dim": 8})())
        {'enable_lora': True, 'max_lora_rank': 8, 'max_loras': 1, 'max_cpu_loras': 2}
    """
    return dict(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_cfg.dim), max_loras=1, max_cpu_loras=2)


def adapter_config_for_vllm(peft_config: dict) -> dict:
    """The ``adapter_config.json`` written next to the adapter weights for vLLM: the keys of
    ``ADAPTER_CONFIG_KEYS`` from peft's config dict (``LoraConfig.to_dict()``), JSON-ready (sets become sorted
    lists, enums their value). Dropout and initialisation are left out: they act in training only, and vLLM
    rejects initialisations it does not know by name.

        >>> adapter_config_for_vllm({"r": 8, "lora_alpha": 32, "target_modules": {"v_proj", "q_proj"},
        ...                          "lora_dropout": 0.1, "init_lora_weights": "xavier"})
        {'r': 8, 'lora_alpha': 32, 'target_modules': ['q_proj', 'v_proj']}
    """
    import enum

    def plain(x):
        if isinstance(x, enum.Enum):
            return x.value
        if isinstance(x, (set, frozenset)):
            return sorted(plain(i) for i in x)
        if isinstance(x, (list, tuple)):
            return [plain(i) for i in x]
        if isinstance(x, dict):
            return {str(k): plain(i) for k, i in x.items()}
        return x

    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in peft_config]
    if missing:
        raise ValueError(f"adapter config without {missing}: expected peft's LoraConfig.to_dict()")
    return {k: plain(peft_config[k]) for k in ADAPTER_CONFIG_KEYS if k in peft_config}


def stop_token_ids(tokenizer, model_eos, sampling) -> list[int]:
    """Tokens that end a completion: the tokenizer's EOS, the model config's EOS and
    ``policy.generation.stop_token_ids`` (the same set as the hf backend)."""
    ids = set()
    for x in (tokenizer.eos_token_id, model_eos, sampling.stop_token_ids):
        ids.update([] if x is None else ([int(x)] if isinstance(x, int) else [int(i) for i in x]))
    return sorted(ids)


def sampling_kwargs(sampling, *, max_tokens: int, seed: int, greedy: bool, stop_ids: list[int],
                    stop: list[str] | None = None) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for one sample.

    greedy -> temperature 0; top_k None -> -1 (off); ``logprobs=0`` returns the sampled token's logprob
    only. The stop token stays in the output ids; the text is decoded by us (`to_output`). ``stop``: this
    sample's stop strings (None: the profile's). ``sampling``: a `grpo.config.Sampling` profile.
    """
    stop = list(sampling.stop_strings or []) if stop is None else list(stop)
    return dict(
        temperature=0.0 if greedy else sampling.temperature,
        top_p=1.0 if greedy else sampling.top_p,
        top_k=-1 if greedy or sampling.top_k is None else sampling.top_k,
        max_tokens=max_tokens,
        stop=stop or None,
        stop_token_ids=stop_ids,
        seed=seed,
        logprobs=0,
        detokenize=bool(stop),  # stop strings are matched on vLLM's text
    )


def to_output(prompt_ids: list[int], completion, decode) -> GenerationOutput:
    """A vLLM ``CompletionOutput`` -> `GenerationOutput`.

    With ``logprobs=0`` each step of ``completion.logprobs`` is ``{sampled_token: Logprob}``; ``text`` is
    ``decode(completion_ids)`` (special tokens skipped), like the hf backend's.
    """
    ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) != len(ids):
        raise RuntimeError("vLLM returned no per-token logprobs: SamplingParams(logprobs=0) is required")
    logprobs = [float(step[t].logprob) for step, t in zip(completion.logprobs, ids)]
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {completion.finish_reason!r} (expected stop or length)")
    return GenerationOutput(prompt_ids=list(prompt_ids), completion_ids=ids, logprobs=logprobs,
                            finish_reason=completion.finish_reason, text=decode(ids))


def refit_problems(pushed: list[str], expected: list[str], never_loaded: set[str]) -> list[str]:
    """What went wrong in one refit, as messages (empty: nothing).

    ``pushed``: the engine parameter names pushed, in order, over all buckets; ``expected``: the
    engine's parameter names; ``never_loaded``: vLLM parameters that no push loaded. Every expected
    name must be pushed exactly once, nothing else pushed, and every vLLM parameter loaded.

        >>> refit_problems(["a", "b", "b"], ["a", "b", "c"], {"model.norm.weight"})  # doctest: +NORMALIZE_WHITESPACE
        ["pushed more than once: ['b']", "never pushed: ['c']",
         "vLLM parameters no push loaded (they keep stale weights): ['model.norm.weight']"]
    """
    from collections import Counter

    problems = []
    twice = sorted(name for name, n in Counter(pushed).items() if n > 1)
    for label, names in (("pushed more than once", twice),
                         ("never pushed", sorted(set(expected) - set(pushed))),
                         ("pushed but not an engine parameter", sorted(set(pushed) - set(expected))),
                         ("vLLM parameters no push loaded (they keep stale weights)", sorted(never_loaded))):
        if names:
            problems.append(f"{label}: {names[:8]}" + (f" and {len(names) - 8} more" if len(names) > 8 else ""))
    return problems


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                             tensor_parallel_size: int = 1) -> int:
    """KV-cache bytes one token takes on one GPU: K and V of every layer, this GPU's share of the KV heads
    (at least one head: vLLM replicates heads when TP exceeds their number).

        >>> kv_cache_bytes_per_token(num_layers=28, num_kv_heads=2, head_dim=128, dtype_bytes=2)  # Qwen2.5-1.5B
        28672
    """
    heads = max(1, num_kv_heads // tensor_parallel_size)
    return 2 * num_layers * heads * head_dim * dtype_bytes


def kv_cache_bytes_for_step(num_prompts: int, num_generations: int, max_total_sequence_length: int,
                            data_parallel_size: int, bytes_per_token: int, headroom: float = 2.0) -> int:
    """KV cache for one GPU to hold its whole share of a step at once, rounded up to a whole MiB:

        ceil(num_prompts * num_generations / data_parallel_size) * max_total_sequence_length
        * bytes_per_token * headroom

    ``data_parallel_size`` = world size / tensor_parallel_size (engines that generate different
    samples). The headroom covers vLLM's block granularity and validation batches larger than a step.

        >>> kv_cache_bytes_for_step(64, 8, 1024, 8, 28672) / 2**30   # the 1.5B vLLM recipe on 8 GPUs
        3.5
    """
    samples = -(-num_prompts * num_generations // data_parallel_size)
    raw = samples * max_total_sequence_length * bytes_per_token * headroom
    return int(-(-raw // 2**20) * 2**20)


def step_kv_cache_bytes(cfg, hf_config, world_size: int, headroom: float = 2.0) -> int:
    """`kv_cache_bytes_for_step` of this run on one GPU, from the run config and the model's HF config: a
    generation batch is grpo.num_prompts_per_step (x grpo.batch_multiplier with dynamic sampling) prompts x
    num_generations_per_prompt samples, shared by world_size / tensor_parallel_size engines, each up to
    policy.max_total_sequence_length tokens of KV in the policy's dtype (fp32: 4 bytes, else 2)."""
    g, p, v = cfg.grpo, cfg.policy, cfg.policy.generation.vllm_cfg
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = kv_cache_bytes_per_token(text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads,
                                         head_dim, 4 if p.precision == "float32" else 2, v.tensor_parallel_size)
    prompts = int(g.num_prompts_per_step * (g.batch_multiplier if g.use_dynamic_sampling else 1))
    return kv_cache_bytes_for_step(prompts, g.num_generations_per_prompt, p.max_total_sequence_length,
                                   max(1, world_size // v.tensor_parallel_size), per_token, headroom)


def kv_cache_shortfall(cfg, hf_config, world_size: int) -> str | None:
    """A warning when ``vllm_cfg.kv_cache_memory_bytes`` cannot hold one generation batch at full length (then
    vLLM queues and preempts requests: slower, not wrong); None when it can or when vLLM sizes it itself."""
    kv = cfg.policy.generation.vllm_cfg.kv_cache_memory_bytes
    need = step_kv_cache_bytes(cfg, hf_config, world_size, headroom=1.0)
    if kv is None or kv >= need:
        return None
    return (f"policy.generation.vllm_cfg.kv_cache_memory_bytes={kv} ({kv / 2**30:.2f} GiB) holds less than one "
            f"generation batch at full length ({need / 2**30:.2f} GiB per GPU): vLLM will queue and preempt; "
            f"grpo.system.generation.vllm_params.step_kv_cache_bytes suggests {step_kv_cache_bytes(cfg, hf_config, world_size)}")


def startup_memory_problem(free_bytes: int, total_bytes: int, gpu_memory_utilization: float) -> str | None:
    """Why vLLM would refuse to start on this GPU, or None. vLLM (0.32-0.33 ``v1/worker/utils.py``
    ``request_memory``) requires free memory >= gpu_memory_utilization x total at start-up, also when
    ``kv_cache_memory_bytes`` is set (then the utilization is used for nothing else: it is only this gate).

        >>> startup_memory_problem(30 * 2**30, 80 * 2**30, 0.5) is not None
        True
        >>> startup_memory_problem(60 * 2**30, 80 * 2**30, 0.5) is None
        True
    """
    asked = gpu_memory_utilization * total_bytes
    if free_bytes >= asked:
        return None
    return (f"vLLM starts only with free GPU memory >= policy.generation.vllm_cfg.gpu_memory_utilization x total "
            f"= {gpu_memory_utilization} x {total_bytes / 2**30:.1f} = {asked / 2**30:.1f} GiB (also with "
            f"kv_cache_memory_bytes set), and the trainer leaves {free_bytes / 2**30:.1f} GiB free: lower "
            f"gpu_memory_utilization to at most {free_bytes / total_bytes:.2f} (it must still cover vLLM's weights, "
            "KV cache and activations when kv_cache_memory_bytes is null)")


# --------------------------------------------------------------------------------------------------
# Image prompts (issue 47): vLLM expands the placeholders itself
# --------------------------------------------------------------------------------------------------


def collapse_image_runs(ids: list[int], image_token_id: int, tokens_per_image: list[int]) -> list[int]:
    """The unexpanded prompt of a trainer-expanded one: the ``tokens_per_image[i]`` consecutive ``image_token_id``
    of image i (in order) become one placeholder, as vLLM takes a token-id prompt with its raw images (it expands
    each placeholder itself; sent expanded, a prompt is expanded a second time: trl#6294, trl#6401). A run of
    placeholders may hold several adjacent images. ValueError when the runs do not split into the images' counts.

        >>> collapse_image_runs([1, 9, 9, 9, 5, 9, 9, 9, 9, 9, 9, 2], 9, [3, 3, 3])
        [1, 9, 5, 9, 9, 2]
    """
    out: list[int] = []
    want = list(tokens_per_image)
    i = 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out.append(ids[i])
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == image_token_id:
            j += 1
        run = j - i
        while run > 0:
            if not want or want[0] > run:
                raise ValueError(f"a run of {j - i} image placeholders at position {i} does not split into the "
                                 f"images' placeholder counts {list(tokens_per_image)}")
            run -= want.pop(0)
            out.append(image_token_id)
        i = j
    if want:
        raise ValueError(f"{len(tokens_per_image) - len(want)} image placeholder runs for {len(tokens_per_image)} "
                         "images")
    return out


def even_tokens_per_image(ids: list[int], image_token_id: int, n_images: int) -> list[int]:
    """Each image's placeholder count where every image has the same (LLaVA at its fixed resolution): the prompt's
    placeholders divided evenly; ValueError when they do not divide.

        >>> even_tokens_per_image([1, 9, 9, 9, 9, 2], 9, 2)
        [2, 2]
    """
    total = sum(1 for t in ids if t == image_token_id)
    if n_images <= 0 or total % n_images or total < n_images:
        raise ValueError(f"{total} image placeholders for {n_images} images: expected a positive multiple")
    return [total // n_images] * n_images


def expansion_problem(expanded_by_vllm: list[int], trainer_ids: list[int], image_token_id: int) -> str | None:
    """Why the prompt vLLM ran (its placeholders expanded by its processor) is not the trainer's expanded prompt,
    in one line; None when they are equal. More placeholders than the trainer's: expanded twice.

        >>> expansion_problem([1, 9, 9, 9, 9, 9, 2], [1, 9, 9, 9, 2], 9)
        "vLLM's prompt has 5 image placeholders in 7 ids, the trainer's 3 in 5 (expanded twice?); first difference at 4"
        >>> expansion_problem([1, 9, 2], [1, 9, 2], 9) is None
        True
    """
    if list(expanded_by_vllm) == list(trainer_ids):
        return None
    n_vllm = sum(1 for t in expanded_by_vllm if t == image_token_id)
    n_trainer = sum(1 for t in trainer_ids if t == image_token_id)
    first = next((k for k, (a, b) in enumerate(zip(expanded_by_vllm, trainer_ids)) if a != b),
                 min(len(expanded_by_vllm), len(trainer_ids)))
    hint = " (expanded twice?)" if n_vllm > n_trainer else ""
    return (f"vLLM's prompt has {n_vllm} image placeholders in {len(expanded_by_vllm)} ids, the trainer's "
            f"{n_trainer} in {len(trainer_ids)}{hint}; first difference at {first}")


def image_prompt(trainer_ids: list[int], images: list, image_token_id: int,
                 tokens_per_image: list[int] | None = None) -> dict:
    """What vLLM takes for a trainer-expanded prompt with its raw ``images`` (PIL, in order): the unexpanded ids
    (`collapse_image_runs`; ``tokens_per_image`` None: every image with the same count, `even_tokens_per_image`) and
    ``multi_modal_data``; the trainer's ids alone without images. A dict of ``vllm.inputs.TokensPrompt``'s keys."""
    if not images:
        return {"prompt_token_ids": list(trainer_ids)}
    counts = tokens_per_image or even_tokens_per_image(trainer_ids, image_token_id, len(images))
    return {"prompt_token_ids": collapse_image_runs(list(trainer_ids), image_token_id, counts),
            "multi_modal_data": {"image": list(images)}}


def grid_tokens_per_image(image_grid_thw, merge_size: int) -> list[int]:
    """Qwen2-VL / Qwen2.5-VL: each image's placeholder count, its patch grid (t, h, w) over the merged patches.

        >>> import torch
        >>> grid_tokens_per_image(torch.tensor([[1, 4, 6], [1, 2, 2]]), 2)
        [6, 1]
    """
    return [int(t * h * w) // (merge_size * merge_size) for t, h, w in image_grid_thw.tolist()]


@dataclass(frozen=True)
class ImagePrompts:
    """A vision-language policy's image prompts on vLLM: the placeholder id, the ids it may sample (every id of the
    vocabulary but the vision ones, which the trainer bans on its head: `grpo.system.vision.ban_token_ids`), and
    Qwen-VL's merge size (placeholders per image from ``image_grid_thw``; None: LLaVA's even split)."""

    image_token_id: int
    allowed_ids: list[int]
    merge_size: int | None = None

    @classmethod
    def of(cls, model_config) -> ImagePrompts | None:
        """For a model config: None for a text model."""
        from grpo.system.vision import is_vision_config, vision_token_ids

        if not is_vision_config(model_config):
            return None
        image_id = next(int(i) for i in (getattr(model_config, "image_token_id", None),
                                         getattr(model_config, "image_token_index", None)) if isinstance(i, int))
        banned = set(vision_token_ids(model_config))
        vocab = model_config.get_text_config().vocab_size
        merge = getattr(model_config.vision_config, "spatial_merge_size", None)
        return cls(image_id, [t for t in range(vocab) if t not in banned], merge)

    def prompt(self, trainer_ids: list[int], media: dict) -> dict:
        """``TokensPrompt`` keys for a trainer-expanded prompt and its media (the raw pictures they hold,
        `grpo.system.media.media_pictures`)."""
        from grpo.system.media import media_pictures

        pictures = media_pictures(media)
        counts = (grid_tokens_per_image(media["image_grid_thw"], self.merge_size)
                  if self.merge_size and "image_grid_thw" in media else None)
        try:
            return image_prompt(trainer_ids, pictures, self.image_token_id, counts)
        except ValueError as err:
            raise ValueError(f"an image prompt of {len(trainer_ids)} ids and {len(pictures)} pictures: {err}") from None

    def check(self, index: int, ran: list[int], trainer_ids: list[int]) -> None:
        """The prompt vLLM ran (its processor expanded the placeholders) must be the trainer's: a RuntimeError
        naming prompt ``index`` and the difference (`expansion_problem`) otherwise."""
        problem = expansion_problem(ran, trainer_ids, self.image_token_id)
        if problem is not None:
            raise RuntimeError(f"image prompt {index}: {problem}; vLLM's processor and the trainer's disagree, so the "
                               "trainer would train tokens generated from another prompt")
