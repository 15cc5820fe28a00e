"""The ``data`` section: where the prompts come from (files, hub datasets, built-in tasks) and how they are read."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from grpo.config.base import _Section


class DataSource(_Section):
    """One dataset of several (``data.train_sources`` / ``data.val_sources``). A field left null takes the
    ``data.*`` field of the same name, as NeMo-RL's ``data.default`` fills its dataset specs; ``split`` takes
    data.train_split / val_split, ``num_samples`` data.num_train_samples / num_val_samples and ``repeat``
    data.val_repeat (validation) or 1 (training) by side."""

    dataset_name: Optional[str] = Field(None, description=(
        "What data.dataset_name takes (a built-in task, a local file or directory, a hub name); on the validation "
        "side a local file or hub name is read as data.val_data_path is."))
    dataset_config: Optional[str] = Field(None, description="Config name of a hub dataset.")
    split: Optional[str] = Field(None, description="Split (hub) or file stem (directory) of this source.")
    input_key: Optional[str] = Field(None, description="Column holding the prompt.")
    output_key: Optional[str] = Field(None, description="Column holding the reference answer.")
    row_format: Optional[Literal["clevr-cogent", "geometry3k", "refcoco"]] = Field(None, description=(
        "This source's rows are in the columns of this NeMo-RL image dataset (data.row_format), so image datasets "
        "of several formats mix in one run."))
    prompt_file: Optional[str] = Field(None, description="This source's prompt template file.")
    prompt_template: Optional[str] = Field(None, description="This source's prompt template.")
    system_prompt_file: Optional[str] = Field(None, description="This source's system prompt file.")
    system_prompt: Optional[str] = Field(None, description="This source's system prompt.")
    task_name: Optional[str] = Field(None, description=(
        "The task (environment, see env.tasks) that scores this source's rows; null: a row's data.task_key "
        "column, else env's task."))
    num_samples: Optional[int] = Field(None, gt=0, description="Rows of a procedural source (a built-in task).")
    split_validation_size: Optional[float] = Field(None, ge=0, description=(
        "Training sources: hold out this share (< 1) or number (>= 1) of the source's rows; they join the "
        "validation rows, before data.val_sources (NeMo-RL's split_validation_size)."))
    split_validation_seed: Optional[int] = Field(None, description="Seed of that split (null: grpo.seed).")
    repeat: Optional[int] = Field(None, gt=0, description=(
        "Each of this source's rows appears this many times (validation: NeMo-RL's repeat; training: a weight in "
        "the mix)."))


class DataConfig(_Section):
    dataset_name: str = Field("arithmetic", description=(
        "arithmetic, guess_number, calculator, reasoning_gym:<task>, a local .jsonl/.json/.parquet/.arrow file "
        "or directory, or a hub name."))
    dataset_config: Optional[str] = Field(
        None, description="Config name of a hub dataset (e.g. main for openai/gsm8k).")
    train_data_path: Optional[str] = Field(
        None, description="Local training file (overrides dataset_name for training).")
    val_data_path: Optional[str] = Field(
        None, description="Local validation file (overrides dataset_name for validation).")
    train_split: Optional[str] = Field(None, description="Split (hub) or file stem (directory) of the training data.")
    val_split: Optional[str] = Field(None, description="Split (hub) or file stem (directory) of the validation data.")
    input_key: str = Field(
        "input", description="Column holding the prompt (a string, or a list of role/content messages).")
    output_key: str = Field("output", description="Column holding the reference answer.")
    prompt_file: Optional[str] = Field(
        None, description="File holding the prompt template ({} or {input} for the question).")
    prompt_template: Optional[str] = Field(None, description="Prompt template with {} or {input} for the question.")
    system_prompt_file: Optional[str] = Field(None, description="File holding the system prompt.")
    system_prompt: Optional[str] = Field(None, description="System prompt.")
    max_input_seq_length: Optional[int] = Field(
        None, gt=0, description="Prompts longer than this (tokens) are filtered out and counted.")
    split_validation_size: float = Field(0, ge=0, description=(
        "Hold out this share (< 1) or number (>= 1) of the training rows; they join the validation rows, before "
        "data.val_data_path's (NeMo-RL's split_validation_size); 0: off."))
    split_validation_seed: Optional[int] = Field(None, description="Seed of that split (null: grpo.seed).")
    val_repeat: int = Field(1, gt=0, description="Each validation row appears this many times (NeMo-RL's repeat).")
    shuffle: bool = Field(True, description="Shuffle the training prompts (seeded; resumes exactly).")
    row_format: Optional[Literal["clevr-cogent", "geometry3k", "refcoco"]] = Field(None, description=(
        "Rows in the columns of this NeMo-RL image dataset (clevr-cogent: image, problem, solution; geometry3k: "
        "images, problem, answer; refcoco: image_path, captions, bbox), read as NeMo-RL's vlm_hf_data_processor "
        "formats them: an image and the prompt-filled problem (input_key and output_key unused); null: "
        "input_key / output_key."))
    on_bad_row: Literal["error", "skip"] = Field("error", description=(
        "error: a malformed row stops the run naming file and row; skip: it is skipped and counted."))
    num_train_samples: int = Field(
        2048, gt=0, description="Size of procedural training sets (arithmetic, guess_number, reasoning_gym).")
    num_val_samples: int = Field(128, gt=0, description="Size of procedural validation sets.")
    arithmetic_max_operand: int = Field(
        9, gt=0, description="Built-in arithmetic: operands are drawn from [0, arithmetic_max_operand].")
    guess_number_high: int = Field(
        9, gt=0, description="Built-in guess_number: secrets are drawn from [0, guess_number_high].")
    calculator_max_operand: int = Field(99, ge=10, description=(
        "Built-in calculator task: a*b with a, b drawn from [10, calculator_max_operand]."))
    num_workers: int = Field(0, ge=0, description="Data loader worker processes (0: load in the trainer).")
    task_key: str = Field("task_name", description=(
        "Column naming each row's task (its environment, see env.tasks); rows without it use env's."))
    train_sources: list[DataSource] = Field(default_factory=list, description=(
        "Several training datasets, concatenated in order (then shuffled together), each a mapping of "
        "dataset_name, dataset_config, split, input_key, output_key, row_format, prompt_file/prompt_template, "
        "system_prompt_file/system_prompt, task_name (the environment scoring its rows), num_samples, "
        "split_validation_size/split_validation_seed, repeat; a field left null takes data.<field> (NeMo-RL's "
        "data.default). Empty: the single source of data.dataset_name / train_data_path."))
    val_sources: list[DataSource] = Field(default_factory=list, description=(
        "Several validation datasets (the same mappings; repeat null takes data.val_repeat), after the rows "
        "held out by split_validation_size; empty: data.val_data_path, else the held-out rows alone, else each "
        "training source's own validation split."))

    @model_validator(mode="after")
    def _sources(self) -> "DataConfig":
        for side, keys in (("train", ("train_data_path", "train_split")), ("val", ("val_data_path", "val_split"))):
            given = [k for k in keys if getattr(self, k) is not None]
            if getattr(self, f"{side}_sources") and given:
                raise ValueError(f"data.{side}_sources and data.{'/'.join(given)} are both set: give each source's "
                                 f"dataset_name / split in data.{side}_sources")
        for i, src in enumerate(self.val_sources):
            if src.split_validation_size:
                raise ValueError(f"data.val_sources.{i}.split_validation_size: only training sources hold rows out "
                                 "for validation")
        return self
