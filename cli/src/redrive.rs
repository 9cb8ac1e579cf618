//! `conveyorctl redrive`: remediation queue → work queue, audited as DEAD_LETTER → QUEUED.

use anyhow::Context;
use conveyor_core::amqp::{self, QueueNames};
use conveyor_core::requeue::publish_and_commit;
use conveyor_core::task::{TaskMessage, TaskRecord};
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::TaskState;
use lapin::options::{BasicAckOptions, BasicNackOptions};

use crate::Direct;

/// How a redrive went.
#[derive(Debug, Default)]
pub struct RedriveReport {
    /// Dead-lettered tasks sent back to the work queue (DEAD_LETTER → QUEUED).
    pub redriven: usize,
    /// Tasks still waiting for a worker whose only message had been parked here (the
    /// broker's delivery limit dead-letters redeliveries that were no task failure): sent
    /// back to the work queue with attempt + 1 (QUEUED → QUEUED).
    pub returned: usize,
    /// Superseded copies (the task has moved on to a later attempt or is COMPLETED) and
    /// probes: acked and dropped.
    pub stale: usize,
    /// Messages of tasks that are owned right now, or unknown to this database: left
    /// parked, never dropped.
    pub kept: usize,
}

/// What to do with one remediation message, from the task's row.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Drop,
    Keep,
}

fn verdict(message: &TaskMessage, task: Option<&TaskRecord>) -> Verdict {
    match task {
        // Perhaps the wrong database: nothing here says the message is dispensable.
        None => Verdict::Keep,
        Some(task) if task.state == TaskState::Completed => Verdict::Drop,
        // A later attempt has its own message (or is done); this copy is fenced anyway.
        Some(task) if task.attempt > message.attempt => Verdict::Drop,
        // Owned at this attempt (its fate is in the database and the reaper's hands), or
        // a state this redrive cannot explain: keep it.
        Some(_) => Verdict::Keep,
    }
}

/// Moves up to `limit` messages from `task_type`'s remediation queue back to its work queue.
/// Each task is re-queued in the database and published before its remediation message is
/// acked, so an interrupted redrive loses nothing and can simply be run again. A message is
/// dropped only when its task is COMPLETED or has moved on to a later attempt; the message
/// of a task that is still waiting goes back to the work queue.
pub async fn redrive(
    direct: &Direct,
    task_type: &str,
    limit: usize,
    by: &str,
) -> anyhow::Result<RedriveReport> {
    let Direct {
        db,
        amqp_url,
        publisher,
    } = direct;
    let conn = amqp::connect(amqp_url, &format!("conveyorctl-redrive-{by}")).await?;
    let channel = conn.create_channel().await.context("opening a channel")?;
    let queue = QueueNames::of(task_type).remediation;
    // Redriven and returned tasks go to the work queue at once: no backoff, no retry queue.
    let main_only = NamedTaskType::named(task_type);
    let mut report = RedriveReport::default();
    // Kept messages stay unacked until the end, so that `basic.get` moves on past them.
    let mut kept = Vec::new();
    let result = async {
        while report.redriven + report.returned + report.stale + report.kept < limit {
            let Some(delivery) = amqp::get_one(&channel, &queue).await? else {
                break;
            };
            if amqp::probe_id(&delivery).is_some() {
                report.stale += 1;
                delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .context("acking")?;
                continue;
            }
            let task: TaskMessage = match serde_json::from_slice(&delivery.data) {
                Ok(task) => task,
                Err(err) => {
                    // Unreadable: leave it parked for a human and say so.
                    eprintln!("unreadable message in {queue} ({err}); kept parked");
                    report.kept += 1;
                    kept.push(delivery);
                    continue;
                }
            };
            // Dead-lettered: redriven. Still waiting at this attempt: this is its only
            // message, returned. Otherwise the row says whether to keep or drop it.
            let returned =
                format!("its message was parked in {queue} while it waited; returned by {by}");
            let requeued = match db.begin_redrive(task.id, task.attempt, by).await? {
                Some(pending) => Some((pending, &mut report.redriven)),
                None => db
                    .begin_return(task.id, task.attempt, &returned)
                    .await?
                    .map(|pending| (pending, &mut report.returned)),
            };
            if let Some((pending, count)) = requeued {
                publish_and_commit(publisher, pending, &main_only)
                    .await
                    .with_context(|| format!("sending task {} back to work", task.id))?;
                *count += 1;
            } else if verdict(&task, db.task(task.id).await?.as_ref()) == Verdict::Keep {
                report.kept += 1;
                kept.push(delivery);
                continue;
            } else {
                report.stale += 1;
            }
            delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .context("acking")?;
        }
        anyhow::Ok(())
    }
    .await;
    for delivery in kept {
        let requeue = BasicNackOptions {
            requeue: true,
            ..Default::default()
        };
        let _ = delivery.acker.nack(requeue).await;
    }
    let _ = conn.close(200, "redrive done").await;
    result.map(|()| report)
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
