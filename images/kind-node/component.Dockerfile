# One Kubernetes component's image for the kind node (cluster/kind-node.sh): the binary that
# cluster/build.sh made, on the same Debian 12 base as Conveyor's images (the binaries are
# linked against its glibc). kube-proxy also gets iptables and conntrack (PACKAGES).
ARG BASE=conveyor.local/debian:bookworm
FROM ${BASE}
ARG COMPONENT
ARG PACKAGES=""
RUN if [ -n "$PACKAGES" ]; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $PACKAGES \
      && rm -rf /var/lib/apt/lists/*; \
    fi
COPY bin/${COMPONENT} /usr/local/bin/${COMPONENT}
