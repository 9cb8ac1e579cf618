//! The state gauges: what the operator knows about every pool and task type, exported from
//! its caches every [`POLL_EVERY`] while it leads (a standby exports none, so a `sum` over
//! operator replicas counts each once):
//!
//! - `conveyor_pool_replicas{namespace, pool, state}`: desired, current, ready and draining
//!   workers, from each pool's status;
//! - `conveyor_queue_depth{namespace, task_type, queue}`: messages ready, in flight, waiting
//!   to retry and dead-lettered, from the broker poller's latest list; `task_type` is the
//!   key (`video.transcode`) as in the gateways' and workers' series;
//! - `conveyor_queue_consumers{namespace, task_type}`: workers consuming its work queue. A type whose counts
//!   are unknown (a broker outage) has no series: unknown, not zero.
//!
//! Rebuilt from scratch on each pass, so a deleted pool or type leaves no stale series.

use std::sync::Arc;

use conveyor_core::crd::{TaskType, WorkerPool};
use conveyor_core::task_type::NamedTaskType;
use kube::runtime::reflector::Store;
use kube::ResourceExt;
use prometheus::IntGaugeVec;
use tokio_util::sync::CancellationToken;

use crate::broker_stats::POLL_EVERY;
use crate::context::{Context, OperatorMetrics};

/// Refreshes the gauges until `stop`, then clears them (a former leader exports nothing).
pub async fn export(
    ctx: Arc<Context>,
    pools: Store<WorkerPool>,
    types: Store<TaskType>,
    stop: CancellationToken,
) {
    let metrics = &ctx.metrics;
    metrics.leader.set(1);
    loop {
        pool_replicas(&metrics.pool_replicas, &pools);
        queue_depths(metrics, &types, &ctx);
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(POLL_EVERY) => {}
        }
    }
    metrics.leader.set(0);
    metrics.pool_replicas.reset();
    metrics.queue_depth.reset();
    metrics.queue_consumers.reset();
}

fn pool_replicas(gauge: &IntGaugeVec, pools: &Store<WorkerPool>) {
    gauge.reset();
    for pool in pools.state() {
        let (namespace, name) = (pool.namespace().unwrap_or_default(), pool.name_any());
        let status = pool.status.clone().unwrap_or_default();
        for (state, count) in [
            ("desired", status.desired_replicas),
            ("current", status.replicas),
            ("ready", status.ready_replicas),
            ("draining", status.draining),
        ] {
            gauge
                .with_label_values(&[&namespace, &name, state])
                .set(i64::from(count));
        }
    }
}

fn queue_depths(metrics: &OperatorMetrics, types: &Store<TaskType>, ctx: &Context) {
    let gauge = &metrics.queue_depth;
    gauge.reset();
    metrics.queue_consumers.reset();
    for task_type in types.state() {
        let spec = NamedTaskType::from(task_type.as_ref());
        let Ok(depths) = ctx.broker.depths(&spec) else {
            continue;
        };
        let namespace = task_type.namespace().unwrap_or_default();
        // The key (`<namespace>.<name>`), as the gateways and workers label their series.
        let name = &spec.name;
        for (queue, count) in [
            ("ready", depths.ready),
            ("in_flight", depths.in_flight),
            ("retry", depths.retry),
            ("remediation", depths.remediation),
        ] {
            gauge
                .with_label_values(&[&namespace, name, queue])
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
        if let Ok(consumers) = ctx.broker.consumers(name) {
            metrics
                .queue_consumers
                .with_label_values(&[&namespace, name])
                .set(i64::try_from(consumers).unwrap_or(i64::MAX));
        }
    }
}
