"""Unit tests for the recipe loader (YAML + overrides + schema) and `_target_` instantiation."""

from __future__ import annotations

import enum
import pickle
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional

import pytest
import torch
from omegaconf import MISSING, DictConfig, OmegaConf

from automodel_ckpt.config.instantiate import instantiate, locate
from automodel_ckpt.config.loader import (
    load_config,
    load_yaml,
    parse_value,
    resolve,
    split_overrides,
    to_yaml,
)
from automodel_ckpt.errors import ConfigError, UserError


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"


@dataclass
class StepScheduler:
    max_steps: int = 10
    lr_scale: float = 1.0
    shuffle: bool = True
    name: str = "run"
    tag: Optional[str] = None
    milestones: List[int] = field(default_factory=lambda: [1, 2])
    mode: Literal["steps", "epochs"] = "steps"
    precision: Precision = Precision.FP32


@dataclass
class Data:
    path: str = MISSING
    seq_length: int = 32


@dataclass
class Recipe:
    seed: int = 42
    step_scheduler: StepScheduler = field(default_factory=StepScheduler)
    data: Data = field(default_factory=lambda: Data(path="/tmp/data"))
    optimizer: Dict[str, Any] = field(
        default_factory=lambda: {"_target_": "torch.optim.AdamW", "lr": 1e-3, "betas": [0.9, 0.95]}
    )
    validation: Optional[Data] = None
    notes: Optional[Dict[str, Any]] = None


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    return write(tmp_path, """\
        seed: 7
        step_scheduler:
          max_steps: 100
        optimizer:
          lr: 1e-4
        """)


# ---------------------------------------------------------------- overrides and values


def test_split_overrides_both_syntaxes_and_negative_values() -> None:
    argv = ["--step_scheduler.max_steps", "5", "--optimizer.lr=1e-4", "--optimizer.weight-decay", "-1", "--a.b=x=y"]
    assert split_overrides(argv) == [
        ("step_scheduler.max_steps", "5"),
        ("optimizer.lr", "1e-4"),
        ("optimizer.weight-decay", "-1"),
        ("a.b", "x=y"),
    ]
    assert split_overrides(["--name", "--weird"]) == [("name", "--weird")]


def test_split_overrides_errors() -> None:
    with pytest.raises(ConfigError, match=r"--a\.b needs a value"):
        split_overrides(["--a.b"])
    with pytest.raises(ConfigError, match="'stray'"):
        split_overrides(["--a", "1", "stray"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("null", None),
        ("1e-4", 1e-4),
        ("3E5", 3e5),
        ("-2.5e-3", -2.5e-3),
        ("1.0e5", 1e5),
        ("7", 7),
        ("-1", -1),
        ("[1,2]", [1, 2]),
        ("true", True),
        ("True", True),
        ("abc", "abc"),
        ("${oc.env:HOME}", "${oc.env:HOME}"),
        ("${a.b}-x", "${a.b}-x"),
        ("", ""),
        ("'5'", "5"),
        ("2024-01-01", "2024-01-01"),
    ],
)
def test_parse_value(text: str, expected: Any) -> None:
    value = parse_value(text)
    assert value == expected and type(value) is type(expected)


def test_overrides_applied(recipe: Path) -> None:
    cfg = load_config(recipe, ["--step_scheduler.max_steps", "5", "--optimizer.lr=2e-5", "--step_scheduler.tag",
                               "null", "--step_scheduler.milestones", "[3,4]", "--step_scheduler.shuffle", "false",
                               "--optimizer.eps", "1e-8", "--step_scheduler.precision", "BF16"], Recipe)
    assert cfg.seed == 7
    assert cfg.step_scheduler.max_steps == 5
    assert cfg.optimizer.lr == 2e-5 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.eps == 1e-8  # new key inside an open Dict section
    assert cfg.optimizer.betas == [0.9, 0.95]  # YAML merged into the default section
    assert cfg.step_scheduler.tag is None
    assert list(cfg.step_scheduler.milestones) == [3, 4]
    assert cfg.step_scheduler.shuffle is False
    assert cfg.step_scheduler.precision is Precision.BF16
    # tuples are accepted too, and OmegaConf-style coercion of "5" to int is fine
    cfg = load_config(recipe, [("step_scheduler.max_steps", "'5'")], Recipe)
    assert cfg.step_scheduler.max_steps == 5
    # a str field keeps the text as typed instead of YAML's reading of it
    assert load_config(recipe, ["--step_scheduler.name", "no"], Recipe).step_scheduler.name == "no"
    assert load_config(recipe, ["--step_scheduler.tag=017"], Recipe).step_scheduler.tag == "017"


def test_yaml_exponent_float_in_open_section(recipe: Path) -> None:
    cfg = load_config(recipe, [], Recipe)
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)
    assert load_yaml(recipe)["optimizer"]["lr"] == 1e-4


def test_optional_section_filled_from_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "validation:\n  path: /v\nnotes:\n  a: 1\n")
    cfg = load_config(path, ["--notes.b.c", "2"], Recipe)
    assert cfg.validation.path == "/v" and cfg.validation.seq_length == 32
    assert cfg.notes == {"a": 1, "b": {"c": 2}}


def test_new_target_replaces_section_kwargs(tmp_path: Path) -> None:
    path = write(tmp_path, "optimizer:\n  _target_: torch.optim.SGD\n  lr: 0.1\n")
    cfg = load_config(path, [], Recipe)
    assert dict(cfg.optimizer) == {"_target_": "torch.optim.SGD", "lr": 0.1}


# ---------------------------------------------------------------- errors


def test_unknown_key_in_yaml_suggests_and_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 1\nstep_scheduler:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, [], Recipe)
    msg = str(err.value)
    assert "unknown key 'step_scheduler.max_stepz' (did you mean 'step_scheduler.max_steps'?)" in msg
    assert f"{path}:3" in msg and "\n" not in msg


def test_unknown_key_in_override_suggests(recipe: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'step_scheduler\.max_stepz' \(did you mean "
                                          r"'step_scheduler\.max_steps'\?\) \(from --step_scheduler\.max_stepz\)"):
        load_config(recipe, ["--step_scheduler.max_stepz", "3"], Recipe)


def test_unknown_key_elsewhere_and_no_match(recipe: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'max_steps' \(did you mean 'step_scheduler\.max_steps'\?\)"):
        load_config(recipe, ["--max_steps", "3"], Recipe)
    with pytest.raises(ConfigError, match=r"unknown key 'data\.zzz'; valid keys in 'data': data\.path, data\.seq"):
        load_config(recipe, ["--data.zzz", "3"], Recipe)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("step_scheduler.max_steps", "abc", "step_scheduler.max_steps: expected int, got 'abc' (str)"),
        ("step_scheduler.lr_scale", "fast", "step_scheduler.lr_scale: expected float, got 'fast' (str)"),
        ("step_scheduler.shuffle", "maybe", "step_scheduler.shuffle: expected bool, got 'maybe' (str)"),
        ("step_scheduler.name", "null", "step_scheduler.name: expected str, got null"),
        ("step_scheduler.tag", "[1]", "step_scheduler.tag: expected str or null, got [1] (list)"),
        ("step_scheduler.milestones", "[1,x]", "step_scheduler.milestones: expected a list of int, got [1, 'x'] (list)"),
        ("step_scheduler.mode", "hours", "step_scheduler.mode: expected one of 'steps', 'epochs', got 'hours' (str)"),
        ("step_scheduler.precision", "fp8", "expected Precision (one of FP32, BF16), got 'fp8' (str)"),
        ("step_scheduler", "3", "step_scheduler: expected a StepScheduler mapping, got 3 (int)"),
    ],
)
def test_wrong_type_messages(recipe: Path, key: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(recipe, [f"--{key}={value}"], Recipe)
    assert expected in str(err.value)
    assert str(err.value).endswith(f"(from --{key})")


def test_wrong_type_in_yaml_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, "step_scheduler:\n  max_steps: abc\n")
    with pytest.raises(ConfigError, match=r"recipe\.yaml:2: step_scheduler\.max_steps: expected int, got 'abc'"):
        load_config(path, [], Recipe)


def test_missing_required_key(tmp_path: Path) -> None:
    path = write(tmp_path, "data:\n  path: ???\n")
    with pytest.raises(ConfigError, match=r"^missing required key 'data\.path'$"):
        load_config(path, [], Recipe)
    assert load_config(path, ["--data.path", "/d"], Recipe).data.path == "/d"


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 1\nstep_scheduler:\n  max_steps: 3\n  name: a: b\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(path)
    assert str(err.value) == f"{path}:4:10: mapping values are not allowed here"


def test_yaml_duplicate_key_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"recipe\.yaml:2:1: duplicate key 'seed'"):
        load_yaml(write(tmp_path, "seed: 1\nseed: 2\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_yaml(write(tmp_path, "- 1\n- 2\n"))
    assert load_yaml(write(tmp_path, "# nothing\n")) == {}


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"^recipe file not found: {missing}$") as err:
        load_config(missing, [], Recipe)
    assert isinstance(err.value, UserError)


# ---------------------------------------------------------------- interpolation, resolve, round trip


def test_env_interpolation_default_and_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "seed: ${oc.env:CKPT_TEST_SEED,5}\ndata:\n  path: ${oc.env:CKPT_TEST_DATA,/default}\n")
    monkeypatch.delenv("CKPT_TEST_SEED", raising=False)
    monkeypatch.delenv("CKPT_TEST_DATA", raising=False)
    cfg = load_config(path, [], Recipe)
    assert cfg.seed == 5 and cfg.data.path == "/default"
    monkeypatch.setenv("CKPT_TEST_SEED", "9")
    monkeypatch.setenv("CKPT_TEST_DATA", "/from/env")
    cfg = resolve(load_config(path, [], Recipe))
    assert cfg.seed == 9 and cfg.data.path == "/from/env"
    assert OmegaConf.to_container(cfg)["seed"] == 9  # no interpolation left


def test_interpolation_errors_name_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPT_TEST_UNSET", raising=False)
    path = write(tmp_path, "data:\n  path: ${oc.env:CKPT_TEST_UNSET}\n")
    with pytest.raises(ConfigError, match=r"^data\.path: cannot resolve"):
        load_config(path, [], Recipe)
    with pytest.raises(ConfigError, match=r"^step_scheduler\.name: cannot resolve"):
        load_config(write(tmp_path, "seed: 1\n"), ["--step_scheduler.name", "${nope.key}"], Recipe)
    with pytest.raises(ConfigError, match=r"^seed"):
        load_config(write(tmp_path, "seed: ${oc.env:CKPT_TEST_UNSET,abc}\n"), [], Recipe)


def test_resolve_and_to_yaml_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_TEST_NAME", "from-env")
    path = write(tmp_path, """\
        step_scheduler:
          name: ${oc.env:CKPT_TEST_NAME}
          tag: "${step_scheduler.name}-1e-4"
          precision: BF16
          mode: epochs
        data:
          path: '\\${literal}'
        optimizer:
          lr: 1e-4
          note: "1e-4"
          when: "2024-01-01"
        notes:
          empty: ""
          flag: "yes"
        """)
    cfg = load_config(path, ["--validation.path", "/v"], Recipe)
    resolved = resolve(cfg)
    assert resolved.step_scheduler.tag == "from-env-1e-4"
    assert resolved.data.path == "${literal}"
    text = to_yaml(cfg)
    assert "${oc.env" not in text and "CKPT_TEST_NAME" not in text
    saved = write(tmp_path, text, "config.yaml")
    monkeypatch.delenv("CKPT_TEST_NAME")
    again = load_config(saved, [], Recipe)
    assert again == resolved
    assert again.optimizer.note == "1e-4" and again.optimizer.lr == 1e-4
    assert again.notes.flag == "yes"
    assert to_yaml(again) == text


# ---------------------------------------------------------------- locate / instantiate


def test_locate_dotted_nested_and_errors() -> None:
    assert locate("torch.optim.AdamW") is torch.optim.AdamW
    assert locate("os.path.join") is __import__("os").path.join
    assert locate("collections.OrderedDict.fromkeys") == __import__("collections").OrderedDict.fromkeys
    with pytest.raises(ConfigError, match=r"^cannot import 'x\.y\.Z' for model\._target_: No module named 'x'$"):
        locate("x.y.Z", "model._target_")
    with pytest.raises(ConfigError, match=r"'torch\.optim' has no attribute 'AdamWW' \(did you mean 'AdamW'\?\)"):
        locate("torch.optim.AdamWW")


def test_locate_file_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, """\
        from dataclasses import dataclass

        @dataclass
        class Point:
            x: int = 0
            y: int = 0

            @classmethod
            def origin(cls):
                return cls()
        """, "shapes.py")
    monkeypatch.chdir(tmp_path)
    point_cls = locate("shapes.py:Point")
    assert locate(f"{tmp_path}/shapes.py:Point") is point_cls  # same module, loaded once
    assert locate("./shapes.py:Point.origin")() == point_cls()
    assert point_cls.__module__ in sys.modules
    assert pickle.loads(pickle.dumps(point_cls(1, 2))) == point_cls(1, 2)
    with pytest.raises(ConfigError, match=r"file not found: nope\.py"):
        locate("nope.py:Point", "model._target_")
    with pytest.raises(ConfigError, match="has no attribute 'Pointt'"):
        locate("shapes.py:Pointt")


def build_pair(a: int, b: int = 2, *, scale: float = 1.0) -> tuple[float, float]:
    return a * scale, b * scale


class Opaque:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


def test_instantiate_checks_kwargs() -> None:
    here = f"{__name__}.build_pair"
    assert instantiate({"_target_": here, "a": 1, "scale": 2.0}, "pair") == (2.0, 4.0)
    assert instantiate(OmegaConf.create({"_target_": here, "a": 1}), "pair", b=5) == (1.0, 5.0)
    assert instantiate({"_target_": here, "b": 3}, "pair", 4) == (4.0, 3.0)
    with pytest.raises(ConfigError, match=rf"^unknown key 'pair\.scal' for {here} \(did you mean 'pair\.scale'\?\)$"):
        instantiate({"_target_": here, "a": 1, "scal": 2.0}, "pair")
    with pytest.raises(ConfigError, match=r"unknown key 'pair\.zzz' for .* \(valid keys: pair\.a, pair\.b"):
        instantiate({"_target_": here, "a": 1, "zzz": 2.0}, "pair")
    with pytest.raises(ConfigError, match=rf"^missing required key 'pair\.a' for {here}$"):
        instantiate({"_target_": here}, "pair")
    with pytest.raises(ConfigError, match=r"^missing required key 'pair\._target_'$"):
        instantiate({"a": 1}, "pair")
    opaque = instantiate({"_target_": f"{__name__}.Opaque", "anything": 1}, "thing", 7)
    assert opaque.args == (7,) and opaque.kwargs == {"anything": 1}


def test_instantiate_recursive_and_plain_containers() -> None:
    node = OmegaConf.create({"_target_": f"{__name__}.Opaque", "inner": {"_target_": f"{__name__}.Opaque", "v": 1},
                             "items": [1, {"k": "${items.0}"}]})
    flat = instantiate(node, "outer")
    assert flat.kwargs["inner"] == {"_target_": f"{__name__}.Opaque", "v": 1}
    assert flat.kwargs["items"] == [1, {"k": 1}] and type(flat.kwargs["items"]) is list
    deep = instantiate(node, "outer", recursive=True)
    assert isinstance(deep.kwargs["inner"], Opaque) and deep.kwargs["inner"].kwargs == {"v": 1}


def test_instantiate_torch_adamw_with_params(recipe: Path) -> None:
    cfg = load_config(recipe, ["--optimizer.weight_decay", "0.1"], Recipe)
    model = torch.nn.Linear(2, 2)
    opt = instantiate(cfg.optimizer, "optimizer", model.parameters())
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["lr"] == 1e-4 and group["weight_decay"] == 0.1 and tuple(group["betas"]) == (0.9, 0.95)
    with pytest.raises(ConfigError, match=r"^unknown key 'optimizer\.lrr' for torch\.optim\.AdamW "
                                          r"\(did you mean 'optimizer\.lr'\?\)$"):
        instantiate({"_target_": "torch.optim.AdamW", "lrr": 1.0}, "optimizer", model.parameters())
    with pytest.raises(ConfigError, match=r"^optimizer: torch\.optim\.AdamW: .*learning rate"):
        instantiate({"_target_": "torch.optim.AdamW", "lr": -1.0}, "optimizer", model.parameters())


def test_config_is_dictconfig(recipe: Path) -> None:
    assert isinstance(load_config(recipe, [], Recipe), DictConfig)


def test_the_tiny_preference_and_rl_recipes_save_beside_the_quickstarts_sft_run() -> None:
    """After the quickstart (``tiny_llama_sft.yaml`` into ``checkpoints/``), the DPO and GRPO recipes run as the
    docs give them: each into a folder of its own, not refused as a checkpoint of another run."""
    recipes = Path(__file__).resolve().parents[3] / "recipes"
    folders = {name: OmegaConf.load(recipes / f"tiny_llama_{name}.yaml").checkpoint.checkpoint_dir.rstrip("/")
               for name in ("sft", "dpo", "grpo")}
    assert folders == {"sft": "checkpoints", "dpo": "checkpoints/dpo", "grpo": "checkpoints/grpo"}
