//! Queue depth as the gateway sees it, and the drain rate that `Retry-After` comes from.
//!
//! A background loop reads each work queue's and retry queue's ready counts every interval
//! (never per request); submissions compare the sum against the last reading. Only the
//! types with work are read each interval (submitted to since their last reading, or with
//! messages waiting); an idle type is read once every [`IDLE_EVERY`], so five hundred idle
//! types cost a few broker calls a second, not a thousand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use conveyor_core::amqp::{QueueNames, QueueObserver};
use conveyor_core::metrics::Metrics;
use tokio_util::sync::CancellationToken;

use crate::registry::Registry;

/// How often a type with nothing waiting and nothing submitted is read (its queue may still
/// fill: retries coming back, or submissions to other gateway replicas).
pub const IDLE_EVERY: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy)]
struct Reading {
    depth: u64,
    at: Instant,
    /// Messages leaving the queue per second, smoothed.
    drain_rate: f64,
    /// Published since this reading; needed to tell drained from added.
    published_since: u64,
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
            },
        );
    }

    /// Whether `task_type` is read this interval: never read, submitted to since, messages
    /// waiting at the last reading, or idle for [`IDLE_EVERY`].
    fn due(&self, task_type: &str) -> bool {
        let readings = self.readings.lock().unwrap_or_else(|p| p.into_inner());
        readings
            .get(task_type)
            .is_none_or(|r| r.published_since > 0 || r.depth > 0 || r.at.elapsed() >= IDLE_EVERY)
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
    /// second (smoothed); `None` before the first reading.
    pub fn backlog(&self, task_type: &str) -> Option<(u64, f64)> {
        let readings = self.readings.lock().unwrap_or_else(|p| p.into_inner());
        readings.get(task_type).map(|r| (r.depth, r.drain_rate))
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
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            for known in task_types.snapshot().values() {
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
        let mut readings = monitor.readings.lock().unwrap();
        let reading = readings.get_mut("t").unwrap();
        if let Some(long_ago) = reading.at.checked_sub(IDLE_EVERY) {
            reading.at = long_ago;
            drop(readings);
            assert!(monitor.due("t"), "idle for IDLE_EVERY: read again");
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
