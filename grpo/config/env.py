"""The ``env`` section: the environments (built-in tasks, user classes, several tasks by name), agents, reward
models, LLM judges and NeMo-Gym."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpo.config.base import _Section, check_toy_model, model_path_problem
from grpo.tasks.catalogue import ENV_NAMES


class AgentConfig(_Section):
    """``env.agent`` (``env.name: agent``): a user's agent plays each sample through the run's OpenAI-compatible
    endpoint (grpo/wings/agents/environment.py has the contract)."""

    fn: Optional[str] = Field(None, description=(
        "package.module:function, an async function fn(row, base_url, api_key, model) -> float or dict with "
        "reward, optional reward_components and mask_sample."))
    command: Optional[list[str]] = Field(None, description=(
        "A program (argv list) run per sample: GRPO_BASE_URL, GRPO_API_KEY, GRPO_MODEL (and OPENAI_BASE_URL, "
        "OPENAI_API_KEY) in its environment, the row as JSON on stdin; it prints the result JSON (as fn returns) "
        "on stdout."))
    max_concurrency: int = Field(64, gt=0, description="Agents running at once on a rank.")
    timeout_s: float = Field(300.0, gt=0, description=(
        "Per-attempt deadline in seconds, whatever the agent does: an agent still running is abandoned (cancelled, "
        "a program killed) and the attempt fails (env_timeout: retried within grpo.rollout_failure, then masked, "
        "never scored 0)."))
    fork_threshold_tokens: int = Field(0, ge=0, description=(
        "A call whose prompt parts from the conversation inside the last generated answer, with fewer than this many "
        "generated tokens after the parting point (a re-rendered end of the answer), continues its row, those tokens "
        "untrained; otherwise the call starts a new row (a branch). 0: every rewrite is a branch, every generated "
        "token trained (TRL's fork_threshold_tokens; grpo/wings/agents/branches.py)."))

    @model_validator(mode="after")
    def _one(self) -> "AgentConfig":
        if (self.fn is None) == (self.command is None):
            raise ValueError(f"env.agent: expected exactly one of fn (got {self.fn!r}) and command (got "
                             f"{self.command!r})")
        if self.fn is not None and ":" not in self.fn:
            raise ValueError(f"env.agent.fn={self.fn!r}: expected 'package.module:function'")
        if self.command is not None and not self.command:
            raise ValueError("env.agent.command=[]: expected a program and its arguments")
        return self


class RewardModelTokenizerConfig(_Section):
    name: Optional[str] = Field(None, description="The reward model's tokenizer and chat template (null: model_name).")


class RewardModelTypeConfig(_Section):
    """NeMo-RL's ``env.reward_model.reward_model_cfg``."""

    enabled: bool = Field(True, description="Must be true (NeMo-RL asserts it).")
    reward_model_type: Literal["bradley_terry"] = Field("bradley_terry", description=(
        "bradley_terry: a sequence classifier with one output, the score of the whole conversation."))


class RewardModelConfig(_Section):
    """``env.reward_model`` (``env.name: reward_model``), NeMo-RL's keys: a sequence classifier scoring each
    conversation rendered with its own chat template (grpo/wings/reward_model/: environment.py, scorer.py)."""

    model_name: str = Field(description="The reward model: a local directory or a hub name of a "
                            "ForSequenceClassification checkpoint (num_labels is set to 1, as NeMo-RL does), or "
                            "toy:demo_rm (built locally: the reward-model demo's).")

    @field_validator("model_name")
    @classmethod
    def _toy_model(cls, v):
        return check_toy_model(v, "env.reward_model.model_name")

    tokenizer: RewardModelTokenizerConfig = Field(default_factory=RewardModelTokenizerConfig, description=(
        "tokenizer.name: the reward model's tokenizer (null: model_name)."))
    precision: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="The reward model's dtype.")
    batch_size: int = Field(8, gt=0, description="Conversations per reward-model forward.")
    max_model_len: Optional[int] = Field(None, gt=0, description=(
        "Longest conversation (reward-model tokens) scored; a longer one fails (masked, counted), never cut. "
        "null: no bound."))
    checkpoint_path: Optional[str] = Field(None, description=(
        "Weights to load instead of model_name's (a local ForSequenceClassification directory); null: model_name."))
    reward_model_cfg: RewardModelTypeConfig = Field(default_factory=RewardModelTypeConfig, description=(
        "NeMo-RL's reward_model_cfg: enabled must be true, reward_model_type bradley_terry."))
    placement: Literal["auto", "plain", "zero3"] = Field("auto", description=(
        "grpo-ds's (NeMo-RL gives the reward model GPUs of its own: resources): plain, a frozen copy on each "
        "training rank; zero3, a ZeRO-3 inference engine sharded over the training ranks "
        "(policy.reference_deepspeed_config), scored collectively once per rollout; auto: as "
        "policy.reference_placement's auto (plain on one rank or when its weights take at most 1/4 of the free "
        "device memory, else zero3)."))
    offload: bool | Literal["auto"] = Field("auto", description=(
        "grpo-ds's: keep the reward model's weights in host memory while the policy trains (GPU runs; no effect on "
        "the CPU): a plain copy moves to the device only to score; a zero3 engine keeps its shards on the host "
        "(ZeRO's offload_param) and fetches each layer as it runs. auto: offload when the weights a rank holds "
        "(the whole copy, or its ZeRO-3 shard) take more than 1/4 of its free device memory once the policy is "
        "built, agreed over the ranks."))

    @model_validator(mode="before")
    @classmethod
    def _own_resources(cls, data):
        """NeMo-RL's ``resources`` (GPUs of the reward model's own) in a native config: refused with the reason (a
        NeMo-RL recipe's is translated: its GPUs join the training ranks, grpo/config/nemo_rl/rules.py)."""
        if isinstance(data, dict) and "resources" in data:
            raise ValueError(f"env.reward_model.resources={data['resources']!r}: grpo-ds has no ranks of the reward "
                             "model's own; it runs on the training ranks beside the policy (with generation on ranks "
                             "of its own, on the trainers), a frozen copy on each or a ZeRO-3 engine sharded over them: "
                             "remove resources and choose env.reward_model.placement (auto, plain, zero3), launching "
                             "the GPUs you meant for it as training ranks")
        return data

    @model_validator(mode="after")
    def _enabled(self) -> "RewardModelConfig":
        if not self.reward_model_cfg.enabled:
            raise ValueError("env.reward_model.reward_model_cfg.enabled=False: expected true (NeMo-RL: 'Please set "
                             "reward_model_cfg.enabled = True in the reward model environment config')")
        return self


class JudgeConfig(_Section):
    """``env.judge`` (``env.name: judge``): an LLM judge behind any OpenAI-compatible URL (grpo/tasks/judge.py)."""

    base_url: str = Field(description="The server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(description="The judge's model name on that server.")
    prompt_template: str = Field(description=(
        "The judge's prompt: {question}, {completion} and {answer} are filled in (literal braces doubled)."))
    score_pattern: str = Field(r"Score:\s*(-?[0-9]+(?:\.[0-9]+)?)", description=(
        "Regex whose last match's group 1 is the score in the judge's answer; an answer without one fails the "
        "sample (env_malformed: retried, then masked), never scores 0."))
    max_score: float = Field(1.0, gt=0, description="reward = score / max_score.")
    timeout_s: float = Field(60.0, gt=0, description="Seconds one judge request may take (env_timeout past it).")
    max_concurrency: int = Field(16, gt=0, description="Judge requests in flight at once (per rank).")
    api_key_env: Optional[str] = Field(None, description=(
        "Environment variable holding the server's API key (null: no key)."))
    temperature: float = Field(0.0, ge=0, description="The judge's sampling temperature.")
    max_tokens: Optional[int] = Field(None, gt=0, description="Most tokens the judge may answer (null: the server's).")

    @model_validator(mode="after")
    def _template(self) -> "JudgeConfig":
        import re

        try:
            self.prompt_template.format(question="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"env.judge.prompt_template: {type(err).__name__}: {err}; expected only {{question}}, "
                             "{completion}, {answer} (double literal braces)") from err
        if "{completion}" not in self.prompt_template:
            raise ValueError("env.judge.prompt_template has no {completion}: the judge would not see the answer")
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as err:
            raise ValueError(f"env.judge.score_pattern={self.score_pattern!r}: {err}") from err
        if groups < 1:
            raise ValueError(f"env.judge.score_pattern={self.score_pattern!r}: expected a group around the score")
        return self


class EffortLevelsConfig(_Section):
    """``env.nemo_gym.effort_levels``: NeMo-RL's length shaping of NeMo-Gym rewards for low-effort prompts
    (``nemo_rl/experience/rollouts.py``, ``EffortLevelsConfig``; `grpo.wings.gym.rewards.apply_effort_shaping`):

        length_reward = min(1, low_weight * (1 - response_len / low_ub))
        reward'       = reward + reward * max(length_reward, 0) + low_penalty * min(length_reward, 0)

    for samples whose last user message contains ``low_string``; off when low_weight <= 0 or low_string is empty."""

    low_weight: float = Field(0.0, description="Weight of the length-reward term (0: shaping off).")
    low_penalty: float = Field(1.0, description="Coefficient of the negative length-reward term.")
    low_ub: int = Field(64000, gt=0, description="Response length (tokens) that normalises the term.")
    low_string: str = Field("", description="Substring of the last user message that turns shaping on ('' : off).")


class NemoGymConfig(BaseModel):
    """``env.nemo_gym`` (``env.should_use_nemo_gym: true``): NeMo-RL's section, its own keys typed, every other key
    Gym's global config (kept as given and handed to the launcher), plus grpo-ds's keys for where the Gym servers
    come from: ``agent_urls`` / ``head_server_url`` (servers you started) or ``config_paths`` + ``launcher`` (grpo-ds
    starts them). grpo/tasks/nemo_gym.py has the protocol."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    invalid_tool_call_patterns: Optional[list[str]] = Field(None, description=(
        "NeMo-RL's key: substrings of an assistant message's text that mark an unexecuted tool call (null: "
        "NeMo-RL's <tool_call>, </tool_call>, <function_call>, </function_call>); read by the reward penalties."))
    thinking_tags: Optional[list[str]] = Field(None, description=(
        "NeMo-RL's key: the thinking tags checked for malformed thinking (null: <think>, </think>)."))
    effort_levels: Optional[EffortLevelsConfig] = Field(None, description=(
        "NeMo-RL's key: effort-level length shaping of Gym results (grpo.wings.gym.rewards; never sent to Gym)."))
    port_range_low: int = Field(5000, gt=0, lt=65536, description=(
        "NeMo-RL's key: the Gym servers' ports (the head server grpo-ds starts takes the first free one); passed to "
        "Gym as its port_range_low."))
    port_range_high: int = Field(5999, gt=0, lt=65536, description="See port_range_low (inclusive).")
    config_paths: Optional[list[str]] = Field(None, description=(
        "Gym's key: the server configs grpo-ds's launcher starts (relative to launcher_cwd, Gym's checkout)."))
    agent_urls: dict[str, str] = Field(default_factory=dict, description=(
        "grpo-ds: agent servers you started, by the agent_ref.name of the rows they serve: {name: http://host:port}."))
    head_server_url: Optional[str] = Field(None, description=(
        "grpo-ds: the head server of Gym servers you started (ng_run prints it; http://127.0.0.1:11000 by default): "
        "the agents' addresses are read from its /global_config_dict_yaml."))
    launcher: list[str] = Field(default_factory=lambda: ["ng_run", "+config_paths=[{config_paths}]"], description=(
        "grpo-ds: the command that starts the Gym servers of config_paths (Gym needs Python >= 3.13 and Ray: "
        "e.g. [uv, run, --python, '3.13', ng_run, ...] or a path into Gym's own venv). {config_paths} is replaced by "
        "the comma-joined config_paths followed by the config grpo-ds writes (policy_base_url, policy_api_key, "
        "policy_model_name, head_server, the port range and Gym's other keys of this section), {config_file} by that "
        "file alone, {python} by the trainer's Python (a launcher script in grpo-ds's environment)."))
    launcher_cwd: Optional[str] = Field(None, description=(
        "grpo-ds: the launcher's working directory (Gym's checkout, where config_paths resolve; null: the run's)."))
    startup_timeout_s: float = Field(600.0, gt=0, description=(
        "grpo-ds: seconds to wait for the Gym servers (launched, or started by you) to answer."))
    request_timeout_s: float = Field(1800.0, gt=0, description=(
        "grpo-ds: seconds one row's POST /run may take before its sample fails (env_timeout: retried, then masked)."))
    max_concurrency: int = Field(256, gt=0, description="grpo-ds: rows posted to the agent servers at once.")

    @model_validator(mode="after")
    def _where(self) -> "NemoGymConfig":
        if self.port_range_low > self.port_range_high:
            raise ValueError(f"env.nemo_gym.port_range_low={self.port_range_low} is above port_range_high="
                             f"{self.port_range_high}: expected low <= high")
        if not (self.agent_urls or self.head_server_url or self.config_paths):
            raise ValueError("env.nemo_gym: say where the Gym servers are: agent_urls ({agent name: URL}) or "
                             "head_server_url for servers you started (ng_run), or config_paths (with launcher, "
                             "default ng_run) for grpo-ds to start them")
        if self.config_paths and (self.agent_urls or self.head_server_url):
            raise ValueError("env.nemo_gym: config_paths (grpo-ds starts the servers) and agent_urls / "
                             "head_server_url (servers you started) are both set: keep one")
        if not self.launcher:
            raise ValueError("env.nemo_gym.launcher=[]: expected a command, e.g. [ng_run, '+config_paths="
                             "[{config_paths}]']")
        for name, url in self.agent_urls.items():
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"env.nemo_gym.agent_urls.{name}={url!r}: expected an http(s):// URL")
        return self

    def gym_keys(self) -> dict[str, Any]:
        """Gym's own keys of this section: everything but NeMo-RL's detection and shaping keys and grpo-ds's."""
        return {k: v for k, v in (self.model_extra or {}).items() if k not in NEMO_RL_ONLY_GYM_KEYS}


# Keys of env.nemo_gym that NeMo-RL pops before handing the section to Gym (run_grpo_nemo_gym.py, nemo_gym.py).
NEMO_RL_ONLY_GYM_KEYS = frozenset({"is_trajectory_collection", "pad_dynamic_image_shapes", "tokenizer_config",
                                   "num_gpu_nodes"})


# Modules that moved, by their old name: specs (package.module:function) naming the old one still load.
MOVED_MODULES = {"grpo.system.sandbox": "grpo.tasks.sandbox"}


class EnvSpec(_Section):
    """One environment: a reward function (single-turn), the built-in multi-turn task, or a user class."""

    name: Literal[ENV_NAMES] = Field(  # the built-in tasks of grpo.tasks.catalogue, function, tools, class
        "arithmetic", description=(
        "Single-turn reward functions: math (math-verify), reasoning_gym, arithmetic, function (reward_fn); "
        "multi-turn: guess_number; class: env_class; agent: env.agent, a program driving the policy over HTTP; "
        "reward_model: env.reward_model, a sequence classifier's score; judge: env.judge, an LLM judge over HTTP; "
        "combined: env.rewards, several rewards per sample; vlm: NeMo-RL's VLM rewards, env.kwargs.reward_functions "
        "(format, exact_alnum, math_expr, bbox_giou, geo3k: [{name, weight, kwargs}])."))
    reward_fn: Optional[str] = Field(None, description=(
        "package.module:function with signature fn(question, completion, answer, meta) -> float | dict."))
    env_class: Optional[str] = Field(
        None, description="package.module:ClassName of a grpo.tasks.interface.Environment (NeMo-RL's interface).")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment's constructor (class, guess_number).")
    observation_format: Literal["auto", "raw", "chat_template"] = Field("auto", description=(
        "How the environment's observations become tokens. raw: the content as tokens, nothing added (NeMo-RL's "
        "rollout: the environment writes its own turn markup; the next assistant turn starts right after it); "
        "chat_template: the chat template's rendering of the observation messages and the next generation prompt "
        "(a role the template renders nothing for, e.g. Qwen2.5 and 'environment', stops the run at its first "
        "observation); auto: raw for env.name=class (environments written for NeMo-RL), chat_template for the "
        "built-ins (tools, guess_number). Without a chat template (policy.tokenizer.chat_template=null) both are "
        "the raw content."))
    num_workers: int = Field(2, gt=0, description="Reward worker processes (math, reasoning_gym, function).")
    timeout_s: float = Field(
        10.0, gt=0, description="Seconds a reward may take before its sample scores 0 (counted as a timeout).")
    math_verify_impl: Literal["hf_math_verify", "dapo_math_verify"] = Field("hf_math_verify", description=(
        "env.name=math: the verifier (NeMo-RL's env.math.math_verify_impl). hf_math_verify: math-verify, symbolic "
        "equivalence of the final answer; dapo_math_verify: DAPO's, the last 'Answer: ...' line in the "
        "completion's last 300 characters must equal the gold answer as a string after DAPO's normalisation."))
    tools: list[str] = Field(default_factory=list, description=(
        "env.name=tools: package.module:function of each tool (typed, documented; grpo.tasks.sandbox:python runs "
        "code in a sandbox)."))
    tool_call_format: Literal["hermes", "compact"] = Field("hermes", description=(
        "hermes: <tool_call>{json}</tool_call> (Qwen2.5 / Qwen3); compact: <name>argument</name> (the char toy)."))
    tool_timeout_s: float = Field(20.0, gt=0, description="Seconds one tool call may take before it is an error.")
    max_tool_result_chars: int = Field(1000, gt=0, description="Tool results are cut to this many characters.")
    max_tool_calls_per_turn: int = Field(4, gt=0, description="Tool calls run per assistant message at most.")
    disable_tools: bool = Field(False, description=(
        "Answer every tool call with an error (an ablation: same task, same model, no tool results)."))
    agent: Optional[AgentConfig] = Field(None, description=(
        "env.name=agent: the agent (fn or command), its concurrency and per-sample deadline."))
    reward_model: Optional[RewardModelConfig] = Field(None, description=(
        "env.name=reward_model: the reward model (NeMo-RL's env.reward_model keys)."))
    judge: Optional[JudgeConfig] = Field(None, description=(
        "env.name=judge: the LLM judge (base_url, model, prompt_template, score_pattern, timeouts)."))
    rewards: dict[str, "EnvSpec"] = Field(default_factory=dict, description=(
        "env.name=combined: the one-turn environments (name -> environment) whose rewards score each sample."))
    combine: Literal["weighted_sum", "components"] = Field("weighted_sum", description=(
        "env.name=combined: weighted_sum: one reward, the sum of env.weights[name] x each reward; components: each "
        "reward a named component for GDPO (grpo.adv_estimator.name=gdpo), the scalar reward their sum."))
    weights: dict[str, float] = Field(default_factory=dict, description=(
        "env.name=combined with combine=weighted_sum: the weight of each reward by name (default 1)."))

    @field_validator("tools")
    @classmethod
    def _moved_tools(cls, tools: list[str]) -> list[str]:
        """Tool specs whose module moved keep working: ``grpo.system.sandbox:python`` is ``grpo.tasks.sandbox:python``.

            >>> EnvSpec(name="tools", tools=["grpo.system.sandbox:python"], reward_fn="m:f").tools
            ['grpo.tasks.sandbox:python']
        """
        moved = []
        for spec in tools:
            module, colon, name = spec.partition(":")
            moved.append(MOVED_MODULES.get(module, module) + colon + name)
        return moved

    @model_validator(mode="after")
    def _check(self) -> "EnvSpec":
        if self.name == "function" and not self.reward_fn:
            raise ValueError("env.reward_fn=None: expected 'package.module:function' when env.name='function'")
        if self.reward_fn and ":" not in self.reward_fn:
            raise ValueError(f"env.reward_fn={self.reward_fn!r}: expected 'package.module:function'")
        if self.name == "tools" and (not self.tools or not self.reward_fn):
            raise ValueError(f"env.name='tools' needs env.tools (got {self.tools!r}) and env.reward_fn, the verifier "
                             f"of the final answer (got {self.reward_fn!r})")
        if self.math_verify_impl != "hf_math_verify" and self.name != "math":
            raise ValueError(f"env.math_verify_impl={self.math_verify_impl!r} picks the verifier of env.name='math' "
                             f"(got env.name={self.name!r}): remove it")
        if (self.name == "agent") != (self.agent is not None):
            raise ValueError(f"env.agent={self.agent!r} with env.name={self.name!r}: env.name='agent' needs an "
                             "env.agent section (fn or command), and only it takes one")
        if (self.name == "combined") != bool(self.rewards):
            raise ValueError(f"env.rewards={sorted(self.rewards)} with env.name={self.name!r}: env.name='combined' "
                             "needs env.rewards (name -> environment), and only it takes them")
        bad = sorted(k for k, spec in self.rewards.items() if spec.name in ("combined", "agent", "tools"))
        if bad:
            raise ValueError(f"env.rewards.{bad[0]}.name={self.rewards[bad[0]].name!r}: a combined reward takes one-turn "
                             "environments (a reward function, a reward model, math, ...)")
        if self.weights and (self.combine != "weighted_sum" or set(self.weights) - set(self.rewards)):
            raise ValueError(f"env.weights={self.weights!r}: expected weights of env.rewards' names "
                             f"{sorted(self.rewards)} with env.combine='weighted_sum' (got {self.combine!r}); GDPO's "
                             "weights are grpo.adv_estimator.reward_weights")
        if (self.name == "judge") != (self.judge is not None):
            raise ValueError(f"env.judge={self.judge!r} with env.name={self.name!r}: env.name='judge' needs an "
                             "env.judge section (base_url, model, prompt_template), and only it takes one")
        if (self.name == "reward_model") != (self.reward_model is not None):
            raise ValueError(f"env.reward_model={self.reward_model!r} with env.name={self.name!r}: env.name="
                             "'reward_model' needs an env.reward_model section (model_name, ...), and only it takes one")
        if self.name == "vlm":  # NeMo-RL's VLMEnvironment: its reward functions checked before any model loads
            from grpo.tasks.vlm import kwargs_problem

            if (problem := kwargs_problem(self.kwargs)) is not None:
                raise ValueError(problem)
        if self.name == "class" and (not self.env_class or ":" not in self.env_class):
            raise ValueError(f"env.env_class={self.env_class!r}: expected 'package.module:ClassName' when "
                             "env.name='class'")
        return self


EnvSpec.model_rebuild()


class EnvConfig(EnvSpec):
    task_name: Optional[str] = Field(None, description="Task name of the top-level environment (null: env.name).")
    tasks: dict[str, EnvSpec] = Field(default_factory=dict, description=(
        "More environments by task name; a data row's task name (data.task_key) picks one."))
    val_tasks: Optional[dict[str, EnvSpec]] = Field(
        None, description="Validation's own environments for the tasks they name.")
    step_timeout_s: float = Field(300.0, gt=0, description=(
        "Seconds one environment step (a batch of samples) may take before the call counts as failed (env_timeout: "
        "retried, then the samples are masked; grpo.rollout_failure)."))
    should_use_nemo_gym: bool = Field(False, description=(
        "NeMo-RL's key: NeMo-Gym's agent servers play the rollouts (env.nemo_gym; the data rows are Gym rows: "
        "responses_create_params, agent_ref, task fields). Sets env.name=nemo_gym."))
    nemo_gym: Optional[NemoGymConfig] = Field(None, description=(
        "NeMo-RL's section: its keys (invalid_tool_call_patterns, thinking_tags, effort_levels, port_range_low/high), "
        "Gym's global config, and grpo-ds's: where the Gym servers come from."))
    should_log_nemo_gym_responses: bool = Field(False, description=(
        "NeMo-RL's key: true says NeMo-Gym logs the full responses itself, so the run writes no local dump of them; "
        "false (the default, as NeMo-RL, which then writes train_data_step<n>.jsonl): every Gym result (the full "
        "/run answer, token fields left out) goes to <log_dir>/nemo_gym_responses/<stream>_step_<n>.jsonl."))
    should_mask_flagged_samples: bool = Field(True, description=(
        "NeMo-RL's key: a sample an environment flags mask_sample (NeMo-Gym's instance_config.mask_sample) is out of "
        "the loss and, in grpo-ds, out of its group's baseline too; false: the flag is ignored and the sample trains."))

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data):
        """env.max_error_rate / env.max_error_steps are gone: a failed sample is masked, not scored 0, and
        grpo.rollout_failure's step budget replaces them (one mechanism, not two)."""
        if isinstance(data, dict):
            for key in ("max_error_rate", "max_error_steps"):
                if key in data:
                    raise ValueError(
                        f"env.{key}={data[key]!r} was retired: failed samples are now retried and masked (never scored "
                        "0), and a step with too few valid samples is skipped. Use grpo.rollout_failure."
                        "min_step_batch_fraction (the share of a step's samples that must not fail) and "
                        "grpo.rollout_failure.max_consecutive_skipped_steps (skipped steps in a row before the run "
                        "stops) instead")
        return data

    @model_validator(mode="before")
    @classmethod
    def _gym_name(cls, data):
        """``should_use_nemo_gym: true`` makes the top-level environment NeMo-Gym's (``env.name: nemo_gym``)."""
        if isinstance(data, dict) and data.get("should_use_nemo_gym") and "name" not in data:
            data = {**data, "name": "nemo_gym"}
        return data

    @model_validator(mode="after")
    def _gym(self) -> "EnvConfig":
        if self.should_use_nemo_gym != (self.name == "nemo_gym"):
            raise ValueError(f"env.should_use_nemo_gym={self.should_use_nemo_gym} with env.name={self.name!r}: "
                             "NeMo-Gym is the top-level environment (env.name=nemo_gym) exactly when "
                             "env.should_use_nemo_gym=true")
        if self.should_use_nemo_gym and self.nemo_gym is None:
            raise ValueError("env.should_use_nemo_gym=true needs env.nemo_gym: agent_urls or head_server_url (Gym "
                             "servers you started) or config_paths (grpo-ds starts them with env.nemo_gym.launcher)")
        if self.nemo_gym is not None and not self.should_use_nemo_gym:
            raise ValueError("env.nemo_gym is set but env.should_use_nemo_gym is false: set it true, or remove "
                             "env.nemo_gym")
        gym_tasks = [t for t, spec in self.tasks.items() if spec.name == "nemo_gym"]
        if gym_tasks:
            raise ValueError(f"env.tasks.{gym_tasks[0]}.name=nemo_gym: NeMo-Gym is the top-level environment only "
                             "(env.should_use_nemo_gym=true)")
        return self

    @model_validator(mode="after")
    def _reward_model_paths(self) -> "EnvConfig":
        """Every reward model's local paths (weights, checkpoint, tokenizer) are there, each named by its key when
        not (`model_path_problem`); a hub name is checked when it loads."""
        def specs(key: str, spec: EnvSpec):
            yield key, spec
            for name, part in spec.rewards.items():
                yield from specs(f"{key}.rewards.{name}", part)

        sections = [("env", self), *((f"env.tasks.{t}", s) for t, s in self.tasks.items()),
                    *((f"env.val_tasks.{t}", s) for t, s in (self.val_tasks or {}).items())]
        for key, spec in (found for k, s in sections for found in specs(k, s)):
            rm = spec.reward_model
            for field, name in (("model_name", rm.model_name), ("checkpoint_path", rm.checkpoint_path),
                                ("tokenizer.name", rm.tokenizer.name)) if rm is not None else ():
                problem = model_path_problem(name, f"{key}.reward_model.{field}")
                if problem is not None:
                    raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _tasks(self) -> "EnvConfig":
        main = self.task_name or self.name
        if main in self.tasks:
            raise ValueError(f"env.tasks.{main}: the top-level environment already has the task name {main!r} "
                             "(set env.task_name to another name)")
        unknown = sorted(set(self.val_tasks or {}) - set(self.tasks) - {main})
        if unknown:
            raise ValueError(f"env.val_tasks: {unknown} are not training tasks (expected some of "
                             f"{sorted([main, *self.tasks])})")
        return self
