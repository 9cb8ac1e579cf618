//! What can go wrong talking to the management API, each with its condition reason.

use std::sync::Arc;

use conveyor_core::crd::status::reasons;
use conveyor_core::with_causes;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ManagementError {
    /// The message holds the whole cause as well (a refused certificate shows in a log
    /// line that prints no source chain).
    #[error("RabbitMQ management API unreachable at {url}: {}", with_causes(source.as_ref()))]
    Unreachable {
        url: String,
        /// Shared: the poller's last error is handed to every reconcile that reads it.
        #[source]
        source: Arc<reqwest::Error>,
    },
    /// The management API's certificate was refused: the CA given does not match it.
    #[error("RabbitMQ management API at {url}: its certificate was refused (check the CA setting): {}", with_causes(source.as_ref()))]
    Certificate {
        url: String,
        #[source]
        source: Arc<reqwest::Error>,
    },
    #[error("cannot make a client for the RabbitMQ management API: {}", with_causes(.0.as_ref()))]
    Client(#[source] Arc<reqwest::Error>),
    #[error("RabbitMQ management API answered {status} to {what}: {body}")]
    Refused {
        what: String,
        status: u16,
        body: String,
    },
    /// A task type's queue is not in the broker's queue list: the TaskType is not declared
    /// yet (or its queues were deleted), which is neither an outage nor a refusal.
    #[error("queue {queue} is not in the broker's queue list (its TaskType is not declared yet)")]
    QueueMissing { queue: String },
    /// A task type's exchange is not in the broker's exchange list: deleted (a tenant's
    /// user may configure its own), so its workers' publishes fail until it is declared.
    #[error("exchange {exchange} is not in the broker's exchange list (deleted?)")]
    ExchangeMissing { exchange: String },
    /// The broker answered without a counter (statistics not collected yet, or disabled):
    /// unknown, never zero, so a pool is not scaled down on a number nobody measured.
    #[error("queue {queue} has no {counter} statistic yet")]
    StatsMissing {
        queue: String,
        counter: &'static str,
    },
    /// The shared poller has no recent queue list ([`crate::broker_stats`]).
    #[error("no recent queue statistics (last list {age:?} ago)")]
    Stale { age: Option<std::time::Duration> },
}

impl ManagementError {
    /// Whether the broker may be out: the poller has had no list for a while (a snapshot is
    /// trusted for [`crate::broker_stats::STALE_AFTER`], so one slow answer never shows here),
    /// refused, timed out or unanswered. Not before a first list (an operator just started).
    pub fn says_broker_out(&self) -> bool {
        matches!(
            self,
            ManagementError::Unreachable { .. } | ManagementError::Stale { age: Some(_) }
        )
    }

    pub fn category(&self) -> &'static str {
        match self {
            ManagementError::Unreachable { .. } => reasons::RABBITMQ_UNAVAILABLE,
            ManagementError::Client(_) => reasons::RABBITMQ_CLIENT,
            ManagementError::Certificate { .. } => reasons::TLS_SETTINGS,
            ManagementError::Refused { .. } => reasons::RABBITMQ_REFUSED,
            ManagementError::QueueMissing { .. } => reasons::QUEUE_MISSING,
            ManagementError::ExchangeMissing { .. } => reasons::EXCHANGE_MISSING,
            ManagementError::StatsMissing { .. } | ManagementError::Stale { .. } => {
                reasons::METRICS_UNAVAILABLE
            }
        }
    }
}
