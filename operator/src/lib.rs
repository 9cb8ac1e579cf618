//! The Conveyor operator: reconcile pipelines for TaskType and WorkerPool, with the pure
//! parts (builders, autoscaling, policies) separate from the parts that call APIs.
#![forbid(unsafe_code)]

pub mod admin_key;
pub mod app;
pub mod autoscale;
pub mod backoff;
pub mod broker_stats;
pub mod build;
pub mod context;
pub mod controllers;
pub mod declarations;
pub mod error;
pub mod gauges;
pub mod leader;
pub mod rabbitmq;
pub mod scale_down;
pub mod shared;
pub mod task_types;
pub mod worker_pools;
