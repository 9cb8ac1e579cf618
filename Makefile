# Conveyor. `make dev` runs it locally; `make test` runs every test tier. Both bring up what
# they need themselves: RabbitMQ and PostgreSQL (scripts/services.sh, installed from Debian
# packages when missing) and the local Kubernetes control plane (cluster/, built once from
# Go modules and cached in ~/.cache/conveyor), via scripts/stack.sh.

CARGO ?= cargo
DEV_DIR := .dev
# The local services speak TLS only, verified against the CA scripts/services.sh makes.
DEV_CA := /etc/conveyor/dev-tls/ca.crt
export CONVEYOR_DATABASE_URL ?= postgres://conveyor:conveyor@127.0.0.1:5432/conveyor?sslmode=verify-full&sslrootcert=$(DEV_CA)
export CONVEYOR_AMQP_URL ?= amqps://conveyor:conveyor@127.0.0.1:5671/%2f?cacertfile=$(DEV_CA)
export CONVEYOR_CA_FILE ?= $(DEV_CA)

# The e2e suite talks to the local cluster with kubectl, which comes with the control plane.
E2E_ENV = KUBECONFIG=$(CURDIR)/$(DEV_DIR)/cluster/kubeconfig PATH="$$(cluster/build.sh):$$PATH"

.PHONY: all toolchains previous-release build browser-tools services services-down cluster-services stack images real-node lint test unit integration e2e e2e-kind chaos chaos-cluster soak bench dev down

all: build

# The toolchains a newcomer installs by hand (the scripts install the rest), named in one line.
toolchains:
	@bash -c '. scripts/lib/tools.sh && need_toolchains $(CARGO) go gcc git'

build: toolchains
	$(CARGO) build --workspace --bins

services:
	scripts/services.sh up

services-down:
	scripts/services.sh down

# The cluster-scale topology beside the single services: a three-node RabbitMQ cluster
# (AMQPS 5681-5683) and a PostgreSQL primary with a synchronous standby (5442/5443).
# `scripts/cluster-services.sh down` stops it.
cluster-services:
	scripts/cluster-services.sh up

browser-tools:
	scripts/browser.sh

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	# No two modules of these crates import each other, directly or round a loop
	# (scripts/module-edges.sh; the operator, chaos and soak crates still have loops).
	for crate in core gateway worker cli pod-runner; do scripts/module-edges.sh $$crate --quiet || exit 1; done

stack: build
	scripts/stack.sh up

# The container images (scripts/images.sh; Dockerfile), from release binaries, on a Debian 12
# base made here from Debian packages. Needs root once (debootstrap, and dockerd when none runs).
images:
	$(CARGO) build --release --locked -p conveyor-gateway -p conveyor-worker -p conveyor-operator -p conveyorctl
	scripts/images.sh build

# The local cluster's real node: a kubelet with containerd running pods as containers
# (cluster/real-node.sh), from images of the debug binaries `make build` made (no second
# compile). Needs root.
real-node: stack
	CONVEYOR_IMAGE_PROFILE=debug scripts/images.sh build
	cluster/real-node.sh up

# Unit tests need nothing; integration tests need the services and the built binaries
# (they start real conveyor-worker processes and signal them); the e2e suite needs the
# whole stack. The stack stays up afterwards (a rerun reuses it); `make down` stops it.
# The console's browser test needs Chromium, ChromeDriver and Selenium (scripts/browser.sh).
test: previous-release stack browser-tools real-node
	$(CARGO) test --workspace --exclude conveyor-e2e-tests -- --test-threads=4
	$(E2E_ENV) $(CARGO) test -p conveyor-e2e-tests -- --test-threads=8
	# make bench's short variant, on the debug build: proves the command works, asserts no time.
	target/debug/conveyor-bench --short --report target/bench/short.md
	# make soak's short variant (about a minute): proves the command works, asserts no time.
	$(E2E_ENV) target/debug/conveyor-soak --short --report target/soak/short.md
	# The e2e suite again, on a kind cluster made here (decision 0051).
	scripts/e2e-kind.sh

unit:
	$(CARGO) test --workspace --lib --bins

integration: services build browser-tools
	$(CARGO) test -p conveyor-integration-tests -- --test-threads=4

e2e: previous-release stack real-node
	$(E2E_ENV) $(CARGO) test -p conveyor-e2e-tests -- --test-threads=8

# Every fault-injection scenario at full size (it kills and restarts the local RabbitMQ and
# PostgreSQL); writes docs/chaos-report.md (+ .jsonl). `make test` runs a short variant.
chaos: stack
	$(E2E_ENV) $(CARGO) run -q -p conveyor-chaos -- --tasks 1500 --outage-seconds 30 --report docs/chaos-report.md; \
	  status=$$?; scripts/services.sh restart-broker; exit $$status

# Twelve simulated days in an hour (about 75 minutes in all): a steady mixed load while a
# simulated day passes every 5 minutes (settled tasks expire after two of them, audit
# partitions are made and dropped under a dump and a slow reader, a worker is rolled, the
# stack's operator restarted or failed over, its fleet grown); writes docs/soak.md (+ .jsonl).
soak: stack
	$(E2E_ENV) $(CARGO) run -q -p conveyor-soak -- --report docs/soak.md

# The cluster-scale scenarios (a RabbitMQ node killed, cut off, restarted in turn; the
# PostgreSQL primary replaced by its standby), at 2,500 tasks each; their part of
# docs/chaos-report.md (+ .jsonl) beside the single-services scenarios. About 10 minutes.
chaos-cluster: build cluster-services
	$(CARGO) run -q -p conveyor-chaos -- --replicated --tasks 2500 --outage-seconds 30 --report docs/chaos-report.md

# Release binaries, the raw floor of this machine and Conveyor end to end, in one run; writes
# docs/benchmarks.md (+ .jsonl). Needs a quiet machine: nothing else building or running.
bench: services
	$(CARGO) build --release -p conveyor-gateway -p conveyor-worker -p conveyor-bench
	scripts/services.sh drop-test-databases
	# The cluster-scale services would count as RabbitMQ's and PostgreSQL's CPU, and the local
	# Prometheus (scrapes, its pod-list loop) takes CPU the load needs: stopped.
	scripts/cluster-services.sh down
	scripts/prometheus.sh down
	target/release/conveyor-bench --report docs/benchmarks.md

# The release before this one (its chart and binaries, built once into the cache): the e2e
# suite upgrades it to this checkout's chart. scripts/previous-release.sh.
previous-release:
	scripts/previous-release.sh >/dev/null

# The e2e suite on a kind cluster, created and deleted by scripts/e2e-kind.sh: with Docker's
# provider where a privileged container starts, else podman's with a node image made here
# (decision 0051). Needs root on the podman path.
e2e-kind:
	scripts/e2e-kind.sh

dev: build
	scripts/dev.sh up

down:
	scripts/dev.sh down
