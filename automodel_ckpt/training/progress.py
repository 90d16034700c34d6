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

    def update(self, step: int, loss: float, lr: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss={loss:.4f} lr={lr:.2e}", refresh=False)
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
