"""The reference's pieces: the TR-DPO mix, the weights fingerprint, and the stored log-probs file and its key."""

from __future__ import annotations

import torch
from torch import nn

from automodel_ckpt.training.reference import StoredLogProbs, mix_into, weights_fingerprint


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(3, 2), nn.Linear(3, 2)


def test_the_mix_moves_the_reference_alpha_of_the_way_to_the_policy_and_changes_its_fingerprint():
    policy, reference = _pair()
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    printed = weights_fingerprint(reference)
    assert weights_fingerprint(reference) == printed  # a function of the values alone
    mix_into(reference, policy, 0.25)
    for name, param in reference.named_parameters():
        want = 0.75 * before[name] + 0.25 * dict(policy.named_parameters())[name].detach()
        assert torch.equal(param.detach(), want)
    assert weights_fingerprint(reference) != printed
    mix_into(reference, policy, 1.0)
    assert weights_fingerprint(reference) == weights_fingerprint(policy)


def test_stored_log_probs_round_trip_by_key_and_fillers_read_zero(tmp_path):
    table = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], dtype=torch.float64)
    file = tmp_path / "ref_log_probs" / "abc.pt"
    StoredLogProbs("abc", {"train": table}).save(file)
    assert [p.name for p in file.parent.iterdir()] == ["abc.pt"]  # no temporary file left
    assert StoredLogProbs.load(file, "other") is None and StoredLogProbs.load(tmp_path / "none.pt", "abc") is None
    chosen, rejected = StoredLogProbs.load(file, "abc").lookup("train", torch.tensor([2, -1, 0]))
    assert chosen.tolist() == [-3.0, 0.0, -1.0] and rejected.tolist() == [-6.0, 0.0, -4.0]
