//! The data path against a real RabbitMQ and PostgreSQL (`scripts/services.sh up`).
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod support;

mod audit_partitions;
mod bounded_costs;
mod cluster_task_types;
mod console;
mod db_layer;
mod degraded_mode;
mod example_handlers;
mod find_and_fix;
mod gateway_api;
mod grouped_writes;
mod hostile_tenants;
mod least_privilege;
mod lifecycle_flows;
mod namespace_limits;
mod outages;
mod progress;
mod python_client;
mod self_healing;
mod settling;
mod sparse_indexes;
mod tenancy;
mod tls;
mod tracing;
mod unattended;
mod worker_faults;
