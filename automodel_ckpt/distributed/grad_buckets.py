"""The replicated model's gradient all-reduce: a bucket layout whose summation order is the same in every launch.

An all-reduce sums each element in an order set by its offset in the buffer it reduces (the ring's chunks), and
from 3 ranks on that order changes the last bits. DDP lays out its first iteration's buckets in one order and then
rebuilds them in the order the gradients became ready; every launch, a resume included, runs its first step in the
first layout, so a resumed run would drift from a straight one. Two layouts keep every element at one offset:

- **One parameter per bucket** (a cap of 0 MB): an element's offset is its offset in its own gradient. The buckets
  are reduced as they fill, overlapped with the backward: the layout for GPUs (NCCL), where an all-reduce is cheap
  to start.
- **One bucket, reduced in the model's parameter order** (``canonical_all_reduce``): every gradient in one bucket
  whatever DDP's order in it, copied into one buffer in ``model.parameters()`` order, all-reduced once, copied
  back. Gloo's TCP all-reduce costs about a millisecond of CPU per call before it moves a byte (a tiny model's
  forty one-parameter buckets cost as much CPU as its step), so on CPUs one call a step is the fast layout.
"""

from __future__ import annotations

from typing import Any

#: Bucket caps in MB: a cap of 0 closes every bucket after one parameter; 2**40 holds any model in one bucket.
ONE_PARAMETER_BUCKETS = [0]
ONE_BUCKET = [2**40]


class ParameterOrder:
    """The comm hook's state: each parameter's place in ``model.parameters()`` (read at the first reduction, once
    the reducer holds the parameters the run trains)."""

    def __init__(self, model: Any) -> None:
        self.model, self.place = model, None

    def of(self, params: list) -> list[int]:
        if self.place is None:
            self.place = {id(p): i for i, p in enumerate(self.model.parameters())}
        return sorted(range(len(params)), key=lambda i: self.place[id(params[i])])


def canonical_all_reduce(state, bucket):  # no annotations: DDP checks them against its own types
    """DDP's comm hook (a ``ParameterOrder`` and a ``GradBucket``): the bucket's gradients averaged over the ranks
    (the default group, which ``replicate_model`` replicates over), each element at the offset the model's parameter
    order gives it, whatever order DDP laid the bucket out in."""
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
