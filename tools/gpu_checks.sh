#!/usr/bin/env bash
# The GPU rows of docs/benchmarks.md in one go on one NVIDIA GPU: MFU against torchtitan, save, load, async stall.
#
#   bash tools/gpu_checks.sh train|checkpoint|grpo|all [OUT]
#
# train:      ours (`ckpt-train`, tools/bench_train.py) and torchtitan 0.3.0 (tools/bench_train_torchtitan.py) on
#             Llama 3.2 1B's shape, 2 rows of 4,096 tokens, bf16, compiled, 13 steps (6..13 timed).
# checkpoint: the save and load of a Llama's fp32 weights and AdamW moments (SIZE_GB, default 4) from and to GPU
#             memory against the host disk's O_DIRECT write and read (tools/bench_checkpoint.py, in ./bench-ckpt,
#             removed after), and the training time an async save blocks against a sync save (tools/bench_async.py).
#             Each bench_checkpoint operation is a process of its own that builds the state (about 25 s each at 4 GB
#             on an H200), so only the device ratios' methods run (METHODS; empty: every method of save and load); a
#             save that a load reads is timed once, as it writes that source; an operation with no result after
#             CHILD_S seconds (default 150) is stopped with its stack printed, and the JSON is rewritten after each.
# grpo:       GRPO's generation speed and step against TRL's GRPOTrainer on the GPU (tools/bench_grpo.py --device cuda,
#             the tiny Llama, 16 prompts x 16 completions, 12 steps; TRL from the carried wheels), and whether
#             sampling on the GPU gives a row the same completion in any batch (tools/sampling_invariance.py, fp32
#             and bf16: what a resume at another world size needs).
#
# A machine without internet gets the packages it lacks as wheels in .whl/, installed into /tmp/site and put first
# on the path. For a machine with torch 2.11 and Python 3.12 (what the lent H100 and H200 have), fetch them with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       transformers==5.24.0 datasets==5.2.0 omegaconf==2.4.0 peft==0.21.2 dill==0.4.1 multiprocess==0.70.19 \
#       torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 spmd_types==0.2.3 typeguard==4.6.1 \
#       trl==1.16.0 accelerate==1.15.0 psutil==7.2.2
# Every part runs under its own time limit and writes its log and JSON to OUT.
set -u
what=${1:-all}
out=${2:-${OUT:-gpu-checks}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
peak=${PEAK_TFLOPS:-989}  # bf16 dense, H100 SXM and H200
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/gpu.txt"
nproc | tee -a "$out/gpu.txt"

part() {  # part NAME SECONDS COMMAND...: one measurement under its own limit, its output kept
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit} s)"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    tail -n 25 "$out/$name.log"
}

if [ "$what" = train ] || [ "$what" = all ]; then
    part torchtitan "${TORCHTITAN_S:-200}" python3 tools/bench_train_torchtitan.py --flavor 1B --seq-len 4096 \
        --rows 2 --steps 13 --peak-tflops "$peak" --json "$out/torchtitan.json"
    part ours "${OURS_S:-220}" python3 tools/bench_train.py --sizes 1b --nprocs 1 --steps 13 --reps 1 \
        --contenders ours --device cuda --dtype bf16 --seq-len 4096 --rows 2 --peak-tflops "$peak" \
        --json "$out/ours.json"
fi
if [ "$what" = checkpoint ] || [ "$what" = all ]; then
    methods=${METHODS-raw_write_direct,ours_save_safetensors,ours_save_torch_save,raw_read_direct,ours_load_safetensors,ours_load_torch_save}
    part checkpoint "${CHECKPOINT_S:-480}" python3 tools/bench_checkpoint.py --device cuda --size-gb "${SIZE_GB:-4}" \
        --nproc 1 --reps 1 --only save load --dir bench-ckpt --json "$out/checkpoint.json" \
        --child-timeout "${CHILD_S:-150}" ${methods:+--methods "$methods"}
    rm -rf bench-ckpt
    part async "${ASYNC_S:-150}" python3 tools/bench_async.py --device cuda --nproc 1 --layers 12 --steps 121 \
        --every 40 --reps 1 --modes sync,async --json "$out/async.json"
fi
if [ "$what" = grpo ] || [ "$what" = all ]; then
    part grpo "${GRPO_S:-240}" python3 tools/bench_grpo.py --device cuda --steps 12 --warmup 2 --prompts 16 \
        --num-generations 16 --trl-python python3 --work "$out/grpo-work" --json "$out/grpo.json"
    rm -rf "$out/grpo-work/assets" "$out/grpo-work/ours" "$out/grpo-work/trl"
    for dtype in float32 bfloat16; do
        part "sampling-$dtype" "${SAMPLING_S:-90}" python3 tools/sampling_invariance.py --device cuda --dtype "$dtype" \
            --json "$out/sampling-$dtype.json"
    done
fi
