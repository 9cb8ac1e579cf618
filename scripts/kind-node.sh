#!/usr/bin/env bash
# The real node's operations that the e2e stories use (cluster/real-node.sh kill-container
# and stop-container), on the node of scripts/e2e-kind.sh's cluster: run inside it through
# the engine that runs it. scripts/lib/kind-suite.sh sets CONVEYOR_NODE_SCRIPT to this.
#
#   scripts/kind-node.sh kill-container ID   a container killed (SIGKILL) through containerd
#   scripts/kind-node.sh stop-container ID   a container's main process stopped (SIGSTOP)
set -euo pipefail
engine=${KIND_EXPERIMENTAL_PROVIDER:-docker}
node=${CONVEYOR_REAL_NODE:?the kind node to act on}
in_node() { "$engine" exec "$node" "$@"; }

case "${1:-}" in
  kill-container) in_node ctr --namespace k8s.io tasks kill --signal KILL "${2:?container id}" ;;
  stop-container)
    pid=$(in_node ctr --namespace k8s.io tasks ls | awk -v id="${2:?container id}" '$1 == id {print $2}')
    [ -n "$pid" ] || { echo "no running container $2 on $node" >&2; exit 1; }
    in_node kill -STOP "$pid" ;;
  *) echo "usage: $0 kill-container ID|stop-container ID" >&2; exit 2 ;;
esac
