"""The one choose-verify-fall-back loop of a restore, for every tier (node-local, durable, start) and every storage.

A tier chooses, the loop loads, and a failure while loading goes back to the tier: it sets the checkpoint aside and
is asked again (``AGAIN``), hands over (``NEXT``), or lets the failure stand (None).
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

from automodel_ckpt.errors import CheckpointError, first_line

LOCAL, DURABLE = "local", "durable"  # the tiers' names
AGAIN = "again"  # choose again in the same tier (the failed choice set aside)
NEXT = "next"  # leave this tier for the next one


class Tier(Protocol):
    """A tier's part in a restore. Every method is collective: each rank calls it, and each rank gets the same."""

    name: str  # "local" or "durable" (a weights-only start too): where the restore loaded from

    def choose(self, damage: str | None) -> Any | None:
        """What to load next (None: try the next tier); ``damage``: why the last choice failed loading."""

    def load(self, states: dict[str, Any], choice: Any) -> Any:
        """Load ``choice`` into ``states``; what was loaded (None: nothing, a fresh start)."""

    def failed(self, choice: Any, exc: CheckpointError) -> str | None:
        """``choice`` failed while loading: ``AGAIN`` or ``NEXT`` (after setting it aside), or None (raised)."""


def first_loaded(tiers: Iterable[Tier], states: dict[str, Any]) -> tuple[str, Any] | None:
    """Collective: ``(tier name, what it loaded)`` of the first tier whose choice loads; None when no tier chose."""
    for tier in tiers:
        damage = None
        while (choice := tier.choose(damage)) is not None:
            try:
                return tier.name, tier.load(states, choice)
            except CheckpointError as exc:
                verdict = tier.failed(choice, exc)
                if verdict is None:
                    raise
                if verdict == NEXT:
                    break
                damage = first_line(exc)
    return None
