"""The replicated model's gradient all-reduce: a bucket layout whose summation order is the same in every launch.

Why (DDP rebuilds its buckets after every launch's first step) and the two layouts: docs/parallelism.md.
"""

from __future__ import annotations

from typing import Any

#: Bucket caps in MB: a cap of 0 closes every bucket after one parameter; 2**40 holds any model in one bucket.
ONE_PARAMETER_BUCKETS = [0]
ONE_BUCKET = [2**40]


class ParameterOrder:
    """The comm hook's state: each parameter's place in ``model.parameters()`` (read at the first reduction)."""

    def __init__(self, model: Any) -> None:
        self.model, self.place = model, None

    def of(self, params: list) -> list[int]:
        if self.place is None:
            self.place = {id(p): i for i, p in enumerate(self.model.parameters())}
        return sorted(range(len(params)), key=lambda i: self.place[id(params[i])])


def canonical_all_reduce(state, bucket):  # no annotations: DDP checks them against its own types
    """DDP's comm hook: the bucket's gradients averaged, each element at its offset in the model's parameter order."""
    import torch
    import torch.distributed as dist

    grads = bucket.gradients()  # views into the bucket's buffer
    order = state.of(bucket.parameters())
    flat = torch.cat([grads[i].reshape(-1) for i in order])
    flat.div_(dist.get_world_size())
    future = dist.all_reduce(flat, async_op=True).get_future()

    def copy_back(done) -> Any:
        summed, offset = done.value()[0], 0
        for i in order:
            n = grads[i].numel()
            grads[i].copy_(summed[offset:offset + n].view_as(grads[i]))
            offset += n
        return bucket.buffer()

    return future.then(copy_back)


def replicate_model(model: Any) -> Any:
    """``model`` under torch's composable ``replicate`` with the layout for the default group's backend."""
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate

    if dist.get_backend() != "gloo":
        return replicate(model, bucket_cap_mb_list=list(ONE_PARAMETER_BUCKETS))
    model = replicate(model, bucket_cap_mb_list=list(ONE_BUCKET))
    model.register_comm_hook(ParameterOrder(model), canonical_all_reduce)
    return model
