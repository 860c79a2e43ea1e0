#!/usr/bin/env bash
# Builds the local Debian base image with debootstrap, for machines that reach a package mirror but no image
# registry. With a registry, skip this and build the Dockerfile FROM an official base (BASE_IMAGE).
# Usage: build-base.sh [TAG] [MIRROR]
set -euo pipefail
tag="${1:-sluice-base:bookworm}"
mirror="${2:-http://deb.debian.org/debian}"
rootfs="$(mktemp -d)"
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
tar -C "$rootfs" -c . | docker import - "$tag" >/dev/null
docker image inspect --format "$tag: {{.Size}} bytes" "$tag"
