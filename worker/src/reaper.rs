//! Heartbeat timeouts: re-queue tasks whose owner went silent.
//!
//! Every worker runs this for the task types it consumes. Rows are taken with
//! `FOR UPDATE SKIP LOCKED`, so reapers never block or double-handle each other, and any
//! surviving worker rescues the tasks of a dead one: no leader, no single point of failure
//! (docs/decisions/0003-heartbeat-reaper-in-every-worker.md).

use std::sync::Arc;

use conveyor_core::amqp::Publisher;
use conveyor_core::db::Db;
use conveyor_core::metrics::Metrics;
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::upkeep::{reap_once, BATCH};
use tokio_util::sync::CancellationToken;

use crate::breaker::Breaker;

/// Checks `spec`'s tasks every half heartbeat timeout until `stop`.
///
/// Only once the database breaker has been closed for a whole heartbeat timeout: after an
/// outage every owner's heartbeat is stale, and the owners (which were cut off too) must get
/// to heartbeat and replay their buffered outcomes before their tasks count as abandoned.
pub async fn reap_loop(
    db: Db,
    publisher: Arc<Publisher>,
    breaker: Arc<Breaker>,
    spec: NamedTaskType,
    worker_id: String,
    metrics: Metrics,
    stop: CancellationToken,
) {
    // A floor keeps absurdly small timeouts from spinning (and a zero period from panicking).
    let period = (spec.heartbeat_timeout() / 2).max(std::time::Duration::from_millis(100));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if breaker
            .closed_for()
            .is_none_or(|closed| closed < spec.heartbeat_timeout())
        {
            continue;
        }
        // Drain everything stale now, a batch at a time.
        loop {
            // Timed like every database call here: a silent link must not stall the loop.
            let pass = reap_once(&db, &publisher, &spec, &worker_id, &metrics);
            match tokio::time::timeout(breaker.call_timeout * 2, pass).await {
                Ok(Ok(n)) if n as i64 == BATCH => continue,
                Ok(Ok(_)) => break,
                Ok(Err(err)) => {
                    tracing::warn!(task_type = spec.name, error = %err, "reaper pass failed");
                    break;
                }
                Err(_) => {
                    tracing::warn!(task_type = spec.name, "reaper pass timed out");
                    break;
                }
            }
        }
    }
}
