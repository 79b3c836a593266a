#!/usr/bin/env bash
# A base image built here, for a Docker host that cannot pull python:3.11-slim: Debian 12's root
# filesystem made by debootstrap (from Debian's package mirror, the only network it needs), with
# Debian's Python 3.11 (the Python python:3.11-slim carries), `python` naming it, and python3-venv.
#   bash docker/local-base.sh [TAG]     (default specinfer/base:bookworm-py3.11; root; ~1.5 minutes)
# then build any image on it: docker build --build-arg BASE_IMAGE=TAG ...
# DEBIAN_MIRROR picks the mirror (default http://deb.debian.org/debian).
set -euo pipefail
tag=${1:-specinfer/base:bookworm-py3.11}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if ! command -v debootstrap >/dev/null; then
    echo "local-base: installing debootstrap" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "local-base: debootstrap bookworm from $mirror" >&2
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; exit 1; }
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root.log"
tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$tag" >/dev/null
echo "local-base: $tag ($(docker run --rm "$tag" python --version))" >&2
