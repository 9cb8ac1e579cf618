//! The Conveyor operator's logic: pure builders and decisions, unit-tested on fixtures.
//! The reconcilers that apply them are not built yet (docs/ARCHITECTURE.md, "Status").
#![forbid(unsafe_code)]

pub mod autoscale;
pub mod build;
pub mod rabbitmq;
