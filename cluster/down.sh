#!/usr/bin/env bash
# Stops what cluster/up.sh started and waits until the processes are gone (so that their
# ports are free again). State stays in $STATE; remove it for a fresh cluster.
set -uo pipefail
cd "$(dirname "$0")/.."
STATE=${CONVEYOR_CLUSTER_DIR:-$PWD/.dev/cluster}
kwoks=$(cd "$STATE" 2>/dev/null && ls kwok*.pid 2>/dev/null | sed 's/\.pid$//')
for name in $kwoks kube-scheduler kube-controller-manager kube-apiserver etcd; do
  pidfile="$STATE/$name.pid"
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if kill -TERM "$pid" 2>/dev/null; then
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null
    printf 'cluster: stopped %s\n' "$name"
  fi
  rm -f "$pidfile"
done
