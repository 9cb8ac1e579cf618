//! `conveyorctl redrive`: remediation queue → work queue, audited as DEAD_LETTER → QUEUED.

use anyhow::Context;
use conveyor_core::amqp::{self, QueueNames};
use conveyor_core::remediation::{return_kept, verdict, Verdict};
use conveyor_core::requeue::publish_and_commit;
use conveyor_core::task::TaskMessage;
use conveyor_core::task_type::NamedTaskType;
use lapin::options::BasicAckOptions;

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
    /// Messages naming a task of another type (or tenant): a tenant may write its own
    /// queue, so a body proves nothing. Acked and dropped, the task untouched.
    pub foreign: usize,
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
        while report.redriven + report.returned + report.stale + report.kept + report.foreign
            < limit
        {
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
            let requeued = match db
                .begin_redrive(task.id, task.attempt, task_type, by)
                .await?
            {
                Some(pending) => Some((pending, &mut report.redriven)),
                None => db
                    .begin_return(task.id, task.attempt, task_type, &returned)
                    .await?
                    .map(|pending| (pending, &mut report.returned)),
            };
            let row = match requeued {
                Some((pending, count)) => {
                    publish_and_commit(publisher, pending, &main_only)
                        .await
                        .with_context(|| format!("sending task {} back to work", task.id))?;
                    *count += 1;
                    None
                }
                None => Some(db.task(task.id).await?),
            };
            match row {
                None => {}
                Some(Some(row)) if row.task_type != task_type => {
                    eprintln!(
                        "a message in {queue} names task {} of type {}; dropped, the task untouched",
                        task.id, row.task_type
                    );
                    report.foreign += 1;
                }
                Some(row) if verdict(&task, row.as_ref()) == Verdict::Keep => {
                    report.kept += 1;
                    kept.push(delivery);
                    continue;
                }
                Some(_) => report.stale += 1,
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
    return_kept(kept).await;
    let _ = conn.close(200, "redrive done").await;
    result.map(|()| report)
}
