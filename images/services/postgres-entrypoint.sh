#!/bin/sh
# PostgreSQL as the public image starts it: an empty PGDATA is initialised with
# POSTGRES_USER (default postgres) and POSTGRES_PASSWORD, POSTGRES_DB is made, and the
# server listens on every address with password authentication. Arguments go to postgres.
set -eu
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is needed (the superuser's password)}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  mkdir -p "$PGDATA"
  chmod 700 "$PGDATA"
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 -D "$PGDATA" >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    # Single-user mode: nothing listens until the database exists.
    echo "CREATE DATABASE \"$db\" OWNER \"$user\"" |
      postgres --single -D "$PGDATA" -j postgres >/dev/null
  fi
  echo "postgres-entrypoint: initialised $PGDATA (user $user, database $db)"
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
