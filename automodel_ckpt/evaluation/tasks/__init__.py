"""The lm-evaluation-harness task definitions the product ships (``TaskManager(include_path=TASKS_DIR)``)."""

from __future__ import annotations

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
