#!/usr/bin/env bash
# The newcomer path on a fresh Debian 12, as far as this machine can give one: a debootstrap
# chroot with only what the README names installed by hand (build-essential and git from
# Debian; this machine's Rust and Go toolchains mounted read-only, as a user would have
# installed them), a fresh clone, then `make dev` and `make test`, each timed. Nothing else
# is copied in: no caches, no Debian packages, no control plane.
#
#   scripts/fresh-machine.sh [run|shell|clean]
#
# Needs root (it installs debootstrap when missing), and this machine's own PostgreSQL, RabbitMQ and local stack
# stopped (`scripts/stack.sh down`, `scripts/services.sh down`): the chroot shares the
# network, so the same ports. What it is not: a fresh kernel, or a machine without this
# one's sysctls; and it trusts this machine's extra CAs (an egress proxy's), as any machine
# on this network must. Logs in $ROOT/root/fresh-*.log.
set -euo pipefail

ROOT=${CONVEYOR_FRESH_ROOT:-/srv/fresh}
REPO=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
RUSTUP=${RUSTUP_HOME:-$HOME/.rustup}
CARGO_BIN=${CARGO_HOME:-$HOME/.cargo}/bin
GOROOT_HOST=$(go env GOROOT)

log() { echo "fresh-machine: $*" >&2; }

[ "$(id -u)" = 0 ] || { log "run as root (debootstrap, chroot, mounts)"; exit 1; }
# shellcheck source=lib/tools.sh
. "$REPO/scripts/lib/tools.sh"
need_packages debootstrap=debootstrap

mounted() { mountpoint -q "$1"; }

mount_all() {
  mounted "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
  mounted "$ROOT/sys" || mount -t sysfs sys "$ROOT/sys"
  mounted "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
  mounted "$ROOT/dev/pts" || mount -t devpts devpts "$ROOT/dev/pts"
  mounted "$ROOT/dev/shm" || mount -t tmpfs -o size=2g shm "$ROOT/dev/shm"
  mkdir -p "$ROOT/root/.rustup" "$ROOT/usr/local/go"
  mounted "$ROOT/root/.rustup" || mount --bind -o ro "$RUSTUP" "$ROOT/root/.rustup"
  mounted "$ROOT/usr/local/go" || mount --bind -o ro "$GOROOT_HOST" "$ROOT/usr/local/go"
}

# What the chroot left running (the stack `make dev` leaves up, the services, epmd) holds
# this machine's ports: stopped politely, then killed.
stop_chroot() {
  in_chroot 'cd /root/conveyor 2>/dev/null && scripts/stack.sh down; scripts/services.sh down' >/dev/null 2>&1 || true
  local pid
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$ROOT" ] && kill -9 "$pid" 2>/dev/null
  done
  return 0
}

unmount_all() {
  for m in usr/local/go root/.rustup dev/shm dev/pts dev sys proc; do
    mounted "$ROOT/$m" && umount -l "$ROOT/$m"
  done
  return 0
}

in_chroot() {
  chroot "$ROOT" env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
    PATH=/root/.cargo/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    bash -c "$1"
}

prepare() {
  if [ ! -x "$ROOT/usr/bin/apt-get" ]; then
    log "debootstrap of Debian 12 into $ROOT"
    debootstrap --variant=minbase bookworm "$ROOT" http://deb.debian.org/debian >/dev/null
  fi
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  mount_all
  log "installing what the README names: build-essential, git"
  in_chroot 'apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q build-essential git ca-certificates >/dev/null'
  # A network that answers TLS through an egress proxy needs its CA trusted, here as on
  # this machine (where crates.io's certificate comes signed by the proxy's CA).
  if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    mkdir -p "$ROOT/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
    in_chroot 'update-ca-certificates >/dev/null 2>&1'
  fi
  mkdir -p "$ROOT/root/.cargo/bin"
  cp -a "$CARGO_BIN/." "$ROOT/root/.cargo/bin/"
  if [ ! -d "$ROOT/root/conveyor" ]; then
    git clone -q "$REPO" "$ROOT/root/conveyor"
  else
    git -C "$ROOT/root/conveyor" pull -q --ff-only
  fi
}

timed() {
  local name=$1 command=$2 began status
  began=$(date +%s)
  log "$name: $command (log: $ROOT/root/fresh-$name.log)"
  set +e
  in_chroot "cd /root/conveyor && $command" >"$ROOT/root/fresh-$name.log" 2>&1
  status=$?
  set -e
  log "$name: exit $status after $(( ($(date +%s) - began) / 60 )) minutes"
  return $status
}

case "${1:-run}" in
  run)
    prepare
    trap 'stop_chroot; unmount_all' EXIT
    timed dev "make dev"
    timed test "CI=true make test </dev/null"
    ;;
  shell) prepare; trap 'stop_chroot; unmount_all' EXIT; in_chroot 'cd /root/conveyor && exec bash -i';;
  clean)
    [ -d "$ROOT" ] || exit 0
    mount_all
    stop_chroot
    unmount_all
    # Never remove through a mount (its /dev is this machine's).
    if grep -q " $ROOT/" /proc/mounts; then log "still mounted under $ROOT: not removing"; exit 1; fi
    rm -rf "$ROOT"
    ;;
  *) echo "usage: $0 [run|shell|clean]" >&2; exit 2;;
esac
