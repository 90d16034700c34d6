"""How a writer writes (format, names, background, export, retention): the durable tier's settings or a local step's."""

from __future__ import annotations

from operator import attrgetter

from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.ondisk.retention import RetentionPolicy


class WriteSettings:
    """What a ``SaveWriter`` reads of the ``checkpoint:`` section: as it says (durable), or ``node_local``'s choices."""

    def __init__(self, cfg: CheckpointConfig, *, node_local: bool = False) -> None:
        self._cfg, self.node_local = cfg, node_local

    @classmethod
    def for_node_local(cls, cfg: CheckpointConfig) -> WriteSettings:
        """A node-local step: in the background, never exported, default names, the ``local.keep`` newest kept."""
        return cls(cfg, node_local=True)

    model_save_format = property(attrgetter("_cfg.model_save_format"))
    write_threads = property(attrgetter("_cfg.async_write_threads"),
                             doc="Background writer threads per rank (None: ``overlap.default_write_threads``).")
    nice = property(attrgetter("_cfg.async_nice"), doc="The background threads' priority: idle, or a niceness added.")

    @property
    def name_template(self) -> str:
        return CheckpointConfig.name_template if self.node_local else self._cfg.name_template

    @property
    def is_async(self) -> bool:
        """Copy now, write in the background (where torch allows it: ``overlap.async_supported``)."""
        return self.node_local or (bool(self._cfg.is_async) and bool(self._cfg.enabled))

    @property
    def incremental(self) -> bool:
        """The model's stable tensors apart, hard-linked from the last checkpoint when unchanged (durable tier)."""
        return not self.node_local and bool(self._cfg.incremental)

    @property
    def save_consolidated(self) -> str:
        """final | every | false: when the model is exported inline."""
        return "false" if self.node_local else self._cfg.save_consolidated

    @property
    def retention(self) -> RetentionPolicy:
        if self.node_local:
            return RetentionPolicy(max_recent=self._cfg.local.keep)
        return RetentionPolicy.from_config(self._cfg)
