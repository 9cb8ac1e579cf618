#!/usr/bin/env bash
# KEDA on the local cluster, as a platform team that brings its own scaler runs it: KEDA's
# operator and its metrics adapter (built from their Go module by cluster/build.sh), its
# CRDs, and the external metrics API registered with the aggregation layer. The e2e suite
# starts it for the test where KEDA scales a WorkerPool through /scale, and stops it after.
#
#   scripts/keda.sh up | down
#
# The local cluster has no Service routing: the APIService points at an ExternalName
# Service whose name is 127.0.0.1, which the aggregator dials itself. The apiserver reaches
# the adapter with its front-proxy certificate (cluster/up.sh); the adapter's serving
# certificate is for keda-metrics-apiserver.keda.svc, signed by a CA of its own that the
# APIService carries. The same certificate secures the operator's gRPC metrics service.
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=${CONVEYOR_DEV_DIR:-$PWD/.dev}
STATE=$DEV/keda
CERTS=$STATE/certs
KUBECONFIG_FILE=$DEV/cluster/kubeconfig
# RabbitMQ's management API serves HTTPS with the dev CA: KEDA's scalers trust it from here.
DEV_CA=${CONVEYOR_CA_FILE:-/etc/conveyor/dev-tls/ca.crt}
GRPC=127.0.0.1:19666
ADAPTER_PORT=19443
NAMESPACE=keda

PID_DIR=$DEV
. scripts/lib/pidfiles.sh
. scripts/lib/certs.sh
log() { printf 'keda: %s\n' "$*" >&2; }

certificates() {
  mkdir -p "$CERTS" "$STATE/scaler-ca"
  cp "$DEV_CA" "$STATE/scaler-ca/ca.crt"
  # KEDA reads ca.crt, tls.crt and tls.key from its certificate directory.
  local_ca_and_cert "$CERTS" ca tls keda-metrics-apiserver \
    "subjectAltName = DNS:keda-metrics-apiserver.keda.svc, DNS:keda-operator.keda.svc.cluster.local, DNS:localhost, IP:127.0.0.1
extendedKeyUsage = serverAuth, clientAuth"
}

start() { # name, command...
  local name=$1; shift
  start_process "$name" "$STATE/$name.log" env KUBECONFIG="$KUBECONFIG_FILE" \
    POD_NAMESPACE=$NAMESPACE KEDA_CLUSTER_OBJECT_NAMESPACE=$NAMESPACE WATCH_NAMESPACE= "$@"
}

api_service() {
  cat <<YAML
apiVersion: v1
kind: Service
metadata: {name: keda-metrics-apiserver, namespace: $NAMESPACE}
spec: {type: ExternalName, externalName: 127.0.0.1}
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: v1beta1.external.metrics.k8s.io}
spec:
  group: external.metrics.k8s.io
  version: v1beta1
  groupPriorityMinimum: 100
  versionPriority: 100
  service: {name: keda-metrics-apiserver, namespace: $NAMESPACE, port: $ADAPTER_PORT}
  caBundle: $(base64 -w0 <"$CERTS/ca.crt")
YAML
}

up() {
  local bin; bin=$(cluster/build.sh)
  [ -s "$KUBECONFIG_FILE" ] || { log "no local cluster yet ($KUBECONFIG_FILE): scripts/stack.sh up first"; exit 1; }
  export KUBECONFIG=$KUBECONFIG_FILE
  certificates
  "$bin/kubectl" apply --server-side --force-conflicts -f "$bin/../share/keda/crds" >/dev/null
  "$bin/kubectl" create namespace "$NAMESPACE" --dry-run=client -o yaml | "$bin/kubectl" apply -f - >/dev/null
  start keda-operator "$bin/keda-operator" --leader-elect=false --zap-encoder=console \
    --enable-cert-rotation=false --cert-dir "$CERTS" --ca-dir "$STATE/scaler-ca" \
    --enable-webhook-patching=false --enable-apiservice-patching=false \
    --metrics-service-bind-address "$GRPC" --metrics-bind-address 127.0.0.1:19081 \
    --health-probe-bind-address 127.0.0.1:19082
  start keda-adapter "$bin/keda-adapter" --secure-port "$ADAPTER_PORT" --bind-address 127.0.0.1 \
    --cert-dir "$CERTS" --tls-cert-file "$CERTS/tls.crt" --tls-private-key-file "$CERTS/tls.key" \
    --metrics-service-address "$GRPC" --port 19080 --zap-encoder=console \
    --lister-kubeconfig "$KUBECONFIG_FILE" --authentication-kubeconfig "$KUBECONFIG_FILE" \
    --authorization-kubeconfig "$KUBECONFIG_FILE"
  api_service | "$bin/kubectl" apply -f - >/dev/null
  for _ in $(seq 1 120); do
    if curl -fsS http://127.0.0.1:19082/readyz >/dev/null 2>&1 &&
      "$bin/kubectl" get --raw /apis/external.metrics.k8s.io/v1beta1 >/dev/null 2>&1; then
      log "ready: the operator, and the external metrics API through the apiserver"
      return 0
    fi
    sleep 1
  done
  log "not ready (the operator's /readyz, or the external metrics API); see $STATE/keda-operator.log and $STATE/keda-adapter.log"
  exit 1
}

down() {
  local bin; bin=$(cluster/build.sh --path)
  # An APIService without its server would fail every discovery, and with it namespace
  # deletion: it goes first.
  if [ -s "$KUBECONFIG_FILE" ] && [ -x "$bin/kubectl" ]; then
    KUBECONFIG=$KUBECONFIG_FILE "$bin/kubectl" delete apiservice v1beta1.external.metrics.k8s.io \
      --ignore-not-found --request-timeout=10s >/dev/null 2>&1 || true
  fi
  for name in keda-adapter keda-operator; do
    if running "$name"; then stop_process "$name"; log "stopped $name"; fi
  done
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 [up|down]" >&2; exit 2 ;;
esac
