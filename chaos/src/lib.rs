//! conveyor-chaos: the fault-injection suite. Every scenario runs the real gateway and
//! workers against the real RabbitMQ and PostgreSQL, injects one fault while tasks flow,
//! heals it, and asks the oracle one question: what went in, did it come out, once?

pub mod broker;
pub mod cluster;
pub mod failover;
pub mod faults;
pub mod hostile;
pub mod load;
pub mod node_loss;
pub mod observe;
pub mod oracle;
pub mod replicated;
pub mod report;
pub mod run;
pub mod scenarios;
pub mod sidecar;
pub mod system;
pub mod telemetry;
