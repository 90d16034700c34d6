"""GGUF export, checked in transformers' own GGUF reader: the logits and the chat tokens of the file read back.

Each family's tiny bf16 base is exported, then loaded with ``AutoModelForCausalLM.from_pretrained(...,
gguf_file=...)`` (which dequantizes with the ``gguf`` library and undoes llama.cpp's layout), and its logits are
compared with the base's own. Bounds, as a share of the largest logit: bf16 exact up to float32 summation order
(1e-5), f16 1e-3 (bf16 weights are exact in f16 but for their range), q8_0 5%, q4_0 50% (and above q8_0's error):
random tiny weights give nearly flat logits; the benchmark measures what quantization costs a trained model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from automodel_ckpt.export.gguf_export import plan_gguf, write_gguf
from automodel_ckpt.export.model_source import open_model
from automodel_ckpt.errors import UserError
from automodel_ckpt.models.tiny import CHAT_TEMPLATE, build_tokenizer, ensure_tiny_base

#: Families beside the default tiny Llama, with what transformers' GGUF reader needs of a tiny config (it reads
#: no head_dim for qwen3, no expert widths for the MoE families and only n_ctx for gpt2: the values it assumes are
#: used).
FAMILIES = {
    "qwen2": {"tie_word_embeddings": True},  # tied embeddings, q/k/v biases
    "qwen3": {"head_dim": 128},  # q/k norms
    "mistral": {},  # written as llama.cpp's converter does: the Llama architecture
    "phi3": {},  # fused qkv_proj / gate_up_proj
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 2, "max_position_embeddings": 1024},  # Conv1D, tied, position embeddings
    "starcoder2": {},  # LayerNorm, biases, a plain GELU MLP
    "gemma3_text": {},  # norms (1 + w) on q and k too, two rotary bases
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256},  # norms (1 + w), soft-capping, tied
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632},  # a shared expert and its gate beside the experts
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 768, "head_dim": 128,
                  "norm_topk_prob": True},  # experts stacked per layer
}
BOUND = {"bf16": 1e-5, "f16": 1e-3, "q8_0": 0.05, "q4_0": 0.5}
IDS = torch.tensor([[1, 5, 6, 40, 7, 8, 44, 12, 13, 45, 9]])
CHAT = [{"role": "user", "content": "12+34=?"}, {"role": "assistant", "content": "46"}]


def _family_base(family: str, folder: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer()
    if family == "phi3":  # llama.cpp's phi3 loader looks this token up by its text
        tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    kwargs = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": len(tok), "max_position_embeddings": 64,
              "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
              **FAMILIES[family]}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kwargs)).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_bases")
    out = {"llama": ensure_tiny_base(root / "llama")}
    return out | {family: _family_base(family, root / family) for family in FAMILIES}


def export(src: Path, out: Path, type_name: str) -> Path:
    with open_model(src) as source:
        write_gguf(source, plan_gguf(source, type_name), out, progress=False)
    return out


def logits_error(base: Path, gguf_file: Path) -> float:
    """Largest difference between the logits of the base and of the GGUF read back, as a share of the largest."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    read_back = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    with torch.no_grad():
        want, got = reference(IDS).logits, read_back(IDS).logits
    return ((want - got).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("type_name", ["bf16", "f16", "q8_0", "q4_0"])
def test_default_model_reads_back_with_its_logits(bases, type_name, tmp_path):
    error = logits_error(bases["llama"], export(bases["llama"], tmp_path / "m.gguf", type_name))
    assert error <= BOUND[type_name], error
    if type_name == "q4_0":
        q8 = logits_error(bases["llama"], export(bases["llama"], tmp_path / "q8.gguf", "q8_0"))
        assert q8 < error  # fewer bits, more error: the types are what they say


@pytest.mark.parametrize("family,type_name", [("qwen2", "q8_0"), ("qwen3", "f16"), ("mistral", "f16"),
                                              ("phi3", "q8_0"), ("gpt2", "f16"), ("qwen3_moe", "q8_0"),
                                              ("qwen3_moe", "bf16"), ("gemma2", "q8_0"),
                                              ("starcoder2", "q8_0"), ("qwen2_moe", "q8_0"),
                                              ("gemma3_text", "f16")])
def test_family_reads_back_with_its_logits(bases, family, type_name, tmp_path):
    error = logits_error(bases[family], export(bases[family], tmp_path / "m.gguf", type_name))
    assert error <= BOUND[type_name], error


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tokenizer_read_back_encodes_a_chat_as_the_export_does(bases, family, tmp_path):
    import gguf
    from transformers import AutoTokenizer

    out = export(bases[family], tmp_path / "m.gguf", "q8_0")
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    ours = build_tokenizer()
    assert tok.apply_chat_template(CHAT, tokenize=False) == ours.apply_chat_template(CHAT, tokenize=False)
    assert tok.apply_chat_template(CHAT)["input_ids"] == ours.apply_chat_template(CHAT)["input_ids"]
    assert tok("12+34= 46").input_ids == ours("12+34= 46").input_ids  # BOS added, the space a token of its own
    fields = gguf.GGUFReader(out).fields
    assert fields["tokenizer.chat_template"].contents() == CHAT_TEMPLATE
    assert fields["tokenizer.ggml.bos_token_id"].contents() == ours.bos_token_id


def test_checkpoint_export_folder_and_archive_give_the_same_file(bases, tmp_path):
    """A checkpoint's shards (2 ranks), its Hugging Face export and its archive: the same tensors and metadata."""
    import gguf

    from automodel_ckpt.export.archive_pack import pack
    from automodel_ckpt.export.plan import consolidate
    from tests.family_bases import checkpoint_of

    _, model_dir = checkpoint_of(bases["qwen3_moe"], tmp_path, "safetensors", noise=1e-2)
    folder = consolidate(model_dir, tmp_path / "export", progress=False)
    archive = pack(folder, tmp_path / "model.tar", progress=False) and tmp_path / "model.tar"
    files = [export(src, tmp_path / f"{i}.gguf", "q8_0") for i, src in enumerate([model_dir.parent, folder, archive])]
    readers = [gguf.GGUFReader(f) for f in files]
    first = readers[0]
    for other in readers[1:]:
        assert [t.name for t in other.tensors] == [t.name for t in first.tensors]
        for a, b in zip(first.tensors, other.tensors):
            assert a.tensor_type == b.tensor_type and bytes(a.data) == bytes(b.data), a.name
        keys = [k for k in first.fields if k != "general.name"]
        assert [k for k in other.fields if k != "general.name"] == keys
        assert all(first.fields[k].contents() == other.fields[k].contents() for k in keys)


def test_unknown_family_is_refused_before_any_work(tmp_path):
    from tests.family_bases import build_family_base

    base = build_family_base("gemma", tmp_path / "gemma", two_files=False)
    with open_model(base) as source, pytest.raises(UserError, match="does not know the model family 'gemma'"):
        plan_gguf(source, "q8_0")
    assert not list(tmp_path.glob("*.gguf"))


def test_plan_counts_tensors_and_bytes(bases):
    from gguf import GGMLQuantizationType as Q

    with open_model(bases["llama"]) as source:
        plan = plan_gguf(source, "q4_0")
        with pytest.raises(UserError, match="unknown GGUF type 'q3'"):
            plan_gguf(source, "q3")
    types = {t.name: q for t, q in plan.tensors}
    assert len(types) == 4 * 9 + 3  # 9 per layer, embedding, final norm, output
    assert types["blk.0.attn_q.weight"] == Q.Q4_0 and types["blk.0.attn_norm.weight"] == Q.F32
    assert types["token_embd.weight"] == types["output.weight"] == Q.Q8_0  # kept at 8 bits with q4_0
    assert plan.nbytes < source.nbytes / 2


def _lora_checkpoint(base, tmp_path):
    """A LoRA checkpoint of ``base`` (rank 4, lora_B nonzero so that merging changes the weights)."""
    from transformers import AutoModelForCausalLM

    from automodel_ckpt.ondisk.formats import peft as peft_format
    from automodel_ckpt.config.schema import PeftConfig
    from automodel_ckpt.models.lora import apply_lora

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), PeftConfig(rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    checkpoint = tmp_path / "epoch_0_step_4"
    peft_format.save_adapter(model, checkpoint / "model", rank=0, base_model_path=base)
    return checkpoint


def test_lora_checkpoint_exports_merged(bases, tmp_path, process_group):
    """A LoRA checkpoint (its model/ holds an adapter) exports its base with the adapter merged: the GGUF equals the
    GGUF of `merge-lora`'s folder, and differs from the base's."""
    import gguf

    from automodel_ckpt.export.lora_merge import merge_lora

    checkpoint = _lora_checkpoint(bases["llama"], tmp_path)
    from_checkpoint = export(checkpoint, tmp_path / "lora.gguf", "bf16")
    from_merged = export(merge_lora(checkpoint, tmp_path / "merged"), tmp_path / "merged.gguf", "bf16")
    from_base = export(bases["llama"], tmp_path / "base.gguf", "bf16")
    tensors = [{t.name: bytes(t.data) for t in gguf.GGUFReader(f).tensors}
               for f in (from_checkpoint, from_merged, from_base)]
    assert tensors[0] == tensors[1]
    assert tensors[0]["blk.0.attn_q.weight"] != tensors[2]["blk.0.attn_q.weight"]  # the adapter is in it
    assert tensors[0]["blk.0.ffn_up.weight"] == tensors[2]["blk.0.ffn_up.weight"]  # and only where it adapts


@pytest.mark.parametrize("family,most,threads", [("llama", 0, 1), ("qwen3_moe", 3, 1), ("llama", 3, 3)])
def test_tensors_are_read_one_output_tensor_at_a_time(bases, tmp_path, family, most, threads):
    """Streaming: when a tensor is read, no tensor read before is still alive, but those of the same GGUF tensor
    (the experts a stacked tensor is made of: 4 in this model), or, with threads, those converted beside it."""
    import weakref

    with open_model(bases[family]) as source:
        alive: list[weakref.ref] = []
        seen = []

        def reading(read):
            def wrapped():
                seen.append(sum(r() is not None for r in alive))
                tensor = read()
                alive.append(weakref.ref(tensor))
                return tensor
            return wrapped

        source.readers = {name: reading(read) for name, read in source.readers.items()}
        write_gguf(source, plan_gguf(source, "q8_0"), tmp_path / "m.gguf", progress=False, num_threads=threads)
    assert len(seen) == len(source.shapes) and max(seen) <= most
    if threads > 1:
        assert (tmp_path / "m.gguf").read_bytes() == export(bases[family], tmp_path / "one.gguf", "q8_0").read_bytes()


@pytest.mark.parametrize("type_name", ["BF16", "F16", "F32"])
def test_float_types_are_the_bytes_gguf_quants_writes(type_name):
    """The float types are cast by torch (threaded); the bytes are the ``gguf`` library's own quantizer's."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from automodel_ckpt.export.gguf_arch import OutputTensor
    from automodel_ckpt.export.gguf_export import _encode

    torch.manual_seed(0)
    value = torch.randn(64, 96) * torch.logspace(-6, 4, 96)  # rounding in every exponent range, ties included
    qtype = getattr(GGMLQuantizationType, type_name)

    class Source:
        def read(self, name: str) -> torch.Tensor:
            return value

    ours = _encode(OutputTensor("t.weight", (64, 96), ["t"]), qtype, Source())
    theirs = np.ascontiguousarray(quantize(value.numpy(), qtype)).view(np.uint8).reshape(-1)
    assert ours.tobytes() == theirs.tobytes()


def test_phi3_without_the_tokens_llama_cpp_needs_is_refused(tmp_path):
    from tests.family_bases import build_family_base

    base = build_family_base("phi3", tmp_path / "phi3", two_files=False)  # the character tokenizer alone
    with open_model(base) as source, pytest.raises(UserError, match=r"lacks <\|endoftext\|>"):
        write_gguf(source, plan_gguf(source, "q8_0"), tmp_path / "m.gguf", progress=False)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*"))


def test_lora_checkpoint_as_a_gguf_adapter(bases, tmp_path, process_group, capsys):
    """`--adapter`: llama.cpp's LoRA adapter format; scale x lora_b @ lora_a is what merging adds to the base's GGUF
    tensor (query rows permuted as the base's are), to within bf16 rounding of the two files."""
    import gguf
    from gguf.quants import dequantize

    from automodel_ckpt.cli import main

    checkpoint = _lora_checkpoint(bases["llama"], tmp_path)
    adapter = tmp_path / "lora.gguf"
    assert main(["export", str(checkpoint), "--adapter", "--type", "f16", "--out", str(adapter)]) == 0
    assert "GGUF LoRA adapter written" in capsys.readouterr().out
    reader = gguf.GGUFReader(adapter)
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    alpha = reader.fields["adapter.lora.alpha"].contents()
    factors = {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors}
    assert sorted(factors) == sorted(f"blk.{i}.{m}.weight.lora_{x}" for i in range(4) for m in ("attn_q", "attn_v")
                                     for x in "ab")
    a, b = torch.from_numpy(factors["blk.2.attn_q.weight.lora_a"]), torch.from_numpy(factors["blk.2.attn_q.weight.lora_b"])
    assert a.shape == (4, 128) and b.shape == (128, 4)
    merged = export(checkpoint, tmp_path / "merged.gguf", "f16")
    base = export(bases["llama"], tmp_path / "base.gguf", "f16")

    def q(path: Path) -> torch.Tensor:
        t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.2.attn_q.weight")
        return torch.from_numpy(dequantize(t.data, t.tensor_type).copy())

    delta = q(merged) - q(base)
    expected = alpha / 4 * (b @ a)
    assert delta.abs().max() > 0.01  # the adapter changes the weight
    assert (delta - expected).abs().max() <= 0.01 * q(base).abs().max()  # both files rounded to bf16 by the merge
    assert main(["export", str(bases["llama"]), "--adapter", "--type", "f16"]) != 0  # not a LoRA checkpoint
