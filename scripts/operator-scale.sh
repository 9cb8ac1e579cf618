#!/usr/bin/env bash
# The operator at scale (issue 13): N TaskTypes and N WorkerPools (autoscaled, minReplicas 0,
# no work: no pods) applied at once on the local stack; how long until every TaskType is
# Ready, then a steady window in which the operator's CPU and memory, the apiserver's
# requests and the operator's broker requests are measured from outside the reconcilers
# (/proc, the apiserver's own metrics, the operator's request counters). Everything is
# deleted again (deletionPolicy Delete, so the operator removes the queues), and the script
# checks that no queue is left. Writes docs/operator-scale.md.
#
#   scripts/operator-scale.sh [N] [STEADY_SECONDS]     (needs `make stack`; default 1000, 120)
set -euo pipefail
cd "$(dirname "$0")/.."

N=${1:-1000}
STEADY=${2:-120}
eval "$(scripts/stack.sh env)"
DEV=${CONVEYOR_DEV_DIR:-$PWD/.dev}
OPERATOR=${CONVEYOR_OPERATOR_LISTEN:-127.0.0.1:8081}
MANAGEMENT=https://127.0.0.1:15671
CURL=(curl -fsS --cacert /etc/conveyor/dev-tls/ca.crt -u conveyor:conveyor)
NS=scale-$(date +%s)
REPORT=${REPORT:-docs/operator-scale.md}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

log() { printf 'operator-scale: %s\n' "$*" >&2; }
. scripts/lib/tools.sh
need_packages jq=jq
minus() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f\n", a - b}'; }
pid=$(cat "$DEV/operator.pid")
cpu_seconds() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$pid/stat"; }
rss_mib() { awk -v k="$1" '$1 == k":" {printf "%.1f\n", $2 / 1024}' "/proc/$pid/status"; }
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
operator_counter() { # metric name
  curl -fsS "http://$OPERATOR/metrics" | awk -v m="$1" '$1 ~ "^"m"(\\{|$)" {sum += $NF} END {printf "%d\n", sum}'
}
queues_left() {
  # (grep finds nothing once every queue is gone: not a failure of the pipeline)
  "${CURL[@]}" "$MANAGEMENT/api/queues/%2F?columns=name" | { grep -o "\"conveyor\\.$NS\\.[^\"]*\"" || true; } | wc -l
}
# Pools whose status the operator has written.
pools_observed() {
  kubectl get workerpools -n "$NS" -o jsonpath='{range .items[*]}{.status.observedGeneration}{"\n"}{end}' \
    | grep -c . || true
}
ready_types() {
  kubectl get tasktypes -n "$NS" -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' \
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

log "generating $N TaskTypes and $N WorkerPools in namespace $NS"
{
  echo "apiVersion: v1"; echo "kind: Namespace"; echo "metadata: {name: $NS}"
  for i in $(seq 1 "$N"); do
    # Most types keep the default settings (the shared policies cover them); every tenth
    # has its own retries, so its own policy.
    if [ $((i % 10)) -eq 0 ]; then spec='{maxRetries: 1, deletionPolicy: Delete}'; else spec='{deletionPolicy: Delete}'; fi
    printf -- '---\napiVersion: conveyor.dev/v1alpha1\nkind: TaskType\nmetadata: {name: t%d, namespace: %s}\nspec: %s\n' "$i" "$NS" "$spec"
    printf -- '---\napiVersion: conveyor.dev/v1alpha1\nkind: WorkerPool\nmetadata: {name: p%d, namespace: %s}\nspec:\n  taskTypes: [t%d]\n  image: conveyor:dev\n  handler: {type: noop}\n  autoscaling: {minReplicas: 0, maxReplicas: 2}\n' "$i" "$NS" "$i"
  done
} >"$WORK/objects.yaml"

started=$(date +%s.%N)
apply_audit=$(audit_now)
cpu_before=$(cpu_seconds)
kubectl apply --server-side -f "$WORK/objects.yaml" >/dev/null
applied=$(date +%s.%N)
log "applied in $(minus "$applied" "$started") s; waiting for $N TaskTypes Ready"
deadline=$(( $(date +%s) + 3600 ))
while [ "$(ready_types)" -lt "$N" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { log "not every TaskType became Ready within an hour"; break; }
  sleep 5
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

log "deleting $NS (the operator deletes the queues)"
kubectl delete namespace "$NS" --wait=false >/dev/null
deleting=$(date +%s)
deadline=$(( deleting + 1800 ))
while kubectl get namespace "$NS" >/dev/null 2>&1; do
  [ "$(date +%s)" -lt "$deadline" ] || { log "namespace $NS still there after 30 min"; break; }
  sleep 5
done
deleted_after=$(( $(date +%s) - deleting ))
left=$(queues_left)
if [ "$left" -gt 0 ]; then
  log "$left queues left behind; deleting them through the management API"
  "${CURL[@]}" "$MANAGEMENT/api/queues/%2F?columns=name" | grep -o "\"conveyor\\.$NS\\.[^\"]*\"" | tr -d '"' |
    while read -r q; do "${CURL[@]}" -X DELETE "$MANAGEMENT/api/queues/%2F/$q" >/dev/null || true; done
fi

# The run's section goes first under the report's title; earlier runs stay below it.
section=$WORK/section.md
cat >"$section" <<EOF
## $(date -u +%Y-%m-%d), \`scripts/operator-scale.sh $N $STEADY\` at $(git rev-parse --short HEAD)

$(nproc) cores, the local stack (debug build of the operator, one process; RabbitMQ and
PostgreSQL on the same machine). $N TaskTypes (nine in ten with default settings, every
tenth with maxRetries 1 and so a policy of its own) and $N WorkerPools (autoscaled 0-2, no
work, so no pods) applied in one \`kubectl apply\`. Counts from outside the reconcilers:
/proc for the operator process, the apiserver's \`apiserver_request_total\` (every client,
so the baseline is shown beside it), the operator's own requests in the apiserver's audit log, the
operator's \`conveyor_operator_broker_requests_total\`
(management API requests and AMQP declarations).

| | before the objects | with $N + $N objects |
|---|---|---|
| \`kubectl apply\` of the $((2 * N)) objects | — | $(minus "$applied" "$started") s |
| TaskTypes Ready | — | $ready of $N after ${to_ready} s (operator CPU ${cpu_to_ready} s) |
| WorkerPools with a status written, then | — | $pools of $N |
| the operator's apiserver requests from the apply until then | — | $own_to_ready |
| queues declared | — | $queues |
| operator CPU, s per minute (steady) | $base_cpu | $cpu |
| operator RSS, MiB | $base_rss | $rss (peak $hwm) |
| apiserver requests per minute (all clients) | $base_api | $api |
| apiserver requests per minute (the operator's, from the audit log) | $base_own | $own |
| operator broker requests per minute | $base_broker | $broker |
| namespace deleted (the operator deleting the queues) | — | after $deleted_after s |
| queues left after deleting the namespace | — | $left (before the script's own clean-up) |

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
