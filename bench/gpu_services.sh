#!/usr/bin/env bash
# Issue 61: the services end to end on a lent GPU with a 7B-class verifier, one call of at most 8 minutes
# (460 s from the end of set-up: the tests at most 120, the inflation 90, the float32 check 90, the services
# what is left),
# which leaves a short rerun within the 15-minute lease:
#   tests     the guard: unless bench/results/ holds a record of the CUDA tests passing on a GPU (a summary
#             a GPU run brought back and a session kept there, bench/results/NAME_GPU_summary.txt with GPU
#             not cpu, e.g. first_run_h100_summary.txt, holding the line "tests: ok ..."), the CUDA path's
#             tests ($CUDA_TESTS), stopped at the first failure, in at most 2 minutes; a failure ends the run
#   inflate   the fixture LLM inflated to 7B class (llama-7b's sizes, bfloat16, 12 GB), built on the GPU and
#             written to /dev/shm (else /tmp) on that machine, never carried; kept there for a rerun
#   exact     float32 through the services: the fixture LLM itself on the GPU, speculation off and the
#             manager's default each give the LLM's own greedy tokens (8 prompts x 32 tokens; the bench stops
#             at the first difference where the dtype is float32), then a token load at 1 stream
#   services  specinfer_bench.services --in-process on it: first the same requests in this process through
#             the engine, then the verifier on the GPU and the two fixture SSMs as speculators, speculation
#             off against the manager's default at 1, 16 and 64 streams, and off without steps sent ahead
#             (@sequential, the manager's --steps-ahead off: what sending plain steps ahead gains), one round
#             each, greedy: tok/s, the manager's split of an iteration (verifier, slowest speculator, the
#             rest), services against in process (what the hops cost), and each setting's share of off's
#             greedy tokens (bfloat16)
# It ends with a summary of a screen; everything comes back as one archive (bench/gpu_lib.sh).
#
#   . bench/gpu_lib.sh && gpu_pack fixtures          # here: models/smollm2 aside, the wheels in .whl
#   run(carry [".whl"], "bash bench/gpu_services.sh", timeout_s 540)
#   . bench/gpu_lib.sh && gpu_unpack                 # here: the checkout as it was
#   bash bench/gpu_services.sh --device cpu          # here: the plumbing on the fixtures as they are (record:
#                                                    # bench/results/gpu_services_cpu.md)
#
# A rerun of one part: `bash bench/gpu_services.sh --only services` (inflating first only if the model is not
# there: on a machine still warm it is); `--only tests` runs the tests whatever the records say.
set -uo pipefail
. bench/gpu_lib.sh
gpu_start services 'tests|inflate|exact|services' "$@" || exit $?
fx=models/fixtures budget=460
if [ "$device" = cuda ]; then
    tests=("${CUDA_TESTS[@]}")
    size=7b inflate=(--preset llama-7b --dtype bfloat16 --device cuda)
    services=(--concurrency 1,16,64 --requests-per-stream 4 --max-new-tokens 128)
else  # the plumbing only: every part, on the fixtures as they are and the smallest load
    tests=(tests/test_staging.py)
    size=fixture inflate=(--dtype float32)
    services=(--concurrency 1,2 --requests-per-stream 1 --max-new-tokens 8)
fi
shm=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
llm=$([ "${shm:-0}" -ge 20 ] && echo /dev/shm || echo /tmp)/specinfer-llm-$size
left() { local s=$(( GPU_START + budget - $(date +%s) )); echo $(( s > 60 ? s : 60 )); }  # (timeout 0: none)

if [ "$only" = tests ] || { [ -z "$only" ] && ! record=$(gpu_tests_record); }; then
    tests_part 120 "${tests[@]}"
    rc=$?
    if [ $rc != 0 ]; then
        say "the tests failed: nothing else was run (the failure: tests.log in the archive)"
        gpu_finish
        exit 1
    fi
elif want tests; then
    say "tests: passed on a GPU before ($record), not rerun"
fi
if want inflate || { want services && [ ! -d "$llm" ]; }; then
    if [ -d "$llm" ]; then
        say "inflate: $llm is there from an earlier call on this machine"
    else
        rm -rf "$llm.part"
        part inflate 90 python3 -m specinfer_bench.inflate $fx/llm --out "$llm.part" "${inflate[@]}" \
            && mv "$llm.part" "$llm" && say "  $llm: $(grep -h 'parameters' "$work/inflate.log" | tail -1 | sed 's/^[^:]*: //')"
    fi
fi
if want exact; then
    part exact 90 python3 -m specinfer_bench.services --llm $fx/llm --ssm $fx/ssm-0 --ssm $fx/ssm-1 --dtype float32 \
        --prompt-file $fx/heldout_prompts.jsonl --configs 'off;default' --rounds 1 --concurrency 1 \
        --requests-per-stream 1 --max-new-tokens 16 --log-dir "$work/exact-logs" --out "$work/exact_$gpu"
    grep -h '^Greedy check' "$work/exact_$gpu.md" 2>/dev/null | while read -r line; do say "  exact: $line"; done
fi
if want services && [ ! -d "$llm" ]; then
    say "services: not run (no inflated model)"
elif want services; then
    part services "$(left)" python3 -m specinfer_bench.services --llm "$llm" --ssm $fx/ssm-0 --ssm $fx/ssm-1 \
        --prompt-file $fx/heldout_prompts.jsonl --configs 'off;off@sequential;default' --rounds 1 --in-process "${services[@]}" \
        --log-dir "$work/services-logs" --out "$work/services_$gpu"
    grep -h '^in process: \|^services: .* serving' "$work/services.log" | while read -r line; do say "  $line"; done
    figures services "$work/services_$gpu.json"
fi
gpu_finish
