"""A writer's settings: the durable tier reads the section live; a node-local step's fixed choices win over it."""

from automodel_ckpt.checkpoint import CheckpointConfig
from automodel_ckpt.checkpoint.save.settings import WriteSettings


def _cfg(**overrides):
    cfg = CheckpointConfig(checkpoint_dir="/tmp/x", is_async=False, save_consolidated="every",
                           name_template="s{step}", max_recent_checkpoints=7, model_save_format="torch_save",
                           async_write_threads=3, async_nice=5, **overrides)
    cfg.local.keep = 2
    return cfg


def test_durable_settings_are_the_section_read_at_each_save():
    cfg = _cfg()
    settings = WriteSettings(cfg)  # the durable tier's: as the section says
    assert (settings.model_save_format, settings.name_template, settings.is_async) == ("torch_save", "s{step}", False)
    assert (settings.write_threads, settings.nice, settings.save_consolidated) == (3, 5, "every")
    assert settings.retention.max_recent == 7
    cfg.name_template, cfg.is_async = "t{step}", True  # read live, as the checkpointer's config is
    assert (settings.name_template, settings.is_async) == ("t{step}", True)
    cfg.enabled = False
    assert not settings.is_async  # nothing is saved: nothing in the background


def test_a_local_step_is_in_the_background_unexported_default_named_and_keeps_local_keep():
    settings = WriteSettings.for_node_local(_cfg())
    assert settings.is_async and settings.save_consolidated == "false"
    assert settings.name_template == CheckpointConfig.name_template
    assert settings.retention.max_recent == 2 and settings.retention.top_k is None
    assert not settings.retention.keep_steps
    assert (settings.model_save_format, settings.write_threads, settings.nice) == ("torch_save", 3, 5)
