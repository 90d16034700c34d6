#!/usr/bin/env bash
# Export the model of this checkpoint to a Hugging Face folder: <this folder>/consolidated/
#
#   bash consolidate.sh [--out DIR] [--max-shard-size 5GB] ...     (works from any directory, or `source` it)
#
# Environment:
#   NPROC_PER_NODE      processes to split the work over (default 1; >1 runs under torch.distributed.run)
#   NUM_THREADS         writer threads per process (default 5)
#   CAST_DTYPE          bf16 | fp16 | fp32 | fp64: dtype of floating tensors (default: the base model's dtypes)
#   CONSOLIDATION_TOOL  a Python file to run instead of the built-in module (e.g. tools/offline_hf_consolidation.py)
#   PYTHON              interpreter to use (default: the one that wrote this checkpoint, else python3)
#
# Everything runs in a subshell, so sourcing this file leaves the calling shell as it was; the subshell's exit
# status is the script's (or the `source` command's) status. When sourced, command-line arguments are ignored
# (bash would hand over the caller's own); use the environment variables above.
(
    set -euo pipefail
    script="${BASH_SOURCE[0]:-$0}"
    model_dir="$(cd -- "$(dirname -- "$script")" && pwd -P)"

    default_python=@PYTHON@
    package_root=@PACKAGE_ROOT@
    if [[ -n "${PYTHON:-}" ]]; then
        python_bin="$PYTHON"
    elif [[ -x "$default_python" ]]; then
        python_bin="$default_python"
    else
        python_bin=python3
    fi
    if [[ -n "$package_root" && -d "$package_root/automodel_ckpt" ]]; then
        export PYTHONPATH="$package_root${PYTHONPATH:+:$PYTHONPATH}"
    fi

    if [[ "${BASH_SOURCE[0]:-$0}" != "$0" ]]; then
        set --  # sourced: "$@" are the caller's arguments, not ours
    fi

    nproc="${NPROC_PER_NODE:-1}"
    args=("$model_dir" --num-threads "${NUM_THREADS:-5}")
    if [[ -n "${CAST_DTYPE:-}" ]]; then
        args+=(--cast-dtype "$CAST_DTYPE")
    fi
    if [[ -n "${CONSOLIDATION_TOOL:-}" ]]; then
        target=("$CONSOLIDATION_TOOL")
    else
        target=(-m automodel_ckpt.cli.consolidate)
    fi
    if [[ "$nproc" -gt 1 ]]; then
        "$python_bin" -m torch.distributed.run --standalone --nproc-per-node "$nproc" "${target[@]}" "${args[@]}" "$@"
    else
        "$python_bin" "${target[@]}" "${args[@]}" "$@"
    fi
)
