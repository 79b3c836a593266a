#!/usr/bin/env bash
# Issue 62: tree attention tuned on a lent Hopper GPU (H100, H200), one call of at most 8 minutes: the
# parts run in 450 s (set-up aside), each in its own limit, the last one in what is left:
#   tests   tests/test_kernels.py natively (fp32, fp16, bf16 on every test shape; about 90 variants of
#           the two kernels to compile), stopped at the first failure; a failure (not the time limit)
#           ends the run there, its log in the archive
#   table   python -m specinfer_bench.kernel as it stands, default configuration: the full attention grid
#           (prefix 512..16k x tree 1..256 x batch 1..64, bf16; kernel, reference, SDPA with the tree
#           mask, share of HBM peak) and the verifier step
#   sweep   python -m specinfer_bench.kernel_sweep for 120 s: configurations (rows and keys of a tile,
#           warps, stages) searched axis by axis on 7 cells, each variant checked against the reference
#           before it is timed against SDPA; registers, spills and shared memory of every variant
#   best    the table's attention grid again with the sweep's best configuration
#           (SPECINFER_TREE_ATTENTION_CONFIG), if 60 s or more are left; else it is the rerun below
# It ends with a summary of a screen; everything comes back as one archive (bench/gpu_lib.sh).
#
#   . bench/gpu_lib.sh && gpu_pack fixtures          # here: models/smollm2 aside (the tree: about 38 MB)
#   run(carry [".whl"], "bash bench/gpu_kernel.sh", timeout_s 540)
#   . bench/gpu_lib.sh && gpu_unpack                 # here: the checkout as it was
#   bash bench/gpu_kernel.sh --device cpu            # here: the plumbing, tiny, under Triton's interpreter
#
# A rerun of one part: `bash bench/gpu_kernel.sh --only sweep`, or `--only best --config m64-n128-w8-s2`
# (a configuration by its label; without --config, best takes the sweep's of the same call).
set -uo pipefail
. bench/gpu_lib.sh
args=() config=
while [ $# -gt 0 ]; do  # --config LABEL here, the other flags as every bench/gpu_*.sh takes them
    case $1 in
    --config) config=${2:?--config LABEL}; shift 2 ;;
    *) args+=("$1"); shift ;;
    esac
done
gpu_start kernel 'tests|table|sweep|best' "${args[@]}" || exit $?
[ "$device" = cpu ] && export TRITON_INTERPRET=1  # (tests/conftest.py and kernel_sweep set it too)
if [ "$device" = cuda ]; then
    tests=(tests/test_kernels.py)
    table=(--grid full)
    best=(--grid full)
    limits=(150 130 150) total=450  # tests, table, sweep (its own budget 30 s less); all parts
else  # the plumbing only: the configuration tests, the smallest grid, two tiny cells and two configurations
    fx=models/fixtures
    tests=(tests/test_kernels.py -k tile_config)
    table=(--grid quick --llm $fx/llm)
    best=(--grid quick)
    limits=(300 300 300) total=1200
fi

if want tests; then
    tests_first "${limits[0]}" "${tests[@]}"
fi
if want table; then
    part table "${limits[1]}" python3 -m specinfer_bench.kernel "${table[@]}" --out "$work/kernel_$gpu"
    figures kernel "$work/kernel_$gpu.json"
fi
if want sweep; then
    part sweep "${limits[2]}" python3 -m specinfer_bench.kernel_sweep --seconds $(( limits[2] - 30 )) \
        --out "$work/kernel_sweep_$gpu"
    figures sweep "$work/kernel_sweep_$gpu.json"
fi
if want best; then
    [ -z "$config" ] && [ -f "$work/kernel_sweep_$gpu.json" ] && config=$(python3 -c \
        'import json, sys; print(json.load(open(sys.argv[1]))["meta"]["best"] or "")' "$work/kernel_sweep_$gpu.json")
    left=$(( total - ($(date +%s) - GPU_START) ))
    if [ -z "$config" ]; then
        say "best: skipped (no configuration: the sweep chose none; --config LABEL names one)"
    elif [ -z "$only" ] && [ $left -lt 60 ]; then
        say "best: skipped ($left s left); rerun: bash bench/gpu_kernel.sh --only best --config $config"
    else
        [ -n "$only" ] && left=${limits[1]}
        SPECINFER_TREE_ATTENTION_CONFIG=$config part best "$left" python3 -m specinfer_bench.kernel "${best[@]}" \
            --no-verifier --out "$work/kernel_best_$gpu"
        figures kernel "$work/kernel_best_$gpu.json"
    fi
fi
gpu_finish
