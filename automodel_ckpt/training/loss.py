"""The next-token loss: the labels are shifted, never the logits, and the vocabulary is taken in chunks of rows.

The loss and its gradient (softmax minus the one-hot target) are computed together, a chunk of rows at a time in
float32: the backward keeps one tensor of the logits' size and dtype, never a float32 copy of them all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Elements of logits taken at once (rows x vocabulary), by device: on CPU a float32 chunk of 4 MiB, which stays in
#: the caches between its passes; on a GPU 128 MiB, few enough chunks that launching their kernels costs nothing.
CHUNK_ELEMENTS = {"cpu": 1 << 20}
CHUNK_ELEMENTS_DEFAULT = 1 << 25
#: Devices where the gradient's ignored rows are found by asking the host whether there are any (free on CPU, and it
#: spares a pass over a chunk); elsewhere every chunk is masked on the device: asking would wait for it each chunk.
ASK_HOST = {"cpu"}


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The summed loss of each position's next token (``labels[:, t + 1]`` scored at ``logits[:, t]``), labels
    ``ignore_index`` left out; a float32 scalar with the gradient of the logits when they require one."""
    targets = F.pad(labels[:, 1:], (0, 1), value=ignore_index).flatten()
    flat = logits.flatten(0, 1)
    if hasattr(logits, "device_mesh"):  # a DTensor (tensor-parallel logits): torch's own loss handles its layout
        return F.cross_entropy(flat.float(), targets, ignore_index=ignore_index, reduction="sum")
    chunk = CHUNK_ELEMENTS.get(flat.device.type, CHUNK_ELEMENTS_DEFAULT)
    rows = max(1, chunk // max(flat.shape[-1], 1))
    if torch.is_grad_enabled() and flat.requires_grad:
        return _LossAndGradient.apply(flat, targets, ignore_index, rows)
    return sum((_chunk(flat[i:i + rows], targets[i:i + rows], ignore_index)[0] for i in range(0, len(flat), rows)),
               torch.zeros((), dtype=torch.float32, device=flat.device))


def _chunk(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
           grad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss of ``logits``' rows and, into ``grad``, its gradient (softmax - one-hot, 0 if ignored)."""
    keep = targets != ignore_index
    safe = targets.masked_fill(~keep, 0)[:, None]
    logp = torch.log_softmax(logits.float(), dim=-1)
    loss = -(logp.gather(1, safe).squeeze(1) * keep).sum()
    if grad is not None:  # softmax - one-hot, in float32: straight into a float32 gradient, else copied once
        probs = torch.exp(logp, out=grad) if grad.dtype == logp.dtype else logp.exp_()
        probs.scatter_add_(1, safe, -keep[:, None].to(probs.dtype))
        if probs.device.type not in ASK_HOST:  # every row masked: no host synchronisation per chunk
            probs.masked_fill_(~keep[:, None], 0)
        elif not bool(keep.all()):
            probs[~keep] = 0  # ignored rows only
        if probs is not grad:
            grad.copy_(probs)
    return loss, keep


class _LossAndGradient(torch.autograd.Function):
    """The summed loss, its gradient with respect to the logits computed in the same pass and kept for backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, rows: int) -> torch.Tensor:
        grad = torch.empty_like(logits)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for i in range(0, len(logits), rows):
            total += _chunk(logits[i:i + rows], targets[i:i + rows], ignore_index, grad[i:i + rows])[0]
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, upstream: torch.Tensor):
        (grad,) = ctx.saved_tensors
        # scaled in place: no second tensor of the logits' size (a second backward through the loss, with
        # retain_graph, is refused by autograd itself: the saved tensor changed)
        return grad.mul_(upstream.to(grad.dtype)), None, None, None
