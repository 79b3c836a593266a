#!/usr/bin/env bash
# SmolLM2's head-2 on a lent GPU (issue 60): install, SmolLM2's replies to the request set (>= 5M tokens
# is the aim), head-2 trained on them with `specinfer train-head --device cuda`, head-2 and the shipped head-1
# scored on the held-out prompts (code, chat, general), head-2 brought back in $OUT in files of at most
# 16 MiB. ../shared/GPU.md says what a run may carry; the default LLM's GGUF (98 MB) does not fit one run:
#
#   bench/gpu_train_head.sh pack         # here: .gpu/llm-part-0..2 (<= 35 MB each), the wheels this run needs
#                                        # (gguf, llguidance) in .gpu/whl, models/fixtures and
#                                        # models/smollm2/ssm-0 moved to .gpu/aside; what each call carries
#   run(carry [".gpu/llm-part-0"], "true"); run(carry [".gpu/llm-part-1"], "true")   # one right after the other
#   run(carry [".gpu/llm-part-2", ".gpu/whl"], "bash bench/gpu_train_head.sh run")    # about 9.5 minutes
#   bench/gpu_train_head.sh unpack       # here: the checkout as it was
#
# With less device time left: GEN_MINUTES (replies, default 4.5), TRAIN_MINUTES (training ends there,
# counted from train-head's start, default 7), SCORE_HEAD1=0 (head-1 not scored there: score both here
# with `specinfer train-head --out DIR --score-only`). A train-head that fails after writing head-2 (in its
# scoring) still brings head-2 back. Its last run: bench/results/train_head_h200.md.
#
#   bench/gpu_train_head.sh run --device cpu   # here: the same run on a tiny budget (its record:
#                                              # bench/results/gpu_train_head_cpu.md)
set -euo pipefail
mode=${1:-run}
device=cuda
[ "${2:-}" = "--device" ] && device=${3:?--device cpu|cuda}

. bench/gpu_lib.sh
case $mode in
pack)
    gpu_pack smollm2 || exit 1
    # all of .whl (grpcio's 7 MB among them) beside the last part would pass the 64 MiB a call carries
    rm -rf .gpu/whl && mkdir -p .gpu/whl && cp "$(gpu_wheel gguf)" "$(gpu_wheel llguidance)" .gpu/whl/
    gpu_calls .gpu/whl; exit $? ;;
unpack) gpu_unpack; exit 0 ;;
run) ;;
*) echo "usage: $0 pack | unpack | run [--device cuda|cpu]" >&2; exit 2 ;;
esac

[ -d .gpu/whl ] && export GPU_WHEEL_DIR=.gpu/whl
gpu_setup train_head "$device" || exit 1
gpu_smollm2 || exit 1

if [ "$device" = cuda ]; then  # 9.5 minutes of GPU: replies for 4.5 minutes, training until 7, then scoring
    budget=(--new-tokens 256 --generate-batch 512 --generate-minutes ${GEN_MINUTES:-4.5} --minutes ${TRAIN_MINUTES:-7} --batch 32 --epochs 2)
    score=(--score-tokens 64)
else  # the same run, tiny: 16 requests, 4 steps, short held-out continuations
    budget=(--count 16 --new-tokens 16 --generate-batch 8 --steps 4 --batch 2)
    score=(--score-tokens 8)
fi
start=$(date +%s)
python3 -m specinfer_cli train-head --out .gpu/head-2 --device "$device" "${budget[@]}" "${score[@]}" > "$out/train.log" 2>&1 \
    || { tail -30 "$out/train.log"; [ -f .gpu/head-2/model.safetensors ] || exit 1; SCORE_HEAD1=0; echo "scoring failed: head-2 brought back unscored"; }
trained=$(date +%s)
if [ "${SCORE_HEAD1:-1}" = 1 ]; then
    python3 -m specinfer_cli train-head --out models/smollm2/head-1 --score-only --device "$device" \
        "${score[@]}" --report "$out/head1_agreement.json" > "$out/score_head1.log" 2>&1 || { tail -30 "$out/score_head1.log"; exit 1; }
fi

# head-2 back in files of at most 16 MiB: model.safetensors split (join: cat model.safetensors.part-* > model.safetensors)
split -b 16M -d -a 1 .gpu/head-2/model.safetensors "$out/model.safetensors.part-"
cp .gpu/head-2/config.json .gpu/head-2/base.json "$out/"
cp .gpu/head-2/agreement.json "$out/head2_agreement.json" || true
sed -i 's/\r/\n/g' "$out/train.log"; grep -v '^ *$' "$out/train.log" | tail -200 > "$out/train.log.tail" && mv "$out/train.log.tail" "$out/train.log"
rm -f "$out/score_head1.log"
[ "${SCORE_HEAD1:-1}" = 1 ] && python3 - "$out" $((trained - start)) $(( $(date +%s) - start )) <<'PY'
import json, sys
from pathlib import Path
out, trained_s, total_s = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
h2, h1 = (json.loads((out / f).read_text()) for f in ("head2_agreement.json", "head1_agreement.json"))
print(f"head-2: {h2['sequences']} sequences, {h2['reply_tokens']:,} reply tokens (aim: 5,000,000), "
      f"{h2['steps']}/{h2['of_steps']} steps, loss {h2['loss']['first']} -> {h2['loss']['last']}; "
      f"train-head {trained_s} s, all {total_s} s")
for k in h2["agreement"]:
    a, b = h2["agreement"][k], h1["agreement"][k]
    print(f"{k:28s} first token: head-2 {a['first_token']:.3f}  head-1 {b['first_token']:.3f}   "
          f"chain4: {a['chain4_mean']:.2f} / {b['chain4_mean']:.2f}")
PY
ls -l "$out"
