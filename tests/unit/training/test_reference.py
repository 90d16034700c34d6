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
    StoredLogProbs("abc", {"train": table}).save(file, tmp_path)
    assert [p.name for p in file.parent.iterdir()] == ["abc.pt"]  # no temporary file left
    kw = {"root": tmp_path, "pairs": {"train": 3}}
    assert StoredLogProbs.load(file, "other", **kw) is None and StoredLogProbs.load(tmp_path / "none.pt", "abc", **kw) is None
    chosen, rejected = StoredLogProbs.load(file, "abc", **kw).lookup("train", torch.tensor([2, -1, 0]))
    assert chosen.tolist() == [-3.0, 0.0, -1.0] and rejected.tolist() == [-6.0, 0.0, -4.0]


def test_a_stored_table_is_checked_before_use_and_refused_in_one_line_naming_the_file(tmp_path):
    import os
    import pickle

    import pytest

    from automodel_ckpt.errors import CheckpointError

    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    file = run / "ref_log_probs" / "abc.pt"
    good = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], dtype=torch.float64)
    kw = {"root": run, "pairs": {"train": 3}}

    def refused(match):
        with pytest.raises(CheckpointError, match=match) as err:
            StoredLogProbs.load(file, "abc", **kw)
        assert str(file) in str(err.value) and "\n" not in str(err.value)

    cases = [
        ({"train": good[:, :2]}, r"shape \[2, 2\], this run has 3 pairs"),
        ({"train": torch.cat([good, good], 1)}, r"shape \[2, 6\], this run has 3 pairs"),
        ({"train": good.clone().index_fill_(1, torch.tensor([1]), float("nan"))}, r"not finite \(nan\).* pair 1"),
        ({"train": good.clone().index_fill_(1, torch.tensor([2]), float("-inf"))}, r"not finite \(-inf\).* pair 2"),
        ({"train": good.long()}, r"no 'train' table of numbers \(found a torch.int64 tensor\)"),
        ({"validation": good}, r"no 'train' table of numbers \(found nothing\)"),
    ]
    for tables, match in cases:
        StoredLogProbs("abc", tables).save(file, run)
        refused(match)
    torch.save([1, 2, 3], file)
    refused(r"not a table file \(it holds a list\)")

    class Boom:  # a pickle that would run code: the safe loader refuses it, nothing runs
        def __reduce__(self):
            return (os.system, (f"touch {outside / 'ran'}",))

    file.write_bytes(pickle.dumps({"key": "abc", "tables": Boom()}))
    refused("cannot be read")
    assert not (outside / "ran").exists()
    file.write_bytes(b"\0" * (2**20 + 100))
    refused(r"more than \d+ for 3 pairs")
    file.unlink()
    os.mkfifo(file)
    refused("cannot be read .*FIFO")  # opened without waiting: the test would hang otherwise
    file.unlink()
    torch.save({"key": "abc", "tables": {"train": good}}, outside / "abc.pt")
    os.symlink(outside / "abc.pt", file)
    refused("is a link")
    file.unlink()
    os.rmdir(file.parent)
    os.symlink(outside, file.parent)
    refused("outside the run folder")
    with pytest.raises(CheckpointError, match="outside the run folder"):
        StoredLogProbs("abc", {"train": good}).save(file, run)
    assert sorted(p.name for p in outside.iterdir()) == ["abc.pt"]  # nothing written there


def test_the_counters_of_a_checkpoint_are_checked_before_use():
    import pytest

    from automodel_ckpt.errors import CheckpointError
    from automodel_ckpt.algorithms.dpo.algorithm import PreferenceCounters

    counters = PreferenceCounters()
    counters.load_state_dict({"dpo_step": 3, "consumed_pairs": 12, "last_sync_step": None,
                              "ref_log_probs_key": "0123abcd"})
    assert (counters.dpo_step, counters.consumed_pairs, counters.ref_syncs) == (3, 12, 0)
    for state, match in [([1, 2], "the preference counters are a list, not a mapping"),
                         (torch.zeros(3), "the preference counters are a Tensor"),
                         ({"dpo_step": "3"}, "'dpo_step' is a string of 1 characters, not a count"),
                         ({"consumed_pairs": -1}, "'consumed_pairs' is the integer -1, not a count"),
                         ({"ref_syncs": 10**30}, "'ref_syncs' is an integer out of range"),
                         ({"dpo_step": True}, "'dpo_step' is a bool"),
                         ({"last_sync_step": 1.5}, "'last_sync_step' is a float, not a step"),
                         ({"reference_fingerprint": "../../etc"}, "'reference_fingerprint' is a string of 9")]:
        with pytest.raises(CheckpointError, match=match):
            PreferenceCounters().load_state_dict(state)
