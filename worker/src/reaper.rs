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
use conveyor_core::task::Requeue;
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::TaskState;
use tokio_util::sync::CancellationToken;

use conveyor_core::requeue::publish_and_commit;

use crate::breaker::Breaker;

const BATCH: i64 = 100;

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
            let pass = tokio::time::timeout(breaker.call_timeout * 2, pass).await;
            match pass.unwrap_or_else(|_| Err(anyhow::anyhow!("timed out"))) {
                Ok(n) if n as i64 == BATCH => continue,
                Ok(_) => break,
                Err(err) => {
                    tracing::warn!(task_type = spec.name, error = %err, "reaper pass failed");
                    break;
                }
            }
        }
    }
}

/// One pass: returns how many tasks were re-queued.
pub async fn reap_once(
    db: &Db,
    publisher: &Publisher,
    spec: &NamedTaskType,
    worker_id: &str,
    metrics: &Metrics,
) -> anyhow::Result<usize> {
    let pending = db
        .begin_reap(
            &spec.name,
            spec.heartbeat_timeout(),
            spec.max_retries as i32,
            worker_id,
            BATCH,
        )
        .await?;
    let Some(pending) = pending else {
        return Ok(0);
    };
    let tasks = pending.tasks.clone();
    publish_and_commit(publisher, pending, &spec.backoff).await?;
    for task in &tasks {
        let name = spec.name.as_str();
        metrics.heartbeat_timeouts.with_label_values(&[name]).inc();
        let end = if task.route == Requeue::Remediation {
            metrics.dead_letters.with_label_values(&[name]).inc();
            TaskState::DeadLetter
        } else {
            TaskState::Queued
        };
        metrics.record_path(name, &[TaskState::RetryClaimed, end]);
        tracing::info!(task = %task.message.id, attempt = task.message.attempt, ?end,
            "owner stopped heartbeating; task re-queued");
    }
    Ok(tasks.len())
}
