# Conveyor's images, built by `make images` (scripts/images.sh) from binaries compiled once
# outside (a code change copies new binaries in; no layer below that rebuilds). The build
# context is the folder scripts/images.sh assembles: bin/ (the four binaries) and handlers/
# (the example video pipeline's exec handlers).
#
# Targets, each running as the non-root user 65532:
#   conveyor          every binary, no entrypoint (the chart and manifests name the command)
#   gateway, operator, worker, ctl
#                     one binary each as the entrypoint: `docker run IMAGE --version`
#   video-worker      conveyor-worker with ffmpeg, ffprobe, jq and the example handlers
#
# BASE is a Debian 12 root: `make images` makes one from Debian packages (debootstrap, no
# registry needed); elsewhere the public image works the same: --build-arg BASE=debian:bookworm-slim.
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS base
# The local base already has ca-certificates (scripts/images.sh includes it); the public one
# gets it here. The user owns nothing: binaries are root's and read-only to it.
RUN if ! [ -s /etc/ssl/certs/ca-certificates.crt ]; then \
      apt-get update && apt-get install -y --no-install-recommends ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --gid 65532 conveyor \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin conveyor

# Before any binary, so that a code change never reinstalls ffmpeg.
FROM base AS media
RUN apt-get update \
 && apt-get install -y --no-install-recommends ffmpeg jq \
 && rm -rf /var/lib/apt/lists/*
COPY handlers/ /usr/local/lib/conveyor/handlers/

FROM base AS conveyor
COPY bin/ /usr/local/bin/
USER 65532:65532

FROM conveyor AS gateway
ENTRYPOINT ["conveyor-gateway"]

FROM conveyor AS operator
ENTRYPOINT ["conveyor-operator"]

FROM conveyor AS worker
ENTRYPOINT ["conveyor-worker"]

FROM conveyor AS ctl
ENTRYPOINT ["conveyorctl"]

FROM media AS video-worker
COPY bin/conveyor-worker /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["conveyor-worker"]
