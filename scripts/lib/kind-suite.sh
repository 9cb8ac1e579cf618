# shellcheck shell=bash
# Sourced by scripts/e2e-kind.sh --inside: creates the kind cluster, deploys Conveyor on it
# and runs the e2e binary. On the podman path this runs in a network and mount namespace of
# its own (see e2e-kind.sh), where the cluster lives and dies with it.
#   in: CLUSTER, STATE, KIND_NODE_IMAGE (empty: kind's own), KIND_CONFIG (optional)

provider=${KIND_EXPERIMENTAL_PROVIDER:-docker}

if [ "$provider" = podman ]; then
  ip link set lo up
  # kind mounts /lib/modules into its nodes, and these machines have none: an empty one,
  # in this mount namespace only (an overlay on /usr/lib, which /lib is).
  if ! [ -d /lib/modules ]; then
    mount -t overlay overlay \
      -o "lowerdir=/usr/lib,upperdir=$STATE/modules/upper,workdir=$STATE/modules/work" /usr/lib
  fi
fi

KUBECONFIG=$STATE/kubeconfig
export KUBECONFIG
pids=()
cleanup() {
  local status=$? pid
  kill "${pids[@]}" 2>/dev/null || true
  if [ "${KIND_KEEP:-}" = 1 ] && [ "$provider" != podman ]; then
    log "kept cluster $CLUSTER (kind delete cluster --name $CLUSTER removes it)"
  else
    kind delete cluster --name "$CLUSTER" >&2 || true
  fi
  if [ "$provider" = podman ]; then
    # What podman keeps after its last container: kind's network (a file under
    # /etc/containers/networks) and its empty parent cgroups.
    podman network rm --force kind >/dev/null 2>&1 || true
    # netavark's DNS server outlives the network, and would keep this namespace alive.
    for pid in $(pgrep -x aardvark-dns); do
      [ "$(readlink "/proc/$pid/ns/net")" = "$(readlink /proc/self/ns/net)" ] && kill "$pid"
    done
    rm -f /run/containers/networks/aardvark-dns/kind
    find /sys/fs/cgroup/*/libpod_parent -depth -type d -exec rmdir {} \; 2>/dev/null || true
  fi
  if ! host_settings | diff "$STATE/host-settings.before" - >&2; then
    log "the host's kernel settings changed while kind ran (above)"
    status=1
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 143' INT TERM

# The host's kernel settings that a privileged node could write (the kubelet's six, and
# what systemd and Debian's sysctl.d would set): compared when the script ends.
host_settings() {
  sysctl vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops \
    kernel.keys.root_maxkeys kernel.keys.root_maxbytes kernel.pid_max \
    kernel.core_uses_pid kernel.kptr_restrict fs.file-max fs.nr_open fs.protected_hardlinks \
    fs.protected_symlinks fs.protected_regular fs.protected_fifos vm.max_map_count 2>&1
}
host_settings >"$STATE/host-settings.before"

# A cluster of an earlier run that was killed: on the podman path its namespace is gone
# with that run, so it is removed rather than reused.
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  if [ "$provider" = podman ]; then
    log "removing the cluster a killed run left"
    podman rm -f "$CLUSTER-control-plane" >/dev/null 2>&1 || true
    kind delete cluster --name "$CLUSTER" >&2 || true
  fi
fi
if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  # One node, with the folder the video story's media volume is in at the same path (the
  # story judges the files from this machine).
  media=$PWD/.dev/real-node-media
  mkdir -p "$media"
  {
    if [ -n "${KIND_CONFIG:-}" ]; then cat "$KIND_CONFIG"; else
      printf 'kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\n'; fi
    printf 'nodes:\n- role: control-plane\n  extraMounts: [{hostPath: %s, containerPath: %s}]\n' "$media" "$media"
  } >"$STATE/cluster.yaml"
  create=(kind create cluster --name "$CLUSTER" --wait 180s --config "$STATE/cluster.yaml")
  [ -n "${KIND_NODE_IMAGE:-}" ] && create+=(--image "$KIND_NODE_IMAGE")
  started=$(date +%s)
  "${create[@]}" >&2
  log "cluster created in $(($(date +%s) - started)) s"
fi
kind get kubeconfig --name "$CLUSTER" >"$KUBECONFIG"
# The stories of the local real node run on kind's node: labelled as that one is, and
# acted on through scripts/kind-node.sh.
CONVEYOR_REAL_NODE=$CLUSTER-control-plane
export CONVEYOR_REAL_NODE CONVEYOR_NODE_SCRIPT=scripts/kind-node.sh
kubectl label node "$CONVEYOR_REAL_NODE" conveyor.dev/node=real --overwrite >&2

overlay=manifests/kind
images=(conveyor:dev conveyor-video-worker:dev conveyor.local/postgres:15 conveyor.local/rabbitmq:3)
if [ "${KIND_PUBLIC_IMAGES:-}" = 1 ]; then
  overlay=manifests/kind-public images=(conveyor:dev conveyor-video-worker:dev)
fi
docker save -o "$STATE/images.tar" "${images[@]}"
kind load image-archive "$STATE/images.tar" --name "$CLUSTER" >&2
rm -f "$STATE/images.tar"
kubectl apply --server-side -k "$overlay" >&2
kubectl wait --for condition=Established --timeout=60s crd/tasktypes.conveyor.dev crd/workerpools.conveyor.dev >&2
for deployment in postgres rabbitmq; do
  kubectl -n conveyor-system rollout status "deployment/$deployment" --timeout=300s >&2
done

# The suite runs here and reaches the cluster's services through port-forwards; the
# workers it starts reach them by their in-cluster names.
forward() {
  kubectl -n conveyor-system port-forward "svc/$1" "$2" >"$STATE/forward-$1-${2%%:*}.log" 2>&1 &
  pids+=($!)
}
wait_for_port() {
  for _ in $(seq 60); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 1; done
  log "nothing answers on 127.0.0.1:$1 after 60 s (see $STATE/forward-*.log)"
  return 1
}
forward postgres 25432:5432
forward rabbitmq 25672:5672
forward rabbitmq 35672:15672
for port in 25432 25672 35672; do wait_for_port "$port"; done
export CONVEYOR_DATABASE_URL=postgres://conveyor:conveyor@127.0.0.1:25432/conveyor
export CONVEYOR_AMQP_URL=amqp://conveyor:conveyor@127.0.0.1:25672/%2f
# The schema, with the admin identity, as an operator of a real install does before the
# gateway starts (it waits for the schema otherwise).
target/debug/conveyorctl migrate >&2
for deployment in conveyor-operator conveyor-gateway; do
  kubectl -n conveyor-system rollout status "deployment/$deployment" --timeout=300s >&2
done
forward conveyor-gateway 28080:80
wait_for_port 28080

export CONVEYOR_TEST_AMQP_URL=$CONVEYOR_AMQP_URL
export CONVEYOR_TEST_MANAGEMENT_URL=http://conveyor:conveyor@127.0.0.1:35672
export CONVEYOR_WORKER_DATABASE_URL=postgres://conveyor:conveyor@postgres.conveyor-system.svc:5432/conveyor
export CONVEYOR_WORKER_AMQP_URL=amqp://conveyor:conveyor@rabbitmq.conveyor-system.svc:5672/%2f
export CONVEYOR_GATEWAY_URL=http://127.0.0.1:28080 CONVEYOR_TOKEN=dev-token-change-me
# The e2e binary, without the stories that drive the local stack's own processes or
# files, which a kind cluster does not have (decision 0051 lists where each runs):
skips=(
  containers::the_real_node_lost # kills the node, which carries kind's control plane too
  kind_services::                # the overlay's services on the local real node: here they
                                 # are what the whole suite uses
  at_rest::                      # reads the local apiserver's audit log
  scoped_install::               # runs operators here with kubeconfigs scripts/stack.sh made
  operator::a_standby_whose_clock_is_behind operator::two_operators_with_skewed_clocks
                                 # operators started here under libfaketime beside the leader
  scaling::a_busy_worker_that_is_not_ready # stops a worker's process here with SIGSTOP
  observability::every_dashboard_panel # the Prometheus that scripts/prometheus.sh runs here
  external_scalers::keda_scales  # the KEDA that scripts/keda.sh runs here
  tenancy::pools_run_with_their_namespaces_granted_credentials_alone
                                 # grants name this machine's addresses of the services
)
skip_args=()
for test in "${skips[@]}"; do skip_args+=(--skip "$test"); done
cargo test -p conveyor-e2e-tests --test e2e -- --test-threads=8 "${skip_args[@]}" "$@"
