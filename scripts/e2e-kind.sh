#!/usr/bin/env bash
# `make e2e-kind`: the e2e suite on a kind cluster instead of the local control plane.
# Creates a one-node kind cluster, loads Conveyor's images and PostgreSQL and RabbitMQ's
# (scripts/images.sh: built from Debian's packages), applies manifests/kind, runs the e2e
# binary against it through port-forwards, and deletes the cluster (KIND_KEEP=1 keeps it).
#
# Two ways to run the nodes (decision 0051):
# - docker: kind as users run it, with kind's own node image, where Docker can start a
#   privileged container (an engine whose privileged mode keeps to the capability bounding
#   set, moby#42933). Not run on this project's machines.
# - podman: these machines, where Debian 12's Docker (20.10.24) cannot start a privileged
#   container. The node image is made here (cluster/kind-node.sh), podman's settings are
#   cluster/kind/containers.conf, and everything runs in a network and mount namespace of
#   its own, so kind's bridge, its iptables rules and the forwarding setting are never the
#   host's. The cluster lives as long as this script.
# CONVEYOR_KIND_PROVIDER=docker|podman chooses; by default docker when a privileged
# container starts, podman otherwise. KIND_PUBLIC_IMAGES=1 applies manifests/kind-public
# (the public postgres and rabbitmq images, pulled by the node).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/tools.sh

CLUSTER=${KIND_CLUSTER:-conveyor-e2e}
STATE=$PWD/.dev/kind
log() { printf 'e2e-kind: %s\n' "$*" >&2; }

# The part that runs beside the cluster (in the namespace, on the podman path).
if [ "${1:-}" = --inside ]; then
  shift
  . scripts/lib/kind-suite.sh
  exit 0
fi

BIN=$(cluster/build.sh --kind)
export PATH="$BIN:$PATH"
scripts/docker.sh up
provider=${CONVEYOR_KIND_PROVIDER:-}
if [ -z "$provider" ]; then
  scripts/images.sh base >&2
  if docker run --rm --privileged conveyor.local/debian:bookworm true >/dev/null 2>&1; then
    provider=docker
  else
    provider=podman
  fi
fi
log "nodes run with $provider"
if [ "$provider" = podman ] && [ "$(id -u)" -ne 0 ]; then
  log "the podman path needs root (namespaces, privileged nodes)"; exit 1
fi
mkdir -p "$STATE"

# What the suite needs, built here first (the namespace has no network): the binaries, the
# images, the test binary, and the monitoring CRDs the chart story applies.
cargo build --bins
CONVEYOR_IMAGE_PROFILE=debug scripts/images.sh build
cargo test --no-run -p conveyor-e2e-tests --test e2e
cluster/monitoring-crds.sh >/dev/null

case "$provider" in
  docker)
    export KIND_NODE_IMAGE=${KIND_NODE_IMAGE:-}
    exec "$0" --inside "$@" ;;
  podman)
    need_packages podman=podman runc=runc unshare=util-linux
    export CONTAINERS_CONF=$PWD/cluster/kind/containers.conf KIND_EXPERIMENTAL_PROVIDER=podman
    KIND_NODE_IMAGE=$(cluster/kind-node.sh podman)
    export KIND_NODE_IMAGE KIND_CONFIG=cluster/kind-local.yaml STATE
    mkdir -p "$STATE/modules/upper/modules" "$STATE/modules/work"
    exec unshare --mount --net --propagation private "$0" --inside "$@" ;;
  *) log "CONVEYOR_KIND_PROVIDER is docker or podman, not $provider"; exit 2 ;;
esac
