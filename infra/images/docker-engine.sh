#!/usr/bin/env bash
# Makes sure a Docker engine answers here (for the container stack test): installs Debian's docker.io and
# debootstrap when missing and starts dockerd. Exits non-zero when no engine could be started.
set -uo pipefail
if docker info >/dev/null 2>&1 && command -v debootstrap >/dev/null; then
  exit 0
fi
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null || exit 1
fi
if ! docker info >/dev/null 2>&1; then
  nohup dockerd >/tmp/sluice-dockerd.log 2>&1 &
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && exit 0
    sleep 1
  done
  echo "dockerd did not answer within 60 s; its log: /tmp/sluice-dockerd.log" >&2
  exit 1
fi
