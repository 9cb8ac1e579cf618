# Conveyor. `make dev` runs it locally; `make test` runs every test tier. Both bring up
# RabbitMQ and PostgreSQL themselves (scripts/services.sh), installing them when missing.

CARGO ?= cargo
DEV_DIR := .dev
export CONVEYOR_DATABASE_URL ?= postgres://conveyor:conveyor@127.0.0.1:5432/conveyor
export CONVEYOR_AMQP_URL ?= amqp://conveyor:conveyor@127.0.0.1:5672/%2f

.PHONY: all build services services-down lint test unit integration dev down

all: build

build:
	$(CARGO) build --workspace --bins

services:
	scripts/services.sh up

services-down:
	scripts/services.sh down

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Unit tests need nothing; integration tests need the services and the built binaries
# (they start real conveyor-worker processes and signal them).
test: services build
	$(CARGO) test --workspace -- --test-threads=4

unit:
	$(CARGO) test --workspace --lib --bins

integration: services build
	$(CARGO) test -p conveyor-integration-tests -- --test-threads=4

dev: services build
	scripts/dev.sh up

down:
	scripts/dev.sh down
