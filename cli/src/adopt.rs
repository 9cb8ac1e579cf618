//! `conveyorctl adopt`: a task type from before tenancy (queues `conveyor.<name>…`, rows of
//! tenant `default`) moves into the namespace of its TaskType (decision 0012).
//!
//! The database leads: the rows move first, in one transaction; then every waiting task
//! gets a new message at attempt + 1 in the new work queue and every dead-lettered task a
//! copy of its message in the new remediation queue; only then are the old queues deleted,
//! when everything left in them is fenced by its attempt or copied. Running it again is
//! harmless: it moves no row twice, and a second copy of a message is dropped as stale.

use anyhow::Context;
use conveyor_core::amqp::{self, Outgoing, QueueNames};
use conveyor_core::requeue::publish_and_commit;
use conveyor_core::task::Requeue;
use conveyor_core::task_type::{NamedTaskType, TaskTypeSpec, MAX_RETRY_TIERS};
use conveyor_core::TaskState;

use crate::Direct;

/// What an adoption did.
#[derive(Debug, Default)]
pub struct AdoptReport {
    /// Task rows moved to the namespace.
    pub moved: u64,
    /// Waiting tasks re-published to the new work queue (attempt + 1).
    pub requeued: usize,
    /// Dead-lettered tasks whose message was copied to the new remediation queue.
    pub parked: usize,
}

/// Moves the type's rows and messages, reading `page` tasks at a time.
pub async fn adopt(
    direct: &Direct,
    name: &str,
    namespace: &str,
    by: &str,
    page: i64,
) -> anyhow::Result<AdoptReport> {
    let Direct {
        db,
        amqp_url,
        publisher,
    } = direct;
    let spec = NamedTaskType::in_namespace(namespace, name, TaskTypeSpec::default());
    spec.validate_name().map_err(anyhow::Error::msg)?;
    let old = QueueNames::of(name);
    let new = QueueNames::of(&spec.name);
    let conn = amqp::connect(amqp_url, &format!("conveyorctl-adopt-{by}")).await?;
    // The operator declares the new queues for the TaskType; without them nothing can move.
    for queue in [&new.main, &new.remediation] {
        if !amqp::queue_exists(&conn, queue).await? {
            anyhow::bail!(
                "queue {queue} does not exist: apply TaskType {name} in namespace {namespace} \
                 and let the operator declare its queues first"
            );
        }
    }

    let mut report = AdoptReport {
        moved: db.adopt_type(name, namespace, &spec.name).await?,
        ..AdoptReport::default()
    };
    let why = format!(
        "adopted into namespace {namespace} by {by}: re-published to {}",
        new.main
    );
    // Every page after the last id seen: a re-published task stays QUEUED.
    let mut after = None;
    loop {
        let waiting = db
            .tasks_in(
                &spec.name,
                &[TaskState::Ingested, TaskState::Queued],
                after,
                page,
            )
            .await?;
        let Some(last) = waiting.last() else { break };
        after = Some(last.id);
        for task in waiting {
            if let Some(pending) = db
                .begin_return(task.id, task.attempt, &task.task_type, &why)
                .await?
            {
                publish_and_commit(publisher, pending, &spec)
                    .await
                    .with_context(|| format!("re-publishing task {}", task.id))?;
                report.requeued += 1;
            }
        }
    }
    let mut after = None;
    loop {
        let parked = db
            .tasks_in(&spec.name, &[TaskState::DeadLetter], after, page)
            .await?;
        let Some(last) = parked.last() else { break };
        after = Some(last.id);
        let copies: Vec<Outgoing> = parked
            .iter()
            .map(|task| Outgoing {
                message: task.message(),
                route: Requeue::Remediation,
                delay: None,
                retry_tier: 0,
            })
            .collect();
        for (task, result) in parked.iter().zip(publisher.publish(&copies).await) {
            result.with_context(|| {
                format!("copying task {}'s message to {}", task.id, new.remediation)
            })?;
            report.parked += 1;
        }
    }

    amqp::delete_queues(&conn, &old.all(MAX_RETRY_TIERS)).await;
    amqp::delete_exchange(&conn, &old).await;
    let _ = conn.close(200, "adopt done").await;
    Ok(report)
}
