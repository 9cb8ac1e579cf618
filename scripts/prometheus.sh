#!/usr/bin/env bash
# A Prometheus on loopback that scrapes the local stack the way the chart's monitors do in a
# cluster (charts/conveyor/templates/monitors.yaml): the gateway's and the operator's admin
# ports, and every running worker pod the local apiserver lists (pods labelled
# conveyor.dev/pool, their `metrics` port), with namespace, pod and pool labels. It loads the
# chart's alerting rules. Debian's prometheus package, installed when missing. The e2e suite
# runs every dashboard panel's query and promtool's rule tests against it.
#
#   scripts/prometheus.sh up | down | url
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=${CONVEYOR_DEV_DIR:-$PWD/.dev}
STATE=$DEV/prometheus
LISTEN=${CONVEYOR_PROMETHEUS_LISTEN:-127.0.0.1:9099}
GATEWAY_ADMIN=${CONVEYOR_GATEWAY_ADMIN_LISTEN:-127.0.0.1:8082}
OPERATOR=${CONVEYOR_OPERATOR_LISTEN:-127.0.0.1:8081}
KUBECONFIG_FILE=$DEV/cluster/kubeconfig
RULES=$PWD/charts/conveyor/files/prometheus/rules.yaml

. scripts/lib/tools.sh
PID_DIR=$DEV
. scripts/lib/pidfiles.sh
log() { printf 'prometheus: %s\n' "$*" >&2; }

config() {
  cat <<YAML
# Written by scripts/prometheus.sh.
global:
  scrape_interval: 5s
  evaluation_interval: 5s
rule_files: ["$RULES"]
scrape_configs:
  - job_name: conveyor-gateway
    static_configs: [{targets: ["$GATEWAY_ADMIN"]}]
  - job_name: conveyor-operator
    # Its series name the namespace and task type or pool they describe.
    honor_labels: true
    static_configs: [{targets: ["$OPERATOR"]}]
  - job_name: conveyor-workers
    # Debian's build has no kubernetes_sd_configs: the worker pods come from a file that
    # list_pods (below) rewrites from the apiserver every 5 s, with the labels a
    # PodMonitor gives them.
    file_sd_configs: [{files: ["$STATE/workers.json"], refresh_interval: 5s}]
YAML
}

# The worker pods that run, as file_sd targets: podIP:<metrics port>, namespace, pod, pool.
list_pods() {
  kubectl get pods -A -l conveyor.dev/pool -o json | jq '[.items[]
    | select(.status.phase == "Running" and .status.podIP != null)
    | {pod: ., port: ([.spec.containers[].ports[]? | select(.name == "metrics") | .containerPort][0])}
    | select(.port != null)
    | {targets: ["\(.pod.status.podIP):\(.port)"],
       labels: {namespace: .pod.metadata.namespace, pod: .pod.metadata.name,
                pool: .pod.metadata.labels["conveyor.dev/pool"]}}]'
}

# Rewrites the targets file every 5 s until killed (atomically: Prometheus may read it at
# any moment).
follow_pods() {
  while true; do
    if list_pods >"$STATE/workers.json.new" 2>>"$STATE/targets.log"; then
      mv "$STATE/workers.json.new" "$STATE/workers.json"
    fi
    sleep 5
  done
}

# Debian's package starts its own prometheus.service on *:9090 where systemd runs: all
# interfaces, and the port every worker pod's metrics listen on. Installed with services
# held back (policy-rc.d), and the packaged service kept stopped and disabled.
install_prometheus() {
  command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 && return 0
  if ! as_root test -e /usr/sbin/policy-rc.d; then
    # Removed however this ends (an interrupt included): left behind, it would keep every
    # later package's service from starting.
    trap 'as_root rm -f /usr/sbin/policy-rc.d' EXIT
    printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
    as_root chmod 755 /usr/sbin/policy-rc.d
  fi
  need_packages prometheus=prometheus promtool=prometheus
}

packaged_service_off() {
  command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ] || return 0
  if systemctl is-enabled --quiet prometheus 2>/dev/null || systemctl is-active --quiet prometheus 2>/dev/null; then
    log "stopping and disabling the packaged prometheus.service (it listens on *:9090)"
    as_root systemctl disable --now prometheus >/dev/null 2>&1 ||
      log "warning: cannot stop prometheus.service; worker pods cannot listen on :9090 while it runs"
  fi
}

up() {
  install_prometheus
  packaged_service_off
  need_packages jq=jq
  PATH=$(cluster/build.sh --path):$PATH
  export KUBECONFIG=$KUBECONFIG_FILE
  [ -s "$KUBECONFIG_FILE" ] || { log "no local cluster yet ($KUBECONFIG_FILE): scripts/stack.sh up first"; exit 1; }
  mkdir -p "$STATE/data"
  config >"$STATE/prometheus.yml.new"
  promtool check config "$STATE/prometheus.yml.new" >/dev/null
  local stamp="$LISTEN $(md5sum <"$STATE/prometheus.yml.new")"
  mv "$STATE/prometheus.yml.new" "$STATE/prometheus.yml"
  if running prometheus; then
    [ "$(cat "$STATE/stamp" 2>/dev/null)" = "$stamp" ] && return 0
    log "restarting for its new config"
    stop_process prometheus
  fi
  [ -s "$STATE/workers.json" ] || echo '[]' >"$STATE/workers.json"
  if ! running prometheus-targets; then
    nohup setsid "$0" follow-pods >>"$STATE/targets.log" 2>&1 &
    echo $! >"$DEV/prometheus-targets.pid"
  fi
  nohup setsid prometheus --config.file="$STATE/prometheus.yml" --storage.tsdb.path="$STATE/data" \
    --storage.tsdb.retention.time=1d --web.listen-address="$LISTEN" >>"$STATE/prometheus.log" 2>&1 &
  echo $! >"$DEV/prometheus.pid"
  echo "$stamp" >"$STATE/stamp"
  for _ in $(seq 1 60); do
    curl -fsS "http://$LISTEN/-/ready" >/dev/null 2>&1 && { log "ready at http://$LISTEN"; return 0; }
    sleep 0.5
  done
  log "not ready at http://$LISTEN; see $STATE/prometheus.log"; exit 1
}

case "${1:-up}" in
  up) up ;;
  down)
    for name in prometheus-targets prometheus; do
      if running "$name"; then stop_process "$name"; log "stopped $name"; fi
    done
    ;;
  follow-pods)
    PATH=$(cluster/build.sh --path):$PATH
    export KUBECONFIG=$KUBECONFIG_FILE
    follow_pods
    ;;
  url) echo "http://$LISTEN" ;;
  *) echo "usage: $0 [up|down|url]" >&2; exit 2 ;;
esac
