#!/usr/bin/env bash
# A kind node image made on this machine, for `make e2e-kind` (decision 0051). kind's own
# node images come from a registry, and its base image's recipe starts from Docker Hub and
# clones from GitHub: none of that is reachable here. So the image is assembled from:
#   - Debian 12's packages: systemd, containerd, runc, the CNI plugins, iptables (the base
#     is scripts/images.sh's conveyor.local/debian:bookworm);
#   - kind's node files (its entrypoint and units), from kind's Go module at build time;
#   - kubeadm, the kubelet, kubectl, and images of kube-apiserver, kube-controller-manager,
#     kube-scheduler, kube-proxy, etcd and CoreDNS, from the binaries cluster/build.sh
#     --kind makes, tagged as kubeadm names them; the pause image is images/pause.
# Docker builds it; it is then copied into podman's store when podman runs the nodes. It is
# made again only when its recipe or a binary changes.
#
#   cluster/kind-node.sh [docker|podman]   prints the image's name
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/tools.sh

ENGINE=${1:-docker}
KUBERNETES_VERSION=${KUBERNETES_VERSION:-v1.36.3}
# kubeadm names these; etcd is the version cluster/build.sh builds (the cluster's
# configuration sets kubeadm's etcd image tag to it: cluster/kind-local.yaml).
ETCD_TAG=3.6.16-0
COREDNS_TAG=v1.14.2
PAUSE_TAG=3.10.2
NODE_IMAGE=conveyor.local/kind-node:$KUBERNETES_VERSION
CONTEXT=target/kind-node
log() { printf 'kind-node: %s\n' "$*" >&2; }

BIN=$(cluster/build.sh --kind)
scripts/docker.sh up
scripts/images.sh base >&2
label_of() { "$1" image inspect -f "{{index .Config.Labels \"dev.conveyor.recipe\"}}" "$2" 2>/dev/null; }

# The recipe: this script, images/kind-node, kind's version and every binary that goes in.
recipe=$( (cat "$0" images/kind-node/Dockerfile images/kind-node/component.Dockerfile
  find images/kind-node/files -type f -print0 | sort -z | xargs -0 cat
  "$BIN/kind" version
  docker image inspect -f '{{.Id}}' conveyor.local/debian:bookworm conveyor.local/pause:1
  for b in kubeadm kubelet kubectl kube-apiserver kube-controller-manager kube-scheduler kube-proxy etcd coredns; do
    stat -c '%n %s %Y' "$BIN/$b"
  done) | md5sum | cut -c1-12)

build() {
  log "assembling $NODE_IMAGE (once per recipe; a few minutes)"
  rm -rf "$CONTEXT" && mkdir -p "$CONTEXT/components" "$CONTEXT/node/bin" "$CONTEXT/node/images"
  local component packages tag
  for component in kube-apiserver kube-controller-manager kube-scheduler kube-proxy etcd; do
    mkdir -p "$CONTEXT/components/$component/bin"
    cp "$BIN/$component" "$CONTEXT/components/$component/bin/"
    packages="" tag=$KUBERNETES_VERSION
    [ "$component" = kube-proxy ] && packages="iptables conntrack"
    [ "$component" = etcd ] && tag=$ETCD_TAG
    DOCKER_BUILDKIT=0 docker build -q --network host -f images/kind-node/component.Dockerfile \
      --build-arg "COMPONENT=$component" --build-arg "PACKAGES=$packages" \
      -t "registry.k8s.io/$component:$tag" "$CONTEXT/components/$component" >/dev/null
  done
  # CoreDNS is static: the binary alone, as its own image is.
  mkdir -p "$CONTEXT/components/coredns"
  cp "$BIN/coredns" "$CONTEXT/components/coredns/"
  tar -C "$CONTEXT/components/coredns" --owner=0 --group=0 -c coredns |
    docker import --change 'ENTRYPOINT ["/coredns"]' - "registry.k8s.io/coredns/coredns:$COREDNS_TAG" >/dev/null
  docker tag conveyor.local/pause:1 "registry.k8s.io/pause:$PAUSE_TAG"
  docker save -o "$CONTEXT/node/images/control-plane.tar" \
    "registry.k8s.io/kube-apiserver:$KUBERNETES_VERSION" "registry.k8s.io/kube-controller-manager:$KUBERNETES_VERSION" \
    "registry.k8s.io/kube-scheduler:$KUBERNETES_VERSION" "registry.k8s.io/kube-proxy:$KUBERNETES_VERSION" \
    "registry.k8s.io/etcd:$ETCD_TAG" "registry.k8s.io/coredns/coredns:$COREDNS_TAG" "registry.k8s.io/pause:$PAUSE_TAG"
  cp "$BIN/kubeadm" "$BIN/kubelet" "$BIN/kubectl" "$CONTEXT/node/bin/"
  # kind's node files, from the module `go install` fetched kind from.
  local kind_module
  kind_module=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kind@$("$BIN/kind" version | awk '{print $2}')" |
    sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
  cp -r "$kind_module/images/base/files" "$CONTEXT/node/kind"
  chmod -R u+w "$CONTEXT/node/kind"
  rm -rf "$CONTEXT/node/kind/LICENSES"
  cp -r images/kind-node/files "$CONTEXT/node/files"
  DOCKER_BUILDKIT=0 docker build --network host -f images/kind-node/Dockerfile \
    --build-arg "KUBERNETES_VERSION=$KUBERNETES_VERSION" --label "dev.conveyor.recipe=$recipe" \
    -t "$NODE_IMAGE" "$CONTEXT/node" >"$CONTEXT/build.log" 2>&1 ||
    { tail -30 "$CONTEXT/build.log" >&2; log "building $NODE_IMAGE failed (log: $CONTEXT/build.log)"; exit 1; }
  rm -rf "$CONTEXT/components" "$CONTEXT/node/images" "$CONTEXT/node/bin"
}

# (`if`, not `||`: a failed step inside build must stop the script, not be cached.)
if [ "$(label_of docker "$NODE_IMAGE")" != "$recipe" ]; then build; fi
if [ "$ENGINE" = podman ] && [ "$(label_of podman "$NODE_IMAGE")" != "$recipe" ]; then
  log "copying $NODE_IMAGE into podman's store"
  docker save "$NODE_IMAGE" | podman load >/dev/null
fi
echo "$NODE_IMAGE"
