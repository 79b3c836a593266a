#!/usr/bin/env bash
# The first run on a lent GPU, as one command (../shared/GPU.md: carry .whl, then run this in the
# repository root on the device machine). Everything lands in $OUT with the GPU in the file names:
#   tests_<gpu>.txt      the CUDA path's tests, run natively (kernels, fused layers, graphs, staging,
#                        specializations, the KV cache's Triton path)
#   host_<gpu>.*         host microseconds per forward with the models on the GPU (pinned staging,
#                        asynchronous copies)
#   runtime_<gpu>.*      one step per model, batch and tree, eager vs CUDA graphs (ms, GPU busy, launches)
#   divergence_<gpu>.*   bf16 greedy with speculation vs without (share identical, first divergence)
#   kernel_<gpu>.*       tree attention: the Triton kernel vs its reference and SDPA, KV bandwidth
# Each part has its own time limit, so that one that hangs leaves the others' results.
# The default LLM's package (98 MB) does not fit what a run may carry: the fixtures stand in.
set -uo pipefail
out=${OUT:-/tmp/specinfer-gpu}
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
gpu=$(python3 -c "import torch; n = torch.cuda.get_device_name(0).lower(); print(next((g for g in ('h200', 'h100', 'a100', 'l4') if g in n), 'gpu'))")
fixtures=models/fixtures
export TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu_$gpu.txt" 2>&1

timeout 300 python3 -m pytest -q -x tests/test_kernels.py tests/test_fused.py tests/test_graphs.py \
    tests/test_staging.py tests/test_specialization.py tests/test_kv_cache.py > "$out/tests_$gpu.txt" 2>&1
echo "tests: exit $?" >> "$out/tests_$gpu.txt"
timeout 120 python3 -m specinfer_bench.host --out "$out/host_$gpu" > "$out/host_$gpu.log" 2>&1
timeout 300 python3 -m specinfer_bench.runtime --llm "$fixtures/llm" --ssm "$fixtures/ssm-0" \
    --out "$out/runtime_$gpu" > "$out/runtime_$gpu.log" 2>&1
timeout 180 python3 -m specinfer_bench.divergence --llm "$fixtures/llm" --ssm "$fixtures/ssm-0" --ssm "$fixtures/ssm-1" \
    --prompt-file "$fixtures/heldout_prompts.jsonl" --prompts 16 --out "$out/divergence_$gpu" > "$out/divergence_$gpu.log" 2>&1
timeout 300 python3 -m specinfer_bench.kernel --llm "$fixtures/llm" --out "$out/kernel_$gpu" > "$out/kernel_$gpu.log" 2>&1
ls -l "$out"
