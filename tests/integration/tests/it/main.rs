//! The data path against a real RabbitMQ and PostgreSQL (`scripts/services.sh up`).

mod support;

mod db_layer;
mod gateway_api;
mod lifecycle_flows;
mod worker_faults;
