#!/usr/bin/env bash
# The Prometheus operator's CRDs (ServiceMonitor, PodMonitor, PrometheusRule), so that the
# e2e suite's server-side dry run checks the chart's monitors against their real schemas.
# The module proxy serves the operator's API types but not its YAML: controller-gen (from
# sigs.k8s.io/controller-tools) generates the CRDs from the types, once, cached beside the
# control plane. Prints the directory of the YAML files.
set -euo pipefail
cd "$(dirname "$0")/.."
MONITORING_VERSION=${MONITORING_VERSION:-v0.95.2}
CONTROLLER_TOOLS_VERSION=${CONTROLLER_TOOLS_VERSION:-v0.23.0}
CACHE=${CONVEYOR_CACHE:-$HOME/.cache/conveyor}
OUT="$CACHE/monitoring-crds/$MONITORING_VERSION"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod

if ls "$OUT"/*podmonitors.yaml >/dev/null 2>&1; then echo "$OUT"; exit 0; fi
. scripts/lib/tools.sh
need_toolchains go
printf 'cluster: generating the Prometheus operator %s CRDs (once)\n' "$MONITORING_VERSION" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
GOBIN="$work/bin" go install "sigs.k8s.io/controller-tools/cmd/controller-gen@$CONTROLLER_TOOLS_VERSION" >&2
src=$(go mod download -json "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring@$MONITORING_VERSION" |
  sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
# A writable copy: the module cache is read-only, and controller-gen loads it as a module.
cp -r "$src" "$work/monitoring" && chmod -R u+w "$work/monitoring"
mkdir -p "$OUT"
(cd "$work/monitoring" && go mod download >&2 &&
  "$work/bin/controller-gen" crd:crdVersions=v1,allowDangerousTypes=true,maxDescLen=0 paths=./v1/... output:crd:dir="$OUT" >&2)
ls "$OUT"/*podmonitors.yaml >/dev/null
echo "$OUT"
