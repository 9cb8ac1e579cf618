#!/usr/bin/env bash
# Brings RabbitMQ and PostgreSQL up on loopback, TLS only, for `make dev` and `make test`.
# Idempotent: installs from Debian packages only when missing, makes the dev CA and certificate
# only when absent or expiring, rewrites the config on every run and restarts a service only
# when its config changed, creates users and the database only when absent.
# `services.sh down` stops both. `services.sh reset-broker` wipes RabbitMQ's data (what tests
# left in the dev broker: every queue and policy) and brings it up empty; `restart-broker`
# restarts it with its data. `up` checks that the broker declares a queue, and restarts it
# once if it does not.
set -euo pipefail

AMQP_USER=${CONVEYOR_AMQP_USER:-conveyor}
AMQP_PASSWORD=${CONVEYOR_AMQP_PASSWORD:-conveyor}
PG_USER=${CONVEYOR_PG_USER:-conveyor}
PG_PASSWORD=${CONVEYOR_PG_PASSWORD:-conveyor}
PG_DATABASE=${CONVEYOR_PG_DATABASE:-conveyor}
# Fixed path: clients and tests find the CA here without anything exported.
TLS_DIR=/etc/conveyor/dev-tls

# rabbitmqctl starts epmd when none runs: keep it on loopback too.
export ERL_EPMD_ADDRESS=127.0.0.1

log() { printf 'services: %s\n' "$*" >&2; }
cd "$(dirname "$0")/.."
. scripts/lib/tools.sh
need_packages curl=curl openssl=openssl

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Runs a chatty command, showing its output only when it fails.
quiet() { local out; out=$("$@" 2>&1) || { printf '%s\n' "$out" >&2; return 1; }; }

# Installs stdin as $1 with owner:group $2 and mode $3 unless it is already exactly that, and
# then sets changed=1 so the caller knows to restart. (A global, not the exit status: set -e
# does not apply inside a function called as a condition.)
changed=""
put_file() {
  cat >"$work/put"
  if as_root cmp -s "$work/put" "$1" && [ "$(as_root stat -c '%U:%G %a' "$1")" = "$2 $3" ]; then
    return 0
  fi
  as_root install -o "${2%:*}" -g "${2#*:}" -m "$3" "$work/put" "$1"
  changed=1
}

apt_updated=""
install_packages() {
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]} from Debian packages"
  if [ -z "$apt_updated" ]; then as_root apt-get update -qq; apt_updated=1; fi
  # RUNLEVEL=1 keeps sysvinit package scripts from starting daemons; under systemd a package
  # may still start its service with its defaults, so pg_up and rabbit_up check the running
  # server's settings (max_connections; the config files) and restart it when they differ.
  as_root env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq "${missing[@]}" >/dev/null
}

tls_up() {
  install_packages openssl
  as_root mkdir -p "$TLS_DIR"
  if ! as_root test -s "$TLS_DIR/ca.key" || ! as_root test -s "$TLS_DIR/ca.crt"; then
    log "making the dev CA $TLS_DIR/ca.crt"
    cat >"$work/ca.cnf" <<'CNF'
[req]
distinguished_name = dn
x509_extensions = v3_ca
[dn]
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
CNF
    # umask: the CA key is never readable by anyone but root, not even for a moment.
    as_root sh -c 'umask 077 && openssl genpkey -quiet -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$1"' \
      sh "$TLS_DIR/ca.key"
    as_root openssl req -x509 -new -key "$TLS_DIR/ca.key" -subj "/CN=Conveyor dev CA" -days 3650 -sha256 \
      -config "$work/ca.cnf" -out "$TLS_DIR/ca.crt"
    as_root chmod 600 "$TLS_DIR/ca.key"
    as_root chmod 644 "$TLS_DIR/ca.crt"
    as_root rm -f "$TLS_DIR/server.crt"
  fi
  # 0644: a dev-only key for loopback, which the test suite's gateway also serves with (as the
  # user running the tests). The services get their own copies with the modes they insist on.
  if ! as_root test -s "$TLS_DIR/server.key"; then
    as_root openssl genpkey -quiet -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$TLS_DIR/server.key"
    as_root chmod 644 "$TLS_DIR/server.key"
    as_root rm -f "$TLS_DIR/server.crt"
  fi
  # Re-issue when missing, within 30 days of expiry, not signed by the current CA, or without
  # the address the real node's pods reach the services at (cluster/real-node.sh).
  if ! as_root openssl x509 -checkend $((30 * 86400)) -noout -in "$TLS_DIR/server.crt" >/dev/null 2>&1 ||
    ! as_root openssl x509 -noout -ext subjectAltName -in "$TLS_DIR/server.crt" 2>/dev/null | grep -q "IP Address:10.231.0.1" ||
    ! as_root openssl verify -CAfile "$TLS_DIR/ca.crt" "$TLS_DIR/server.crt" >/dev/null 2>&1; then
    log "issuing the loopback server certificate $TLS_DIR/server.crt"
    # v3 end-entity with a SAN and CA:FALSE: rustls/webpki refuse v1 or CA certs as servers.
    cat >"$work/server.ext" <<'EXT'
[v3_server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost, IP:10.231.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EXT
    as_root openssl req -new -key "$TLS_DIR/server.key" -subj "/CN=localhost" -out "$work/server.csr"
    quiet as_root openssl x509 -req -in "$work/server.csr" -CA "$TLS_DIR/ca.crt" -CAkey "$TLS_DIR/ca.key" \
      -set_serial "0x$(openssl rand -hex 16)" -days 730 -sha256 \
      -extfile "$work/server.ext" -extensions v3_server -out "$TLS_DIR/server.crt"
    as_root chmod 644 "$TLS_DIR/server.crt"
  fi
}

rabbit_configure() {
  # No rabbitmq user before the package is installed; the call after installing fixes owners.
  local owner=rabbitmq:rabbitmq
  id -u rabbitmq >/dev/null 2>&1 || owner=root:root
  as_root mkdir -p /etc/rabbitmq/tls
  put_file /etc/rabbitmq/tls/ca.crt "$owner" 644 <"$TLS_DIR/ca.crt"
  put_file /etc/rabbitmq/tls/server.crt "$owner" 644 <"$TLS_DIR/server.crt"
  put_file /etc/rabbitmq/tls/server.key "$owner" 600 <"$TLS_DIR/server.key"
  # Loopback only: the AMQP listener, the management API and epmd.
  put_file /etc/rabbitmq/rabbitmq-env.conf root:root 644 <<'CONF'
NODENAME=rabbit@localhost
NODE_IP_ADDRESS=127.0.0.1
export ERL_EPMD_ADDRESS=127.0.0.1
# +sbwt none: schedulers that run out of work sleep instead of spinning; on a small machine
# that PostgreSQL and the workers share, a spinning scheduler takes the cores they need.
SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} +sbwt none +sbwtdcpu none +sbwtdio none"
# Sourced by the server's start script, as the rabbitmq user. Every quorum queue keeps files
# open; at the usual 1024 descriptors a few hundred queues starve new connections (accepted,
# never answered), so take the hard limit.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
CONF
  # TLS only: AMQPS on 5671 and the management API over HTTPS on 15671; no plaintext listener
  # (management opens its default 15672 only when no management.ssl.* is set). No client
  # certificates: users log in with a password.
  put_file /etc/rabbitmq/rabbitmq.conf root:root 644 <<'CONF'
listeners.tcp = none
listeners.ssl.default = 127.0.0.1:5671
ssl_options.cacertfile = /etc/rabbitmq/tls/ca.crt
ssl_options.certfile = /etc/rabbitmq/tls/server.crt
ssl_options.keyfile = /etc/rabbitmq/tls/server.key
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
ssl_options.versions.1 = tlsv1.3
ssl_options.versions.2 = tlsv1.2
management.ssl.ip = 127.0.0.1
management.ssl.port = 15671
management.ssl.cacertfile = /etc/rabbitmq/tls/ca.crt
management.ssl.certfile = /etc/rabbitmq/tls/server.crt
management.ssl.keyfile = /etc/rabbitmq/tls/server.key
management.ssl.versions.1 = tlsv1.3
management.ssl.versions.2 = tlsv1.2
# The largest message: a task (a TaskType's maxPayloadBytes is at most 16 MiB) and its
# envelope. A worker holds at most its prefetch times this, whoever published.
max_message_size = 17825792
# Quorum queues keep every message written since the write-ahead log last rolled over in
# memory, consumed or not: 512 MiB by default, which a steady load fills over an hour, so
# the broker's memory rose for that long (make soak: +24 %). 64 MiB bounds it sooner.
raft.wal_max_size_bytes = 67108864
CONF
  # The broker rewrites this file as its own user when plugins change.
  put_file /etc/rabbitmq/enabled_plugins "$owner" 644 <<<'[rabbitmq_management].'
}

rabbit_running() { as_root rabbitmqctl -q status >/dev/null 2>&1; }

# shutdown, not stop: it waits for the VM to exit, so a start right after does not find the
# node name still taken.
rabbit_stop() { as_root rabbitmqctl -q shutdown >/dev/null || true; }

rabbit_start() {
  as_root env ERL_EPMD_ADDRESS=127.0.0.1 sh -c 'nohup rabbitmq-server >/var/log/rabbitmq/conveyor-start.log 2>&1 &'
  for _ in $(seq 1 120); do rabbit_running && break; sleep 1; done
  as_root rabbitmqctl -q await_startup >/dev/null
}

# Whether the broker declares (and deletes) a quorum queue: after thousands of queues made
# and deleted, or being stopped and killed over and over (`make chaos`), a broker was seen
# running and answering every declaration with INTERNAL_ERROR until it was restarted.
rabbit_declares() {
  local url="https://127.0.0.1:15671/api/queues/%2F/conveyor.health-probe"
  local curl=(curl -s -o /dev/null -w '%{http_code}' --max-time 30 --cacert "$TLS_DIR/ca.crt"
    -u "$AMQP_USER:$AMQP_PASSWORD" -H 'content-type: application/json')
  local code
  code=$("${curl[@]}" -X PUT -d '{"durable":true,"arguments":{"x-queue-type":"quorum"}}' "$url")
  case "$code" in 201|204) ;; *) return 1;; esac
  code=$("${curl[@]}" -X DELETE "$url")
  case "$code" in 204|404) return 0;; *) return 1;; esac
}

rabbit_restart() {
  rabbit_stop
  rabbit_start
}

rabbit_up() {
  # Configure before installing: on a machine with systemd the package starts the broker
  # right away, and it must come up on loopback with TLS only.
  dpkg -s rabbitmq-server >/dev/null 2>&1 || { as_root mkdir -p /etc/rabbitmq; rabbit_configure; }
  install_packages rabbitmq-server
  changed=""
  rabbit_configure
  if ! rabbit_running; then
    log "starting RabbitMQ"
    rabbit_start
  elif [ -n "$changed" ]; then
    log "restarting RabbitMQ for its new config"
    rabbit_stop
    rabbit_start
  fi
  if ! as_root rabbitmqctl -q list_users | awk '{print $1}' | grep -qx "$AMQP_USER"; then
    log "creating RabbitMQ user $AMQP_USER"
    as_root rabbitmqctl -q add_user "$AMQP_USER" "$AMQP_PASSWORD" >/dev/null
    as_root rabbitmqctl -q set_user_tags "$AMQP_USER" administrator >/dev/null
  fi
  as_root rabbitmqctl -q set_permissions -p / "$AMQP_USER" '.*' '.*' '.*' >/dev/null
  # The management listener comes up a moment after the node.
  for _ in $(seq 1 30); do rabbit_declares && return 0; sleep 1; done
  log "RabbitMQ runs but does not declare a queue: restarting it"
  rabbit_restart
  for _ in $(seq 1 30); do rabbit_declares && return 0; sleep 1; done
  log "RabbitMQ still declares no queue after a restart; see /var/log/rabbitmq/ (scripts/services.sh reset-broker wipes its data)"
  return 1
}

pg_version() { ls /usr/lib/postgresql 2>/dev/null | sort -n | tail -1; }

pg_up() {
  install_packages postgresql postgresql-contrib
  local ver; ver=$(pg_version)
  local etc=/etc/postgresql/$ver/main
  if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$ver main"; then
    as_root pg_createcluster "$ver" main >/dev/null
  fi
  changed=""
  # A quarter of the memory, at most 1 GB (a small VM must still start it).
  local shared_buffers_mb
  shared_buffers_mb=$(awk '/MemTotal/ {m = int($2 / 4096); print (m > 1024 ? 1024 : (m < 128 ? 128 : m))}' /proc/meminfo)
  # lz4 from PostgreSQL 15 on (cheaper than pglz); the older ones have only pglz.
  local wal_compression=on
  [ "$ver" -ge 15 ] && wal_compression=lz4
  # PostgreSQL refuses a key that group or others can read.
  put_file "$etc/conveyor-server.crt" postgres:postgres 644 <"$TLS_DIR/server.crt"
  put_file "$etc/conveyor-server.key" postgres:postgres 600 <"$TLS_DIR/server.key"
  # Loopback only, TLS only, and enough connections for parallel tests with a database each.
  put_file "$etc/conf.d/conveyor.conf" postgres:postgres 644 <<CONF
listen_addresses = '127.0.0.1'
max_connections = 400
idle_in_transaction_session_timeout = '60s'
ssl = on
ssl_cert_file = '$etc/conveyor-server.crt'
ssl_key_file = '$etc/conveyor-server.key'
ssl_min_protocol_version = 'TLSv1.2'
# Tuned for the task load (measured by make bench, docs/benchmarks.md); durability untouched:
# synchronous_commit stays on and every table stays logged.
# The hot rows (recent tasks, today's audit partition, their indexes) stay in memory.
shared_buffers = '${shared_buffers_mb}MB'
# Fewer checkpoints under a sustained write load, so fewer full-page images in the WAL.
max_wal_size = '4GB'
min_wal_size = '1GB'
checkpoint_timeout = '15min'
# The full-page images that remain are compressed: fewer WAL bytes per task.
wal_compression = $wal_compression
# tasks churns (several versions per task): vacuum it often, throttled ten times less than
# the default (cost limit 2000 instead of 200, the 2 ms delay kept).
autovacuum_naptime = '10s'
autovacuum_vacuum_cost_limit = 2000
# Counts statements per database for make bench (a few per cent of one statement's cost).
shared_preload_libraries = 'pg_stat_statements'
pg_stat_statements.track = top
CONF
  # Our dev cluster, so the whole file: peer on the socket (for `runuser -u postgres -- psql`),
  # passwords over TLS on loopback TCP, and any TCP connection without TLS refused outright.
  put_file "$etc/pg_hba.conf" postgres:postgres 640 <<'CONF'
# Written by scripts/services.sh.
local     all  postgres                peer
local     all  all                     peer
hostssl   all  all       127.0.0.1/32  scram-sha-256
hostnossl all  all       all           reject
CONF
  if ! pg_lsclusters -h | awk '$1=="'"$ver"'" && $2=="main" {print $4}' | grep -qx online; then
    log "starting PostgreSQL $ver"
    as_root pg_ctlcluster "$ver" main start || log "PostgreSQL $ver is still starting"
  elif [ -n "$changed" ]; then
    log "restarting PostgreSQL $ver for its new config"
    as_root pg_ctlcluster "$ver" main restart || log "PostgreSQL $ver is still starting"
  fi
  # After a crash the server first fsyncs its data directory, which can outlast pg_ctl's
  # one-minute wait: wait for it to take connections.
  local ready=""
  for _ in $(seq 1 300); do
    if as_root env -C / runuser -u postgres -- pg_isready -q; then ready=1; break; fi
    sleep 1
  done
  [ -n "$ready" ] || { log "PostgreSQL $ver did not start: see /var/log/postgresql/postgresql-$ver-main.log"; exit 1; }
  # From /: postgres may not enter the caller's directory (root's home) and says so.
  local psql=(as_root env -C / runuser -u postgres -- psql -v ON_ERROR_STOP=1 -qtAX)
  # The settings must be the running server's, not only the file's: a server the package
  # started (or that another tool restarted) may still run with its defaults.
  if [ "$("${psql[@]}" -c 'SHOW max_connections')" != 400 ]; then
    log "PostgreSQL $ver runs without this script's settings; restarting it"
    as_root pg_ctlcluster "$ver" main restart
    [ "$("${psql[@]}" -c 'SHOW max_connections')" = 400 ] ||
      { log "PostgreSQL $ver ignores $etc/conf.d/conveyor.conf (is include_dir = 'conf.d' in $etc/postgresql.conf?)"; exit 1; }
  fi
  if [ -z "$("${psql[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname='$PG_USER'")" ]; then
    log "creating PostgreSQL role $PG_USER"
    "${psql[@]}" -c "CREATE ROLE $PG_USER LOGIN CREATEDB CREATEROLE PASSWORD '$PG_PASSWORD'"
  fi
  # scram-sha-256 in pg_hba.conf admits only SCRAM verifiers: re-set a password stored as md5
  # (or never set) by an older setup.
  if [ -n "$("${psql[@]}" -c "SELECT 1 FROM pg_authid WHERE rolname='$PG_USER'
      AND (rolpassword IS NULL OR rolpassword NOT LIKE 'SCRAM-SHA-256\$%')")" ]; then
    log "storing the password of PostgreSQL role $PG_USER as SCRAM"
    "${psql[@]}" -c "SET password_encryption = 'scram-sha-256'" -c "ALTER ROLE $PG_USER PASSWORD '$PG_PASSWORD'"
  fi
  # CREATEROLE: `conveyorctl grant` makes each namespace's least-privilege role.
  "${psql[@]}" -c "ALTER ROLE $PG_USER CREATEROLE"
  if [ -z "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname='$PG_DATABASE'")" ]; then
    log "creating database $PG_DATABASE"
    "${psql[@]}" -c "CREATE DATABASE $PG_DATABASE OWNER $PG_USER"
  fi
  # Databases that test runs left behind (an interrupted run, a failed chaos scenario's kept
  # for inspection) once a day old and unused: hundreds of them slow every restart's fsync.
  drop_test_databases '1 day'
  # make bench reads statement counts here, for every database.
  "${psql[@]}" -d postgres -c "SET client_min_messages = warning" -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"
}

# Drops the unused test databases older than $1 (an interval). Autovacuum visits every
# database each naptime (10 s here), so 150 of them left by a test run take CPU from whatever
# runs next: make bench drops them all first (its batch phase ran a quarter slower beside them).
drop_test_databases() {
  local psql=(as_root env -C / runuser -u postgres -- psql -v ON_ERROR_STOP=1 -qtAX)
  "${psql[@]}" -d postgres -c "SELECT datname FROM pg_database WHERE datname LIKE 'conveyor\_test\_%'
      AND (pg_stat_file('base/' || oid || '/PG_VERSION')).modification < now() - interval '$1'
      AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = pg_database.datname)" |
    while read -r stale; do "${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS \"$stale\""; done
}

down() {
  rabbit_running && { log "stopping RabbitMQ"; rabbit_stop; }
  local ver; ver=$(pg_version)
  [ -n "$ver" ] && as_root pg_ctlcluster "$ver" main stop 2>/dev/null && log "stopped PostgreSQL" || true
}

case "${1:-up}" in
  # jq: the example handlers (and their tests) read payloads with it. faketime: the e2e
  # suite runs an operator with a skewed clock.
  up)
    install_packages jq faketime
    tls_up
    pg_up
    rabbit_up
    log "PostgreSQL on 127.0.0.1:5432 (TLS only), RabbitMQ on 127.0.0.1:5671 (AMQPS; management https://127.0.0.1:15671), CA $TLS_DIR/ca.crt"
    ;;
  down) down;;
  drop-test-databases) drop_test_databases '0 seconds';;
  # Thousands of left-over queues and policies make each policy write take seconds.
  # After a full chaos run: the broker restarted with its data (see rabbit_declares).
  restart-broker)
    rabbit_running && { log "restarting RabbitMQ"; rabbit_restart; }
    rabbit_up
    ;;
  reset-broker)
    rabbit_running && { log "stopping RabbitMQ"; rabbit_stop; }
    as_root sh -c 'rm -rf /var/lib/rabbitmq/mnesia/rabbit@localhost /var/lib/rabbitmq/mnesia/rabbit@localhost-*'
    rabbit_up
    log "RabbitMQ is up with an empty vhost"
    ;;
  *) echo "usage: $0 [up|down|restart-broker|reset-broker|drop-test-databases]" >&2; exit 2;;
esac
