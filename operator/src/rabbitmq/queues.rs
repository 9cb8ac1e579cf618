//! Queue counters as the management API reports them, and a task type's depths and rates
//! read from a list of queues. A counter the broker has not collected is unknown, never 0.

use conveyor_core::amqp::QueueNames;
use conveyor_core::crd::task_type::QueueDepths;
use conveyor_core::task_type::{NamedTaskType, MAX_RETRY_TIERS};
use serde::Deserialize;

use super::error::ManagementError;

/// One queue as the management API describes it (only the fields read here).
#[derive(Debug, Clone, Deserialize)]
pub struct QueueInfo {
    pub(super) name: String,
    messages_ready: Option<u64>,
    messages_unacknowledged: Option<u64>,
    pub(super) messages: Option<u64>,
    #[serde(default)]
    consumers: Option<u64>,
    #[serde(default)]
    pub(super) effective_policy_definition: Option<serde_json::Value>,
    #[serde(default)]
    message_stats: Option<MessageStats>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct MessageStats {
    #[serde(default)]
    ack_details: Option<Rate>,
    #[serde(default)]
    publish_details: Option<Rate>,
}

/// What flows through a work queue, per second, as the broker measured it over the last few
/// seconds; `None` before it measured any.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Rates {
    /// Acknowledgements: the processing rate.
    pub acks: Option<f64>,
    /// Publishes (new tasks and released retries): the arrival rate.
    pub publishes: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct Rate {
    rate: Option<f64>,
}

impl QueueInfo {
    fn counter(&self, counter: &'static str, value: Option<u64>) -> Result<u64, ManagementError> {
        value.ok_or_else(|| ManagementError::StatsMissing {
            queue: self.name.clone(),
            counter,
        })
    }

    fn messages(&self) -> Result<u64, ManagementError> {
        self.counter("messages", self.messages)
    }
}

/// Queues per page of the queue list: RabbitMQ refuses more than 500.
pub const LIST_PAGE: u64 = 500;
/// Passes over the pages before a list that changed while it was read is kept as it is.
pub const LIST_ATTEMPTS: u32 = 3;

/// One page of the queue list (`?page=N&page_size=...`); a vhost without queues has no
/// pages (`page_count` 0).
#[derive(Debug, Deserialize)]
pub struct QueuePage {
    pub items: Vec<QueueInfo>,
    pub page_count: u64,
    /// Queues in the vhost when this page was cut.
    pub total_count: u64,
}

/// One page of the exchange list, names only.
#[derive(Debug, Deserialize)]
pub struct ExchangePage {
    pub items: Vec<ExchangeName>,
    pub page_count: u64,
}

#[derive(Debug, Deserialize)]
pub struct ExchangeName {
    pub name: String,
}

/// Queues by name.
pub type Queues = std::collections::HashMap<String, QueueInfo>;

impl QueueInfo {
    /// The counters a pool's scaling reads: a change of any wakes the pools of its type.
    pub fn counts(&self) -> (Option<u64>, Option<u64>, Option<u64>) {
        (
            self.messages_ready,
            self.messages_unacknowledged,
            self.messages,
        )
    }
}

fn queue_in<'a>(queues: &'a Queues, name: &str) -> Result<&'a QueueInfo, ManagementError> {
    queues
        .get(name)
        .ok_or_else(|| ManagementError::QueueMissing {
            queue: name.to_owned(),
        })
}

/// A task type's depths in `queues`: its work, retry and remediation queues must be there
/// (a type not declared yet is [`ManagementError::QueueMissing`]); retry tiers beyond the first count when present (one
/// left from before an edit to fewer retries still holds retries until it drains).
pub fn depths_in(queues: &Queues, spec: &NamedTaskType) -> Result<QueueDepths, ManagementError> {
    let names = QueueNames::of(&spec.name);
    let main = queue_in(queues, &names.main)?;
    let mut retry = queue_in(queues, &names.retry)?.messages()?;
    for tier in 1..MAX_RETRY_TIERS {
        if let Some(queue) = queues.get(&names.retry_tier(tier)) {
            retry += queue.messages()?;
        }
    }
    let remediation = queue_in(queues, &names.remediation)?;
    Ok(QueueDepths {
        ready: main.counter("messages_ready", main.messages_ready)?,
        in_flight: main.counter("messages_unacknowledged", main.messages_unacknowledged)?,
        retry,
        remediation: remediation.messages()?,
    })
}

/// Consumers of a task type's work queue in `queues` (workers of every pool that serves it).
pub fn consumers_in(queues: &Queues, task_type: &str) -> Result<u64, ManagementError> {
    let main = queue_in(queues, &QueueNames::of(task_type).main)?;
    main.counter("consumers", main.consumers)
}

/// A task type's work-queue rates in `queues`.
pub fn rates_in(queues: &Queues, task_type: &str) -> Result<Rates, ManagementError> {
    let stats = queue_in(queues, &QueueNames::of(task_type).main)?
        .message_stats
        .clone()
        .unwrap_or_default();
    Ok(Rates {
        acks: stats.ack_details.and_then(|d| d.rate),
        publishes: stats.publish_details.and_then(|d| d.rate),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_counter_is_unknown_not_zero() {
        // What RabbitMQ answers for a queue whose statistics are not collected yet.
        let fresh: QueueInfo =
            serde_json::from_str(r#"{"name": "ns.t", "state": "running"}"#).unwrap();
        let err = fresh.messages().unwrap_err();
        assert_eq!(err.category(), "MetricsUnavailable");
        assert!(err.to_string().contains("ns.t has no messages"), "{err}");
        let counted: QueueInfo =
            serde_json::from_str(r#"{"name": "ns.t", "messages": 0}"#).unwrap();
        assert_eq!(counted.messages().unwrap(), 0);
    }
}
