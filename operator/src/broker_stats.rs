//! One poller of the broker's queue statistics for the whole operator: a single list request
//! every [`POLL_EVERY`], whatever the number of TaskTypes and pools, instead of several
//! requests per type in every reconcile. Both controllers read the latest snapshot. A
//! snapshot older than [`STALE_AFTER`] is not used: the reader gets the poller's last error
//! (or [`ManagementError::Stale`]), and an autoscaled pool holds.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use conveyor_core::crd::task_type::QueueDepths;
use conveyor_core::task_type::NamedTaskType;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::rabbitmq::{depths_in, rates_in, ManagementApi, ManagementError, Queues, Rates};

/// How often the queue list is fetched (RabbitMQ refreshes its statistics every 5 s).
pub const POLL_EVERY: Duration = Duration::from_secs(5);
/// A snapshot this old is not trusted.
pub const STALE_AFTER: Duration = Duration::from_secs(30);

#[derive(Default)]
pub struct BrokerStats {
    state: RwLock<State>,
}

#[derive(Default)]
struct State {
    snapshot: Option<(Arc<Queues>, Instant)>,
    last_error: Option<ManagementError>,
}

impl BrokerStats {
    /// Fetches the queue list once and keeps it (or the error).
    pub async fn refresh(&self, api: &ManagementApi) -> Result<(), ManagementError> {
        self.store(api.list_queues().await)
    }

    fn store(&self, fetched: Result<Queues, ManagementError>) -> Result<(), ManagementError> {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        match fetched {
            Ok(queues) => {
                state.snapshot = Some((Arc::new(queues), Instant::now()));
                state.last_error = None;
                Ok(())
            }
            Err(err) => {
                state.last_error = Some(err.clone());
                Err(err)
            }
        }
    }

    /// Refreshes every [`POLL_EVERY`] until `stop`.
    pub async fn poll(&self, api: &ManagementApi, stop: CancellationToken) {
        loop {
            if let Err(err) = self.refresh(api).await {
                tracing::warn!(error = %err, "cannot read the broker's queue statistics");
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(POLL_EVERY) => {}
            }
        }
    }

    /// A task type's depths in the latest snapshot.
    pub fn depths(&self, spec: &NamedTaskType) -> Result<QueueDepths, ManagementError> {
        depths_in(self.latest()?.as_ref(), spec)
    }

    /// A task type's work-queue rates in the latest snapshot.
    pub fn rates(&self, task_type: &str) -> Result<Rates, ManagementError> {
        rates_in(self.latest()?.as_ref(), task_type)
    }

    /// Whether the latest snapshot lists `queue`; `None` without a recent one.
    pub fn lists(&self, queue: &str) -> Option<bool> {
        self.latest().ok().map(|queues| queues.contains_key(queue))
    }

    fn latest(&self) -> Result<Arc<Queues>, ManagementError> {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        match &state.snapshot {
            Some((queues, at)) if at.elapsed() < STALE_AFTER => Ok(queues.clone()),
            snapshot => Err(state.last_error.clone().unwrap_or(ManagementError::Stale {
                age: snapshot.as_ref().map(|(_, at)| at.elapsed()),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queues(names: &[&str]) -> Queues {
        names
            .iter()
            .map(|name| {
                let info = serde_json::json!({"name": name, "messages": 2, "messages_ready": 1,
                    "messages_unacknowledged": 1});
                (name.to_string(), serde_json::from_value(info).unwrap())
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn readers_get_the_latest_list_until_it_is_stale_then_the_pollers_error() {
        let stats = BrokerStats::default();
        let spec = NamedTaskType::in_namespace("video", "t", Default::default());
        let err = stats.depths(&spec).unwrap_err();
        assert_eq!(
            err.category(),
            "MetricsUnavailable",
            "nothing polled yet: {err}"
        );
        stats
            .store(Ok(queues(&[
                "conveyor.video.t",
                "conveyor.video.t.retry",
                "conveyor.video.t.remediation",
            ])))
            .unwrap();
        let depths = stats.depths(&spec).unwrap();
        assert_eq!(
            (
                depths.ready,
                depths.in_flight,
                depths.retry,
                depths.remediation
            ),
            (1, 1, 2, 2)
        );
        let other = NamedTaskType::in_namespace("video", "other", Default::default());
        assert!(matches!(
            stats.depths(&other),
            Err(ManagementError::Refused { status: 404, .. })
        ));
        // The broker goes away: the last list serves until it is stale, then the error.
        let down = ManagementError::Unreachable {
            url: "https://rabbit".into(),
            reason: "connection refused".into(),
        };
        assert!(stats.store(Err(down)).is_err());
        assert!(stats.depths(&spec).is_ok());
        tokio::time::advance(STALE_AFTER).await;
        let err = stats.depths(&spec).unwrap_err();
        assert_eq!(err.category(), "RabbitMQUnavailable", "{err}");
    }
}
