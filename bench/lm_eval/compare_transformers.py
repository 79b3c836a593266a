"""Each log-likelihood lm-evaluation-harness logged (--log_samples DIR) against transformers' own
on the default LLM in float32, tokenized as lm_eval tokenizes a pair (the whole text, then split at
the context's length): the largest difference, and the accuracy transformers' scores give."""

import glob
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specinfer.checkpoints import DEFAULT_LLM, checkpoint_dir

torch.set_num_threads(1)  # NOTE: on the shared 2-core VM, more threads ran many times slower
d = checkpoint_dir(DEFAULT_LLM)
tok, hf = AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
worst, n, correct = 0.0, 0, 0
for line in open(glob.glob(sys.argv[1] + "/*/samples_*.jsonl")[0]):
    s = json.loads(line)
    want = []
    for (ctx, cont), got in zip(((a["arg_0"], a["arg_1"]) for a in s["arguments"].values()), s["resps"]):
        whole = tok(ctx + cont, add_special_tokens=False).input_ids
        n_ctx = len(tok(ctx, add_special_tokens=False).input_ids)
        with torch.no_grad():
            lp = hf(torch.tensor([whole])).logits[0].log_softmax(-1)
        ll = sum(lp[i - 1, whole[i]].item() for i in range(n_ctx, len(whole)))
        worst, n = max(worst, abs(ll - float(got[0][0]))), n + 1
        want.append(ll)
    correct += max(range(len(want)), key=want.__getitem__) == s["doc"]["answer"]
print(f"{n} log-likelihoods: largest |gateway - transformers| = {worst:.2e}; transformers' accuracy {correct}/160")
