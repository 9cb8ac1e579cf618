//! Prometheus metrics, one registry per process, injected (no globals).

use prometheus::{
    HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// Every metric a Conveyor process exports. Gateways and workers fill in their own part;
/// the rest stays at zero.
#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// Gateway: submissions by task type and outcome (created, existing, or an error code).
    pub submissions: IntCounterVec,
    /// Worker: finished attempts by task type and outcome (completed, retried, dead_lettered).
    pub tasks: IntCounterVec,
    /// Lifecycle transitions written, by task type, from and to.
    pub transitions: IntCounterVec,
    /// Deliveries acked and dropped because the task was not claimable at that attempt.
    pub duplicates: IntCounterVec,
    /// Outcomes refused because the worker no longer owned the task.
    pub fenced: IntCounterVec,
    /// Tasks re-queued because their owner stopped heartbeating.
    pub heartbeat_timeouts: IntCounterVec,
    pub retries: IntCounterVec,
    pub dead_letters: IntCounterVec,
    /// Handler run time per attempt.
    pub processing_seconds: HistogramVec,
    /// Submission to COMPLETED.
    pub end_to_end_seconds: HistogramVec,
    /// Gateway: API requests by matched route, method and status code.
    pub http_request_seconds: HistogramVec,
    /// Errors talking to the database or the broker, by component and category.
    pub errors: IntCounterVec,
    /// Tasks this worker is processing now; the operator reads it to pick idle pods to
    /// remove on scale-down.
    pub in_flight: IntGauge,
    /// Worker: 1 while it takes no new tasks because the operator chose it for removal.
    pub draining: IntGauge,
    /// Worker: the database circuit breaker, 0 closed, 1 half-open, 2 open.
    pub breaker_state: IntGauge,
    /// Worker: breaker state changes, by the state entered.
    pub breaker_transitions: IntCounterVec,
    /// Worker: outcomes waiting in the degraded-mode buffer, and their size on disk.
    pub buffered: IntGauge,
    pub buffer_bytes: IntGauge,
    /// Worker: buffered outcomes replayed, by task type and what the database made of them.
    pub replayed: IntCounterVec,
    /// Upkeep: tasks re-published because their message was lost (decision 0011).
    pub republished: IntCounterVec,
    /// Upkeep: probes sent through the work queues.
    pub probes: IntCounterVec,
    /// Upkeep: open tasks of a TaskType deleted with its queues, settled (decision 0033).
    pub retired_settled: IntCounterVec,
    /// Upkeep: settled tasks deleted after their retention (decision 0034).
    pub tasks_expired: IntCounterVec,
    /// Worker: buffered outcomes the database refused for good, set aside for a human.
    pub quarantined: IntCounterVec,
    /// Upkeep: days from today on whose audit partitions exist; below a week, upkeep has
    /// failed for a week.
    pub audit_partition_days_ahead: IntGauge,
    /// Upkeep: audit partitions past the retention period, not dropped yet (a long reader
    /// of the log holds them).
    pub audit_partitions_overdue: IntGauge,
    /// Upkeep: how full each B-tree index of `tasks` is, in percent of a fresh build's
    /// fill; below 40 % (2.5 times its packed size) it is rebuilt (decision 0037).
    pub task_index_density: IntGaugeVec,
    /// Upkeep: indexes of `tasks` rebuilt because deletes had left them sparse.
    pub task_index_rebuilds: IntCounterVec,
}

/// Registers a labelled counter named `conveyor_<name>`.
pub fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let metric = IntCounterVec::new(Opts::new(format!("conveyor_{name}"), help), labels);
    register(registry, metric)
}

/// Registers a gauge named `conveyor_<name>`.
pub fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    register(registry, IntGauge::new(format!("conveyor_{name}"), help))
}

/// Upper bounds, in seconds, of the task latency histograms: a noop task takes milliseconds,
/// a transcode an hour or more, and both must land in a bucket of their own size.
pub const TASK_SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1200.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0,
];

/// Upper bounds, in seconds, of request and reconcile durations (a millisecond to a minute).
pub const REQUEST_SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Registers a labelled histogram named `conveyor_<name>`.
pub fn histogram(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> HistogramVec {
    let metric = HistogramVec::new(
        HistogramOpts::new(format!("conveyor_{name}"), help).buckets(buckets.to_vec()),
        labels,
    );
    register(registry, metric)
}

/// Registers a labelled gauge named `conveyor_<name>`.
pub fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let metric = IntGaugeVec::new(Opts::new(format!("conveyor_{name}"), help), labels);
    register(registry, metric)
}

/// Metric definitions are constants of this crate: a bad one, or one registered twice in
/// one registry, is a programming error.
fn register<M: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: prometheus::Result<M>,
) -> M {
    let metric = metric.expect("metric definition is valid");
    registry
        .register(Box::new(metric.clone()))
        .expect("metric registered once");
    metric
}

/// What every Conveyor process exports beside its own metrics: `conveyor_build_info`
/// (which component, which version) and the process's CPU, memory and file descriptors
/// (`process_*`, read from /proc).
pub fn describe_process(registry: &Registry, component: &str) {
    gauge_vec(
        registry,
        "build_info",
        "Always 1; the labels say which component and version this process is",
        &["component", "version"],
    )
    .with_label_values(&[component, env!("CARGO_PKG_VERSION")])
    .set(1);
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .expect("process collector registered once");
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let r = &registry;
        Metrics {
            audit_partition_days_ahead: gauge(
                r,
                "audit_partition_days_ahead",
                "Days from today on whose audit-log partitions exist (upkeep makes 14)",
            ),
            audit_partitions_overdue: gauge(
                r,
                "audit_partitions_overdue",
                "Audit-log partitions past the retention period and not dropped yet",
            ),
            task_index_density: gauge_vec(
                r,
                "task_index_density_percent",
                "How full each B-tree index of the tasks table is, in percent of a fresh build's fill",
                &["index"],
            ),
            task_index_rebuilds: counter(
                r,
                "task_index_rebuilds_total",
                "Indexes of the tasks table rebuilt (REINDEX CONCURRENTLY) because deletes had left them sparse",
                &["index"],
            ),
            in_flight: gauge(r, "in_flight_tasks", "Tasks this worker is processing"),
            draining: gauge(
                r,
                "worker_draining",
                "1 while the worker takes no new tasks (chosen for removal)",
            ),
            breaker_state: gauge(
                r,
                "database_breaker_state",
                "Database circuit breaker: 0 closed, 1 half-open, 2 open",
            ),
            breaker_transitions: counter(
                r,
                "database_breaker_transitions_total",
                "Database circuit breaker state changes, by the state entered",
                &["to"],
            ),
            buffered: gauge(
                r,
                "buffered_transitions",
                "Outcomes waiting in the degraded-mode buffer",
            ),
            buffer_bytes: gauge(r, "buffer_bytes", "Size of the degraded-mode buffer file"),
            replayed: counter(
                r,
                "replayed_transitions_total",
                "Buffered outcomes replayed, by what the database made of them",
                &["task_type", "outcome"],
            ),
            republished: counter(
                r,
                "tasks_republished_total",
                "Waiting tasks re-published because a probe showed their message was lost",
                &["task_type"],
            ),
            tasks_expired: counter(
                r,
                "tasks_expired_total",
                "Settled tasks deleted (archived first, when an archive is set) after their retention",
                &["task_type"],
            ),
            retired_settled: counter(
                r,
                "retired_tasks_settled_total",
                "Open tasks of a TaskType deleted with its queues, cancelled or dead-lettered",
                &["task_type", "outcome"],
            ),
            probes: counter(
                r,
                "probes_total",
                "Probes published through the work queues",
                &["task_type"],
            ),
            quarantined: counter(
                r,
                "quarantined_transitions_total",
                "Buffered outcomes the database refused for good, moved out of the buffer",
                &["task_type"],
            ),
            submissions: counter(
                r,
                "submissions_total",
                "Task submissions by outcome",
                &["task_type", "outcome"],
            ),
            tasks: counter(
                r,
                "tasks_total",
                "Finished task attempts by outcome",
                &["task_type", "outcome"],
            ),
            transitions: counter(
                r,
                "transitions_total",
                "Lifecycle transitions written",
                &["task_type", "from", "to"],
            ),
            duplicates: counter(
                r,
                "duplicates_suppressed_total",
                "Duplicate or stale deliveries acked and dropped",
                &["task_type"],
            ),
            fenced: counter(
                r,
                "fenced_total",
                "Outcomes refused because the worker lost ownership",
                &["task_type"],
            ),
            heartbeat_timeouts: counter(
                r,
                "heartbeat_timeouts_total",
                "Tasks re-queued after their owner stopped heartbeating",
                &["task_type"],
            ),
            retries: counter(
                r,
                "retries_total",
                "Tasks sent to the retry queue",
                &["task_type"],
            ),
            dead_letters: counter(
                r,
                "dead_letters_total",
                "Tasks parked in the remediation queue",
                &["task_type"],
            ),
            processing_seconds: histogram(
                r,
                "processing_duration_seconds",
                "Handler run time per attempt",
                &["task_type"],
                TASK_SECONDS_BUCKETS,
            ),
            end_to_end_seconds: histogram(
                r,
                "end_to_end_latency_seconds",
                "Submission to COMPLETED",
                &["task_type"],
                TASK_SECONDS_BUCKETS,
            ),
            http_request_seconds: histogram(
                r,
                "http_request_duration_seconds",
                "Gateway API requests, by route, method and status",
                &["route", "method", "status"],
                REQUEST_SECONDS_BUCKETS,
            ),
            errors: counter(
                r,
                "errors_total",
                "Errors by component and category",
                &["component", "category"],
            ),
            registry,
        }
    }

    /// Counts a lifecycle path `states[0] → states[1] → ...`.
    pub fn record_path(&self, task_type: &str, states: &[crate::TaskState]) {
        for pair in states.windows(2) {
            self.transitions
                .with_label_values(&[task_type, pair[0].as_str(), pair[1].as_str()])
                .inc();
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_hour_long_transcode_lands_in_a_bucket_not_in_inf() {
        let metrics = Metrics::new();
        let e2e = metrics.end_to_end_seconds.with_label_values(&["transcode"]);
        e2e.observe(3000.0);
        e2e.observe(0.003);
        let families = metrics.registry.gather();
        let family = families
            .iter()
            .find(|f| f.name() == "conveyor_end_to_end_latency_seconds")
            .unwrap();
        let histogram = family.get_metric()[0].get_histogram();
        let first_holding = |n: u64| {
            histogram
                .get_bucket()
                .iter()
                .find(|b| b.cumulative_count() >= n)
                .map(|b| b.upper_bound())
        };
        assert_eq!(first_holding(1), Some(0.005));
        assert_eq!(first_holding(2), Some(3600.0));
    }
}
