"""distributed/grad_buckets.py: the replicated model's gradients reduced in one bucket, in the model's order."""

from __future__ import annotations

import torch
from torch import nn

from automodel_ckpt.distributed import grad_buckets


class _Bucket:
    """A GradBucket as DDP hands one to a hook: parameters in DDP's order, gradients as views into one buffer."""

    def __init__(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        self.params = params
        self.buf = torch.cat([g.reshape(-1) for g in grads])
        self.grads, offset = [], 0
        for g in grads:
            self.grads.append(self.buf[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def parameters(self):
        return self.params

    def gradients(self):
        return self.grads

    def buffer(self):
        return self.buf


def test_the_bucket_is_reduced_in_the_models_parameter_order_and_copied_back_in_ddps(process_group):
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 4))
    params = list(model.parameters())
    state = grad_buckets.ParameterOrder(model)
    ddp_order = [params[3], params[0], params[2], params[1]]  # as a rebuilt bucket might lay them out
    assert state.of(ddp_order) == [1, 3, 2, 0]  # the places in ddp_order of parameters 0, 1, 2, 3
    grads = [torch.full_like(p, float(i)) for i, p in enumerate(ddp_order)]
    bucket = _Bucket(ddp_order, grads)
    seen = []
    real = torch.distributed.all_reduce

    def recording(tensor, *args, **kwargs):
        seen.append(tensor.clone())
        return real(tensor, *args, **kwargs)

    torch.distributed.all_reduce = recording
    try:
        out = grad_buckets.canonical_all_reduce(state, bucket).wait()
    finally:
        torch.distributed.all_reduce = real
    [flat] = seen  # one call for the whole bucket, its elements in the model's order
    place_in_bucket = [next(i for i, q in enumerate(ddp_order) if q is p) for p in params]
    want = torch.cat([torch.full((p.numel(),), float(i)) for p, i in zip(params, place_in_bucket)])
    assert torch.equal(flat, want)
    assert out is bucket.buf and all(torch.equal(g, torch.full_like(g, float(i))) for i, g in enumerate(grads))


def test_on_gloo_a_replicated_model_has_one_bucket_and_the_gradients_of_the_unwrapped_one(process_group):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    wrapped = grad_buckets.replicate_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(5, 4)
    for _ in range(2):  # the first step in DDP's first layout, the second in the rebuilt one
        for m in (plain, wrapped):
            m.zero_grad()
            m(x).square().sum().backward()
        for a, b in zip(plain.parameters(), wrapped.parameters()):
            assert torch.equal(a.grad, b.grad)
    from torch.distributed._composable.replicate import replicate

    logged = replicate.state(wrapped)._ddp._get_ddp_logging_data()
    assert logged["comm_hook"] == "canonical_all_reduce" and logged["bucket_sizes"] == "232"  # one bucket: all
    assert logged["total_parameter_size_bytes"] == 232
