#!/usr/bin/env bash
# Build the images compose.local.yaml runs, on a test host that can reach Debian's and Python's
# package registries but no image registry: a Debian bookworm base from debootstrap, stand-ins for
# python:3.11-slim, postgres:16 and redis:7 from Debian's packages, then flywheel's own image from
# ops/deploy/Dockerfile on the stand-in Python. The Kafka-protocol broker and the vLLM servers run
# from flywheel's image (the tansu binary it installs, vLLM's CPU build). Production pulls the
# upstream images and needs none of this.
#
#   bash ops/deploy/standins.sh            build what is missing (each image once)
#   bash ops/deploy/standins.sh --rebuild  rebuild flywheel's image (after a code change)
#
# Needs root (debootstrap), docker and debootstrap (apt-get install docker.io debootstrap). Every
# build runs with host networking (no bridge on these hosts). A torch wheel that pip finds locally
# (its find-links or cache) is served to the build on a loopback port, since PyTorch's index may be
# out of reach; PyPI serves the rest. The stand-ins trust the CAs the host added for its own clients.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=ops/deploy/standins
rebuild="${1:-}"
PY="${PYTHON:-python3}"

have() { docker image inspect "$1" >/dev/null 2>&1; }
build() { docker build --network host "$@"; }

if ! have flywheel-standin/debian:bookworm; then
  root="$(mktemp -d)"
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase bookworm "$root" >/dev/null
  tar -C "$root" -c . | docker import - flywheel-standin/debian:bookworm >/dev/null
  rm -rf "$root"
  trap - EXIT
fi
context="$(mktemp -d)"
cp "$here"/* "$context"/
mkdir -p "$context/certs"
cp /usr/local/share/ca-certificates/*.crt "$context/certs/" 2>/dev/null || true
for name in python postgres redis; do
  tag="flywheel-standin/$name:bookworm"
  have "$tag" || build -q -t "$tag" -f "$context/$name.Dockerfile" "$context" >/dev/null
  echo "$tag"
done
rm -rf "$context"

if [ "$rebuild" = --rebuild ] || ! have flywheel:latest; then
  wheels="$(mktemp -d)"
  "$PY" -m pip download --no-deps --only-binary=:all: -q -d "$wheels" "torch==2.13.0+cpu" 2>/dev/null || true
  args=(--build-arg BASE_IMAGE=flywheel-standin/python:bookworm)
  if ls "$wheels"/torch-*.whl >/dev/null 2>&1; then
    port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    "$PY" -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" >/dev/null 2>&1 &
    server=$!
    trap 'kill "$server" 2>/dev/null; rm -rf "$wheels"' EXIT
    args+=(--build-arg TORCH_INDEX_URL= --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/")
  fi
  build "${args[@]}" -t flywheel:latest -f ops/deploy/Dockerfile .
fi
echo flywheel:latest
