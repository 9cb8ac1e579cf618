#!/usr/bin/env bash
# The bigger topology of the cluster-scale chaos scenarios (`make cluster-services`), beside
# the single services of scripts/services.sh (which this brings up first, for the packages,
# the dev CA and the users), all on loopback and TLS only:
#
# - a three-node RabbitMQ cluster, nodes conveyor-1..3@localhost: AMQPS on 5681-5683,
#   management (HTTPS) on 15681-15683, Erlang distribution on 25681-25683, one Erlang cookie
#   (the rabbitmq user's); pause_minority, so a node cut off from the other two stops
#   serving instead of diverging;
# - PostgreSQL 'conveyor-a' on 5442 and 'conveyor-b' on 5443: one the primary, the other its
#   synchronous streaming standby (a commit returns once the standby has it on disk).
#
# Usage: cluster-services.sh up | down | status
#        cluster-services.sh rabbit-start N | rabbit-stop N | rabbit-pid N
#        cluster-services.sh pg-primary | pg-standby   (print the port)
#        cluster-services.sh pg-kill PORT | pg-promote PORT
# `up` is idempotent: it starts what is down, joins nodes not yet in the cluster, and re-makes
# the standby from the primary when it does not stream from it (after a failover the old
# primary comes back as the new one's standby, so the roles alternate between runs).
set -euo pipefail

TLS_DIR=/etc/conveyor/dev-tls
AMQP_USER=${CONVEYOR_AMQP_USER:-conveyor}
AMQP_PASSWORD=${CONVEYOR_AMQP_PASSWORD:-conveyor}
PG_USER=${CONVEYOR_PG_USER:-conveyor}
PG_PASSWORD=${CONVEYOR_PG_PASSWORD:-conveyor}
REPLICATOR=conveyor_replicator
REPLICATOR_PASSWORD=conveyor-replication
NODES=(1 2 3)
PG_PORTS=(5442 5443)
PG_NAMES=(conveyor-a conveyor-b)
RABBIT_ETC=/etc/rabbitmq/conveyor-cluster
RABBIT_VAR=/var/lib/rabbitmq/conveyor-cluster
RABBIT_LOG=/var/log/rabbitmq/conveyor-cluster
export ERL_EPMD_ADDRESS=127.0.0.1

log() { printf 'cluster-services: %s\n' "$*" >&2; }
. "$(dirname "$0")/lib/tools.sh"
here=$(cd "$(dirname "$0")" && pwd)

# ---- RabbitMQ ----------------------------------------------------------------------------

node_name() { echo "conveyor-$1@localhost"; }

# Runs a RabbitMQ command line tool for node $1 as the rabbitmq user (whose home holds the
# cookie every node and tool shares).
rabbit_tool() {
  local n=$1 tool=$2; shift 2
  as_root runuser -u rabbitmq -- env HOME=/var/lib/rabbitmq ERL_EPMD_ADDRESS=127.0.0.1 \
    "/usr/lib/rabbitmq/bin/$tool" -n "$(node_name "$n")" "$@"
}

rabbit_configure() {
  as_root mkdir -p "$RABBIT_ETC" "$RABBIT_VAR" "$RABBIT_LOG"
  as_root chown rabbitmq:rabbitmq "$RABBIT_VAR" "$RABBIT_LOG" "$RABBIT_ETC"
  for n in "${NODES[@]}"; do
    as_root tee "$RABBIT_ETC/node$n.conf" >/dev/null <<CONF
listeners.tcp = none
listeners.ssl.default = 127.0.0.1:568$n
ssl_options.cacertfile = /etc/rabbitmq/tls/ca.crt
ssl_options.certfile = /etc/rabbitmq/tls/server.crt
ssl_options.keyfile = /etc/rabbitmq/tls/server.key
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
management.ssl.ip = 127.0.0.1
management.ssl.port = 1568$n
management.ssl.cacertfile = /etc/rabbitmq/tls/ca.crt
management.ssl.certfile = /etc/rabbitmq/tls/server.crt
management.ssl.keyfile = /etc/rabbitmq/tls/server.key
cluster_partition_handling = pause_minority
CONF
    # Its own env file: the single node's (/etc/rabbitmq/rabbitmq-env.conf) names another node.
    # net_ticktime 10: a node that stops answering is declared down within about 10 s
    # (the default 60 s would keep the others waiting for it a minute).
    as_root tee "$RABBIT_ETC/node$n-env.conf" >/dev/null <<CONF
NODENAME=$(node_name "$n")
SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} -kernel net_ticktime 10 +sbwt none +sbwtdcpu none +sbwtdio none"
ulimit -n "\$(ulimit -Hn)" 2>/dev/null || true
CONF
  done
  echo '[rabbitmq_management].' | as_root tee "$RABBIT_ETC/enabled_plugins" >/dev/null
  as_root chown rabbitmq:rabbitmq "$RABBIT_ETC/enabled_plugins"
}

rabbit_running() { rabbit_tool "$1" rabbitmqctl -q status >/dev/null 2>&1; }
# The node's VM answers, whether or not RabbitMQ runs in it (pause_minority stops RabbitMQ in
# a node left alone, and keeps the VM).
rabbit_vm_up() { rabbit_tool "$1" rabbitmqctl -q ping >/dev/null 2>&1; }

# Launches node $1 in the background unless its VM is up.
rabbit_launch() {
  local n=$1
  rabbit_vm_up "$n" && return 0
  log "starting RabbitMQ node $(node_name "$n")"
  as_root runuser -u rabbitmq -- env HOME=/var/lib/rabbitmq ERL_EPMD_ADDRESS=127.0.0.1 \
    RABBITMQ_CONF_ENV_FILE="$RABBIT_ETC/node$n-env.conf" \
    RABBITMQ_NODENAME="$(node_name "$n")" \
    RABBITMQ_CONFIG_FILE="$RABBIT_ETC/node$n.conf" \
    RABBITMQ_DIST_PORT="2568$n" \
    RABBITMQ_MNESIA_BASE="$RABBIT_VAR" \
    RABBITMQ_LOG_BASE="$RABBIT_LOG" \
    RABBITMQ_PID_FILE="$RABBIT_VAR/node$n.pid" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$RABBIT_ETC/enabled_plugins" \
    setsid sh -c 'nohup /usr/lib/rabbitmq/bin/rabbitmq-server >"$1" 2>&1 &' sh "$RABBIT_LOG/node$n-start.log"
}

# Waits for RabbitMQ to run in node $1. A clustered node that was not the last to stop
# waits at boot for a peer: `up` launches every node before waiting for any.
rabbit_await() {
  local n=$1
  for _ in $(seq 1 120); do rabbit_running "$n" && return 0; sleep 1; done
  rabbit_tool "$n" rabbitmqctl -q await_startup >/dev/null ||
    { log "node $n did not start: see $RABBIT_LOG"; exit 1; }
}

rabbit_start() { rabbit_launch "$1"; rabbit_await "$1"; }

rabbit_stop() { rabbit_vm_up "$1" && rabbit_tool "$1" rabbitmqctl -q shutdown >/dev/null || true; }

# The process id of node $1's Erlang VM (what a node failure kills).
rabbit_pid() { as_root cat "$RABBIT_VAR/node$1.pid"; }

rabbit_members() {
  rabbit_tool 1 rabbitmqctl -q cluster_status --formatter json |
    jq -r '.running_nodes[]' 2>/dev/null || true
}

rabbit_up() {
  rabbit_configure
  # A node an interrupted run left paused (SIGSTOP) would answer nothing: resume it.
  for n in "${NODES[@]}"; do
    as_root test -f "$RABBIT_VAR/node$n.pid" && as_root kill -CONT "$(rabbit_pid "$n")" 2>/dev/null || true
  done
  for n in "${NODES[@]}"; do rabbit_launch "$n"; done
  for n in "${NODES[@]}"; do rabbit_await "$n"; done
  for n in 2 3; do
    if ! rabbit_members | grep -qx "$(node_name "$n")"; then
      log "joining $(node_name "$n") to the cluster"
      rabbit_tool "$n" rabbitmqctl -q stop_app >/dev/null
      rabbit_tool "$n" rabbitmqctl -q reset >/dev/null
      rabbit_tool "$n" rabbitmqctl -q join_cluster "$(node_name 1)" >/dev/null
      rabbit_tool "$n" rabbitmqctl -q start_app >/dev/null
    fi
  done
  if ! rabbit_tool 1 rabbitmqctl -q list_users | awk '{print $1}' | grep -qx "$AMQP_USER"; then
    rabbit_tool 1 rabbitmqctl -q add_user "$AMQP_USER" "$AMQP_PASSWORD" >/dev/null
    rabbit_tool 1 rabbitmqctl -q set_user_tags "$AMQP_USER" administrator >/dev/null
  fi
  rabbit_tool 1 rabbitmqctl -q set_permissions -p / "$AMQP_USER" '.*' '.*' '.*' >/dev/null
}

# ---- PostgreSQL --------------------------------------------------------------------------

pg_version() { ls /usr/lib/postgresql | sort -n | tail -1; }
VER=$(pg_version)
pg_data() { echo "/var/lib/postgresql/$VER/$1"; }
psql_at() { # port, sql...
  local port=$1; shift
  as_root runuser -u postgres -- psql -p "$port" -h /var/run/postgresql -v ON_ERROR_STOP=1 -qtAX "$@"
}
pg_online() { as_root runuser -u postgres -- pg_isready -q -h /var/run/postgresql -p "$1"; }
in_recovery() { psql_at "$1" -c 'SELECT pg_is_in_recovery()'; }

pg_configure() { # name, port
  local name=$1 port=$2 etc="/etc/postgresql/$VER/$1"
  if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$VER $name"; then
    as_root pg_createcluster "$VER" "$name" -p "$port" >/dev/null
  fi
  as_root install -o postgres -g postgres -m 644 "$TLS_DIR/server.crt" "$etc/conveyor-server.crt"
  as_root install -o postgres -g postgres -m 600 "$TLS_DIR/server.key" "$etc/conveyor-server.key"
  as_root tee "$etc/conf.d/conveyor.conf" >/dev/null <<CONF
listen_addresses = '127.0.0.1'
max_connections = 300
ssl = on
ssl_cert_file = '$etc/conveyor-server.crt'
ssl_key_file = '$etc/conveyor-server.key'
shared_buffers = '256MB'
max_wal_size = '2GB'
wal_compression = on
# Streaming replication: either node can be the primary or the standby.
wal_level = replica
max_wal_senders = 5
max_replication_slots = 5
hot_standby = on
wal_log_hints = on
CONF
  as_root tee "$etc/pg_hba.conf" >/dev/null <<CONF
# Written by scripts/cluster-services.sh.
local     all          postgres                 peer
local     all          all                      peer
hostssl   replication  $REPLICATOR  127.0.0.1/32  scram-sha-256
hostssl   all          all          127.0.0.1/32  scram-sha-256
hostnossl all          all          all           reject
CONF
  as_root chown postgres:postgres "$etc/pg_hba.conf"
}

pg_start() { # name, port
  pg_online "$2" && return 0
  as_root pg_ctlcluster "$VER" "$1" start || true
  for _ in $(seq 1 120); do pg_online "$2" && return 0; sleep 1; done
  log "PostgreSQL $1 did not start: see /var/log/postgresql/postgresql-$VER-$1.log"
  exit 1
}

# The port of the node that is the primary (online and not in recovery); empty when none.
pg_primary() {
  for port in "${PG_PORTS[@]}"; do
    if pg_online "$port" && [ "$(in_recovery "$port" 2>/dev/null)" = f ]; then
      echo "$port"
      return 0
    fi
  done
}

pg_name_of() { [ "$1" = "${PG_PORTS[0]}" ] && echo "${PG_NAMES[0]}" || echo "${PG_NAMES[1]}"; }
pg_other() { [ "$1" = "${PG_PORTS[0]}" ] && echo "${PG_PORTS[1]}" || echo "${PG_PORTS[0]}"; }

# Whether the node on $1 streams from the primary on $2.
pg_streams_from() {
  pg_online "$1" && [ "$(in_recovery "$1" 2>/dev/null)" = t ] &&
    [ -n "$(psql_at "$2" -c "SELECT 1 FROM pg_stat_replication WHERE state = 'streaming'")" ]
}

pg_make_standby() { # standby port, primary port
  local port=$1 primary=$2 name data
  name=$(pg_name_of "$port")
  data=$(pg_data "$name")
  log "re-making $name (port $port) as the standby of port $primary"
  as_root pg_ctlcluster "$VER" "$name" stop -m immediate 2>/dev/null || true
  local slot=${name//-/_}
  # The slot of an earlier copy: its walsender may still be exiting after the stop.
  for _ in $(seq 1 30); do
    psql_at "$primary" -c "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
        WHERE slot_name = '$slot' AND active" >/dev/null
    psql_at "$primary" -c "SELECT pg_drop_replication_slot('$slot')
        FROM pg_replication_slots WHERE slot_name = '$slot' AND NOT active" >/dev/null 2>&1 || true
    [ -z "$(psql_at "$primary" -c "SELECT 1 FROM pg_replication_slots WHERE slot_name = '$slot'")" ] && break
    sleep 1
  done
  as_root rm -rf "$data"
  # -R writes standby.signal and primary_conninfo; the slot keeps the WAL it has not yet had.
  as_root runuser -u postgres -- env PGPASSWORD="$REPLICATOR_PASSWORD" pg_basebackup \
    -d "host=127.0.0.1 port=$primary user=$REPLICATOR sslmode=verify-full sslrootcert=$TLS_DIR/ca.crt application_name=$slot" \
    -D "$data" -R -X stream -S "$slot" -C -c fast
  as_root runuser -u postgres -- sh -c "echo \"primary_conninfo = 'host=127.0.0.1 port=$primary user=$REPLICATOR password=$REPLICATOR_PASSWORD sslmode=verify-full sslrootcert=$TLS_DIR/ca.crt application_name=$slot'\" >> '$data/postgresql.auto.conf'"
  pg_start "$name" "$port"
}

pg_up() {
  pg_configure "${PG_NAMES[0]}" "${PG_PORTS[0]}"
  pg_configure "${PG_NAMES[1]}" "${PG_PORTS[1]}"
  local primary
  primary=$(pg_primary)
  if [ -z "$primary" ]; then
    # Neither serves writes: start both; a fresh pair starts with a as the primary.
    pg_start "${PG_NAMES[0]}" "${PG_PORTS[0]}"
    primary=$(pg_primary)
    if [ -z "$primary" ]; then
      pg_start "${PG_NAMES[1]}" "${PG_PORTS[1]}"
      primary=$(pg_primary)
    fi
    [ -n "$primary" ] || { log "no PostgreSQL node of the pair is a primary"; exit 1; }
  fi
  # The roles and the synchronous setting live on the primary (and are copied to a standby).
  if [ -z "$(psql_at "$primary" -c "SELECT 1 FROM pg_roles WHERE rolname = '$PG_USER'")" ]; then
    psql_at "$primary" -c "CREATE ROLE $PG_USER LOGIN CREATEDB CREATEROLE PASSWORD '$PG_PASSWORD'"
    psql_at "$primary" -c "CREATE DATABASE conveyor OWNER $PG_USER"
  fi
  if [ -z "$(psql_at "$primary" -c "SELECT 1 FROM pg_roles WHERE rolname = '$REPLICATOR'")" ]; then
    psql_at "$primary" -c "CREATE ROLE $REPLICATOR REPLICATION LOGIN PASSWORD '$REPLICATOR_PASSWORD'"
  fi
  local standby
  standby=$(pg_other "$primary")
  pg_streams_from "$standby" "$primary" || pg_make_standby "$standby" "$primary"
  # Synchronous: a commit the primary acknowledges is on the standby's disk too.
  psql_at "$primary" -c "ALTER SYSTEM SET synchronous_standby_names = '*'" -c "SELECT pg_reload_conf()" >/dev/null
  for _ in $(seq 1 60); do
    [ -n "$(psql_at "$primary" -c "SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync'")" ] && return 0
    sleep 1
  done
  log "the standby on $standby did not become synchronous"
  exit 1
}

# kill -9 of every process of the node on port $1 (a machine gone, not a clean stop).
pg_kill() {
  local name data pid
  name=$(pg_name_of "$1")
  data=$(pg_data "$name")
  pid=$(as_root head -1 "$data/postmaster.pid" 2>/dev/null || true)
  [ -n "$pid" ] && as_root kill -9 "$pid" 2>/dev/null || true
  as_root pkill -9 -f "postgres: $VER/$name" 2>/dev/null || true
}

# What an HA manager does once the primary is gone: promote the standby on $1 and let it
# accept commits alone (no standby to wait for until the old primary rejoins, as Patroni's
# non-strict synchronous mode and CloudNativePG do).
pg_promote() {
  # Fenced first: the old primary, should it start again (a reboot, `down` then `up`), comes
  # up as a standby, never as a second primary that `up` could take for the real one.
  local old; old=$(pg_data "$(pg_name_of "$(pg_other "$1")")")
  as_root runuser -u postgres -- touch "$old/standby.signal"
  psql_at "$1" -c "SELECT pg_promote(wait => true, wait_seconds => 60)" >/dev/null
  psql_at "$1" -c "ALTER SYSTEM SET synchronous_standby_names = ''" -c "SELECT pg_reload_conf()" >/dev/null
}

down() {
  for n in "${NODES[@]}"; do rabbit_stop "$n"; done
  for name in "${PG_NAMES[@]}"; do as_root pg_ctlcluster "$VER" "$name" stop 2>/dev/null || true; done
  log "stopped"
}

status() {
  echo "RabbitMQ cluster: $(rabbit_members | tr '\n' ' ')"
  local primary; primary=$(pg_primary)
  echo "PostgreSQL primary: ${primary:-none}, standby streaming: $(
    [ -n "$primary" ] && pg_streams_from "$(pg_other "$primary")" "$primary" && echo yes || echo no)"
}

case "${1:-up}" in
  up)
    "$here/services.sh" up
    rabbit_up
    pg_up
    log "RabbitMQ cluster on 127.0.0.1:5681-5683 (management 15681-15683), PostgreSQL primary on $(pg_primary), standby on $(pg_other "$(pg_primary)")"
    ;;
  down) down ;;
  status) status ;;
  rabbit-start) rabbit_configure; rabbit_start "$2" ;;
  rabbit-stop) rabbit_stop "$2" ;;
  rabbit-pid) rabbit_pid "$2" ;;
  pg-primary) pg_primary ;;
  pg-standby) p=$(pg_primary); [ -n "$p" ] && pg_other "$p" ;;
  pg-kill) pg_kill "$2" ;;
  pg-promote) pg_promote "$2" ;;
  *) sed -n '2,19p' "$0" >&2; exit 2 ;;
esac
