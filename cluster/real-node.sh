#!/usr/bin/env bash
# One real Kubernetes node beside the simulated ones: a kubelet with containerd (Debian's
# packages) running pods as containers from the images scripts/images.sh builds (decision
# 0029). Everything of it lives in a network namespace of its own, `conveyor-real`:
#
#   host (root namespace)                    conveyor-real namespace
#   10.231.0.1 cvr-host  <──── veth ────>    10.231.0.2 cvr-node   kubelet :10250, containerd
#   socat 10.231.0.1:{16443,5432,5671}         └─ bridge cvr0 10.232.0.1/24 ── pods 10.232.0.x
#       → 127.0.0.1 (apiserver, PostgreSQL, RabbitMQ)
#   route 10.232.0.0/24 via 10.231.0.2 (the operator reaches its workers' admin port)
#
# So the kubelet's iptables chains, the CNI bridge, its masquerading and its forwarding
# setting are the namespace's, never the host's; no traffic leaves this machine. The kubelet
# and containerd share one mount namespace of their own too, where the six kernel settings
# the kubelet would rewrite are files of theirs (never the host's sysctls). The node is
# tainted `conveyor.dev/real-node=true:NoSchedule`: only pods that tolerate it run here, and
# every other story stays on the simulated (kwok) nodes.
#
#   cluster/real-node.sh up              start the node (and load the images into it)
#   cluster/real-node.sh load-images     import the current images into its containerd
#   cluster/real-node.sh stop-kubelet    the kubelet stops, its containers keep running
#   cluster/real-node.sh kill            the node dies: kubelet, containerd and every container
#   cluster/real-node.sh kill-container ID   a container killed (SIGKILL) through containerd
#   cluster/real-node.sh stop-container ID   a container's main process stopped (SIGSTOP)
#   cluster/real-node.sh down            stop it and remove its namespace, route and chains
#   cluster/real-node.sh env             the addresses pods reach the services at
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CONVEYOR_CLUSTER_DIR:-$PWD/.dev/cluster}
STATE=$CLUSTER/real-node
PORT=${CONVEYOR_APISERVER_PORT:-16443}
NODE=conveyor-real-node
NETNS=conveyor-real
HOST_IP=10.231.0.1
NODE_IP=10.231.0.2
POD_SUBNET=10.232.0.0/24
# Sockets: short paths (a unix socket path has at most 107 bytes).
RUN=/run/conveyor-real
SOCK=$RUN/containerd.sock
MNT=$RUN/mnt
# Ports the pods reach on $HOST_IP, forwarded to the host's loopback.
FORWARDED="$PORT 5432 5671"
PID_DIR=$STATE
mkdir -p "$STATE"
. scripts/lib/pidfiles.sh
. scripts/lib/tools.sh
log() { printf 'real-node: %s\n' "$*" >&2; }

# Runs a command inside the node: its network and mount namespaces.
in_node() { nsenter --net="/run/netns/$NETNS" --mount="$MNT" "$@"; }

network() {
  if ! [ -e "/run/netns/$NETNS" ]; then
    ip netns add "$NETNS"
  fi
  if ! ip link show cvr-host >/dev/null 2>&1; then
    ip link add cvr-host type veth peer name cvr-node
    ip link set cvr-node netns "$NETNS"
    ip addr add "$HOST_IP/30" dev cvr-host
    ip link set cvr-host up
    ip -n "$NETNS" addr add "$NODE_IP/30" dev cvr-node
    ip -n "$NETNS" link set cvr-node up
    ip -n "$NETNS" link set lo up
  fi
  # No default route in the node: its pods reach this machine's forwarded services and
  # nothing else (an address outside is unreachable at once, never forwarded off the machine).
  ip -n "$NETNS" route del default 2>/dev/null || true
  ip route replace "$POD_SUBNET" via "$NODE_IP" dev cvr-host
}

# A mount namespace kept open by a bind mount of it (on a private mount, as that needs), in
# which both containerd and the kubelet run: the kubelet's volume mounts must be containerd's.
mount_namespace() {
  mkdir -p "$RUN"
  mountpoint -q "$RUN" || { mount --bind "$RUN" "$RUN"; mount --make-private "$RUN"; }
  [ -f "$MNT" ] && nsenter --mount="$MNT" true 2>/dev/null && return 0
  touch "$MNT"
  unshare --mount="$MNT" --propagation slave true
  # The kernel settings the kubelet checks and would rewrite, as files of this namespace
  # holding the values it wants (so it writes nothing, and the host keeps its own).
  local setting value
  mkdir -p "$STATE/sysctl"
  for setting in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
    kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
    value=${setting#*=} setting=${setting%%=*}
    echo "$value" >"$STATE/sysctl/${setting//\//.}"
    nsenter --mount="$MNT" mount --bind "$STATE/sysctl/${setting//\//.}" "/proc/sys/$setting"
  done
}

containerd_config() {
  mkdir -p "$STATE/cni/net.d" "$STATE/cni/ipam"
  cat >"$STATE/cni/net.d/10-conveyor.conflist" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "conveyor-real",
  "plugins": [
    {"type": "bridge", "bridge": "cvr0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$STATE/cni/ipam",
              "ranges": [[{"subnet": "$POD_SUBNET"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
  # restrict_oom_score_adj: no process here holds CAP_SYS_RESOURCE, and without it every
  # sandbox fails ("can't get final child's PID from pipe: EOF").
  cat >"$STATE/containerd.toml" <<TOML
version = 2
root = "$STATE/containerd"
state = "$RUN/containerd"
[grpc]
  address = "$SOCK"
[plugins."io.containerd.internal.v1.opt"]
  path = "$STATE/containerd-opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "conveyor.local/pause:1"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni/net.d"
TOML
}

kubelet_config() {
  local token; token=$(cat "$CLUSTER/token")
  cat >"$STATE/kubelet.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters: [{name: conveyor-local, cluster: {server: "https://$HOST_IP:$PORT", insecure-skip-tls-verify: true}}]
users: [{name: kubelet, user: {token: "$token"}}]
contexts: [{name: kubelet, context: {cluster: conveyor-local, user: kubelet}}]
current-context: kubelet
KC
  # failCgroupV1: this machine is cgroup v1 (hybrid). The lease is kwok's (16 s), so that a
  # dead node is NotReady within cluster/up.sh's grace period like the simulated ones. Its
  # API (10250) listens on the node's own address only, reachable from this machine alone.
  # Disk thresholds are absolute: the node shares this machine's disk with its builds, and a
  # percentage of a large, mostly-reserved disk put it under DiskPressure (every pod evicted or
  # unscheduled) when a second checkout had been built. Image GC is off: the images were
  # imported (nothing can pull them again), so a collected one would leave its pods unable to start.
  cat >"$STATE/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$SOCK
address: $NODE_IP
readOnlyPort: 0
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
failSwapOn: false
protectKernelDefaults: false
podLogsDir: $STATE/pod-logs
nodeLeaseDurationSeconds: 16
nodeStatusUpdateFrequency: 4s
maxPods: 64
serializeImagePulls: false
registerWithTaints: [{key: conveyor.dev/real-node, value: "true", effect: NoSchedule}]
evictionHard: {memory.available: 200Mi, nodefs.available: 512Mi, imagefs.available: 512Mi, nodefs.inodesFree: 2%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
YAML
}

start_containerd() {
  running containerd && return 0
  start_process containerd "$STATE/containerd.log" \
    nsenter --net="/run/netns/$NETNS" --mount="$MNT" containerd --config "$STATE/containerd.toml"
  for _ in $(seq 1 60); do ctr --address "$SOCK" version >/dev/null 2>&1 && return 0; sleep 0.5; done
  log "containerd did not start; see $STATE/containerd.log"; exit 1
}

start_kubelet() {
  start_process kubelet "$STATE/kubelet.log" \
    nsenter --net="/run/netns/$NETNS" --mount="$MNT" "$BIN/kubelet" --config "$STATE/kubelet.yaml" \
    --kubeconfig "$STATE/kubelet.kubeconfig" --hostname-override "$NODE" --node-ip "$NODE_IP" \
    --root-dir "$STATE/kubelet" --cert-dir "$STATE/kubelet/pki" \
    --node-labels "conveyor.dev/node=real,kubernetes.io/hostname=$NODE"
}

forwarders() {
  local port
  for port in $FORWARDED; do
    start_process "forward-$port" "$STATE/forward-$port.log" \
      socat "TCP-LISTEN:$port,bind=$HOST_IP,fork,reuseaddr" "TCP:127.0.0.1:$port"
  done
}

# Imports the images into the node's containerd (the node pulls nothing: no registry is
# reachable), unless those very images (by Docker's ids) were the last imported.
load_images() {
  start_containerd
  local ids; ids=$(scripts/images.sh ids)
  [ "$(cat "$STATE/images.ids" 2>/dev/null)" = "$ids" ] && return 0
  log "importing the images into the node's containerd"
  scripts/images.sh save | ctr --address "$SOCK" -n k8s.io images import - >/dev/null
  echo "$ids" >"$STATE/images.ids"
}

up() {
  need_packages containerd=containerd runc=runc socat=socat nsenter=util-linux ip=iproute2 \
    iptables=iptables
  [ -x /usr/lib/cni/bridge ] || install_debian_packages containernetworking-plugins
  BIN=$(cluster/build.sh)
  network
  mount_namespace
  containerd_config
  kubelet_config
  forwarders
  start_containerd
  load_images
  start_kubelet
  local kubectl=("$BIN/kubectl" --kubeconfig "$CLUSTER/kubeconfig")
  for _ in $(seq 1 120); do
    [ "$("${kubectl[@]}" get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ] &&
      { log "ready: node $NODE (pods on $POD_SUBNET; services at $HOST_IP)"; return 0; }
    sleep 1
  done
  log "node $NODE is not Ready after 120 s; see $STATE/kubelet.log"; exit 1
}

# Every process of the node's containers: those in the kubelet's pod cgroups.
container_pids() {
  find /sys/fs/cgroup/pids/kubepods /sys/fs/cgroup/memory/kubepods -name cgroup.procs 2>/dev/null |
    xargs -r cat 2>/dev/null | sort -u
}

kill_node() {
  # As a machine losing power: nothing gets a signal it could act on.
  for name in kubelet containerd; do
    if [ -f "$STATE/$name.pid" ]; then kill -KILL "$(cat "$STATE/$name.pid")" 2>/dev/null || true; fi
    rm -f "$STATE/$name.pid" "$STATE/$name.cmd"
  done
  pkill -KILL -f "containerd-shim-runc-v2 -namespace k8s.io .*-address $SOCK" 2>/dev/null || true
  container_pids | xargs -r kill -KILL 2>/dev/null || true
}

down() {
  stop_process kubelet
  # Pods' containers go with their shims; then containerd.
  if running containerd; then
    ctr --address "$SOCK" -n k8s.io tasks ls -q 2>/dev/null | while read -r id; do
      ctr --address "$SOCK" -n k8s.io tasks kill -s KILL "$id" >/dev/null 2>&1 || true
    done
  fi
  kill_node
  local port
  for port in $FORWARDED; do stop_process "forward-$port"; done
  # Unmount what pods left under the kubelet's root (in the node's mount namespace).
  if [ -f "$MNT" ] && nsenter --mount="$MNT" true 2>/dev/null; then
    nsenter --mount="$MNT" sh -c "grep -o ' $STATE/[^ ]*' /proc/self/mounts | sort -r | xargs -r umount -l" 2>/dev/null || true
    umount "$MNT" 2>/dev/null || true
  fi
  if mountpoint -q "$RUN"; then umount -l "$RUN" 2>/dev/null || true; fi
  # The pods' network namespaces, which containerd pins under /run/netns/cni-* (its own
  # store: no other runtime here uses CNI).
  local pinned
  for pinned in /run/netns/cni-*; do
    [ -e "$pinned" ] && { ip netns delete "${pinned#/run/netns/}" 2>/dev/null || rm -f "$pinned"; }
  done
  ip route del "$POD_SUBNET" via "$NODE_IP" 2>/dev/null || true
  ip link del cvr-host 2>/dev/null || true
  # The namespace goes with its bridge, veths, iptables chains and forwarding setting.
  [ -e "/run/netns/$NETNS" ] && ip netns del "$NETNS"
  log "stopped"
}

# Namespaces, mounts and a kubelet need root: a sudoer's run goes through sudo.
if [ "$(id -u)" -ne 0 ] && [ "${1:-up}" != env ]; then exec sudo -E "$0" "$@"; fi

case "${1:-up}" in
  up) up ;;
  load-images) load_images ;;
  stop-kubelet) stop_process kubelet ;;
  start-kubelet) BIN=$(cluster/build.sh --path); start_kubelet ;;
  kill) kill_node ;;
  kill-container) ctr --address "$SOCK" -n k8s.io tasks kill -s KILL "${2:?container id}" ;;
  # A wedged process: the container's main process stopped (SIGSTOP), alive but answering nothing.
  stop-container)
    pid=$(ctr --address "$SOCK" -n k8s.io tasks ls | awk -v id="${2:?container id}" '$1 == id {print $2}')
    [ -n "$pid" ] || { log "no running container $2"; exit 1; }
    kill -STOP "$pid" ;;
  down) down ;;
  env) echo "CONVEYOR_REAL_NODE=$NODE CONVEYOR_REAL_NODE_SERVICES=$HOST_IP" ;;
  *) echo "usage: $0 up|load-images|stop-kubelet|start-kubelet|kill|kill-container ID|stop-container ID|down|env" >&2; exit 2 ;;
esac
