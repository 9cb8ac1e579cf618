#!/usr/bin/env bash
# A Docker engine for building the images (scripts/images.sh): Debian's docker.io, installed
# when missing, and its dockerd started here when none answers. No container network of its
# own: no docker0 bridge, no iptables rules, no masquerading, no forwarding setting (builds
# run with the host's network, as apt on this machine would), so nothing of the host's
# firewall or sysctls changes. It keeps running, like the services; `down` stops it.
#
#   scripts/docker.sh up | down
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/tools.sh

STATE=${CONVEYOR_DOCKER_DIR:-$PWD/.dev/docker}
PID_DIR=$STATE
. scripts/lib/pidfiles.sh
log() { printf 'docker: %s\n' "$*" >&2; }

up() {
  mkdir -p "$STATE"
  need_packages dockerd=docker.io
  if docker info >/dev/null 2>&1; then return 0; fi
  [ "$(id -u)" -eq 0 ] || { log "no Docker engine answers; start one (as root: scripts/docker.sh up)"; exit 1; }
  start_process dockerd "$STATE/dockerd.log" dockerd --bridge=none --iptables=false \
    --ip6tables=false --ip-masq=false --ip-forward=false --host unix:///var/run/docker.sock
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && return 0; sleep 0.5; done
  log "dockerd did not answer within 30 s; see $STATE/dockerd.log"
  exit 1
}

case "${1:-up}" in
  up) up ;;
  down) stop_process dockerd ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
