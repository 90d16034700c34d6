"""``collective.main_first``: a failure of rank 0 reaches the ranks waiting for it as one line, and each of them ends
with the code rank 0 ends with, so a launcher that sees a waiting rank end first reports rank 0's code."""

from __future__ import annotations

import pytest

from automodel_ckpt.distributed import collective, env
from automodel_ckpt.errors import UserError


@pytest.mark.parametrize("user, code", [(False, 1), (True, 2)])
def test_a_rank_waiting_for_rank_0_ends_with_rank_0s_code(monkeypatch, user, code):
    monkeypatch.setattr(env, "broadcast_object", lambda obj: (user, "AttributeError: no such column here"))
    with pytest.raises(UserError) as caught:
        collective.main_first(lambda: pytest.fail("made on rank 1 after rank 0 failed"), rank=1)
    assert caught.value.exit_code == code  # rank 0: an exception's 1, or bad input's 2
    assert caught.value.failed_rank == 0
    assert "no such column here" in str(caught.value)
