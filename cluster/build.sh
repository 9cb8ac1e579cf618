#!/usr/bin/env bash
# Builds the local control plane from Go modules, once per version, into a cache outside the
# clone: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl (k8s.io/kubernetes), etcd
# (go.etcd.io/etcd/server/v3), kwok (sigs.k8s.io/kwok), helm (helm.sh/helm/v4) and KEDA's
# operator and metrics adapter (github.com/kedacore/keda/v2). Prints the bin directory.
#
# `go install` of the kubernetes commands fails on the module's replace directives, so a
# small wrapper module requires k8s.io/kubernetes and replaces every k8s.io staging module
# with its published v0.X.Y twin (the list comes from that version's own go.mod).
set -euo pipefail

KUBERNETES_VERSION=${KUBERNETES_VERSION:-v1.36.3}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
# Helm installs the chart (charts/conveyor) on the local cluster in the e2e suite.
HELM_VERSION=${HELM_VERSION:-v4.3.2}
# KEDA scales a pool through its /scale in the e2e suite, as users who bring it run it.
KEDA_VERSION=${KEDA_VERSION:-v2.21.0}
CACHE=${CONVEYOR_CACHE:-$HOME/.cache/conveyor}
# Bumped whenever the way the binaries are built changes, so that old caches are not reused.
RECIPE=2
BIN="$CACHE/control-plane/k8s-$KUBERNETES_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-r$RECIPE/bin"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
K8S_COMMANDS="kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet"
# `--kind` also builds kind itself and what a kind node image holds besides those
# (cluster/kind-node.sh): kubeadm, kube-proxy and CoreDNS, at the version kubeadm deploys.
COREDNS_VERSION=${COREDNS_VERSION:-v1.14.2}
KIND_VERSION=${KIND_VERSION:-v0.33.0}
KIND_EXTRAS=""
if [ "${1:-}" = --kind ]; then
  K8S_COMMANDS="$K8S_COMMANDS kubeadm kube-proxy"
  KIND_EXTRAS="coredns kind"
  shift
fi

log() { printf 'cluster: %s\n' "$*" >&2; }

# `--path`: where the binaries are (or will be), without building: for commands that only
# stop or print.
if [ "${1:-}" = --path ]; then echo "$BIN"; exit 0; fi

have_all() {
  for b in $K8S_COMMANDS etcd kwok helm keda-operator keda-adapter $KIND_EXTRAS; do
    [ -x "$BIN/$b" ] || return 1
  done
}

if have_all; then echo "$BIN"; exit 0; fi
cd "$(dirname "$0")/.."
. scripts/lib/tools.sh
need_toolchains go
mkdir -p "$BIN"
work=$(mktemp -d)
# A cold build is quiet for most of its half hour: say what it needs, then how it is going.
free_gb=$(df -Pk "$CACHE" | awk 'NR == 2 {print int($4 / 1048576)}')
if ! [ -x "$BIN/kube-apiserver" ]; then
  log "first run: building the control plane from Go modules into $BIN; 10 to 40 minutes on"
  log "2 cores, 4 GB of disk for Go's caches (~/.cache/go-build, ~/go/pkg/mod; $free_gb GB free)"
  log "and up to 3 GB of memory. It is cached: later runs start at once."
fi
[ "$free_gb" -ge 5 ] || log "warning: less than 5 GB free on the disk of $CACHE"
started=$(date +%s)
( while sleep 60; do
    log "still building ($(( ($(date +%s) - started) / 60 )) min; Go build cache $(du -sh "$(go env GOCACHE)" 2>/dev/null | cut -f1))"
  done ) &
ticker=$!
trap 'kill $ticker 2>/dev/null; rm -rf "$work"' EXIT

missing_k8s=""
for b in $K8S_COMMANDS; do [ -x "$BIN/$b" ] || missing_k8s="$missing_k8s $b"; done
if [ -n "$missing_k8s" ]; then
  log "building Kubernetes $KUBERNETES_VERSION (a cold build takes a while)"
  staging_version="v0.${KUBERNETES_VERSION#v1.}"
  gomod=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  mkdir -p "$work/k8s" && cd "$work/k8s"
  go mod init conveyor.dev/control-plane >/dev/null 2>&1
  go mod edit -require="k8s.io/kubernetes@$KUBERNETES_VERSION"
  # Every `k8s.io/x => ./staging/src/k8s.io/x` of kubernetes' go.mod becomes `=> k8s.io/x vX`.
  for module in $(sed -n 's#^[[:space:]]*\(k8s.io/[^[:space:]]*\) => ./staging/src/.*#\1#p' "$gomod"); do
    go mod edit -replace="$module=$module@$staging_version"
  done
  cat > tools.go <<'GO'
//go:build tools

package tools
GO
  packages=""
  for b in $missing_k8s; do packages="$packages k8s.io/kubernetes/cmd/$b"; done
  # shellcheck disable=SC2086 # one word per package
  go get $(for p in $packages; do echo "$p@$KUBERNETES_VERSION"; done) >&2
  # Without these the binaries call themselves v0.0.0-master (the release build stamps them).
  minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
  stamp=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp="$stamp -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    stamp="$stamp -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  # shellcheck disable=SC2086
  go build -trimpath -ldflags="-s $stamp" -o "$BIN/" $packages >&2
fi

if ! [ -x "$BIN/etcd" ]; then
  log "building etcd $ETCD_VERSION"
  # etcd's server module has replace directives too: build it from a wrapper module, where
  # they do not apply and its siblings come at the same version from the proxy.
  mkdir -p "$work/etcd" && cd "$work/etcd"
  go mod init conveyor.dev/etcd >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
  go build -trimpath -ldflags=-s -o "$BIN/etcd" go.etcd.io/etcd/server/v3 >&2
fi

if ! [ -x "$BIN/kwok" ]; then
  log "building kwok $KWOK_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags=-s "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" >&2
fi

if ! [ -x "$BIN/helm" ]; then
  log "building helm $HELM_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags=-s "helm.sh/helm/v4/cmd/helm@$HELM_VERSION" >&2
fi

if ! [ -x "$BIN/keda-operator" ] || ! [ -x "$BIN/keda-adapter" ]; then
  log "building KEDA $KEDA_VERSION (its operator and metrics adapter; a cold build takes a while)"
  # KEDA's go.mod has replace directives, which `go install` refuses and a module requiring
  # KEDA ignores: a wrapper module carries them over (single-line `replace a v => b v` only).
  download=$(go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION")
  gomod=$(echo "$download" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  # Its CRDs beside the binaries, for scripts/keda.sh.
  mkdir -p "$BIN/../share/keda/crds"
  cp "$(echo "$download" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')"/config/crd/bases/*.yaml "$BIN/../share/keda/crds/"
  mkdir -p "$work/keda" && cd "$work/keda"
  go mod init conveyor.dev/keda >/dev/null 2>&1
  go mod edit -require="github.com/kedacore/keda/v2@$KEDA_VERSION"
  if grep -q '^replace *($' "$gomod"; then
    log "KEDA $KEDA_VERSION's go.mod has a replace block, which this script does not carry over"
    exit 1
  fi
  sed -n 's#^replace \([^ ]*\) \([^ ]*\) => \([^ ]*\) \([^ ]*\)$#\1@\2=\3@\4#p' "$gomod" |
    while read -r replacement; do go mod edit -replace="$replacement"; done
  go get "github.com/kedacore/keda/v2/cmd/operator@$KEDA_VERSION" "github.com/kedacore/keda/v2/cmd/adapter@$KEDA_VERSION" >&2
  stamp="-X github.com/kedacore/keda/v2/version.Version=$KEDA_VERSION"
  go build -trimpath -ldflags="-s $stamp" -o "$BIN/keda-operator" github.com/kedacore/keda/v2/cmd/operator >&2
  go build -trimpath -ldflags="-s $stamp" -o "$BIN/keda-adapter" github.com/kedacore/keda/v2/cmd/adapter >&2
fi

if [ -n "$KIND_EXTRAS" ] && ! [ -x "$BIN/coredns" ]; then
  log "building CoreDNS $COREDNS_VERSION"
  GOBIN="$BIN" CGO_ENABLED=0 go install -trimpath -ldflags=-s "github.com/coredns/coredns@$COREDNS_VERSION" >&2
fi
if [ -n "$KIND_EXTRAS" ] && ! [ -x "$BIN/kind" ]; then
  log "building kind $KIND_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags=-s "sigs.k8s.io/kind@$KIND_VERSION" >&2
fi

have_all || { log "some binaries are missing in $BIN"; ls -l "$BIN" >&2; exit 1; }
echo "$BIN"
