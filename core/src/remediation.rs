//! The remediation queue's stale copies. A task sent back to work from the database (a
//! retry or redrive over the API) leaves its parked message behind, now fenced by an older
//! attempt. This walk drops such copies, and probes, and leaves every other message parked:
//! it never redrives, and it never drops a message its row does not show superseded.

use lapin::options::{BasicAckOptions, BasicNackOptions};

use crate::amqp::{self, AmqpError};
use crate::db::{Db, DbError};
use crate::task::{TaskMessage, TaskRecord};
use crate::TaskState;

/// What to do with one remediation message, from its task's row.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Drop,
    Keep,
}

pub fn verdict(message: &TaskMessage, task: Option<&TaskRecord>) -> Verdict {
    match task {
        // Perhaps the wrong database: nothing here says the message is dispensable.
        None => Verdict::Keep,
        Some(task) if matches!(task.state, TaskState::Completed | TaskState::Cancelled) => {
            Verdict::Drop
        }
        // A later attempt has its own message (or is done); this copy is fenced anyway.
        Some(task) if task.attempt > message.attempt => Verdict::Drop,
        // Owned at this attempt (its fate is in the database and the reaper's hands), or
        // a state that cannot be explained: keep it.
        Some(_) => Verdict::Keep,
    }
}

/// Returns messages a walk kept unacked (so that `basic.get` moved past them) to their
/// queue. Best effort: a message whose nack is lost comes back when the channel closes.
pub async fn return_kept(kept: Vec<lapin::message::Delivery>) {
    for delivery in kept {
        let requeue = BasicNackOptions {
            requeue: true,
            ..Default::default()
        };
        let _ = delivery.acker.nack(requeue).await;
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TidyError {
    #[error("reading the remediation queue")]
    Amqp(#[source] AmqpError),
    #[error("acknowledging a remediation message")]
    Ack(#[source] lapin::Error),
    #[error("reading a parked task's row")]
    Db(#[source] DbError),
}

/// How a walk went.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Tidied {
    pub dropped: usize,
    pub kept: usize,
}

/// Walks up to `max` messages of `queue`: stale copies and probes are acked (dropped), the
/// rest returned to the queue at the end (unacked until then, so the walk moves past them).
pub async fn drop_stale(
    amqp_url: &str,
    db: &Db,
    queue: &str,
    max: usize,
    name: &str,
) -> Result<Tidied, TidyError> {
    let conn = amqp::connect(amqp_url, name)
        .await
        .map_err(TidyError::Amqp)?;
    let channel = conn
        .create_channel()
        .await
        .map_err(|e| TidyError::Amqp(AmqpError::Unavailable(e)))?;
    let mut tidied = Tidied::default();
    let mut kept = Vec::new();
    let walk = async {
        while tidied.dropped + tidied.kept < max {
            let Some(delivery) = amqp::get_one(&channel, queue)
                .await
                .map_err(TidyError::Amqp)?
            else {
                break;
            };
            let stale = if amqp::probe_id(&delivery).is_some() {
                true
            } else {
                match serde_json::from_slice::<TaskMessage>(&delivery.data) {
                    Ok(message) => {
                        let task = db.task(message.id).await.map_err(TidyError::Db)?;
                        verdict(&message, task.as_ref()) == Verdict::Drop
                    }
                    Err(_) => false,
                }
            };
            if stale {
                delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .map_err(TidyError::Ack)?;
                tidied.dropped += 1;
            } else {
                tidied.kept += 1;
                kept.push(delivery);
            }
        }
        Ok::<(), TidyError>(())
    }
    .await;
    return_kept(kept).await;
    let _ = conn.close(200, "remediation walk done").await;
    walk.map(|()| tidied)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(state: TaskState, attempt: i32) -> TaskRecord {
        let message = message(attempt);
        TaskRecord {
            id: message.id,
            tenant: "default".into(),
            idempotency_key: message.idempotency_key,
            task_type: message.task_type,
            state,
            attempt,
            retries: 0,
            owner: None,
            payload: message.payload,
            labels: Default::default(),
            progress: None,
            result: None,
            error: None,
            created_at: message.submitted_at,
            updated_at: message.submitted_at,
            suspect: false,
        }
    }

    fn message(attempt: i32) -> TaskMessage {
        TaskMessage {
            id: uuid::Uuid::nil(),
            task_type: "t".into(),
            attempt,
            idempotency_key: uuid::Uuid::nil(),
            payload: serde_json::json!({}),
            submitted_at: chrono::DateTime::UNIX_EPOCH,
            suspect: false,
            traceparent: None,
        }
    }

    #[test]
    fn only_completed_or_superseded_messages_are_dropped() {
        use TaskState::*;
        let m = message(2);
        assert_eq!(verdict(&m, Some(&record(Completed, 2))), Verdict::Drop);
        assert_eq!(verdict(&m, Some(&record(Cancelled, 2))), Verdict::Drop);
        assert_eq!(verdict(&m, Some(&record(Queued, 3))), Verdict::Drop);
        assert_eq!(verdict(&m, Some(&record(DeadLetter, 3))), Verdict::Drop);
        for state in [Processing, Claimed, Failed, RetryClaimed] {
            assert_eq!(
                verdict(&m, Some(&record(state, 2))),
                Verdict::Keep,
                "{state}"
            );
        }
        assert_eq!(verdict(&m, Some(&record(Queued, 1))), Verdict::Keep);
        assert_eq!(verdict(&m, None), Verdict::Keep);
    }
}
