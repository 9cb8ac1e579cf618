#!/bin/sh
# RabbitMQ as the public management image starts it: RABBITMQ_DEFAULT_USER and
# RABBITMQ_DEFAULT_PASS (default guest/guest) may connect from anywhere, and the
# management plugin listens on 15672. The node's files live in HOME (/var/lib/rabbitmq).
set -eu
user=${RABBITMQ_DEFAULT_USER:-guest}
pass=${RABBITMQ_DEFAULT_PASS:-guest}
# The configuration file takes a value to the end of its line, and `#` starts a comment.
case "$user$pass" in
  *'#'* | *' '* | *'
'*)
    echo "rabbitmq-entrypoint: RABBITMQ_DEFAULT_USER and RABBITMQ_DEFAULT_PASS may not hold '#', spaces or newlines" >&2
    exit 1 ;;
esac
cat >"$RABBITMQ_CONFIG_FILE" <<CONF
default_user = $user
default_pass = $pass
loopback_users = none
listeners.tcp.default = 5672
management.tcp.port = 15672
CONF
echo '[rabbitmq_management].' >"$RABBITMQ_ENABLED_PLUGINS_FILE"
exec rabbitmq-server
