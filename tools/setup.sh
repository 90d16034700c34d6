#!/usr/bin/env bash
# Creates .venv with torch and automodel-ckpt (editable, with test extras). Safe to rerun: it only installs
# what is missing or changed.
#   TORCH_SPEC   what to install when .venv has no torch yet (default: torch==2.13.0, the CPU build).
#                GPU users: install the torch build for their CUDA into .venv first, or set TORCH_SPEC;
#                an existing torch is never replaced.
#   PYTHON       interpreter used to create .venv (default: python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing ${TORCH_SPEC:-torch==2.13.0}"
  # shellcheck disable=SC2086
  "${PIP[@]}" install ${TORCH_SPEC:-torch==2.13.0}
fi
stamp="$VENV/.automodel-ckpt-setup"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VENV/bin/python" -c "import automodel_ckpt" >/dev/null 2>&1; then
  echo "setup: installing automodel-ckpt and its dependencies"
  "${PIP[@]}" install -e ".[test]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
  "$VENV/bin/python" -c "import automodel_ckpt, torch, transformers, peft, datasets" || { echo "setup: install failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
echo "setup: ready ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
