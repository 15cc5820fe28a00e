"""The ``policy`` section: tokenizer, optimizer and scheduler, generation (vLLM, the OpenAI endpoint, colocated or
on generation ranks), LoRA, sequence packing and dynamic batching."""

from __future__ import annotations

import functools
import os

from dataclasses import dataclass
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from grpo.config.base import _Section, check_toy_model


# What grpo.system.chat.ChatFormat passes to apply_chat_template itself (chat_template_kwargs may not repeat them).
CHAT_TEMPLATE_ARGS_SET_BY_GRPO = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


class TokenizerConfig(_Section):
    name: Optional[str] = Field(None, description="Tokenizer to load (null: the model's own).")
    chat_template: Optional[str] = Field(None, description=(
        "null: plain-text prompts; default: the tokenizer's chat template; anything else: a Jinja template."))
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description=(
        "Extra variables of the chat template, passed to every apply_chat_template (prompts, observations; "
        "NeMo-RL's chat_template_kwargs), e.g. {enable_thinking: false} for Qwen3; one the template does not read "
        "changes nothing."))

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_kwargs(cls, v):
        taken = sorted(set(v or ()) & CHAT_TEMPLATE_ARGS_SET_BY_GRPO)
        if taken:
            raise ValueError(f"policy.tokenizer.chat_template_kwargs: {taken} are set by grpo-ds "
                             "(grpo/system/chat.py), not template variables")
        return v


class OptimizerConfig(_Section):
    name: Literal["adamw"] = Field("adamw", description="Optimizer (torch AdamW).")
    lr: float = Field(5.0e-6, gt=0, description="Learning rate.")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")


class SchedulerConfig(_Section):
    name: Literal["cosine", "constant", "linear"] = Field(
        "constant", description="After warmup: cosine decay to min_lr_ratio * lr, constant, or linear decay.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    warmup_start_factor: Optional[float] = Field(None, ge=0, le=1, description=(
        "Warmup from this fraction of lr: step t < warmup_steps uses s + (1 - s) * t / warmup_steps (torch LinearLR, "
        "Megatron's lr_warmup_init / lr); null: (t + 1) / warmup_steps."))
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="The learning rate decays to min_lr_ratio * lr.")
    decay_steps: Optional[int] = Field(None, gt=0, description=(
        "Optimizer step at which the decay reaches min_lr_ratio * lr and stays (Megatron's lr_decay_iters, a "
        "CosineAnnealingLR's milestone + T_max); null: the run's last step."))

    @model_validator(mode="after")
    def _check(self) -> "SchedulerConfig":
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"policy.scheduler.decay_steps={self.decay_steps}: expected > "
                             f"policy.scheduler.warmup_steps={self.warmup_steps}")
        return self


# What grpo.system.generation.vllm_params.llm_kwargs passes to vllm.LLM itself (vllm_kwargs may not repeat them).
VLLM_KWARGS_SET_BY_GRPO = frozenset({
    "model", "tokenizer", "dtype", "trust_remote_code", "seed", "tensor_parallel_size", "max_model_len",
    "enforce_eager", "enable_prefix_caching", "gpu_memory_utilization", "kv_cache_memory_bytes", "enable_sleep_mode",
    "logprobs_mode", "generation_config", "distributed_executor_backend", "hf_overrides"})


# With policy.lora: what vllm_params.lora_llm_kwargs passes to vllm.LLM, and vLLM's largest LoRA rank.
VLLM_LORA_KWARGS = frozenset({"enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras"})


VLLM_MAX_LORA_RANK = 512


# NeMo-RL passes these to vLLM's OpenAIServingChat. grpo-ds's own parsers (the hf backend's; compact on both); on the
# vLLM backend the endpoint uses vLLM's, any name the installed vLLM registers (`vllm_parser_names`).
TOOL_PARSERS = ("hermes", "compact")


REASONING_PARSERS = ("qwen3", "deepseek_r1")


_VLLM_PARSER_TABLES = {"tool_parser": ("tool_parsers", "_TOOL_PARSERS_TO_REGISTER"),
                       "reasoning_parser": ("reasoning", "_REASONING_PARSERS_TO_REGISTER")}


@functools.cache
def vllm_parser_names(kind: str) -> Optional[tuple[str, ...]]:
    """The parser names the installed vLLM registers (``kind``: "tool_parser" or "reasoning_parser"), read from its
    registry's source (``vllm/tool_parsers/__init__.py``, ``vllm/reasoning/__init__.py``) without importing vLLM
    (15-30 s); None when vLLM is not installed (or its registry has moved)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    package, table = _VLLM_PARSER_TABLES[kind]
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], package, "__init__.py")) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id == table
                and isinstance(node.value, ast.Dict)):
            return tuple(sorted(k.value for k in node.value.keys if isinstance(k, ast.Constant)))
    return None


def parser_problem(kind: str, name: Optional[str], backend: str) -> Optional[str]:
    """Why ``http_server_serving_chat_kwargs.<kind>=name`` cannot parse on ``backend``, or None: the hf backend
    has grpo-ds's parsers; the vLLM backend vLLM's (those the installed vLLM registers; any name when vLLM is not
    installed here, as the run then fails at the engine) and ``compact``.

        >>> parser_problem("tool_parser", "mistral", "hf")
        "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser='mistral': the hf backend's endpoint parses with grpo-ds's parsers: expected one of ['compact', 'hermes'] (policy.generation.backend=vllm uses vLLM's)"
    """
    ours = TOOL_PARSERS if kind == "tool_parser" else REASONING_PARSERS
    if name is None or name in ours:
        return None
    key = f"policy.generation.vllm_cfg.http_server_serving_chat_kwargs.{kind}={name!r}"
    if backend == "hf":
        return (f"{key}: the hf backend's endpoint parses with grpo-ds's parsers: expected one of {sorted(ours)} "
                "(policy.generation.backend=vllm uses vLLM's)")
    names = vllm_parser_names(kind)
    if names is None or name in names:
        return None
    return f"{key}: neither vLLM nor grpo-ds has that parser: expected one of {sorted(set(names) | set(ours))}"


class ServingChatKwargs(_Section):
    """NeMo-RL's ``policy.generation.vllm_cfg.http_server_serving_chat_kwargs`` (vLLM's OpenAIServingChat
    arguments): the endpoint's chat rendering and output parsing, on every backend."""

    tool_parser: Optional[str] = Field(None, description=(
        "How the model's tool-call text becomes OpenAI tool_calls. backend=vllm: any parser vLLM registers (vLLM's "
        "own code parses); hf: hermes (<tool_call>{json}</tool_call>: Qwen2.5, Qwen3, Hermes); both: compact "
        "(<name>argument</name>: the char-level toy); null: no parsing (the text is the content)."))
    reasoning_parser: Optional[str] = Field(None, description=(
        "Split <think>...</think> into message.reasoning_content. backend=vllm: any parser vLLM registers; hf: "
        "qwen3 (thinking on unless enable_thinking=false: no </think> yet, all reasoning) and deepseek_r1, as the "
        "installed vLLM's; null: no split."))
    chat_template: Optional[str] = Field(None, description=(
        "The endpoint's chat template: a Jinja string or a file path (null: policy.tokenizer.chat_template, else "
        "the tokenizer's own)."))
    default_chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description=(
        "Template variables of every request (a request's chat_template_kwargs override them), e.g. "
        "{enable_thinking: false}."))
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description=(
        "The older spelling of default_chat_template_kwargs (NeMo-RL accepts both); both set is an error."))

    @model_validator(mode="after")
    def _one_spelling(self) -> "ServingChatKwargs":
        if self.chat_template_kwargs is not None and self.default_chat_template_kwargs is not None:
            raise ValueError("policy.generation.vllm_cfg.http_server_serving_chat_kwargs: chat_template_kwargs and "
                             "default_chat_template_kwargs are both set: keep default_chat_template_kwargs")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        return dict(self.default_chat_template_kwargs or self.chat_template_kwargs or {})


class HttpServerConfig(_Section):
    """grpo-ds's settings of the endpoint (NeMo-RL's keys are vllm_cfg.expose_http_server and
    vllm_cfg.http_server_serving_chat_kwargs)."""

    host: str = Field("127.0.0.1", description=(
        "Address the endpoint binds (loopback by default: only this machine's agents reach it; every request also "
        "needs the run's bearer token)."))
    max_concurrent_requests: int = Field(256, gt=0, description=(
        "Requests in flight at once; one more is answered 429."))
    max_body_bytes: int = Field(8 * 2**20, gt=0, description="A request body over this many bytes is answered 413.")
    batch_window_s: float = Field(0.02, ge=0, description=(
        "Requests generate in one batch while they keep coming: a batch closes once no request has come for this "
        "long while the server reads or answers no other, or once it holds policy.generation_batch_size."))
    max_wait_s: float = Field(30.0, gt=0, description=(
        "How long a request waits for a generation window (the run generates only during rollouts; weights change "
        "between them) before it is answered 503 with a Retry-After header."))
    model_name: Optional[str] = Field(None, description=(
        "The model name /v1/models lists and requests send (null: policy.model_name)."))
    read_timeout_s: float = Field(30.0, gt=0, description=(
        "A request body that has not arrived in full this long after its headers is answered 408; until its body "
        "is read a request holds none of the max_concurrent_requests slots."))
    trust_request_chat_template: bool = Field(False, description=(
        "vLLM's --trust-request-chat-template: a request's own chat_template replaces the run's; false (default): "
        "a request that sends one is answered 400 (the run's template is what the policy trains on)."))
    render_timeout_s: float = Field(10.0, gt=0, description=(
        "Rendering a request with the chat template (off the server's event loop) is stopped after this long and "
        "the request answered 400."))
    allow_remote_images: bool = Field(False, description=(
        "A vision-language policy's requests may give an image part as an http(s) URL, which the endpoint then "
        "downloads (max_image_bytes, read_timeout_s); false (default): only data: URLs, a remote URL is answered "
        "400 (the trainer's machine fetches nothing a client names)."))
    max_image_bytes: int = Field(8 * 2**20, gt=0, description=(
        "An image downloaded for an http(s) image part (allow_remote_images) is answered 400 past this many bytes; "
        "a data: URL is bounded by max_body_bytes."))
    max_image_pixels: int = Field(2**25, gt=0, description=(
        "The pictures of one request may have this many pixels together (width x height, read from each header "
        "before it is decoded); one past it is answered 400: a small compressed file can decode into gigabytes."))


class VllmConfig(_Section):
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs per vLLM engine (a divisor of the world size).")
    gpu_memory_utilization: float = Field(
        0.6, gt=0, le=1, description="Share of GPU memory vLLM may take (weights + KV cache).")
    kv_cache_memory_bytes: Optional[int] = Field(
        None, gt=0, description="Explicit KV cache size in bytes (CPU default 256 MiB: vLLM would reserve 92% of RAM).")
    max_model_len: Optional[int] = Field(
        None, gt=0, description="vLLM's context length (null: policy.max_total_sequence_length).")
    enforce_eager: bool = Field(
        False, description="No CUDA graphs / torch.compile in vLLM (faster start, slower decode).")
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV of shared prefixes (a group's prompt, a conversation's earlier turns).")
    sleep_level: Literal[1, 2] = Field(1, description=(
        "1: offload weights and discard the KV cache while training (default); 2: discard both (reports of "
        "wrong output after wake)."))
    offload_optimizer_during_generation: bool = Field(
        False, description="GPU: move DeepSpeed's optimizer states to the host while vLLM generates.")
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "More keyword arguments of vllm.LLM (NeMo-RL's policy.generation.vllm_kwargs), e.g. compilation_config; "
        "one that grpo-ds sets itself is an error."))
    expose_http_server: bool = Field(False, description=(
        "NeMo-RL's key: serve an OpenAI-compatible endpoint over the policy being trained "
        "(grpo/wings/agents/endpoint.py: /v1/chat/completions, /tokenize, /v1/models, /health). It lives here "
        "for every backend: an hf-backend run reads the same key (and http_server_serving_chat_kwargs) from "
        "policy.generation.vllm_cfg, so a NeMo-RL recipe turns it on unchanged. env.name=agent starts it without "
        "this key. grpo-ds's own server settings: policy.generation.http_server."))
    http_server_serving_chat_kwargs: Optional[ServingChatKwargs] = Field(None, description=(
        "NeMo-RL's key (any backend, see expose_http_server): how the endpoint renders and parses chat: "
        "tool_parser, reasoning_parser, chat_template, default_chat_template_kwargs (null: none of them)."))

    @field_validator("vllm_kwargs")
    @classmethod
    def _own_keys(cls, v):
        taken = sorted(set(v) & VLLM_KWARGS_SET_BY_GRPO)
        if taken:
            raise ValueError(f"policy.generation.vllm_cfg.vllm_kwargs: {taken} are set by grpo-ds "
                             "(grpo/system/generation/vllm_params.py); set them through their policy.* fields")
        return v


class ColocatedResourcesConfig(_Section):
    """The ranks that generate when ``colocated.enabled=false`` (NeMo-RL's ``colocated.resources``)."""

    gpus_per_node: Optional[int] = Field(None, gt=0, description=(
        "Generation ranks per node (NeMo-RL's meaning): on one node the last gpus_per_node ranks generate and the "
        "others train; with cluster.num_nodes > 1 it must equal cluster.gpus_per_node (whole nodes generate)."))
    num_nodes: Optional[int] = Field(None, gt=0, description=(
        "Nodes that generate (null: 1). Generation ranks = gpus_per_node x num_nodes, the last ranks of the launch."))


class ColocatedConfig(_Section):
    """Where generation runs (NeMo-RL's ``policy.generation.colocated``): on the training ranks (``enabled=true``,
    the default) or on ranks of its own (`grpo.system.generation.remote`)."""

    enabled: bool = Field(True, description=(
        "true: every rank trains and generates; false: the last colocated.resources ranks of the launch only "
        "generate (vLLM or hf, never sleeping), the others train; prompts, trajectories and weights go over a "
        "bridge between trainer rank 0 and them (train_async_grpo.py with vllm needs false, as in NeMo-RL)."))
    resources: ColocatedResourcesConfig = Field(
        default_factory=ColocatedResourcesConfig, description="The generation ranks (colocated.enabled=false).")
    bridge_timeout_s: float = Field(600.0, gt=0, description=(
        "grpo-ds: seconds trainer rank 0 waits for a generation rank's answer (a batch's generation, a weight "
        "load) before it stops the run naming that rank as hung."))


class GenerationConfig(_Section):
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="hf: transformers generate on a plain copy (any device); vllm: a vLLM engine (colocated "
                          "with training, or on ranks of its own: colocated.enabled=false).")
    max_new_tokens: int = Field(512, gt=0, description="Generated tokens per assistant turn at most.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the trainer's logprobs use it too).")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling (the trainer's logprobs apply the same filter).")
    top_k: Optional[int] = Field(
        None, gt=0, description="Top-k sampling (null: off; the trainer's logprobs apply the same filter).")
    val_temperature: Optional[float] = Field(
        None, gt=0, description="Validation's sampling temperature (null: temperature, the training value).")
    val_top_p: Optional[float] = Field(
        None, gt=0, le=1, description="Validation's nucleus sampling (null: top_p, the training value).")
    val_top_k: Optional[int] = Field(
        None, gt=0, description="Validation's top-k sampling (null: top_k, the training value).")
    stop_token_ids: Optional[list[int]] = Field(
        None, description="Extra token ids that end a turn (besides the tokenizer's and the model's EOS).")
    stop_strings: Optional[list[str]] = Field(
        None, description="Strings that end a turn (an environment may set per-turn ones).")
    hf_drop_finished_rows: bool = Field(True, description=(
        "hf backend: samples that end leave the batch and its KV cache (once they are a quarter of it), so a "
        "generation call costs about the sum of its samples' lengths (grpo/system/generation/hf.py "
        "decode_dropping_finished); false: transformers' "
        "generate, every row decoded until the call's longest ends. The same samples either way."))
    refit_bucket_numel: int = Field(2**28, gt=0, description=(
        "Elements per weight-refit push: ZeRO-3 gathers whole decoder layers until a bucket holds this many."))
    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig, description="vLLM engine settings.")
    port_range_low: int = Field(3000, gt=0, lt=65536, description=(
        "NeMo-RL's key: the endpoint (vllm_cfg.expose_http_server, env.name=agent) takes the first free port from "
        "port_range_low to port_range_high."))
    port_range_high: int = Field(4999, gt=0, lt=65536, description="See port_range_low (inclusive).")
    http_server: HttpServerConfig = Field(default_factory=HttpServerConfig, description=(
        "grpo-ds's endpoint settings: bind address, concurrency and body limits, batching window."))
    colocated: ColocatedConfig = Field(default_factory=ColocatedConfig, description=(
        "Generation on the training ranks (default) or on ranks of its own (NeMo-RL's colocated section)."))

    @model_validator(mode="after")
    def _parsers(self) -> "GenerationConfig":
        serving = self.vllm_cfg.http_server_serving_chat_kwargs
        problems = [parser_problem(kind, getattr(serving, kind) if serving else None, self.backend)
                    for kind in ("tool_parser", "reasoning_parser")]
        if any(problems):  # both, when both are wrong (a line each)
            raise ValueError("\n".join(p for p in problems if p))
        return self

    @model_validator(mode="after")
    def _port_range(self) -> "GenerationConfig":
        if self.port_range_low > self.port_range_high:
            raise ValueError(f"policy.generation.port_range_low={self.port_range_low} is above "
                             f"port_range_high={self.port_range_high}: expected low <= high")
        return self

    def sampling(self, validation: bool = False) -> "Sampling":
        """The frozen sampling profile a `generate` call takes: training's, or with ``validation`` NeMo-RL's
        val_temperature / val_top_p / val_top_k in place of temperature / top_p / top_k (each null: the training
        value)."""
        knobs = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k")}
        if validation:
            knobs.update({name: getattr(self, f"val_{name}") for name in knobs
                          if getattr(self, f"val_{name}") is not None})
        return Sampling(**knobs, max_new_tokens=self.max_new_tokens,
                        stop_strings=tuple(self.stop_strings) if self.stop_strings is not None else None,
                        stop_token_ids=tuple(self.stop_token_ids) if self.stop_token_ids is not None else None)

    def profiles(self) -> dict[str, "Sampling"]:
        """Both profiles by name, ``{"train": ..., "val": ...}``: what a batch of the endpoint says it samples with."""
        return {"train": self.sampling(), "val": self.sampling(validation=True)}


@dataclass(frozen=True)
class Sampling:
    """What one `generate` call samples with (`GenerationConfig.sampling`): passed as an argument on every backend,
    never set on one, so validation's profile and training's can be in flight on one backend at once.
    ``max_new_tokens`` / ``stop_strings``: the defaults for a sample the call gives none; ``stop_token_ids``: the
    config's extra stop tokens (besides the tokenizer's and the model's EOS).

        >>> GenerationConfig(temperature=0.7, val_temperature=0.1).sampling(validation=True).temperature
        0.1
    """

    temperature: float
    top_p: float
    top_k: int | None
    max_new_tokens: int
    stop_strings: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None


class LoraConfig(_Section):
    """LoRA adapters on the policy (NeMo-RL's ``policy.dtensor_cfg.lora_cfg``, same names and defaults), built with
    peft (grpo/system/engines.py ``apply_lora``): only the adapters train and have optimizer states; the reference
    is the policy with its adapters off (no second model); checkpoints hold the adapters."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of the whole policy.")
    target_modules: list[str] = Field(default_factory=list, description=(
        "Modules to adapt (with match_all_linear=false): a module's own name (q_proj) or a pattern with * over its "
        "full dotted name (*.layers.0.*.q_proj)."))
    exclude_modules: list[str] = Field(default_factory=list, description=(
        "Modules never adapted, named as target_modules (applies with match_all_linear too)."))
    match_all_linear: bool = Field(True, description=(
        "Adapt every linear layer but the output head (peft's all-linear); target_modules must then be empty."))
    dim: int = Field(8, gt=0, description="LoRA rank r.")
    alpha: float = Field(32, gt=0, description="LoRA alpha: the adapter's output is scaled by alpha / dim.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability of the adapter path.")
    dropout_position: Literal["pre", "post"] = Field("post", description=(
        "pre: dropout on the adapter's input, dropout(x) -> A -> B (peft's); post: on its output, "
        "dropout(B(A(x)) * alpha / dim) (NeMo-RL's default). The same when dropout is 0."))
    lora_A_init: Literal["xavier", "uniform"] = Field("xavier", description=(
        "Initialization of A (B starts at 0, so the adapted model starts as the base): xavier (normal) or "
        "uniform (kaiming uniform, a=sqrt(5): peft's default)."))

    @model_validator(mode="after")
    def _check(self) -> "LoraConfig":
        if self.enabled and not self.match_all_linear and not self.target_modules:
            raise ValueError("policy.lora: match_all_linear=false with no target_modules adapts nothing: name the "
                             "modules (e.g. [q_proj, v_proj]) or set match_all_linear=true")
        if self.match_all_linear and self.target_modules:
            raise ValueError(f"policy.lora: match_all_linear=true adapts every linear layer, target_modules="
                             f"{self.target_modules} would be ignored: set match_all_linear=false to adapt only those")
        return self


class SequencePackingConfig(_Section):
    """NeMo-RL's ``policy.sequence_packing`` (same names and meanings; grpo/packing.py, grpo/system/packed.py): the
    logprob and training forwards fill micro-batches up to a token budget with a bin-packing algorithm and run each
    with its samples back to back (positions restarting at 0 in each, so attention never crosses samples), where
    that puts fewer tokens through the model than padded rows or shared prompts. Same logprobs and gradients as the
    padded forward up to float rounding; exclusive with dynamic_batching."""

    enabled: bool = Field(True, description=(
        "Micro-batches of up to *_mb_tokens tokens, their samples packed back to back where that runs fewer tokens "
        "(on by default, as in NeMo-RL's recipes: 0.26x TRL's step on the long-tail workload against 0.68x padded, "
        "and a micro-batch whose lengths are even runs padded or with shared prompts as before; docs/packing.md). "
        "Left at its default it gives way to dynamic_batching.enabled=true, and to a model whose "
        "attention cannot take packed rows (the startup line says so); set explicitly, both are errors."))
    train_mb_tokens: Optional[int] = Field(None, gt=0, description=(
        "Real tokens per training micro-batch (sdpa / eager rows of the longest sample can hold up to twice that in "
        "slots); null: max_total_sequence_length x train_micro_batch_size (NeMo-RL's default)."))
    logprob_mb_tokens: Optional[int] = Field(None, gt=0, description=(
        "Tokens per logprob micro-batch; null: max_total_sequence_length x logprob_batch_size."))
    algorithm: Literal["modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle",
                       "concatenative"] = Field("modified_first_fit_decreasing", description=(
                           "Bin packing (grpo/packing.py PACKING_ALGORITHMS, NeMo-RL's four)."))
    microbatch_order: Literal["packer", "largest_first"] = Field("packer", description=(
        "Order the bins run in: the packer's, or the fullest first."))
    sequence_length_round: int = Field(1, gt=0, description=(
        "Packed rows are padded to a multiple of this many tokens (steadier shapes for GPU kernels; NeMo-RL's "
        "recipes say 64); 1: no padding."))


class DynamicBatchingConfig(_Section):
    """NeMo-RL's ``policy.dynamic_batching`` (same names and meanings; grpo/packing.py dynamic_micro_batches): a
    rank's samples sorted by length and cut into micro-batches of at most *_mb_tokens padded tokens (rows x the
    longest rounded length), so short samples run many at a time. Works with any attention implementation;
    exclusive with sequence_packing."""

    enabled: bool = Field(False, description="Micro-batches by token budget instead of by row count.")
    train_mb_tokens: Optional[int] = Field(None, gt=0, description=(
        "Padded tokens per training micro-batch; null: max_total_sequence_length x train_micro_batch_size."))
    logprob_mb_tokens: Optional[int] = Field(None, gt=0, description=(
        "Padded tokens per logprob micro-batch; null: max_total_sequence_length x logprob_batch_size."))
    sequence_length_round: int = Field(1, gt=0, description=(
        "Each micro-batch is padded to a multiple of this many columns (NeMo-RL's recipes say 64); 1: none."))


class VisionConfig(_Section):
    """A vision-language policy (a checkpoint whose config has a vision_config; grpo/system/vision.py): its vision
    tower, and LoRA on it. NeMo-RL names this freeze_config.freeze_vision_tower under its automodel kwargs."""

    train_vision_tower: bool = Field(True, description=(
        "Train the vision tower's weights (false: frozen, gradients reach the projector and the text model only)."))
    lora_vision_tower: bool = Field(False, description=(
        "With policy.lora: adapt the vision tower's linear layers too (false: LoRA never adapts it)."))


class PolicyConfig(_Section):
    model_name: str = Field(
        "Qwen/Qwen2.5-1.5B", description="Local directory, hub name (needs network), or toy:<name> (built locally).")

    @field_validator("model_name")
    @classmethod
    def _toy_model(cls, v):
        return check_toy_model(v, "policy.model_name")

    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer and chat template.")
    train_global_batch_size: int = Field(512, gt=0, description=(
        "Samples per optimizer step across all ranks (a divisor of prompts x generations per step)."))
    train_micro_batch_size: int = Field(4, gt=0, description="Samples per forward/backward on each rank.")
    generation_batch_size: int = Field(32, gt=0, description="Conversations per generation call on each rank.")
    logprob_batch_size: int = Field(
        4, gt=0, description="Samples per logprob forward (previous policy, reference) on each rank.")
    max_total_sequence_length: int = Field(
        512, gt=0, description="Tokens of a whole conversation at most (prompt + every turn).")
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Training precision (float32 on CPUs: bf16 is 5-30x slower there).")
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="Gradient-norm clipping (null: off).")
    activation_checkpointing: bool = Field(
        False, description="Recompute activations in backward (saves memory, costs a forward).")
    trust_remote_code: bool = Field(
        False, description="Allow model code from the checkpoint (transformers' trust_remote_code).")
    hf_config_overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "Changes to the checkpoint's model config for every copy of the policy (training, reference, generation, "
        "vLLM's hf_overrides; NeMo-RL's hf_config_overrides), e.g. {rope_scaling: {rope_type: yarn, factor: 4, "
        "original_max_position_embeddings: 32768}}. A dict into a sub-config (text_config) updates its keys, "
        "any other value replaces the attribute; a key the config does not have is an error "
        "(grpo/system/model_config.py)."))
    logprob_chunk_size: Optional[int] = Field(
        None, gt=0, description="Rows per chunk of the logprob computation (null: 2^24 / vocabulary size).")
    shared_prompt_forward: Literal["auto", True, False] = Field("auto", description=(
        "A prompt that several samples share goes through the model once, their continuations over its KV cache: "
        "in the hf backend's prefill, and in the logprob and training forwards except under ZeRO-3 "
        "(grpo/system/shared_prefix.py; same values up to rounding). auto: for models of 10M parameters or more "
        "(below, the extra forward call costs more than the prompt tokens save)."))
    cpu_linear_kernel: Literal["auto", "onednn", "torch"] = Field("auto", description=(
        "fp32 linear layers on the CPU: onednn (oneDNN's matmul where a call has at least 2^21 multiply-adds; on "
        "an AMD CPU about twice MKL's rate, which runs AVX2 there), torch (F.linear: MKL), or auto: onednn for "
        "models of 10M parameters or more (grpo/system/cpu_linear.py; same values up to rounding). Anything "
        "but fp32 on the CPU (a GPU, bf16, ZeRO-3 partitions) always runs F.linear."))
    deepspeed_config: str = Field("auto", description=(
        "DeepSpeed JSON of the policy (its auto values are filled from this config); auto: on one rank "
        "ds_configs/zero0.json in float32 (nothing to partition) or zero1.json in 16-bit, zero3.json on several."))
    reference_deepspeed_config: str = Field(
        "ds_configs/zero3_reference.json", description="DeepSpeed JSON of the frozen reference (and teacher).")
    reference_placement: Literal["auto", "plain", "zero3"] = Field("auto", description=(
        "The frozen reference / teacher: plain (a module on each rank, no ZeRO hooks), zero3 (sharded over the "
        "ranks), or auto: plain on one rank or when its weights take at most 1/4 of the free device memory."))
    max_nonfinite_steps: int = Field(3, ge=1, description=(
        "Non-finite steps (loss, gradient norm or rewards) in a row before the run stops with exit 1."))
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Learning-rate schedule.")
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="Generation (sampling, backend, stop rules).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description=(
        "LoRA adapters (NeMo-RL's dtensor_cfg.lora_cfg); off by default."))
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig, description=(
        "Samples packed into rows by token budget in the logprob and training forwards (NeMo-RL's)."))
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig, description=(
        "Micro-batches by token budget in the logprob and training forwards (NeMo-RL's)."))
    is_vlm: bool | None = Field(None, description=(
        "NeMo-RL's policy.is_vlm: true asks for a vision-language checkpoint (one with a vision_config), false for a "
        "text one; a checkpoint of the other kind fails at model load, naming this key. null: the checkpoint decides "
        "(the model class and the processor follow its config either way)."))
    vision: VisionConfig = Field(default_factory=VisionConfig, description=(
        "A vision-language policy's vision tower (ignored for a text model)."))

    def mb_tokens(self, phase: Literal["train", "logprob"]) -> Optional[int]:
        """The token budget of a ``phase`` micro-batch under packing or dynamic batching (None: both off)."""
        section = (self.sequence_packing if self.sequence_packing.enabled
                   else self.dynamic_batching if self.dynamic_batching.enabled else None)
        if section is None:
            return None
        rows = self.train_micro_batch_size if phase == "train" else self.logprob_batch_size
        value = section.train_mb_tokens if phase == "train" else section.logprob_mb_tokens
        return value if value is not None else self.max_total_sequence_length * rows

    @model_validator(mode="after")
    def _token_batching(self) -> "PolicyConfig":
        """Packing and dynamic batching are exclusive (as in NeMo-RL); packing left at its default (on) gives way
        to dynamic batching; a budget must hold the longest sample."""
        if (self.sequence_packing.enabled and self.dynamic_batching.enabled
                and "enabled" not in self.sequence_packing.model_fields_set):
            self.sequence_packing.enabled = False
        if self.sequence_packing.enabled and self.dynamic_batching.enabled:
            raise ValueError("policy.sequence_packing.enabled and policy.dynamic_batching.enabled are both true: they "
                             "are exclusive (as in NeMo-RL); enable one")
        name = ("sequence_packing" if self.sequence_packing.enabled
                else "dynamic_batching" if self.dynamic_batching.enabled else None)
        if name is None:
            return self
        rnd = getattr(self, name).sequence_length_round
        longest = self.max_total_sequence_length if name == "sequence_packing" else \
            -(-self.max_total_sequence_length // rnd) * rnd
        for phase in ("train", "logprob"):
            if self.mb_tokens(phase) < longest:
                raise ValueError(f"policy.{name}.{phase}_mb_tokens={self.mb_tokens(phase)}: a sample of "
                                 f"policy.max_total_sequence_length={self.max_total_sequence_length} tokens "
                                 f"({longest} rounded) would not fit; expected >= {longest}")
        return self

    @model_validator(mode="after")
    def _lora_on_vllm(self) -> "PolicyConfig":
        """LoRA with the vLLM backend (grpo/system/generation/vllm.py AdapterSync): vLLM keeps the checkpoint's base
        weights for the run and loads the adapters (ranks up to 512, vLLM 0.32-0.33 config/lora.py)."""
        if not (self.lora.enabled and self.generation.backend == "vllm"):
            return self
        v = self.generation.vllm_cfg
        if self.lora.dim > VLLM_MAX_LORA_RANK:
            raise ValueError(f"policy.lora.dim={self.lora.dim}: vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANK} "
                             "(policy.generation.backend=vllm); lower it or use backend=hf")
        if v.sleep_level == 2:
            raise ValueError("policy.generation.vllm_cfg.sleep_level=2 discards vLLM's weights while training; with "
                             "policy.lora the base weights are loaded once and never pushed again: use sleep_level=1")
        taken = sorted(set(v.vllm_kwargs) & VLLM_LORA_KWARGS)
        if taken:
            raise ValueError(f"policy.generation.vllm_cfg.vllm_kwargs: {taken} are set by grpo-ds with policy.lora "
                             "(grpo/system/generation/vllm_params.py lora_llm_kwargs)")
        return self


def generation_ranks(gen: GenerationConfig) -> int:
    """How many ranks of the launch only generate: 0 when colocated, else NeMo-RL's
    ``colocated.resources.gpus_per_node x num_nodes`` (num_nodes null: 1).

        >>> generation_ranks(GenerationConfig(colocated={"enabled": False, "resources": {"gpus_per_node": 4}}))
        4
    """
    c = gen.colocated
    return 0 if c.enabled else (c.resources.gpus_per_node or 0) * (c.resources.num_nodes or 1)


def generation_split_problem(gen: GenerationConfig, world_size: int, num_teacher: int = 0, teachers: int = 1
                             ) -> str | None:
    """Why a launch of ``world_size`` ranks cannot give ``generation_ranks`` of them to generation (and
    ``num_teacher`` to the distillation teachers, ``teachers`` blocks of them: `grpo.config.teacher_ranks`), or None.

        >>> generation_split_problem(GenerationConfig(colocated={"enabled": False, "resources": {"gpus_per_node": 2}}), 2)
        'policy.generation.colocated.resources: 2 generation ranks of the 2 the launcher started leave none to train'
        >>> generation_split_problem(GenerationConfig(), 2, num_teacher=2)
        'on_policy_distillation.non_colocated_teachers.default_teacher_cfg: 2 teacher ranks of the 2 the launcher started leave none to train'
        >>> generation_split_problem(GenerationConfig(), 3, num_teacher=4, teachers=2)
        'on_policy_distillation.non_colocated_teachers.default_teacher_cfg: 4 teacher ranks (2 per teacher x 2 teachers) of the 3 the launcher started leave none to train'
    """
    n = generation_ranks(gen)
    if (n or num_teacher) and world_size - n - num_teacher < 1:
        parts = ([f"policy.generation.colocated.resources: {n} generation ranks"] if n else []) + \
                ([f"on_policy_distillation.non_colocated_teachers.default_teacher_cfg: {num_teacher} teacher ranks"
                  + (f" ({num_teacher // teachers} per teacher x {teachers} teachers)" if teachers > 1 else "")]
                 if num_teacher else [])
        return f"{' and '.join(parts)} of the {world_size} the launcher started leave none to train"
    return None
