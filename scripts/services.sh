#!/usr/bin/env bash
# Brings RabbitMQ and PostgreSQL up on loopback for `make dev` and `make test`.
# Idempotent: installs from Debian packages only when missing, starts only what is stopped,
# creates users and the database only when absent. `services.sh down` stops both.
set -euo pipefail

AMQP_USER=${CONVEYOR_AMQP_USER:-conveyor}
AMQP_PASSWORD=${CONVEYOR_AMQP_PASSWORD:-conveyor}
PG_USER=${CONVEYOR_PG_USER:-conveyor}
PG_PASSWORD=${CONVEYOR_PG_PASSWORD:-conveyor}
PG_DATABASE=${CONVEYOR_PG_DATABASE:-conveyor}

# rabbitmqctl starts epmd when none runs: keep it on loopback too.
export ERL_EPMD_ADDRESS=127.0.0.1

log() { printf 'services: %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_updated=""
install_packages() {
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]} from Debian packages"
  if [ -z "$apt_updated" ]; then as_root apt-get update -qq; apt_updated=1; fi
  # policy-rc.d keeps the package scripts from starting daemons with the wrong settings.
  as_root env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq "${missing[@]}" >/dev/null
}

rabbit_configure() {
  # Loopback only: the AMQP listener, the management API and epmd.
  as_root tee /etc/rabbitmq/rabbitmq-env.conf >/dev/null <<'CONF'
NODENAME=rabbit@localhost
NODE_IP_ADDRESS=127.0.0.1
export ERL_EPMD_ADDRESS=127.0.0.1
SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
# Sourced by the server's start script, as the rabbitmq user. Every quorum queue keeps files
# open; at the usual 1024 descriptors a few hundred queues starve new connections (accepted,
# never answered), so take the hard limit.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
CONF
  as_root tee /etc/rabbitmq/rabbitmq.conf >/dev/null <<'CONF'
listeners.tcp.default = 127.0.0.1:5672
management.tcp.ip = 127.0.0.1
management.tcp.port = 15672
CONF
  echo '[rabbitmq_management].' | as_root tee /etc/rabbitmq/enabled_plugins >/dev/null
}

rabbit_running() { as_root rabbitmqctl -q status >/dev/null 2>&1; }

rabbit_up() {
  # Configure before installing: on a machine with systemd the package starts the broker
  # right away, and it must come up on loopback with the management API.
  dpkg -s rabbitmq-server >/dev/null 2>&1 || { as_root mkdir -p /etc/rabbitmq; rabbit_configure; }
  install_packages rabbitmq-server
  if ! rabbit_running; then
    rabbit_configure
    log "starting RabbitMQ"
    as_root env ERL_EPMD_ADDRESS=127.0.0.1 sh -c 'nohup rabbitmq-server >/var/log/rabbitmq/conveyor-start.log 2>&1 &'
    for _ in $(seq 1 120); do rabbit_running && break; sleep 1; done
    as_root rabbitmqctl -q await_startup >/dev/null
  fi
  if ! as_root rabbitmqctl -q list_users | awk '{print $1}' | grep -qx "$AMQP_USER"; then
    log "creating RabbitMQ user $AMQP_USER"
    as_root rabbitmqctl -q add_user "$AMQP_USER" "$AMQP_PASSWORD" >/dev/null
    as_root rabbitmqctl -q set_user_tags "$AMQP_USER" administrator >/dev/null
  fi
  as_root rabbitmqctl -q set_permissions -p / "$AMQP_USER" '.*' '.*' '.*' >/dev/null
}

pg_version() { ls /usr/lib/postgresql 2>/dev/null | sort -n | tail -1; }

pg_up() {
  install_packages postgresql postgresql-contrib
  local ver; ver=$(pg_version)
  if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$ver main"; then
    as_root pg_createcluster "$ver" main >/dev/null
  fi
  if ! pg_lsclusters -h | awk '$1=="'"$ver"'" && $2=="main" {print $4}' | grep -qx online; then
    log "starting PostgreSQL $ver"
    # Loopback only, and enough connections for parallel tests with a database each.
    as_root tee "/etc/postgresql/$ver/main/conf.d/conveyor.conf" >/dev/null <<'CONF'
listen_addresses = '127.0.0.1'
max_connections = 400
idle_in_transaction_session_timeout = '60s'
CONF
    as_root pg_ctlcluster "$ver" main start
  fi
  local psql=(as_root runuser -u postgres -- psql -v ON_ERROR_STOP=1 -qtAX)
  if [ -z "$("${psql[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname='$PG_USER'")" ]; then
    log "creating PostgreSQL role $PG_USER"
    "${psql[@]}" -c "CREATE ROLE $PG_USER LOGIN CREATEDB CREATEROLE PASSWORD '$PG_PASSWORD'"
  fi
  # CREATEROLE: `conveyorctl grant` makes each namespace's least-privilege role.
  "${psql[@]}" -c "ALTER ROLE $PG_USER CREATEROLE"
  if [ -z "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname='$PG_DATABASE'")" ]; then
    log "creating database $PG_DATABASE"
    "${psql[@]}" -c "CREATE DATABASE $PG_DATABASE OWNER $PG_USER"
  fi
}

down() {
  rabbit_running && { log "stopping RabbitMQ"; as_root rabbitmqctl -q stop >/dev/null || true; }
  local ver; ver=$(pg_version)
  [ -n "$ver" ] && as_root pg_ctlcluster "$ver" main stop 2>/dev/null && log "stopped PostgreSQL" || true
}

case "${1:-up}" in
  # jq: the example handlers (and their tests) read payloads with it.
  up) install_packages jq; pg_up; rabbit_up; log "PostgreSQL on 127.0.0.1:5432, RabbitMQ on 127.0.0.1:5672 (management :15672)";;
  down) down;;
  *) echo "usage: $0 [up|down]" >&2; exit 2;;
esac
