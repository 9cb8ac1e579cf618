//! The AMQP layer: every connection, topology and publish/consume call Conveyor makes.
//!
//! Per task type T there are three quorum queues: `conveyor.T` (work), `conveyor.T.retry`
//! (per-message TTL, dead-letters back to the work queue) and `conveyor.T.remediation`
//! (parked tasks, and the work queue's dead letters). Messages are published to the type's
//! own direct exchange, `conveyor.T` (exchanges and queues are named apart), where each
//! queue is bound by its name: RabbitMQ authorizes a publish by exchange, so a tenant's
//! broker user, which may write only `conveyor.<namespace>.` exchanges, cannot put a message
//! into another tenant's queue (decision 0013). The broker's own dead-lettering between a
//! type's queues goes through the default exchange, which no permission governs. The
//! gateway, which serves every tenant, publishes through the default exchange too
//! ([`Via::DefaultExchange`]): a tenant that deletes its own exchange must not close the
//! channels other tenants' publishes share (decision 0045).
//! Publishes are persistent, `mandatory` and confirmed; a nack, a return (no such queue), a
//! missing exchange or a missing confirm is an error of that message only; a closed channel
//! is replaced on the next publish, and only a lost or hung connection is reconnected.

mod confirms;
mod connection;
mod consume;
mod error;
mod names;
mod publisher;
mod settle;
mod topology;

pub use connection::{
    close_bounded, connect, node_urls, with_heartbeat, CLOSE_TIMEOUT, CONNECT_TIMEOUT,
};
pub use consume::{consume, get_one, probe_id, traceparent, PROBE_KIND};
pub use error::{AmqpError, AmqpResult};
pub use names::QueueNames;
pub use publisher::{Outgoing, Publisher, QueueObserver, Via, DEFAULT_PUBLISH_CHANNELS};
pub use settle::{Settlement, Settler};
pub use topology::{
    declare_task_type, delete_exchange, delete_queues, queue_arguments, queue_counts, queue_exists,
    ready_count, QueueCounts,
};
