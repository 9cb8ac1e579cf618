#!/bin/sh
# PostgreSQL as the public image starts it: an empty PGDATA is initialised with
# POSTGRES_USER (default postgres) and POSTGRES_PASSWORD (POSTGRES_INITDB_ARGS added),
# POSTGRES_DB is made, and the server listens on every address with
# POSTGRES_HOST_AUTH_METHOD (default scram-sha-256). Arguments go to postgres, with or
# without a leading `postgres`. Not supported: /docker-entrypoint-initdb.d scripts.
set -eu
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is needed (the superuser's password)}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}
if [ "${1:-}" = postgres ]; then shift; fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  mkdir -p "$PGDATA"
  # A volume the user does not own keeps its mode; initdb says so if it matters.
  chmod 700 "$PGDATA" 2>/dev/null || :
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  # shellcheck disable=SC2086 # POSTGRES_INITDB_ARGS is a list of arguments, as in the public image
  initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host="$auth" \
    --encoding=UTF8 --locale=C.UTF-8 ${POSTGRES_INITDB_ARGS:-} -D "$PGDATA" >/dev/null
  rm -f "$pwfile"
  echo "host all all all $auth" >>"$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    # Single-user mode: nothing listens until the database exists.
    echo "CREATE DATABASE \"$db\" OWNER \"$user\"" |
      postgres --single -D "$PGDATA" -j postgres >/dev/null
  fi
  echo "postgres-entrypoint: initialised $PGDATA (user $user, database $db)"
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
