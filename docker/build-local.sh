#!/usr/bin/env bash
# Opt-in: build docker/Dockerfile.cpu without a Docker engine and without a registry, with buildah (chroot
# isolation, vfs storage), on a Debian base made here with debootstrap, then run the image's `grpoflow --help`.
# Needs root and the Debian packages buildah, podman and debootstrap. Not part of the test run.
#
#   sudo docker/build-local.sh            # WORK=/var/tmp/grpoflow-build, TAG=grpoflow:0.1.0-cpu
#
# The host's pip configuration (index URL, find-links folder, CA bundle) is handed to the build as the `pipconf`
# secret and read-only volumes, so pip inside the build reaches the same package index as pip here; nothing of
# it is stored in the image or in this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-/var/tmp/grpoflow-build}"
TAG="${TAG:-grpoflow:0.1.0-cpu}"
BASE_TAG="${BASE_TAG:-localhost/debian-python:bookworm}"
SUITE="${SUITE:-bookworm}"
# The Debian mirror apt uses here (first URIs: line of the deb822 sources), else deb.debian.org.
MIRROR="${MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
STORAGE=(--storage-driver vfs)
mkdir -p "$WORK"
log() { printf '[build-local %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# 1. The base image: minimal Debian with python3 and its venv module (what python:3.12-slim provides).
if ! buildah "${STORAGE[@]}" inspect --type image "$BASE_TAG" >/dev/null 2>&1; then
  if [ ! -x "$WORK/rootfs/usr/bin/python3" ]; then
    log "debootstrap $SUITE from $MIRROR"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$WORK/rootfs" "$MIRROR"
    rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
  fi
  log "import the rootfs as $BASE_TAG"
  ctr=$(buildah "${STORAGE[@]}" from scratch)
  tar -C "$WORK/rootfs" -cf "$WORK/rootfs.tar" .
  buildah "${STORAGE[@]}" add "$ctr" "$WORK/rootfs.tar" /  # a local tar archive is extracted
  rm -f "$WORK/rootfs.tar"
  buildah "${STORAGE[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
  buildah "${STORAGE[@]}" commit --rm "$ctr" "$BASE_TAG"
fi

# 2. pip's configuration for the build, from this machine's.
PIPCONF="$WORK/pip.conf"
VOLUMES=()
{
  echo "[global]"
  idx=$(pip config get global.index-url 2>/dev/null || true)
  [ -n "$idx" ] && echo "index-url = $idx"
  extra=$(pip config get global.extra-index-url 2>/dev/null | tr ' ' '\n' | grep -v '^file:' | tr '\n' ' ' || true)
  [ -n "${extra// /}" ] && echo "extra-index-url = $extra"
  if [ -n "${PIP_FIND_LINKS:-}" ] && [ -d "$PIP_FIND_LINKS" ]; then
    echo "find-links = $PIP_FIND_LINKS"
    VOLUMES+=(--volume "$PIP_FIND_LINKS:$PIP_FIND_LINKS:ro")
  fi
  echo "cert = /etc/host-ca.crt"
  echo "timeout = 180"
} > "$PIPCONF"
VOLUMES+=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/host-ca.crt:ro)
# torch: the CPU wheel index, unless a find-links folder here already holds the CPU wheel.
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
if [ -n "${PIP_FIND_LINKS:-}" ] && ls "$PIP_FIND_LINKS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  TORCH_INDEX_URL="${idx:-https://pypi.org/simple}"
fi

# 3. Build (no layer cache: vfs copies the whole filesystem for every layer; docker format keeps SHELL).
log "buildah bud -> $TAG (base $BASE_TAG, torch from $TORCH_INDEX_URL)"
start=$(date +%s)
buildah "${STORAGE[@]}" bud --isolation chroot --layers=false --format docker \
  --secret id=pipconf,src="$PIPCONF" "${VOLUMES[@]}" \
  --build-arg BASE_IMAGE="$BASE_TAG" --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" \
  -f docker/Dockerfile.cpu -t "$TAG" .
log "built in $(( $(date +%s) - start )) s"
buildah "${STORAGE[@]}" images "$TAG"

# 4. Run the CLI inside the image: podman first, then buildah's chroot as the fallback. In a sandbox with a hybrid
# cgroup layout and no CAP_SYS_RESOURCE, podman needs runc with cgroupfs (crun refuses hybrid cgroups) and limits
# no higher than this shell's (podman's defaults raise nofile and nproc, which fails with EPERM).
log "grpoflow --help inside $TAG"
PODMAN=(podman "${STORAGE[@]}" --runtime runc --cgroup-manager cgroupfs)
LIMITS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=4096:4096")
if "${PODMAN[@]}" run --rm --network none "${LIMITS[@]}" "$TAG" --help; then
  log "podman run: ok"
else
  log "podman run failed; trying buildah run --isolation chroot"
  ctr=$(buildah "${STORAGE[@]}" from "$TAG")
  buildah "${STORAGE[@]}" run --isolation chroot --user 1000:1000 "$ctr" -- grpoflow --help
  buildah "${STORAGE[@]}" rm "$ctr"
  log "buildah run: ok"
fi
