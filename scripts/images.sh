#!/usr/bin/env bash
# `make images`: builds images/{operator,runtime-cpu,runtime-gpu}/Dockerfile from the repository root with
# the first builder that works here: docker (with a running daemon), podman, buildah. Prints each image's
# size and build time. Layers are cached by the builder, and pip's downloads by a cache mount, so a
# second build redoes only what changed.
#   scripts/images.sh [NAME...]          default: operator runtime-cpu runtime-gpu
# Env (what differs between sites):
#   IMAGE_PREFIX (localhost/hybrid-inference/: fully qualified, so a short name cannot resolve to another
#                 registry's image of the same name)  IMAGE_TAG (dev)  IMAGE_BUILDER (docker | podman | buildah)
#   TORCH_INDEX   runtime-cpu's PyTorch index; when unset and the Dockerfile's CPU index cannot be reached,
#                 PyPI (its torch is the CUDA build: it runs on CPU, the image is larger)
#   PIP_CERT / SSL_CERT_FILE   a site CA bundle: mounted into the build where pip and apt look for it
#   IMAGE_BUILD_OPTS           anything else for the builder, e.g. "--pull=never"
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=${IMAGE_PREFIX:-localhost/hybrid-inference/}
# a first component without a registry host ("team/") would resolve by the builder's search list: qualify it
first=${PREFIX%%/*}
case $first in *.*|*:*|localhost) ;; *) PREFIX=localhost/$PREFIX ;; esac
TAG=${IMAGE_TAG:-dev}
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(operator runtime-cpu runtime-gpu)

builder=${IMAGE_BUILDER:-}
if [ -z "$builder" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then builder=docker
  elif command -v podman >/dev/null; then builder=podman
  elif command -v buildah >/dev/null; then builder=buildah
  else echo "images: no working docker (daemon), podman or buildah here" >&2; exit 1; fi
fi
case $builder in
  docker) build=(docker build) ;;
  podman) build=(podman build --layers) ;;
  buildah) build=(buildah bud --layers) ;;
  *) echo "images: IMAGE_BUILDER must be docker, podman or buildah, not $builder" >&2; exit 1 ;;
esac
# host networking: rootless and nested builders often have no other route to the package indexes
opts=(--network host)
ca=${PIP_CERT:-${SSL_CERT_FILE:-}}
[ -n "$ca" ] && [ -f "$ca" ] && opts+=(-v "$(realpath "$ca"):/etc/ssl/certs/ca-certificates.crt:ro")
# shellcheck disable=SC2206  # IMAGE_BUILD_OPTS is a list of options
opts+=(${IMAGE_BUILD_OPTS:-})

torch_index() {
  local default
  default=$(sed -n 's/^ARG TORCH_INDEX=//p' images/runtime-cpu/Dockerfile)
  if [ -n "${TORCH_INDEX:-}" ]; then echo "$TORCH_INDEX"
  elif curl -fsS --max-time 10 -o /dev/null "$default/torch/" 2>/dev/null; then echo "$default"
  else echo "images: $default is not reachable: torch from PyPI (CUDA build, larger image)" >&2
       echo "https://pypi.org/simple"; fi
}

image_size() {
  case $builder in
    buildah) buildah images --noheading --format '{{.Size}}' "$1" | head -1 ;;
    *) "$builder" image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}' ;;
  esac
}

for name in "${NAMES[@]}"; do
  [ -f "images/$name/Dockerfile" ] || { echo "images: no images/$name/Dockerfile" >&2; exit 1; }
  args=()
  [ "$name" = runtime-cpu ] && args+=(--build-arg "TORCH_INDEX=$(torch_index)")
  ref="$PREFIX$name:$TAG"
  t0=$(date +%s)
  iid=$(mktemp)
  "${build[@]}" "${opts[@]}" "${args[@]}" --iidfile "$iid" -f "images/$name/Dockerfile" -t "$ref" .
  id=$(cat "$iid"); id=${id#sha256:}; rm -f "$iid"
  # what was built is read by its ID, never by a name another image may also answer to
  echo "images: $ref $id built by $builder in $(( $(date +%s) - t0 )) s, $(image_size "$id")"
done
