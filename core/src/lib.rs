//! Conveyor's shared library: the task model and lifecycle, task type settings, and the
//! Postgres and AMQP layers every binary uses.
#![forbid(unsafe_code)]

pub mod admin;
pub mod amqp;
pub mod config;
pub mod db;
pub mod lifecycle;
pub mod metrics;
pub mod task;
pub mod task_type;
#[cfg(feature = "testing")]
pub mod testing;

pub use lifecycle::TaskState;
