"""Builds the model (causal LM or image-text-to-text) and tokenizer a recipe trains, from a local HF folder or a config."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel_ckpt.errors import ConfigError, first_line

if TYPE_CHECKING:  # transformers and torch load lazily: the launcher validates recipes without them
    import torch
    from transformers import PreTrainedModel

EMBEDDED_BASES = ("tiny_llama", "tiny_llava")
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def resolve_dtype(name: str) -> "torch.dtype":
    import torch

    try:
        return getattr(torch, _DTYPES[str(name).lower()])
    except KeyError:
        raise ConfigError(f"model.dtype: expected one of {', '.join(_DTYPES)}, got '{name}'") from None


DEFAULT_MODEL_TYPE = "llama"  # the family of a `model.config` that names none


def local_model_path(path: str | None) -> Path | None:
    """The local folder of ``path`` (a folder, or a cached hub id's snapshot), else None."""
    if not path:
        return None
    p = Path(path).expanduser()
    if (p / "config.json").exists():
        return p
    if p.is_absolute() or p.exists() or str(path).count("/") > 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(path), "config.json")
    except Exception:  # not a valid hub id
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def ensure_embedded_base(name: str, path: str) -> Path:
    """Create the embedded base model ``name`` at ``path`` if it is not there yet."""
    if name not in EMBEDDED_BASES:
        raise ConfigError(f"model.embedded: unknown embedded base '{name}' (available: {', '.join(EMBEDDED_BASES)})")
    if name == "tiny_llava":
        from automodel_ckpt.models.tiny_vlm import ensure_tiny_vlm_base

        return ensure_tiny_vlm_base(path)
    from automodel_ckpt.models.tiny import ensure_tiny_base

    return ensure_tiny_base(path)


def check_model_source(pretrained_model_name_or_path: str | None, config: dict | None, embedded: str | None, *,
                       offline_ok: bool = False) -> str:
    """One line when the model can be neither read nor downloaded (``offline_ok``: only said); else where it lies."""
    if config is None and not pretrained_model_name_or_path:
        raise ConfigError("model: set model.pretrained_model_name_or_path (a local HF folder) or a model.config block")
    if config is not None and pretrained_model_name_or_path:
        raise ConfigError(
            "model: both model.config (a new model, initialised from the seed) and model.pretrained_model_name_or_path "
            f"('{pretrained_model_name_or_path}', a folder's weights) are set; to build from model.config set "
            "model.pretrained_model_name_or_path null (and tokenizer.pretrained_model_name_or_path to a tokenizer), "
            "else remove model.config")
    if config is not None:
        return "model: built from model.config (seeded initialisation)"
    if embedded:
        return f"model: embedded base '{embedded}' (created at '{pretrained_model_name_or_path}' on first use)"
    from automodel_ckpt.models.hub import model_source

    source = model_source(str(pretrained_model_name_or_path), "model.pretrained_model_name_or_path")
    if not offline_ok:
        source.require_available()
    return f"model.pretrained_model_name_or_path {source.describe()}"


def build_causal_lm(pretrained_model_name_or_path: str | None = None, config: dict[str, Any] | None = None,
                    embedded: str | None = None, dtype: str = "float32", attn_implementation: str | None = None,
                    seed: int = 0, on_meta: bool = False) -> PreTrainedModel:
    """A causal LM with parameters in ``dtype``: from ``config`` and ``seed``, else read from the folder (an
    ``embedded`` base is created there on first use); ``on_meta``: without weights (``models/materialize.py``)."""
    from transformers import AutoModelForCausalLM

    return _build(AutoModelForCausalLM, pretrained_model_name_or_path, config, embedded, dtype, attn_implementation,
                  seed, on_meta)


def build_image_text_model(pretrained_model_name_or_path: str | None = None, config: dict[str, Any] | None = None,
                           embedded: str | None = None, dtype: str = "float32", attn_implementation: str | None = None,
                           seed: int = 0, on_meta: bool = False) -> PreTrainedModel:
    """An image-text-to-text model (LLaVA, Qwen2-VL, ...), as :func:`build_causal_lm`."""
    from transformers import AutoModelForImageTextToText

    return _build(AutoModelForImageTextToText, pretrained_model_name_or_path, config, embedded, dtype,
                  attn_implementation, seed, on_meta)


def _build(auto_class: Any, pretrained_model_name_or_path: str | None, config: dict[str, Any] | None,
           embedded: str | None, dtype: str, attn_implementation: str | None, seed: int,
           on_meta: bool = False) -> PreTrainedModel:
    import torch
    from transformers import AutoConfig

    check_model_source(pretrained_model_name_or_path, config, embedded)
    torch_dtype = resolve_dtype(dtype)
    folder = None
    if config is not None:
        cfg_kwargs = dict(config)
        hf_config = AutoConfig.for_model(cfg_kwargs.pop("model_type", DEFAULT_MODEL_TYPE), **cfg_kwargs)
    else:
        assert pretrained_model_name_or_path is not None
        if embedded and local_model_path(pretrained_model_name_or_path) is None:
            ensure_embedded_base(embedded, pretrained_model_name_or_path)
        from automodel_ckpt.models.hub import model_folder

        folder = model_folder(pretrained_model_name_or_path)  # a Hub id: its snapshot, downloaded once if missing
        hf_config = AutoConfig.from_pretrained(folder)
    if attn_implementation:
        hf_config._attn_implementation = attn_implementation
    if on_meta:
        with torch.device("meta"):
            return auto_class.from_config(hf_config, dtype=torch_dtype)
    if folder is not None:
        return auto_class.from_pretrained(folder, config=hf_config, dtype=torch_dtype)
    torch.manual_seed(seed)
    return auto_class.from_config(hf_config).to(torch_dtype)


def no_folder_error(what: str = "tokenizer") -> ConfigError:
    """Neither ``tokenizer.pretrained_model_name_or_path`` nor a model folder to read the ``what`` from."""
    return ConfigError(f"tokenizer.pretrained_model_name_or_path: no {what} folder (set it, or use a model folder)")


def _from_folder(auto_class, path: str | None, what: str):
    if not path:
        raise no_folder_error(what)
    from automodel_ckpt.models.hub import is_hub_id, model_folder

    if is_hub_id(path):  # the same snapshot as the model's, downloaded once if missing
        path = str(model_folder(path, "tokenizer.pretrained_model_name_or_path", weights=False))
    try:
        return auto_class.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer: cannot load a {what} from '{path}': {first_line(exc)}") from None


def build_processor(path: str | None):
    """The Hugging Face processor (image processor + tokenizer + chat template) of an image-text model folder."""
    from transformers import AutoProcessor

    return _from_folder(AutoProcessor, path, "processor")


def build_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    return _from_folder(AutoTokenizer, path, "tokenizer")