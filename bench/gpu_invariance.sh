#!/usr/bin/env bash
# Issue 96 on a lent GPU: row-invariant verification (SPECINFER_TREE_ATTENTION=invariant) natively, one
# call of at most 6 minutes (the parts' limits add up to 330 s, set-up aside):
#   tests       tests/test_invariance.py natively, bf16 on CUDA: a position's logits against its one-row
#               step in prompts, chunks, trees and batches, the engines' greedy and seeded outputs with
#               every drafter and the prefix cache, the attention against the reference, and
#               invariant_matmul's rows at any row count and place; stopped at the first failure, which
#               ends the run there (its log in the archive)
#   divergence  greedy with speculation against without on the fixture LLM, bf16 and float32, the Triton
#               attention (what serves today) and the row-invariant mode: prompts identical, tok/s
#   cost        the same on the fixture LLM inflated to 1B class (bf16, built on the GPU in /dev/shm):
#               what the mode costs where the GEMMs are a real model's
# It ends with a summary of a screen; everything comes back as one archive (bench/gpu_lib.sh).
#
#   . bench/gpu_lib.sh && gpu_pack fixtures          # here: models/smollm2 aside, the wheels in .whl
#   run(carry [".whl"], "bash bench/gpu_invariance.sh", timeout_s 420)
#   . bench/gpu_lib.sh && gpu_unpack                 # here: the checkout as it was
#   bash bench/gpu_invariance.sh --device cpu        # here: the plumbing, tiny, under Triton's interpreter
#
# A rerun of one part: `bash bench/gpu_invariance.sh --only cost`.
set -uo pipefail
. bench/gpu_lib.sh
gpu_start invariance 'tests|divergence|cost' "$@" || exit $?
fx=models/fixtures
both=(--attentions triton,invariant --ssm $fx/ssm-0 --ssm $fx/ssm-1 --prompt-file $fx/heldout_prompts.jsonl)
if [ "$device" = cuda ]; then
    tests=(tests/test_invariance.py)
    divergence=(--prompts 8 --max-new-tokens 64 --dtypes bfloat16,float32)
    cost=(--prompts 8 --max-new-tokens 64 --dtypes bfloat16)
    preset=llama-1b
    limits=(150 60 120)
else  # the plumbing only: the Triton products' tests, one prompt of a few tokens, the fixture as it is
    export TRITON_INTERPRET=1
    tests=(tests/test_invariance.py -k "invariant_matmul or triton_products")
    divergence=(--prompts 1 --max-new-tokens 8 --dtypes float32)
    cost=(--prompts 1 --max-new-tokens 8 --dtypes float32)
    preset=
    limits=(300 300 300)
fi

if want tests; then
    tests_first "${limits[0]}" "${tests[@]}"
fi
if want divergence; then
    part divergence "${limits[1]}" python3 -m specinfer_bench.divergence --llm $fx/llm "${both[@]}" \
        "${divergence[@]}" --device "$device" --out "$work/invariance_divergence_$gpu"
    figures divergence "$work/invariance_divergence_$gpu.json"
fi
if want cost; then
    llm=$fx/llm
    if [ -n "$preset" ]; then
        llm=/dev/shm/llm-1b
        [ -d $llm ] || python3 -m specinfer_bench.inflate $fx/llm --preset $preset --device cuda --out $llm \
            > "$work/inflate.log" 2>&1 || say "cost: inflate FAILED; last: $(tail -1 "$work/inflate.log")"
    fi
    part cost "${limits[2]}" python3 -m specinfer_bench.divergence --llm $llm "${both[@]}" "${cost[@]}" \
        --device "$device" --out "$work/invariance_cost_$gpu"
    figures divergence "$work/invariance_cost_$gpu.json"
fi
gpu_finish
