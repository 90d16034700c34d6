"""The rank-0 progress bar (step, loss, rate) and messages printed without breaking it."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total_steps: int, enabled: bool) -> None:
        self.total = total_steps
        self.enabled = enabled
        self._bar: tqdm | None = None

    def start(self, step: int) -> None:
        if self.enabled:
            self._bar = tqdm(total=self.total, initial=step, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr, mininterval=0.5)

    def update(self, step: int, loss: float, lr: float, shown: dict[str, float] | None = None) -> None:
        """The bar at ``step``: the loss, ``shown`` (an algorithm's numbers: GRPO's reward, DPO's accuracy), the lr."""
        if self._bar is not None:
            extra = "".join(f" {name}={value:.4f}" for name, value in (shown or {}).items())
            self._bar.set_postfix_str(f"loss={loss:.4f}{extra} lr={lr:.2e}", refresh=False)
            self._bar.update(step - self._bar.n)

    def write(self, message: str) -> None:
        """Print a message on stdout (rank 0 calls this) above the bar."""
        if self._bar is not None:
            self._bar.clear()
        print(message, flush=True)
        if self._bar is not None:
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
