#!/usr/bin/env bash
# Issue 95 on a lent GPU: drafting during verification through the services, on SmolLM2 inflated to a
# 7B-class cost (the inflation keeps its outputs SmolLM2's, so its real SSM meets real text at real
# acceptance; the fixtures' 7B text loops). One call of at most 8 minutes (470 s from the end of set-up),
# after two short calls that carry SmolLM2's GGUF in parts (../shared/GPU.md):
#   inflate   SmolLM2 (its GGUF joined from the carried parts and checked) inflated to llama-7b's sizes in
#             bfloat16 on the GPU, written to /dev/shm (else /tmp) on that machine, kept there for a rerun
#   code      specinfer_bench.services --in-process on the held-out code and chat requests
#             (models/smollm2/prompts.jsonl), SmolLM2's SSM 0 the speculator: speculation off, the manager's
#             default, the default drafting ahead where its controller prices it faster (@predraft: --draft-ahead
#             4), drafting ahead at every step on the default's whole trees (@static@predraft: no controller),
#             and the default drafting ahead with steps that leave before the outcome of the step before
#             (@predraft@outcome: --outcome-steps) at 1, 16 and 64 streams, 128 new tokens, ignore_eos: tok/s, tokens per step, an
#             iteration's split, the hit rate and the verifier's idle time by what the next step was;
#             services against in process
#   natural   the same at 1 and 16 streams with natural stops (a request ends where SmolLM2 ends its reply)
#   general   the same on the general requests (models/smollm2/general_prompts.jsonl), natural stops
# head-1 does not draft here: it reads SmolLM2's 576-wide residual stream, the inflated model's is 4096 wide.
# The speculator shares the verifier's GPU (one is lent): what drafting ahead costs the verifier there is
# measured, not what a drafter on a device of its own would.
#
#   bench/gpu_services_smollm2.sh pack      # here: .gpu/llm-part-0..2 (<= 35 MB each), models/fixtures,
#                                           # models/requests, head-1 and the replies moved to .gpu/aside, the
#                                           # wheels in .whl; what each call carries
#   run(carry [".gpu/llm-part-0"], "true"); run(carry [".gpu/llm-part-1"], "true")   # one right after the other
#   run(carry [".gpu/llm-part-2", ".whl"], "bash bench/gpu_services_smollm2.sh run", timeout_s 540)
#   bench/gpu_services_smollm2.sh unpack    # here: the checkout as it was
#   bash bench/gpu_services_smollm2.sh run --device cpu   # here: the plumbing on SmolLM2 two layers deeper, in
#                                                          # float32, the smallest load (record:
#                                                          # bench/results/gpu_services_smollm2_cpu_summary.txt)
#
# A rerun of one part: `bash bench/gpu_services_smollm2.sh run --only general` (inflating first only if the
# model is not there: on a machine still warm it is).
set -uo pipefail
mode=${1:-run}
[ $# -gt 0 ] && shift
. bench/gpu_lib.sh
case $mode in
pack) gpu_pack smollm2-ssm && gpu_calls .whl; exit $? ;;
unpack) gpu_unpack; exit 0 ;;
run) ;;
*) echo "usage: $0 pack | unpack | run [--device cuda|cpu] [--only inflate|code|natural|general]" >&2; exit 2 ;;
esac
gpu_start services_smollm2 'inflate|code|natural|general' "$@" || exit $?
gpu_smollm2 || exit 1
budget=470 ssm=models/smollm2/ssm-0 configs='off;default;default@predraft;default@static@predraft;default@predraft@outcome'
if [ "$device" = cuda ]; then
    size=7b inflate=(--preset llama-7b --dtype bfloat16 --device cuda)
    load=(--concurrency 1,16,64 --requests-per-stream 4 --max-new-tokens 128)
    few=(--concurrency 1,16 --requests-per-stream 2 --max-new-tokens 128)
else  # the plumbing only: every part, SmolLM2 two layers deeper (exact in float32), the smallest load, a CPU's time
    size=cpu inflate=(--layers 32 --dtype float32) budget=1200
    load=(--concurrency 1,2 --requests-per-stream 1 --max-new-tokens 8)
    few=(--concurrency 1 --requests-per-stream 1 --max-new-tokens 8)
fi
shm=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
llm=$([ "${shm:-0}" -ge 20 ] && echo /dev/shm || echo /tmp)/specinfer-smollm2-$size
left() { echo $(( GPU_START + budget - $(date +%s) )); }  # seconds of the budget left
most() { local l; l=$(left); echo $(( l < $1 ? l : $1 )); }  # at most $1 s, and what is left

if want inflate || [ ! -d "$llm" ]; then
    if [ -d "$llm" ]; then
        say "inflate: $llm is there from an earlier call on this machine"
    else
        src=$(python3 -c "from specinfer.checkpoints import DEFAULT_LLM, checkpoint_dir; print(checkpoint_dir(DEFAULT_LLM))")
        rm -rf "$llm.part"
        part inflate 90 python3 -m specinfer_bench.inflate "$src" --out "$llm.part" "${inflate[@]}" \
            && mv "$llm.part" "$llm" && say "  $llm: $(grep -h 'parameters' "$work/inflate.log" | tail -1 | sed 's/^[^:]*: //')"
    fi
fi
[ -d "$llm" ] || { say "no inflated model: nothing else was run"; gpu_finish; exit 1; }

services() {  # NAME SECONDS PROMPTS ARGS...: one services part and its summary lines (skipped under 30 s)
    local name=$1 limit=$2 prompts=$3
    shift 3
    [ "$limit" -ge 30 ] || { say "$name: skipped, $limit s of the budget left"; return 0; }
    part "$name" "$limit" python3 -m specinfer_bench.services --llm "$llm" --ssm $ssm --prompt-file "$prompts" \
        --configs "$configs" --rounds 1 --in-process "$@" --log-dir "$work/$name-logs" --out "$work/${name}_$gpu"
    figures services "$work/${name}_$gpu.json"
}
want code && services code "$(most $(( budget / 2 )))" models/smollm2/prompts.jsonl "${load[@]}"
want natural && services natural "$(most $(( budget / 4 )))" models/smollm2/prompts.jsonl "${few[@]}" --stop-at-eos
want general && services general "$(left)" models/smollm2/general_prompts.jsonl "${few[@]}" --stop-at-eos
gpu_finish
