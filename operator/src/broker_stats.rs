//! One poller of the broker's queue statistics for the whole operator: a single paged list
//! every [`POLL_EVERY`], whatever the number of TaskTypes and pools, instead of several
//! requests per type in every reconcile. Both controllers read the latest snapshot. A list
//! that takes long (a large fleet, a busy broker) is paced, never repeated back to back: the
//! poller pauses three times as long as the list took. A snapshot older than [`STALE_AFTER`]
//! (or than two such pauses) is not used: the reader gets the poller's last error (or
//! [`ManagementError::Stale`]), and an autoscaled pool holds.
//!
//! Each poll also lists the exchanges' names: a type whose exchange went (a tenant's user
//! may delete its own) is woken and declared again at once, not at its next re-declaration
//! half an hour later (decision 0045).

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use conveyor_core::crd::task_type::QueueDepths;
use conveyor_core::task_type::NamedTaskType;
use tokio::sync::mpsc::UnboundedSender;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::rabbitmq::{
    consumers_in, depths_in, rates_in, ManagementApi, ManagementError, QueueInfo, Queues, Rates,
};

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
    /// The exchanges' names in the last list that came through (`None` before the first).
    exchanges: Option<HashSet<String>>,
    last_error: Option<ManagementError>,
    /// How long the last list took.
    took: Duration,
}

/// The pause after a list that took `took`: the list costs the broker at most a quarter of
/// the time.
fn pause_after(took: Duration) -> Duration {
    POLL_EVERY.max(took * 3)
}

/// How old a snapshot may be when lists take `took`: two pauses and a list, at least
/// [`STALE_AFTER`].
fn stale_after(took: Duration) -> Duration {
    STALE_AFTER.max(pause_after(took) * 2 + took)
}

impl BrokerStats {
    /// Fetches the queue list once and keeps it (or the error).
    pub async fn refresh(&self, api: &ManagementApi) -> Result<(), ManagementError> {
        self.fetch(api).await.map(drop)
    }

    /// Fetches the list, keeps it with how long it took, and answers what changed.
    /// Only a list that came through paces the next: a failed one (a hung broker takes the
    /// whole client timeout) must not make an old snapshot trusted for longer.
    async fn fetch(&self, api: &ManagementApi) -> Result<BTreeSet<String>, ManagementError> {
        let started = Instant::now();
        let fetched = api.list_queues().await;
        let exchanges = match &fetched {
            Ok(_) => match api.list_exchange_names().await {
                Ok(names) => Some(names),
                Err(err) => {
                    tracing::warn!(error = %err, "cannot list the broker's exchanges");
                    None
                }
            },
            Err(_) => None,
        };
        if fetched.is_ok() {
            self.state.write().unwrap_or_else(|p| p.into_inner()).took = started.elapsed();
        }
        let mut changed = self.store_changes(fetched)?;
        changed.extend(self.store_exchanges(exchanges));
        Ok(changed)
    }

    /// Keeps the exchange names; answers the keys of the types whose exchange appeared or
    /// went since the last list.
    /// A list that failed keeps the last one, the baseline of the next.
    fn store_exchanges(&self, exchanges: Option<HashSet<String>>) -> BTreeSet<String> {
        let Some(now) = exchanges else {
            return BTreeSet::new();
        };
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        let changed = match &state.exchanges {
            Some(before) => before
                .symmetric_difference(&now)
                .filter_map(|name| type_key(name))
                .collect(),
            None => BTreeSet::new(),
        };
        state.exchanges = Some(now);
        changed
    }

    /// A task type's depths, as [`BrokerStats::depths`], unless a recent list shows its
    /// exchange missing ([`ManagementError::ExchangeMissing`], whatever the queues'
    /// statistics say).
    pub fn declared(&self, spec: &NamedTaskType) -> Result<QueueDepths, ManagementError> {
        if self.latest().is_ok() {
            let exchange = conveyor_core::amqp::QueueNames::of(&spec.name).main;
            let state = self.state.read().unwrap_or_else(|p| p.into_inner());
            if state
                .exchanges
                .as_ref()
                .is_some_and(|names| !names.contains(&exchange))
            {
                return Err(ManagementError::ExchangeMissing { exchange });
            }
        }
        self.depths(spec)
    }

    #[cfg(test)]
    fn store(&self, fetched: Result<Queues, ManagementError>) -> Result<(), ManagementError> {
        self.store_changes(fetched).map(drop)
    }

    /// Keeps the list (or the error); answers the task type keys whose queues' counts
    /// changed since the last list (every key listed, on the first).
    fn store_changes(
        &self,
        fetched: Result<Queues, ManagementError>,
    ) -> Result<BTreeSet<String>, ManagementError> {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        match fetched {
            Ok(queues) => {
                let changed = match &state.snapshot {
                    Some((before, _)) => changed_types(before, &queues),
                    None => queues.keys().filter_map(|q| type_key(q)).collect(),
                };
                state.snapshot = Some((Arc::new(queues), Instant::now()));
                state.last_error = None;
                Ok(changed)
            }
            Err(err) => {
                state.last_error = Some(err.clone());
                Err(err)
            }
        }
    }

    /// Refreshes every [`POLL_EVERY`] until `stop`, sending the task type keys whose queue
    /// counts changed to `changed` (pools at rest are woken by them, not by a timer).
    pub async fn poll(
        &self,
        api: &ManagementApi,
        changed: Vec<UnboundedSender<BTreeSet<String>>>,
        stop: CancellationToken,
    ) {
        loop {
            let fetched = self.fetch(api).await;
            let pause = match &fetched {
                Ok(_) => pause_after(self.state.read().unwrap_or_else(|p| p.into_inner()).took),
                Err(_) => POLL_EVERY,
            };
            match fetched {
                Ok(keys) if !keys.is_empty() => {
                    for listener in &changed {
                        let _ = listener.send(keys.clone());
                    }
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(error = %err, "cannot read the broker's queue statistics");
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// A task type's depths in the latest snapshot.
    pub fn depths(&self, spec: &NamedTaskType) -> Result<QueueDepths, ManagementError> {
        depths_in(self.latest()?.as_ref(), spec)
    }

    /// Consumers of a task type's work queue in the latest snapshot.
    pub fn consumers(&self, task_type: &str) -> Result<u64, ManagementError> {
        consumers_in(self.latest()?.as_ref(), task_type)
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
            Some((queues, at)) if at.elapsed() < stale_after(state.took) => Ok(queues.clone()),
            snapshot => Err(state.last_error.clone().unwrap_or(ManagementError::Stale {
                age: snapshot.as_ref().map(|(_, at)| at.elapsed()),
            })),
        }
    }
}

/// The task type a queue belongs to: `conveyor.<key>`, `.retry`, `.retry.<n>`,
/// `.remediation`.
fn type_key(queue: &str) -> Option<String> {
    let rest = queue.strip_prefix("conveyor.")?;
    let rest = rest.strip_suffix(".remediation").unwrap_or(rest);
    let rest = match rest.rsplit_once('.') {
        Some((head, tier)) if tier.chars().all(|c| c.is_ascii_digit()) => {
            head.strip_suffix(".retry").unwrap_or(rest)
        }
        _ => rest.strip_suffix(".retry").unwrap_or(rest),
    };
    Some(rest.to_owned())
}

/// Keys of the types whose queues appeared, went, or changed a count.
fn changed_types(before: &Queues, now: &Queues) -> BTreeSet<String> {
    let changed = |name: &String| {
        before.get(name).map(QueueInfo::counts) != now.get(name).map(QueueInfo::counts)
    };
    before
        .keys()
        .chain(now.keys())
        .filter(|name| changed(name))
        .filter_map(|name| type_key(name))
        .collect()
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
            Err(ManagementError::QueueMissing { .. })
        ));
        assert_eq!(stats.depths(&other).unwrap_err().category(), "QueueMissing");
        // The broker goes away: the last list serves until it is stale, then the error.
        let down = reqwest::get("http://127.0.0.1:1/api/queues")
            .await
            .unwrap_err();
        let down = ManagementError::Unreachable {
            url: "http://127.0.0.1:1".into(),
            source: std::sync::Arc::new(down),
        };
        assert!(stats.store(Err(down)).is_err());
        assert!(stats.depths(&spec).is_ok());
        tokio::time::advance(STALE_AFTER).await;
        let err = stats.depths(&spec).unwrap_err();
        assert_eq!(err.category(), "RabbitMQUnavailable", "{err}");
    }

    #[test]
    fn a_type_whose_exchange_went_is_woken_and_reads_as_missing() {
        let stats = BrokerStats::default();
        let spec = NamedTaskType::in_namespace("video", "t", Default::default());
        let names = [
            "conveyor.video.t",
            "conveyor.video.t.retry",
            "conveyor.video.t.remediation",
        ];
        stats.store(Ok(queues(&names))).unwrap();
        let exchanges = |names: &[&str]| Some(names.iter().map(|n| n.to_string()).collect());
        assert!(stats
            .store_exchanges(exchanges(&["", "conveyor.video.t"]))
            .is_empty());
        assert!(stats.declared(&spec).is_ok());
        // Deleted by hand: the type is named, and reads as missing until it is back.
        let changed: Vec<String> = stats
            .store_exchanges(exchanges(&[""]))
            .into_iter()
            .collect();
        assert_eq!(changed, ["video.t"]);
        let err = stats.declared(&spec).unwrap_err();
        assert!(
            matches!(err, ManagementError::ExchangeMissing { .. }),
            "{err}"
        );
        assert_eq!(err.category(), "ExchangeMissing");
        assert!(
            stats.depths(&spec).is_ok(),
            "depths do not need the exchange"
        );
        // A failed exchange list changes nothing; the next compares with the last good one.
        assert!(stats.store_exchanges(None).is_empty());
        assert!(stats.declared(&spec).is_err());
        let changed: Vec<String> = stats
            .store_exchanges(exchanges(&["", "conveyor.video.t"]))
            .into_iter()
            .collect();
        assert_eq!(changed, ["video.t"]);
        assert!(stats.declared(&spec).is_ok());
    }

    #[test]
    fn a_slow_list_is_paced_and_trusted_for_as_long() {
        assert_eq!(pause_after(Duration::from_millis(200)), POLL_EVERY);
        assert_eq!(stale_after(Duration::from_millis(200)), STALE_AFTER);
        let slow = Duration::from_secs(20);
        assert_eq!(pause_after(slow), Duration::from_secs(60));
        assert_eq!(stale_after(slow), Duration::from_secs(140));
    }

    #[test]
    fn a_changed_count_names_its_type_and_nothing_else() {
        let before = queues(&[
            "conveyor.video.t",
            "conveyor.video.t.retry.2",
            "conveyor.video.u.remediation",
        ]);
        let mut now = before.clone();
        assert!(changed_types(&before, &now).is_empty(), "nothing changed");
        let info = serde_json::json!({"name": "conveyor.video.t.retry.2", "messages": 3,
            "messages_ready": 3, "messages_unacknowledged": 0});
        now.insert(
            "conveyor.video.t.retry.2".to_owned(),
            serde_json::from_value(info).unwrap(),
        );
        now.remove("conveyor.video.u.remediation");
        let changed: Vec<String> = changed_types(&before, &now).into_iter().collect();
        assert_eq!(changed, ["video.t", "video.u"]);
        assert_eq!(
            type_key("conveyor.video.t.retry").as_deref(),
            Some("video.t")
        );
        assert_eq!(type_key("other.queue"), None);
    }
}
