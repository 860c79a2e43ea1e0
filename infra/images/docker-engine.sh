#!/usr/bin/env bash
# Makes sure a Docker engine answers here (for the container stack test): installs Debian's docker.io and
# debootstrap when missing and starts dockerd. Exits non-zero when no engine could be started.
set -uo pipefail
IDLE_CGROUP=/sys/fs/cgroup/cpu/sluice-docker
if docker info >/dev/null 2>&1 && command -v debootstrap >/dev/null; then
  exit 0
fi
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null || exit 1
fi
if ! docker info >/dev/null 2>&1; then
  # The engine's containers, an image build's steps among them, take only the CPU the tests leave (`make test` builds
  # the container test's image while the other tiers run): a CPU cgroup of weight 2 (of 1024) as their parent (cgroup
  # v1, as on CI's machines; elsewhere the usual weight), and the daemon itself at niceness 19.
  parent=()
  if mkdir -p "$IDLE_CGROUP" 2>/dev/null && echo 2 >"$IDLE_CGROUP/cpu.shares" 2>/dev/null; then
    parent=(--cgroup-parent="/${IDLE_CGROUP##*/}")
  fi
  nohup nice -n 19 dockerd "${parent[@]}" >/tmp/sluice-dockerd.log 2>&1 &
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && exit 0
    sleep 1
  done
  echo "dockerd did not answer within 60 s; its log: /tmp/sluice-dockerd.log" >&2
  exit 1
fi
