"""Sequence parallelism: the residual stream between the tensor-parallel regions split along the sequence.

Derived from the family's tensor-parallel plan, as torchtitan does for Llama; each style: docs/parallelism.md.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from torch import nn

from automodel_ckpt.distributed.plan_paths import module_paths
from automodel_ckpt.errors import ConfigError

#: Plan styles whose module gives the residual stream (their output becomes ``Shard(1)``).
ROWWISE = ("rowwise", "rowwise_split_input")
#: Plan styles a block may hold under sequence parallelism (besides the embedding's and the head's).
BLOCK_STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_split_input",
                "replicated_with_grad_allreduce")
HEAD_STYLES = ("colwise_gather_output", "colwise_rep")


def is_norm(module: nn.Module) -> bool:
    """A norm applied position by position: ``nn.LayerNorm``, or a class named ``...RMSNorm`` / ``...LayerNorm``."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _call_layouts(layer: nn.Module, child: str, family: str) -> dict[str, Any]:
    """How ``layer.forward`` passes the hidden states to ``layer.<child>`` (positional, keyword), or ``ConfigError``."""
    refuse = ConfigError(f"distributed.sequence_parallel: cannot tell how the '{family}' decoder layer passes the "
                         f"hidden states to its '{child}'; set sequence_parallel to false")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(layer).forward)))
    except (OSError, TypeError, SyntaxError):
        raise refuse from None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == child and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    forms = set()
    for call in calls:
        if any(isinstance(a, ast.Starred) for a in call.args):
            raise refuse
        if call.args:
            forms.add(("positional", len(call.args)))
        else:
            params = [p for p in inspect.signature(getattr(layer, child).forward).parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            keywords = {k.arg for k in call.keywords}
            if not params or params[0].name not in keywords:
                raise refuse
            forms.add(("keyword", params[0].name))
    if len(forms) != 1:
        raise refuse
    (kind, value), = forms
    return {kind: value}


def _gathered_input(layer: nn.Module, child: str, family: str, *, output: bool = False) -> Any:
    """The style gathering the hidden states ``layer`` passes ``layer.<child>`` (``output``: cut back after)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput

    call = _call_layouts(layer, child, family)
    if "positional" in call:
        rest = (None,) * (call["positional"] - 1)
        inputs = {"input_layouts": (Shard(1), *rest), "desired_input_layouts": (Replicate(), *rest)}
    else:
        inputs = {"input_kwarg_layouts": {call["keyword"]: Shard(1)},
                  "desired_input_kwarg_layouts": {call["keyword"]: Replicate()}}
    if not output:
        return PrepareModuleInput(**inputs, use_local_output=True)
    return PrepareModuleInputOutput(**inputs, use_local_input=True, output_layouts=Replicate(),
                                    desired_output_layouts=Shard(1), use_local_output=False)


def sequence_parallel_plan(model: nn.Module, plan: dict[str, str], experts: list[str], styles: dict[str, Any],
                           family: str) -> dict[str, Any]:
    """``{module path: style}``: ``plan`` with the residual stream split along the sequence (``experts``: the
    fused-experts patterns; ``styles``: each plan style's torch style); ``ConfigError`` for what it cannot place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    def refuse(reason: str) -> ConfigError:
        return ConfigError(f"distributed.sequence_parallel: the '{family}' model {reason}; set sequence_parallel "
                           "to false")

    lists = {k.split(".*.", 1)[0] for k in list(plan) + experts if ".*." in k}
    if len(lists) != 1:
        raise refuse("has no single list of decoder layers in its tensor-parallel plan")
    layers_path = lists.pop()
    layers = model.get_submodule(layers_path)
    base_path = layers_path.rpartition(".")[0]
    base = model.get_submodule(base_path)
    prefix = f"{base_path}." if base_path else ""

    concrete: dict[str, str] = {name: style for pattern, style in plan.items() for name in module_paths(model, pattern)}
    expert_names = [name for pattern in experts for name in module_paths(model, pattern)]
    out: dict[str, Any] = {}
    try:
        embedding = model.get_input_embeddings()
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = head = None
    modules = {id(m): name for name, m in model.named_modules()}
    embedding_name, head_name = modules.get(id(embedding)), modules.get(id(head))
    if embedding_name is None or head_name is None:
        raise refuse("has no input embedding or head to split the sequence after and gather it before")

    for name, style in concrete.items():  # the entries outside the decoder layers: the embedding and the head
        if name.startswith(f"{layers_path}."):
            continue
        if name == embedding_name and style == "embedding_rowwise":
            out[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
        elif name == head_name and style in HEAD_STYLES:
            out[name] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        else:
            raise refuse(f"splits {name} ({style}) outside its decoder layers")
    if embedding_name not in out:  # tied embeddings stay whole: their output is only cut
        out[embedding_name] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                  use_local_output=False)
    if head_name not in out:
        out[head_name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_output=True)
    for child_name, child in base.named_children():
        if is_norm(child):
            out[f"{prefix}{child_name}"] = SequenceParallel()

    for index, layer in enumerate(layers):
        path = f"{layers_path}.{index}"
        for child_name, child in layer.named_children():
            block = f"{path}.{child_name}"
            inside = {n: s for n, s in concrete.items() if n == block or n.startswith(f"{block}.")}
            moe = any(e == block or e.startswith(f"{block}.") for e in expert_names)
            if is_norm(child):
                out[block] = SequenceParallel()
            elif moe:  # whole experts: the block computes the whole output from the gathered input
                out[block] = _gathered_input(layer, child_name, family, output=True)
                out.update({n: styles[s]() for n, s in inside.items()})
            elif inside:
                odd = sorted({s for s in inside.values() if s not in BLOCK_STYLES})
                if odd or not any(s in ROWWISE for s in inside.values()):
                    raise refuse(f"splits {block} in a way sequence parallelism cannot follow "
                                 f"({', '.join(odd) or 'no rowwise projection'})")
                out[block] = _gathered_input(layer, child_name, family)
                for name, style in inside.items():
                    if style in ROWWISE:
                        split = {"input_layouts": Replicate()} if style == "rowwise_split_input" else {}
                        out[name] = RowwiseParallel(**split, output_layouts=Shard(1), use_local_output=False)
                    else:
                        out[name] = styles[style]()
            elif any(True for _ in child.parameters()):
                raise refuse(f"has a decoder-layer module its plan does not split ({child_name}: "
                             f"{type(child).__name__})")
    return out
