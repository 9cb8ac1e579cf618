#!/usr/bin/env bash
# `make e2e-kind`: the e2e suite of `make test`, on a kind cluster instead of the local
# control plane, for machines with Docker. Creates the cluster (once), builds the images
# (scripts/images.sh: Conveyor's, and PostgreSQL and RabbitMQ from Debian's packages) and
# loads them into kind, applies manifests/kind, then runs tests/e2e against it through
# port-forwards. KIND_PUBLIC_IMAGES=1 applies manifests/kind-public instead (the public
# postgres and rabbitmq images, pulled by the nodes). `kind delete cluster --name
# conveyor-e2e` removes it all. It has not run on the machines this project is built on:
# docs/decisions/0051-kind-on-these-machines.md says where it stops there.
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${KIND_CLUSTER:-conveyor-e2e}
for tool in docker kind kubectl cargo; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: $tool is needed (see README, 'kind')" >&2; exit 1; }
done

kind get clusters 2>/dev/null | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 180s
KUBECONFIG=$(mktemp)
export KUBECONFIG
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -f "$KUBECONFIG"' EXIT
kind get kubeconfig --name "$CLUSTER" >"$KUBECONFIG"

cargo build --bins
CONVEYOR_IMAGE_PROFILE=debug scripts/images.sh build
overlay=manifests/kind
images=(conveyor:dev conveyor.local/postgres:15 conveyor.local/rabbitmq:3)
if [ "${KIND_PUBLIC_IMAGES:-}" = 1 ]; then overlay=manifests/kind-public images=(conveyor:dev); fi
kind load docker-image "${images[@]}" --name "$CLUSTER"
kubectl apply --server-side -k "$overlay"
kubectl wait --for condition=Established --timeout=60s crd/tasktypes.conveyor.dev crd/workerpools.conveyor.dev
for deployment in postgres rabbitmq conveyor-operator conveyor-gateway; do
  kubectl -n conveyor-system rollout status "deployment/$deployment" --timeout=300s
done

# The suite itself runs here and reaches the cluster's services through port-forwards; the
# workers it starts reach them by their in-cluster names.
forward() { kubectl -n conveyor-system port-forward "svc/$1" "$2" >/dev/null 2>&1 & pids+=($!); }
forward postgres 25432:5432
forward rabbitmq 25672:5672
forward rabbitmq 35672:15672
forward conveyor-gateway 28080:8080
for port in 25432 25672 35672 28080; do
  for _ in $(seq 60); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 1; done
done

export CONVEYOR_DATABASE_URL=postgres://conveyor:conveyor@127.0.0.1:25432/conveyor
export CONVEYOR_AMQP_URL=amqp://conveyor:conveyor@127.0.0.1:25672/%2f
export CONVEYOR_TEST_AMQP_URL=$CONVEYOR_AMQP_URL
export CONVEYOR_TEST_MANAGEMENT_URL=http://conveyor:conveyor@127.0.0.1:35672
export CONVEYOR_WORKER_DATABASE_URL=postgres://conveyor:conveyor@postgres.conveyor-system.svc:5432/conveyor
export CONVEYOR_WORKER_AMQP_URL=amqp://conveyor:conveyor@rabbitmq.conveyor-system.svc:5672/%2f
export CONVEYOR_GATEWAY_URL=http://127.0.0.1:28080 CONVEYOR_TOKEN=dev-token-change-me
# The e2e binary only, without the stories of the local stack's real node (containers,
# kind_services): kind's nodes are the containers there. chart_upgrade runs the previous
# release from the local pod runner's cache, which kind has no image of.
cargo test -p conveyor-e2e-tests --test e2e -- --test-threads=8 --skip containers:: --skip kind_services::
