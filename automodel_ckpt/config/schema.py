"""The recipe schema: one dataclass per YAML section, with the defaults of the embedded recipe."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from automodel_ckpt.checkpoint import CheckpointConfig


@dataclass
class StepSchedulerConfig:
    """How many samples make a step, and when to stop, validate and checkpoint."""

    global_batch_size: int = 32  # samples per optimizer step, over all ranks
    local_batch_size: int = 8  # samples per forward pass on one rank; grad accumulation makes up the rest
    max_steps: Optional[int] = None  # stop after this many optimizer steps (None: run num_epochs)
    num_epochs: int = 1  # stop after this many passes over the training data
    ckpt_every_steps: Optional[Any] = None  # checkpoint every N optimizer steps (None: only at the end; auto: Young/Daly's interval from the measured save cost and checkpoint.mtbf_hours, docs/tracking.md)
    min_every_steps: int = 1  # ckpt_every_steps auto: the shortest interval (also when the first save comes)
    max_every_steps: Optional[int] = None  # ckpt_every_steps auto: the longest interval (None: no limit but the run's end)
    val_every_steps: Optional[int] = None  # validate every N optimizer steps (None: only at checkpoints)


@dataclass
class DataConfig:
    """How examples become token sequences, and how the validation split is made."""

    seq_length: int = 32  # tokens per sequence after padding or packing
    packing: bool = False  # pack several examples into one sequence instead of padding each
    val_size: float = 0.05  # held-out fraction (<1) or count (>=1) of the training data, if no validation_dataset
    shuffle: bool = True  # visit training samples in a seeded random order each epoch
    prompt_field: str = "prompt"  # prompt/completion columns: loss on the completion only
    completion_field: str = "completion"
    text_field: str = "text"  # plain-text column: loss on every token
    messages_field: str = "messages"  # chat column: a list of {role, content}, rendered with the chat template
    image_field: str = "image"  # image column of image + messages records, for image-text models (docs/vlm.md)
    chat_loss: str = "assistant"  # chat turns that take the loss: assistant | last (last assistant turn) | all
    prompt_template: Optional[str] = None  # build the prompt from a record's fields: "{context}\nQ: {question}"
    completion_template: Optional[str] = None  # build the completion likewise: " {answers.text[0]}", "{endings[label]}"
    num_proc: Optional[int] = None  # processes that tokenize (None: this one)
    map_batch_size: int = 1000  # records per tokenization batch (and per packing window)
    cache_dir: Optional[str] = None  # tokenized-data cache folder (None: beside the dataset's Hugging Face cache)
    shuffle_buffer: int = 1000  # streamed corpus: rows in the seeded shuffle buffer (1: file order; docs/data.md)
    lanes: int = 64  # streamed corpus: the lanes its order is made over, fixed for a run (docs/data.md, "Lanes")
    num_workers: int = 0  # streamed corpus: DataLoader worker processes per rank that read and tokenize
    skip_bad_rows: int = 0  # streamed corpus: bad rows, unreadable or empty files skipped (and counted) before an error
    allow_appended_shards: bool = False  # streamed corpus: a resume accepts files added since, read from the next epoch
    max_record_bytes: int = 32 * 2**20  # streamed corpus: a longer line or row is a bad row (counted by skip_bad_rows)


@dataclass
class TokenizerConfig:
    pretrained_model_name_or_path: Optional[str] = None  # local folder; default: the model's folder
    chat_template: Optional[str] = None  # Jinja chat template for `messages` data (None: the tokenizer's own)


@dataclass
class DistributedConfig:
    backend: Optional[str] = None  # None: nccl when CUDA is available, else gloo
    mixed_precision: Optional[str] = None  # None (fp32) | bf16: compute in bf16 (FSDP2 casts, else autocast), reduce in fp32
    dp_shard: str = "auto"  # auto | full | none: shard with FSDP2, or replicate a model that fits (docs/parallelism.md)
    timeout_minutes: int = 30  # collective timeout
    tp_size: int = 1  # tensor-parallel ranks per model replica, split by the family's own plan (docs/parallelism.md)
    dp_size: Optional[int] = None  # data-parallel ranks (None: the world size / tp_size)
    dp_replicate_size: int = 1  # HSDP: replicate over this many groups, shard within each (must divide dp_size)
    sequence_parallel: bool = False  # with tp_size > 1: norms and residuals split along the sequence (docs/parallelism.md)
    pp_size: Optional[int] = None  # pipeline stages (null: 1), each a run of decoder layers (docs/parallelism.md)
    pp_schedule: str = "1f1b"  # with pp_size > 1: torch's pipeline schedule, 1f1b, gpipe or interleaved_1f1b
    pp_microbatches: Optional[int] = None  # with pp_size > 1: microbatches per local batch (null: pp_size)
    pp_layers: Optional[List[int]] = None  # with pp_size > 1: decoder layers of each stage (null: an even split)
    pp_stages_per_rank: Optional[int] = None  # stages per rank (interleaved_1f1b; null: 2 with it, else 1)
    cp_size: Optional[int] = None  # context parallelism: not supported yet (1 or null)
    ep_size: Optional[int] = None  # expert parallelism (null: 1): ranks the experts are spread over (a multiple of tp_size)
    activation_checkpointing: bool = False  # recompute each decoder block's activations in backward: less memory


@dataclass
class TrainingConfig:
    max_grad_norm: Optional[float] = 1.0  # gradient clipping (None: off)
    compile: str = "auto"  # auto | true | false: torch.compile each decoder block (auto: where it pays; docs/parallelism.md)
    progress_bar: bool = True  # rank-0 progress bar with step, loss and rate
    log_sample_ids: bool = False  # add the ids of the step's samples to training.jsonl
    ema_decay: Optional[float] = None  # keep an EMA of the trainable weights (e.g. 0.999), checkpointed as ema/ (None: off)


@dataclass
class EvaluationConfig:
    every_steps: Optional[int] = None  # run lm-evaluation-harness tasks every N steps on rank 0 (None: never; docs/evaluation.md)
    tasks: List[str] = field(default_factory=list)  # the harness's task names, e.g. [addition]
    limit: Optional[int] = None  # documents per task (None: all)
    batch_size: int = 32  # the harness's batch size
    include_path: Optional[str] = None  # a folder of your own harness task definitions (YAML), beside the shipped ones


@dataclass
class PeftConfig:
    """LoRA fine-tuning (docs/peft.md): only the adapter weights train, the base model stays frozen."""

    method: str = "lora"  # the only method for now
    rank: int = 8  # LoRA rank r of every adapted projection
    alpha: float = 16.0  # scaling numerator: updates are scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)
    dropout: float = 0.0  # dropout on the adapter input
    target_modules: Optional[List[str]] = None  # module name suffixes (None: chosen for the model family, docs/peft.md)
    bias: str = "none"  # none | all | lora_only: which biases also train
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(rank)
    vision_tower: bool = False  # image-text models: also adapt the vision tower (default: the language model only)
    init_lora_weights: bool = True  # True: B starts at zero (the adapted model starts as the base); False: random


@dataclass
class TensorBoardConfig:
    """TensorBoard event files (pip install 'automodel-ckpt[tensorboard]')."""

    log_dir: Optional[str] = None  # event files folder (None: tensorboard/ in the run folder)


@dataclass
class MLflowConfig:
    """An MLflow run (pip install 'automodel-ckpt[mlflow]')."""

    tracking_uri: Optional[str] = None  # server URL or store URI (None: a SQLite store mlflow.db in the run folder)
    experiment: Optional[str] = None  # experiment name, created if missing (None: the run folder's name)


@dataclass
class WandbConfig:
    """A Weights & Biases run (pip install 'automodel-ckpt[wandb]')."""

    project: Optional[str] = None  # W&B project (None: the run folder's name)
    entity: Optional[str] = None  # user or team (None: your default entity)
    mode: Optional[str] = None  # online, offline or disabled (None: W&B's default, WANDB_MODE)
    dir: Optional[str] = None  # folder W&B writes wandb/ into (None: the run folder)


@dataclass
class LoggingConfig:
    """Experiment trackers (docs/tracking.md): each one present is enabled; rank 0 logs."""

    tensorboard: Optional[TensorBoardConfig] = None  # `tensorboard: {}` enables it
    mlflow: Optional[MLflowConfig] = None  # `mlflow: {}` enables it
    wandb: Optional[WandbConfig] = None  # `wandb: {mode: offline}` enables it
    close_timeout_s: float = 10.0  # the end of a launch waits this long for a tracker making no progress (then gives up)
    report: bool = False  # rewrite RUN_DIR/report.html (ckpt-train report) at each checkpoint, off the training thread


def _target(name: str, **kwargs: Any) -> Any:
    """A ``_target_`` section's default, a fresh copy for each config."""
    return field(default_factory=lambda: copy.deepcopy({"_target_": name, **kwargs}))


@dataclass
class RecipeConfig:
    """A whole recipe. `_target_` sections accept the keyword arguments of their target."""

    recipe: str = "automodel_ckpt.recipes.llm_finetune.FinetuneRecipe"  # recipe class (dotted or file.py:Class)
    seed: int = 42  # seeds Python, NumPy and torch, the data order and the validation split
    model: Dict[str, Any] = _target("automodel_ckpt.models.build.build_causal_lm")  # causal LM to fine-tune: a local HF folder or a config block
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # tokenizer folder
    dataset: Dict[str, Any] = _target("automodel_ckpt.data.builtin.builtin_task_dataset")  # training examples: messages, prompt/completion or text columns (docs/data.md)
    validation_dataset: Optional[Dict[str, Any]] = None  # held-out examples; default: data.val_size of the training data
    data: DataConfig = field(default_factory=DataConfig)  # tokenization and the validation split
    step_scheduler: StepSchedulerConfig = field(default_factory=StepSchedulerConfig)  # batch sizes, length of the run, validation and checkpoint intervals
    optimizer: Dict[str, Any] = _target("torch.optim.AdamW", lr=1e-3, weight_decay=0.01, betas=[0.9, 0.95])  # optimizer, called with the trainable parameters
    lr_scheduler: Dict[str, Any] = _target("automodel_ckpt.training.lr.warmup_cosine", warmup_steps=10, min_lr_ratio=0.1)  # learning-rate schedule, called with the optimizer and total_steps
    training: TrainingConfig = field(default_factory=TrainingConfig)  # gradient clipping and logging
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # process group and FSDP2 settings
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # checkpoint format, location, export, resume and retention
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)  # benchmark tasks during training, logged as eval/<task>/<metric>
    peft: Optional[PeftConfig] = None  # a `peft:` section turns the fine-tune into LoRA
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # TensorBoard, MLflow, Weights & Biases (none by default)
    stages: List[Dict[str, Any]] = field(default_factory=list)  # later stages, each {name, at_step, set: {dotted key: value}}: the run goes on with `set` applied after step at_step (the recipe as written is the first stage, main; docs/stages.md)
