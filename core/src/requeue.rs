//! Completing a [`PendingRequeue`]: publish its messages, then commit (decision 0002).

use crate::amqp::{AmqpError, Outgoing, Publisher};
use crate::db::{DbError, PendingRequeue};
use crate::task::Requeue;
use crate::task_type::NamedTaskType;

#[derive(Debug, thiserror::Error)]
pub enum RequeueError {
    #[error("publishing the re-queued task failed")]
    Publish(#[source] AmqpError),
    #[error("committing the re-queue failed")]
    Commit(#[source] DbError),
}

/// Publishes every message of `pending` (a retry waits the type's backoff for its retry
/// number, in that retry number's queue), waits for the confirms, then commits. On any error the transaction rolls back
/// and the task stays with its silent owner for the heartbeat reaper.
pub async fn publish_and_commit(
    publisher: &Publisher,
    pending: PendingRequeue,
    spec: &NamedTaskType,
) -> Result<(), RequeueError> {
    publish(publisher, &pending, spec)
        .await
        .map_err(RequeueError::Publish)?;
    pending.commit().await.map_err(RequeueError::Commit)
}

/// The publishing half of [`publish_and_commit`], for callers that time the commit
/// themselves.
pub async fn publish(
    publisher: &Publisher,
    pending: &PendingRequeue,
    spec: &NamedTaskType,
) -> Result<(), AmqpError> {
    let outgoing: Vec<Outgoing> = pending
        .tasks
        .iter()
        .map(|task| {
            let retry = (task.retries - 1).max(0) as u32;
            Outgoing {
                message: task.message.clone(),
                route: task.route,
                delay: (task.route == Requeue::Retry).then(|| spec.backoff.delay(retry)),
                retry_tier: spec.retry_tier(retry),
            }
        })
        .collect();
    for result in publisher.publish(&outgoing).await {
        result?;
    }
    Ok(())
}
