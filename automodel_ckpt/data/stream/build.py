"""From a recipe with a streamed ``dataset:`` to its loader, its held-out batches and its one-line data report."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from automodel_ckpt.config.instantiate import instantiate
from automodel_ckpt.data.stream.corpus import Corpus, is_streamed
from automodel_ckpt.data.stream.loader import StreamLoader, worker_lanes
from automodel_ckpt.data.stream.stream import StreamSettings
from automodel_ckpt.data.stream.validation import validation_batches, validation_rows
from automodel_ckpt.errors import ConfigError, expect


def stream_settings(cfg: DictConfig) -> StreamSettings:
    """The stream's settings from the ``data:`` keys (the records rendered as the up-front path renders them)."""
    from automodel_ckpt.data.pipeline import data_spec

    d = cfg.data
    return StreamSettings(seq_length=int(d.seq_length), seed=int(cfg.seed), shuffle=bool(d.shuffle),
                          shuffle_buffer=int(d.shuffle_buffer), skip_bad_rows=int(d.skip_bad_rows),
                          text_field=str(d.text_field), spec=data_spec(cfg), max_record_bytes=int(d.max_record_bytes))


def streamed_corpus_of(cfg: DictConfig, section: str) -> Corpus:
    corpus = instantiate(cfg[section], section)
    if not isinstance(corpus, Corpus):
        raise ConfigError(f"{section}: a streamed target must return a corpus, got {type(corpus).__name__}")
    return corpus


def build_streamed(cfg: DictConfig, tokenizer: Any, dims: Any, log_ids: bool) -> tuple[StreamLoader, str]:
    """``(loader, report line)`` of the streamed ``dataset:``, read in lanes over the data-parallel ranks."""
    lanes = cfg.data.lanes
    expect(isinstance(lanes, int) and not isinstance(lanes, bool) and lanes >= 1, "data.lanes", "a positive integer",
           lanes)
    corpus = streamed_corpus_of(cfg, "dataset")
    shards = corpus.list_shards(lanes=lanes)
    settings = stream_settings(cfg)
    sched = cfg.step_scheduler
    loader = StreamLoader(corpus, shards, tokenizer, settings, global_batch_size=sched.global_batch_size,
                          local_batch_size=sched.local_batch_size, dp_rank=dims.dp_rank, dp_size=dims.dp_size,
                          num_workers=int(cfg.data.num_workers), allow_appended_shards=bool(cfg.data.allow_appended_shards),
                          lanes=lanes, gather=dims.sum_over_dp, log_ids=log_ids)
    files = len({x.path for s in shards for x in s})
    units = sum(len(s) for s in shards)
    size = sum(x.size for s in shards for x in s if x.first == 0 or x.stop < 0)
    blend = f" in {len(shards)} sources (weights {', '.join(f'{s.weight:g}' for s in corpus.sources)})" \
        if len(shards) > 1 else ""
    report = (f"data: streamed corpus of {files} files ({size / 2**20:.1f} MiB){blend} -> sequences of "
              f"{settings.seq_length} tokens (documents joined by EOS), shuffle buffer "
              f"{settings.shuffle_buffer if settings.shuffle else 'off'}; {lanes_line(loader, units)}")
    return loader, report


def streamed_validation(cfg: DictConfig, tokenizer: Any, dims: Any) -> tuple[list | None, str]:
    """``(this rank's held-out micro-batches or None, report suffix)``: a streamed ``validation_dataset:`` read once."""
    if cfg.validation_dataset is None:
        return None, ""
    if not is_streamed(cfg.validation_dataset):
        raise ConfigError("validation_dataset: with a streamed dataset, the validation corpus is streamed too "
                          "(_target_: automodel_ckpt.data.stream.corpus.streamed_corpus)")
    rows, labels = validation_rows(streamed_corpus_of(cfg, "validation_dataset"), tokenizer, stream_settings(cfg))
    if not len(rows):
        return None, ""
    val = validation_batches(rows, labels, local_batch_size=cfg.step_scheduler.local_batch_size, rank=dims.dp_rank,
                             world_size=dims.dp_size)
    return val, f"; validation {len(rows)} sequences"


def lanes_line(loader: StreamLoader, units: int) -> str:
    """How the lanes are read: units, lanes per rank, the redundancy, lanes per worker."""
    per_rank = len(loader.my_lanes)
    again = loader.redundancy
    shared = f"each lane read by {again} ranks" if again > 1 else "each lane read once"
    workers = loader.num_workers
    per_worker = ""
    if workers > 1:
        most = max(len(worker_lanes(loader.dp_rank, loader.dp_size, w, workers, loader.lanes)) for w in range(workers))
        per_worker = f", {most} lanes per worker" + (" (workers share lanes: dp x num_workers does not divide "
                                                    "data.lanes)" if most * workers > per_rank else "")
    few = f"; only {units} units for {loader.lanes} lanes: lanes share units" if units < loader.lanes else ""
    return (f"{loader.lanes} lanes over {units} units, this rank reads {per_rank} ({shared}), "
            f"{workers} workers per rank{per_worker}{few}")
