"""The next-token loss shifts the labels, not the logits: the same value and gradients as the loss that sliced the
logits (padded, packed and chat batches; float32 and bf16), and no float32 copy of the logits kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from automodel_ckpt.data.tokenize import IGNORE_INDEX
from automodel_ckpt.training import loss as loss_module
from automodel_ckpt.training.loss import next_token_loss_sum


def _sliced(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss as it was computed before: the logits' last position sliced off, a float32 copy."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def _labels(kind: str, rows: int, length: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, vocab, (rows, length), generator=g)
    if kind == "padded":  # each row's padding at its end is ignored
        for r in range(rows):
            labels[r, length - 3 * r - 1:] = IGNORE_INDEX
    elif kind == "chat":  # the prompt and the user turns are ignored, the assistant turns scored
        labels[:, : length // 3] = IGNORE_INDEX
        labels[:, length // 2: length // 2 + 4] = IGNORE_INDEX
    return labels  # packed: every position scored


@pytest.mark.parametrize("kind", ["padded", "packed", "chat"])
@pytest.mark.parametrize("vocab,chunk", [(48, 1 << 23), (3000, 5000)])  # one chunk; several chunks of rows
@pytest.mark.parametrize("ask_host", [{"cpu"}, set()])  # ignored rows found by the host, or masked as on a GPU
def test_the_loss_and_its_gradients_are_those_of_the_sliced_logits(kind, vocab, chunk, ask_host, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", {"cpu": chunk})
    monkeypatch.setattr(loss_module, "ASK_HOST", ask_host)
    logits = torch.randn(3, 21, vocab, generator=torch.Generator().manual_seed(1), requires_grad=True)
    labels = _labels(kind, 3, 21, vocab)
    want = _sliced(logits, labels)
    (want * 0.3).backward()
    want_grad, logits.grad = logits.grad.clone(), None
    got = next_token_loss_sum(logits, labels, IGNORE_INDEX)
    (got * 0.3).backward()
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(logits.grad, want_grad, rtol=1e-6, atol=1e-7)
    with torch.no_grad():  # validation: the value alone
        assert next_token_loss_sum(logits, labels, IGNORE_INDEX).item() == pytest.approx(want.item(), rel=1e-6)


def test_bf16_logits_give_the_float32_loss():
    logits = torch.randn(2, 17, 300, generator=torch.Generator().manual_seed(2)).bfloat16().requires_grad_()
    labels = _labels("chat", 2, 17, 300)
    assert next_token_loss_sum(logits, labels, IGNORE_INDEX).item() == pytest.approx(_sliced(logits, labels).item(),
                                                                                      rel=1e-6)


def _saved_bytes(fn) -> int:
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_keeps_one_tensor_of_the_logits_size_and_dtype(dtype):
    logits = torch.randn(4, 32, 512, dtype=dtype, requires_grad=True)
    labels = _labels("packed", 4, 32, 512)
    size = logits.numel() * logits.element_size()
    kept = _saved_bytes(lambda: next_token_loss_sum(logits, labels, IGNORE_INDEX))
    before = _saved_bytes(lambda: _sliced(logits, labels))
    assert size <= kept < size * 1.01  # the gradient, in the logits' own dtype
    assert before >= logits.numel() * 4  # what the sliced loss kept: float32 log-probabilities
    assert kept < before


def test_a_second_backward_through_the_loss_is_refused():
    logits = torch.randn(1, 5, 7, requires_grad=True)
    loss = next_token_loss_sum(logits, torch.randint(0, 7, (1, 5)), IGNORE_INDEX)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # never a wrong gradient
        loss.backward()
