//! `conveyorctl redrive`: remediation queue → work queue, audited as DEAD_LETTER → QUEUED.

use anyhow::Context;
use conveyor_core::amqp::{self, Publisher, QueueNames};
use conveyor_core::db::Db;
use conveyor_core::requeue::publish_and_commit;
use conveyor_core::task::TaskMessage;
use conveyor_core::task_type::Backoff;
use lapin::options::{BasicAckOptions, BasicNackOptions};

/// How a redrive went.
#[derive(Debug, Default)]
pub struct RedriveReport {
    pub redriven: usize,
    /// Messages whose task was not dead-lettered at that attempt (already redriven, or a
    /// stale copy); acked and dropped.
    pub stale: usize,
}

/// Moves up to `limit` tasks from `task_type`'s remediation queue back to its work queue.
/// Each task is re-queued in the database and published before its remediation message is
/// acked, so an interrupted redrive loses nothing and can simply be run again.
pub async fn redrive(
    db: &Db,
    amqp_url: &str,
    publisher: &Publisher,
    task_type: &str,
    limit: usize,
    by: &str,
) -> anyhow::Result<RedriveReport> {
    let conn = amqp::connect(amqp_url, &format!("conveyorctl-redrive-{by}")).await?;
    let channel = conn.create_channel().await.context("opening a channel")?;
    let queue = QueueNames::of(task_type).remediation;
    let mut report = RedriveReport::default();
    while report.redriven + report.stale < limit {
        let Some(delivery) = amqp::get_one(&channel, &queue).await? else {
            break;
        };
        let task: TaskMessage = match serde_json::from_slice(&delivery.data) {
            Ok(task) => task,
            Err(err) => {
                // Leave unreadable messages parked for a human; stop so we do not spin on them.
                let _ = delivery
                    .acker
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await;
                anyhow::bail!("unreadable message in {queue}: {err}");
            }
        };
        match db.begin_redrive(task.id, task.attempt, by).await? {
            Some(pending) => {
                // Redriven tasks go to the work queue at once; no backoff applies.
                publish_and_commit(publisher, pending, &Backoff::default())
                    .await
                    .with_context(|| format!("redriving task {}", task.id))?;
                report.redriven += 1;
            }
            None => report.stale += 1,
        }
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .context("acking")?;
    }
    let _ = conn.close(200, "redrive done").await;
    Ok(report)
}
