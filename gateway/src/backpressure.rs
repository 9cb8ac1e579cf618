//! Queue depth as the gateway sees it, and the drain rate that `Retry-After` comes from.
//!
//! A background loop reads each work queue's and retry queue's ready counts every interval
//! (never per request); submissions compare the sum against the last reading. Only the
//! types with work are read (submitted to since their last reading, or with messages
//! waiting), and the types someone looked at whose reading is older than [`STALE_AFTER`]:
//! an idle type costs nothing after its first reading, however many there are.
//!
//! An idle type's queue may still fill while this replica does not read it (retries coming
//! back, submissions to other replicas). Its first submission here is then checked against
//! a reading that is too low, and makes it read at the next interval: `maxQueueDepth` is
//! overshot by at most one interval's submissions to this replica, the same bound as for a
//! busy type between two readings.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use conveyor_core::amqp::{QueueNames, QueueObserver};
use conveyor_core::metrics::Metrics;
use tokio_util::sync::CancellationToken;

use crate::registry::Registry;

/// A reading this old is read again at the next interval once someone looks at it (the
/// task types overview).
pub const STALE_AFTER: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy)]
struct Reading {
    depth: u64,
    at: Instant,
    /// Messages leaving the queue per second, smoothed.
    drain_rate: f64,
    /// Published since this reading; needed to tell drained from added.
    published_since: u64,
    /// Looked at while stale: read at the next interval.
    wanted: bool,
}

/// Latest depth per task type.
#[derive(Debug, Default)]
pub struct DepthMonitor {
    readings: Mutex<HashMap<String, Reading>>,
}

impl DepthMonitor {
    /// Notes accepted publishes, so that the next reading can compute the drain rate.
    pub fn published(&self, task_type: &str, count: u64) {
        let mut readings = self.readings.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reading) = readings.get_mut(task_type) {
            reading.published_since += count;
        }
    }

    fn record(&self, task_type: &str, depth: u64) {
        let now = Instant::now();
        let mut readings = self.readings.lock().unwrap_or_else(|p| p.into_inner());
        let drain_rate = match readings.get(task_type) {
            Some(prev) => {
                let elapsed = now.duration_since(prev.at).as_secs_f64().max(1e-3);
                let drained = (prev.depth + prev.published_since).saturating_sub(depth);
                let rate = drained as f64 / elapsed;
                0.7 * prev.drain_rate + 0.3 * rate
            }
            None => 0.0,
        };
        readings.insert(
            task_type.to_owned(),
            Reading {
                depth,
                at: now,
                drain_rate,
                published_since: 0,
                wanted: false,
            },
        );
    }

    /// Whether `task_type` is read this interval: never read, submitted to since, messages
    /// waiting at the last reading, or looked at while stale. Not for being idle a while.
    fn due(&self, task_type: &str) -> bool {
        let readings = self.readings.lock().unwrap_or_else(|p| p.into_inner());
        readings
            .get(task_type)
            .is_none_or(|r| r.published_since > 0 || r.depth > 0 || r.wanted)
    }

    /// `Some(wait)` when `task_type`'s queue holds more than `max_depth`: how long until it
    /// should have drained below the limit at the measured rate (1 s to 60 s).
    pub fn over_limit(&self, task_type: &str, max_depth: u64) -> Option<Duration> {
        let readings = self.readings.lock().unwrap_or_else(|p| p.into_inner());
        let reading = readings.get(task_type)?;
        if reading.depth <= max_depth {
            return None;
        }
        let excess = (reading.depth - max_depth) as f64;
        let secs = if reading.drain_rate > 0.01 {
            excess / reading.drain_rate
        } else {
            10.0
        };
        Some(Duration::from_secs_f64(secs.clamp(1.0, 60.0)))
    }

    /// The last reading of `task_type`'s queues: messages waiting, and how many leave per
    /// second (smoothed); `None` before the first reading. A reading older than
    /// [`STALE_AFTER`] is answered as it is, and read again at the next interval.
    pub fn backlog(&self, task_type: &str) -> Option<(u64, f64)> {
        let mut readings = self.readings.lock().unwrap_or_else(|p| p.into_inner());
        let reading = readings.get_mut(task_type)?;
        reading.wanted |= reading.at.elapsed() >= STALE_AFTER;
        Some((reading.depth, reading.drain_rate))
    }

    /// Polls the work queues of the task types that are [`Self::due`] until `shutdown`.
    pub async fn run(
        self: Arc<Self>,
        observer: Arc<QueueObserver>,
        task_types: Arc<Registry>,
        interval: Duration,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_set = None;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let known = task_types.snapshot();
            // Readings of types that left the set go with them (looked at only when the
            // registry installed a new set, not every interval).
            if !last_set
                .as_ref()
                .is_some_and(|last| Arc::ptr_eq(last, &known))
            {
                let names: HashSet<&str> = known.values().map(|k| k.spec.name.as_str()).collect();
                self.readings
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .retain(|name, _| names.contains(name.as_str()));
                last_set = Some(known.clone());
            }
            for known in known.values() {
                let task_type = &known.spec.name;
                if !self.due(task_type) {
                    continue;
                }
                let queues = QueueNames::of(task_type);
                // Failed attempts waiting out their backoff come back as work: they count
                // against maxQueueDepth too.
                let depths = async {
                    let main = observer.ready_count(&queues.main).await?;
                    let mut retry = 0;
                    for queue in queues.retry_queues(known.spec.retry_tiers()) {
                        retry += observer.ready_count(&queue).await?;
                    }
                    Ok::<_, conveyor_core::amqp::AmqpError>((main, retry))
                };
                match depths.await {
                    // Not exported: every gateway replica reads the same queues, so their
                    // sum would count each message once per replica. The operator exports
                    // the depths (`conveyor_queue_depth`).
                    Ok((main, retry)) => self.record(task_type, u64::from(main) + u64::from(retry)),
                    Err(err) => {
                        metrics
                            .errors
                            .with_label_values(&["depth", err.category()])
                            .inc();
                        tracing::debug!(task_type, error = %err, "cannot read queue depth");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_types_with_work_are_read_every_interval() {
        let monitor = DepthMonitor::default();
        assert!(monitor.due("t"), "never read");
        monitor.record("t", 0);
        assert!(!monitor.due("t"), "idle: not read again this interval");
        monitor.published("t", 1);
        assert!(monitor.due("t"), "submitted to since");
        monitor.record("t", 3);
        assert!(monitor.due("t"), "messages waiting");
        monitor.record("t", 0);
        assert!(!monitor.due("t"));
        assert_eq!(monitor.backlog("t").map(|(depth, _)| depth), Some(0));
        assert!(!monitor.due("t"), "looked at while fresh");
        let mut readings = monitor.readings.lock().unwrap();
        let reading = readings.get_mut("t").unwrap();
        if let Some(long_ago) = reading.at.checked_sub(STALE_AFTER * 100) {
            reading.at = long_ago;
            drop(readings);
            assert!(!monitor.due("t"), "idle for long: still not read");
            assert_eq!(monitor.backlog("t").map(|(depth, _)| depth), Some(0));
            assert!(monitor.due("t"), "looked at while stale: read again");
            monitor.record("t", 0);
            assert!(!monitor.due("t"));
        }
    }

    #[test]
    fn limit_and_retry_after_follow_the_drain_rate() {
        let monitor = DepthMonitor::default();
        assert_eq!(monitor.over_limit("t", 10), None, "no reading yet");
        monitor.record("t", 50);
        assert_eq!(monitor.over_limit("t", 10), Some(Duration::from_secs(10)));
        assert_eq!(monitor.over_limit("t", 50), None);
        std::thread::sleep(Duration::from_millis(100));
        monitor.record("t", 20);
        let wait = monitor.over_limit("t", 10).unwrap();
        assert!(wait >= Duration::from_secs(1) && wait < Duration::from_secs(10));
    }
}
