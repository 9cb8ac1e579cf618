#!/usr/bin/env bash
# The operator at scale (issues 13 and 32): N TaskTypes and N WorkerPools (autoscaled,
# minReplicas 0, no work: no pods) spread over NAMESPACES namespaces and applied at once on
# the local stack; how long until every TaskType is Ready, then a steady window in which
# the operator's CPU and memory, the apiserver's requests and the operator's broker
# requests are measured from outside the reconcilers (/proc, the apiserver's own metrics
# and audit log, the operator's request counters). Then the operator is killed (-9) and
# started again: what it wrote to the apiserver and declared on the broker until it had
# looked at every object again (nothing changed, so nothing should be written), and a
# steady window after. Everything is deleted again (deletionPolicy Delete, so the operator
# removes the queues), and the script checks that no queue is left. Writes
# docs/operator-scale.md.
#
#   scripts/operator-scale.sh [N] [STEADY_SECONDS] [NAMESPACES]   (needs `make stack`;
#                                                                  default 1000, 120, 1)
#   OPERATOR_BIN=target/release/conveyor-operator scripts/operator-scale.sh 10000 300 1000
#     measures another build of the operator (`cargo build --release -p conveyor-operator`);
#     the stack's own comes back at the next `scripts/stack.sh up`.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${1:-1000}
STEADY=${2:-120}
NAMESPACES=${3:-1}
[ $((N % NAMESPACES)) -eq 0 ] || { echo "operator-scale: N ($N) must be a multiple of NAMESPACES ($NAMESPACES)" >&2; exit 2; }
PER=$((N / NAMESPACES))
if [ -n "${OPERATOR_BIN:-}" ]; then
  [ -x "$OPERATOR_BIN" ] || { echo "operator-scale: no operator binary at $OPERATOR_BIN" >&2; exit 2; }
  export CONVEYOR_OPERATOR_BIN=$(realpath "$OPERATOR_BIN")
  scripts/stack.sh up >/dev/null
fi
BUILD=$(basename "$(dirname "$(readlink -f "/proc/$(cat "${CONVEYOR_DEV_DIR:-$PWD/.dev}/operator.pid")/exe")")")
eval "$(scripts/stack.sh env)"
DEV=${CONVEYOR_DEV_DIR:-$PWD/.dev}
OPERATOR=${CONVEYOR_OPERATOR_LISTEN:-127.0.0.1:8081}
MANAGEMENT=https://127.0.0.1:15671
CURL=(curl -fsS --cacert /etc/conveyor/dev-tls/ca.crt -u conveyor:conveyor)
RUN=scale-$(date +%s)
# Every object of the run carries it, so that the run's objects are listed apart.
LABEL=conveyor.dev/scale-run=$RUN
REPORT=${REPORT:-docs/operator-scale.md}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Listing ten thousand objects is itself load: look less often the more there are.
POLL=$(( N / 500 > 5 ? N / 500 : 5 ))

log() { printf 'operator-scale: %s\n' "$*" >&2; }
. scripts/lib/tools.sh
need_packages jq=jq
minus() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f\n", a - b}'; }
# Read each time: the operator is restarted half-way.
operator_pid() { cat "$DEV/operator.pid"; }
cpu_seconds() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$(operator_pid)/stat"; }
rss_mib() { awk -v k="$1" '$1 == k":" {printf "%.1f\n", $2 / 1024}' "/proc/$(operator_pid)/status"; }
# Every request the apiserver served, whoever made it.
apiserver_requests() {
  kubectl get --raw /metrics | awk '/^apiserver_request_total\{/ {sum += $NF} END {printf "%d\n", sum}'
}
# The operator's own requests from the apiserver's audit log (cluster/up.sh writes it; the
# stack's operator acts as its service account): those completed since an audit time.
AUDIT=${CONVEYOR_CLUSTER_DIR:-$DEV/cluster}/audit.log
[ -f "$AUDIT" ] || { log "no audit log at $AUDIT (cluster/up.sh writes it): restart the stack"; exit 1; }
OPERATOR_USER=system:serviceaccount:conveyor-system:conveyor-operator
audit_now() { date -u +%Y-%m-%dT%H:%M:%S.%6NZ; }
operator_api_requests() { # since, until → count
  cat "${AUDIT%.log}"*.log 2>/dev/null | { grep -F "\"$OPERATOR_USER\"" || true; } |
    jq -r --arg since "$1" --arg until "$2" \
      'select(.stage == "ResponseComplete" and .stageTimestamp >= $since and .stageTimestamp < $until) | 1' |
    wc -l
}
# The operator's writes (create, update, patch, delete) in a window, by verb and resource:
# "12 patch workerpools/status, 3 create events" or "none".
operator_api_writes() { # since, until → summary
  cat "${AUDIT%.log}"*.log 2>/dev/null | { grep -F "\"$OPERATOR_USER\"" || true; } |
    jq -r --arg since "$1" --arg until "$2" '
      select(.stage == "ResponseComplete" and .stageTimestamp >= $since and .stageTimestamp < $until
        and (.verb | IN("create", "update", "patch", "delete")))
      | "\(.verb) \(.objectRef.resource)\(if .objectRef.subresource then "/" + .objectRef.subresource else "" end)"' |
    sort | uniq -c | sort -rn | awk '{printf "%s%d %s %s", (NR > 1 ? ", " : ""), $1, $2, $3} END {if (NR == 0) printf "none"}'
}
operator_counter() { # metric name [label filter]
  curl -fsS "http://$OPERATOR/metrics" | awk -v m="$1" -v f="${2:-}" \
    '$1 ~ "^"m"(\\{|$)" && (f == "" || index($1, f)) {sum += $NF} END {printf "%d\n", sum}'
}
queues_left() {
  # (grep finds nothing once every queue is gone: not a failure of the pipeline)
  "${CURL[@]}" "$MANAGEMENT/api/queues/%2F?columns=name" | { grep -o "\"conveyor\\.$RUN-[0-9]*\\.[^\"]*\"" || true; } | wc -l
}
# Pools whose status the operator has written.
pools_observed() {
  kubectl get workerpools -A -l "$LABEL" -o jsonpath='{range .items[*]}{.status.observedGeneration}{"\n"}{end}' \
    | grep -c . || true
}
ready_types() {
  kubectl get tasktypes -A -l "$LABEL" -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' \
    | grep -c True || true
}

# A steady window: CPU seconds, apiserver requests (all, and the operator's own) and broker
# requests per minute.
measure() { # seconds → "cpu_per_min api_per_min operator_api_per_min broker_per_min"
  local c0 a0 b0 t0 c1 a1 b1 t1 own
  c0=$(cpu_seconds); a0=$(apiserver_requests); b0=$(operator_counter conveyor_operator_broker_requests_total)
  t0=$(audit_now)
  sleep "$1"
  c1=$(cpu_seconds); a1=$(apiserver_requests); b1=$(operator_counter conveyor_operator_broker_requests_total)
  t1=$(audit_now)
  sleep 2 # the audit log is written in batches
  own=$(operator_api_requests "$t0" "$t1")
  awk -v c="$(minus "$c1" "$c0")" -v a=$((a1 - a0)) -v o="$own" -v b=$((b1 - b0)) -v s="$1" \
    'BEGIN {printf "%.2f %.0f %.0f %.0f\n", c * 60 / s, a * 60 / s, o * 60 / s, b * 60 / s}'
}

log "baseline: ${STEADY}s with the cluster as it is"
read -r base_cpu base_api base_own base_broker <<<"$(measure "$STEADY")"
base_rss=$(rss_mib VmRSS)

log "generating $N TaskTypes and $N WorkerPools in $NAMESPACES namespaces ($RUN-1 ...)"
# Ten namespaces to a file, applied four files at a time: one kubectl of twenty thousand
# objects in a row would measure kubectl.
mkdir -p "$WORK/objects"
for k in $(seq 1 "$NAMESPACES"); do
  ns=$RUN-$k
  {
    printf -- '---\napiVersion: v1\nkind: Namespace\nmetadata: {name: %s, labels: {%s: %s}}\n' "$ns" "${LABEL%%=*}" "$RUN"
    for j in $(seq 1 "$PER"); do
      i=$(( (k - 1) * PER + j ))
      # Most types keep the default settings (the shared policies cover them); every tenth
      # has its own retries, so its own policy.
      if [ $((i % 10)) -eq 0 ]; then spec='{maxRetries: 1, deletionPolicy: Delete}'; else spec='{deletionPolicy: Delete}'; fi
      printf -- '---\napiVersion: conveyor.dev/v1alpha1\nkind: TaskType\nmetadata: {name: t%d, namespace: %s, labels: {%s: %s}}\nspec: %s\n' \
        "$j" "$ns" "${LABEL%%=*}" "$RUN" "$spec"
      printf -- '---\napiVersion: conveyor.dev/v1alpha1\nkind: WorkerPool\nmetadata: {name: p%d, namespace: %s, labels: {%s: %s}}\nspec:\n  taskTypes: [t%d]\n  image: conveyor:dev\n  handler: {type: noop}\n  autoscaling: {minReplicas: 0, maxReplicas: 2}\n' \
        "$j" "$ns" "${LABEL%%=*}" "$RUN" "$j"
    done
  } >>"$WORK/objects/$(printf '%05d' $(( (k - 1) / 10 ))).yaml"
done

started=$(date +%s.%N)
apply_audit=$(audit_now)
cpu_before=$(cpu_seconds)
ls "$WORK"/objects/*.yaml | xargs -P 4 -n 1 kubectl apply --server-side -f >/dev/null
applied=$(date +%s.%N)
log "applied in $(minus "$applied" "$started") s; waiting for $N TaskTypes Ready"
deadline=$(( $(date +%s) + 3600 ))
while [ "$(ready_types)" -lt "$N" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { log "not every TaskType became Ready within an hour"; break; }
  sleep "$POLL"
done
all_ready=$(date +%s.%N)
ready=$(ready_types)
pools=$(pools_observed)
sleep 2 # the audit log is written in batches
own_to_ready=$(operator_api_requests "$apply_audit" "$(audit_now)")
to_ready=$(minus "$all_ready" "$started")
cpu_to_ready=$(minus "$(cpu_seconds)" "$cpu_before")
log "$ready of $N Ready after ${to_ready}s; steady window of ${STEADY}s"
read -r cpu api own broker <<<"$(measure "$STEADY")"
rss=$(rss_mib VmRSS); hwm=$(rss_mib VmHWM)
queues=$(queues_left)

# Killed and started again: nothing changed, so what it writes and declares until it has
# looked at every object again is what a restart costs.
reconciled() { # controller → reconciles by this process
  operator_counter conveyor_operator_reconciles_total "controller=\"$1\""
}
log "killing the operator (-9) and starting it again"
restart_audit=$(audit_now)
killed=$(date +%s.%N)
kill -9 "$(operator_pid)"
scripts/stack.sh up >/dev/null
back=$(date +%s.%N)
# Every object reconciled at least once by the new process (a type or pool may be looked
# at more than once; the count is a lower bound on the work, not an exact one).
deadline=$(( $(date +%s) + 3600 ))
until [ "$(reconciled tasktype)" -ge "$N" ] && [ "$(reconciled workerpool)" -ge "$N" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { log "the restarted operator did not look at every object within an hour"; break; }
  sleep 5
done
caught_up=$(date +%s.%N)
restart_cpu=$(cpu_seconds)
restart_declared=$(operator_counter conveyor_operator_broker_requests_total 'api="amqp"')
restart_management=$(operator_counter conveyor_operator_broker_requests_total 'api="management"')
sleep 2 # the audit log is written in batches
restart_until=$(audit_now)
restart_writes=$(operator_api_writes "$restart_audit" "$restart_until")
restart_requests=$(operator_api_requests "$restart_audit" "$restart_until")
log "restarted operator caught up after $(minus "$caught_up" "$killed") s; steady window of ${STEADY}s"
read -r cpu2 api2 own2 broker2 <<<"$(measure "$STEADY")"
rss2=$(rss_mib VmRSS); hwm2=$(rss_mib VmHWM)

log "deleting the $NAMESPACES namespaces (the operator deletes the queues)"
kubectl delete namespace -l "$LABEL" --wait=false >/dev/null
deleting=$(date +%s)
deadline=$(( deleting + 3600 ))
while [ "$(kubectl get namespaces -l "$LABEL" -o name | grep -c .)" -gt 0 ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { log "namespaces of $RUN still there after an hour"; break; }
  sleep "$POLL"
done
deleted_after=$(( $(date +%s) - deleting ))
left=$(queues_left)
if [ "$left" -gt 0 ]; then
  log "$left queues left behind; deleting them through the management API"
  "${CURL[@]}" "$MANAGEMENT/api/queues/%2F?columns=name" | grep -o "\"conveyor\\.$RUN-[0-9]*\\.[^\"]*\"" | tr -d '"' |
    while read -r q; do "${CURL[@]}" -X DELETE "$MANAGEMENT/api/queues/%2F/$q" >/dev/null || true; done
fi

# The run's section goes first under the report's title; earlier runs stay below it.
section=$WORK/section.md
cat >"$section" <<EOF
## $(date -u +%Y-%m-%d), \`scripts/operator-scale.sh $N $STEADY $NAMESPACES\` at $(git rev-parse --short HEAD)

$(nproc) cores, the local stack ($BUILD build of the operator, one process; RabbitMQ and
PostgreSQL on the same machine). $N TaskTypes (nine in ten with default settings, every
tenth with maxRetries 1 and so a policy of its own) and $N WorkerPools (autoscaled 0-2, no
work, so no pods), $PER of each in each of $NAMESPACES namespaces, applied by four
\`kubectl apply\` at a time. Counts from outside the reconcilers: /proc for the operator
process, the apiserver's \`apiserver_request_total\` (every client, so the baseline is
shown beside it), the operator's own requests in the apiserver's audit log, the operator's
\`conveyor_operator_broker_requests_total\` (management API requests and AMQP
declarations). Steady windows of $STEADY s.

| | before the objects | with the objects | after a restart |
|---|---|---|---|
| \`kubectl apply\` of the $((2 * N)) objects | — | $(minus "$applied" "$started") s | |
| TaskTypes Ready | — | $ready of $N after ${to_ready} s (operator CPU ${cpu_to_ready} s) | |
| WorkerPools with a status written, then | — | $pools of $N | |
| the operator's apiserver requests from the apply until then | — | $own_to_ready | |
| queues declared | — | $queues | |
| restart: killed until every object was looked at again | — | — | $(minus "$caught_up" "$killed") s (back up after $(minus "$back" "$killed") s; CPU $restart_cpu s) |
| restart: the operator's apiserver requests until then | — | — | $restart_requests |
| restart: the operator's apiserver writes until then | — | — | $restart_writes |
| restart: AMQP declarations, management API requests until then | — | — | $restart_declared, $restart_management |
| operator CPU, s per minute (steady) | $base_cpu | $cpu | $cpu2 |
| operator RSS, MiB | $base_rss | $rss (peak $hwm) | $rss2 (peak $hwm2) |
| apiserver requests per minute (all clients) | $base_api | $api | $api2 |
| apiserver requests per minute (the operator's, from the audit log) | $base_own | $own | $own2 |
| operator broker requests per minute | $base_broker | $broker | $broker2 |
| namespaces deleted (the operator deleting the queues) | — | after $deleted_after s | |
| queues left after deleting the namespaces | — | $left (before the script's own clean-up) | |

EOF
if [ -f "$REPORT" ]; then
  awk -v section="$section" '
    !done && /^## / { while ((getline line < section) > 0) print line; done = 1 }
    { print }
    END { if (!done) while ((getline line < section) > 0) print line }
  ' "$REPORT" >"$WORK/report.md"
else
  { echo "# The operator at scale"; echo; cat "$section"; } >"$WORK/report.md"
fi
cp "$WORK/report.md" "$REPORT"
log "wrote $REPORT"
