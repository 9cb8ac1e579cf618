#!/usr/bin/env bash
# Conveyor's container images, from the repository's Dockerfile, on a Debian 12 base made here
# from Debian packages (no image registry is reachable from these machines).
#
#   scripts/images.sh build     every image (make images); prints each with its size
#   scripts/images.sh base      only the base images: Debian 12 and the pod sandbox (pause)
#   scripts/images.sh services  only PostgreSQL and RabbitMQ from Debian's packages (for
#                               manifests/kind; images/services/), made again when their recipe changes
#   scripts/images.sh list      the images, their tags and sizes
#   scripts/images.sh save      every image as one docker-archive tar on stdout (for a node)
#
# Settings:
#   CONVEYOR_IMAGE_PROFILE  cargo profile whose binaries go in: release (default) or debug
#                           (the test tier reuses `make test`'s debug build, debug info stripped)
#   CONVEYOR_IMAGE_TAG      tag besides the version (default dev, what manifests/ names)
#   CONVEYOR_IMAGE_BASE     base image; default: the local one, conveyor.local/debian:bookworm
#                           (debootstrap --variant=minbase; made when missing, then cached)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/tools.sh

PROFILE=${CONVEYOR_IMAGE_PROFILE:-release}
TAG=${CONVEYOR_IMAGE_TAG:-dev}
VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
LOCAL_BASE=conveyor.local/debian:bookworm
BASE=${CONVEYOR_IMAGE_BASE:-$LOCAL_BASE}
# The sandbox image the real node's containerd starts every pod with (images/pause/pause.c).
PAUSE_IMAGE=conveyor.local/pause:1
# Bumped when the recipe of the local base changes, so that an old base is made again.
BASE_RECIPE=2
MIRROR=${CONVEYOR_DEBIAN_MIRROR:-http://deb.debian.org/debian}
CONTEXT=target/images/context
BINARIES="conveyor-gateway conveyor-operator conveyor-worker conveyorctl"
# PostgreSQL and RabbitMQ from Debian 12's packages (images/services/Dockerfile target → image).
SERVICE_IMAGES="postgres:conveyor.local/postgres:15 rabbitmq:conveyor.local/rabbitmq:3"
# Dockerfile target → image name.
IMAGES="conveyor:conveyor gateway:conveyor-gateway operator:conveyor-operator worker:conveyor-worker ctl:conveyorctl video-worker:conveyor-video-worker"

log() { printf 'images: %s\n' "$*" >&2; }
has_image() { docker image inspect "$1" >/dev/null 2>&1; }
label_of() { docker image inspect -f "{{index .Config.Labels \"$2\"}}" "$1" 2>/dev/null; }

# Debian 12 minbase with ca-certificates, as `debian:bookworm-slim` has it, imported into Docker.
local_base() {
  [ "$BASE" = "$LOCAL_BASE" ] || return 0
  [ "$(label_of "$LOCAL_BASE" dev.conveyor.recipe)" = "$BASE_RECIPE" ] && return 0
  need_packages debootstrap=debootstrap
  [ "$(id -u)" -eq 0 ] || { log "debootstrap needs root: run this as root (or sudo) once"; exit 1; }
  local root; root=$(mktemp -d /var/tmp/conveyor-base.XXXXXX)
  trap 'rm -rf "$root"; trap - RETURN' RETURN
  log "making $LOCAL_BASE with debootstrap from $MIRROR (about a minute)"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$MIRROR" >"$root.log" 2>&1 ||
    { log "debootstrap failed; see $root.log"; exit 1; }
  # As the slim image does: no documentation, manuals or translations, now or in later apt steps.
  cat >"$root/etc/dpkg/dpkg.cfg.d/slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
CFG
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/*
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log
  rm -f "$root.log"
  tar --numeric-owner -C "$root" -c . |
    docker import --change "LABEL dev.conveyor.recipe=$BASE_RECIPE" \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["bash"]' - "$LOCAL_BASE" >/dev/null
  docker image prune -f >/dev/null
}

pause_image() {
  [ "$(label_of "$PAUSE_IMAGE" dev.conveyor.source)" = "$(md5sum <images/pause/pause.c | cut -c1-12)" ] && return 0
  need_packages gcc=gcc
  local dir; dir=$(mktemp -d)
  trap 'rm -rf "$dir"; trap - RETURN' RETURN
  gcc -static -Os -Wall -Wextra -Werror -o "$dir/pause" images/pause/pause.c
  strip "$dir/pause"
  tar -C "$dir" --owner=0 --group=0 -c pause |
    docker import --change "LABEL dev.conveyor.source=$(md5sum <images/pause/pause.c | cut -c1-12)" \
      --change 'ENTRYPOINT ["/pause"]' --change 'USER 65535:65535' - "$PAUSE_IMAGE" >/dev/null
  log "made $PAUSE_IMAGE"
}

# The services' images, made again only when their recipe (images/services/) or base changes.
service_images() {
  local recipe pair target ref
  mkdir -p target/images
  recipe=$( (cat images/services/*; docker image inspect -f '{{.Id}}' "$BASE") | md5sum | cut -c1-12)
  for pair in $SERVICE_IMAGES; do
    target=${pair%%:*} ref=${pair#*:}
    [ "$(label_of "$ref" dev.conveyor.recipe)" = "$recipe" ] && continue
    log "building $ref from Debian's packages (once; about a minute)"
    DOCKER_BUILDKIT=0 docker build --network host --build-arg "BASE=$BASE" --target "$target" \
      --label "dev.conveyor.recipe=$recipe" -t "$ref" images/services >"target/images/build-$target.log" 2>&1 ||
      { tail -30 "target/images/build-$target.log" >&2; log "building $ref failed (log: target/images/build-$target.log)"; exit 1; }
  done
}

# The build context: the binaries of $PROFILE (debug info stripped) and the example handlers.
context() {
  mkdir -p "$CONTEXT/bin"
  local b
  for b in $BINARIES; do
    [ -x "target/$PROFILE/$b" ] || { log "target/$PROFILE/$b is missing: build it first (make images does)"; exit 1; }
    # Copied only when rebuilt, so that Docker's cache sees the same bytes.
    if ! [ "$CONTEXT/bin/$b" -nt "target/$PROFILE/$b" ]; then
      objcopy --strip-debug "target/$PROFILE/$b" "$CONTEXT/bin/$b"
    fi
  done
  rm -rf "$CONTEXT/handlers"
  cp -r examples/video-pipeline/handlers "$CONTEXT/handlers"
  cp Dockerfile "$CONTEXT/Dockerfile"
}

build() {
  scripts/docker.sh up
  local_base
  pause_image
  service_images
  context
  local pair target name
  for pair in $IMAGES; do
    target=${pair%%:*} name=${pair#*:}
    log "building $name:$VERSION ($name:$TAG)"
    # The host's network for the apt step of the media layer; no container network exists.
    # The engine's legacy builder (Debian's has no BuildKit); its output only when it fails.
    DOCKER_BUILDKIT=0 docker build --network host --build-arg "BASE=$BASE" --target "$target" \
      --label "org.opencontainers.image.version=$VERSION" --label "dev.conveyor.profile=$PROFILE" \
      -t "$name:$VERSION" -t "$name:$TAG" "$CONTEXT" >"$CONTEXT/../build-$target.log" 2>&1 ||
      { tail -30 "$CONTEXT/../build-$target.log" >&2; log "building $name failed (log: $CONTEXT/../build-$target.log)"; exit 1; }
  done
  # The images a rebuild replaced, untagged now: gone, so that rebuilds do not fill the disk.
  docker image prune -f >/dev/null
  check_versions
  list
}

# Each entrypoint image answers --version with its binary's name and the workspace version.
check_versions() {
  local name expected answer
  for name in conveyor-gateway conveyor-operator conveyor-worker conveyorctl conveyor-video-worker; do
    expected="${name/video-/} $VERSION"
    answer=$(docker run --rm --network none "$name:$TAG" --version 2>&1) || true
    [ "$answer" = "$expected" ] || { log "$name:$TAG --version answered '$answer', not '$expected'"; exit 1; }
  done
}

list() {
  local pair
  for pair in $IMAGES; do
    docker image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' "${pair#*:}:$TAG"
  done
  docker image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' "$PAUSE_IMAGE"
  for pair in $SERVICE_IMAGES; do
    docker image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' "${pair#*:}"
  done
}

save() {
  local pair refs=()
  for pair in $IMAGES; do refs+=("${pair#*:}:$TAG" "${pair#*:}:$VERSION"); done
  for pair in $SERVICE_IMAGES; do refs+=("${pair#*:}"); done
  docker save "${refs[@]}" "$PAUSE_IMAGE"
}

# Docker's ids of the images `save` writes: they change exactly when an image does.
ids() {
  local pair
  for pair in $IMAGES; do docker image inspect -f '{{.Id}}' "${pair#*:}:$TAG"; done
  docker image inspect -f '{{.Id}}' "$PAUSE_IMAGE"
  for pair in $SERVICE_IMAGES; do docker image inspect -f '{{.Id}}' "${pair#*:}"; done
}

case "${1:-build}" in
  build) build ;;
  base) scripts/docker.sh up; local_base; pause_image ;;
  services) scripts/docker.sh up; local_base; service_images ;;
  list) list ;;
  save) save ;;
  ids) ids ;;
  *) echo "usage: $0 build|base|services|list|save|ids" >&2; exit 2 ;;
esac
