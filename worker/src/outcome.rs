//! Where a finished attempt's outcome goes: the database, or the degraded-mode buffer
//! while the database is down, and from there back to the database (the replay). One path
//! for both, and every write is fenced by owner and attempt, so replaying an outcome that
//! already landed changes nothing.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use anyhow::Context as _;
use conveyor_core::amqp::{AmqpError, Publisher};
use conveyor_core::db::{Completion, Db, DbError, Fence, OwnerWrites};
use conveyor_core::metrics::Metrics;
use conveyor_core::requeue;
use conveyor_core::task::Requeue;
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::TaskState::*;

use crate::breaker::Breaker;
use crate::buffer::{Buffer, BufferError, Outcome, Transition};

/// The worker's outcome recorder (cheap to clone).
#[derive(Clone)]
pub struct Recorder {
    pub db: Db,
    /// Claims and completions, group-committed with the worker's other deliveries.
    pub writes: OwnerWrites,
    pub publisher: Arc<Publisher>,
    pub breaker: Arc<Breaker>,
    pub buffer: Buffer,
    pub types: BTreeMap<String, NamedTaskType>,
    pub metrics: Metrics,
}

/// What the database made of an outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Completed,
    Retried,
    DeadLettered,
    /// The task is no longer PROCESSING by this owner at this attempt: it was re-queued
    /// after a heartbeat timeout (fenced), or this very outcome landed before (a replay).
    NotOwned,
}

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("publishing the re-queued task failed")]
    Publish(#[source] AmqpError),
}

impl ApplyError {
    /// The database was unreachable (or silent): the outcome may be buffered and replayed.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, ApplyError::Db(err) if err.is_unavailable())
    }

    /// Trying the same write again will not help: the database refused it as such, or the
    /// queue its re-queue must go to does not exist.
    pub fn is_permanent(&self) -> bool {
        match self {
            ApplyError::Db(err) => err.is_permanent(),
            ApplyError::Publish(err) => matches!(
                err,
                AmqpError::NoQueue { .. } | AmqpError::Encode(_) | AmqpError::Mismatch { .. }
            ),
        }
    }
}

impl Recorder {
    /// Writes `t` (re-queueing a failed attempt through the broker), each database call
    /// timed by the breaker.
    pub async fn apply(&self, spec: &NamedTaskType, t: &Transition) -> Result<Applied, ApplyError> {
        let (db, breaker) = (&self.db, &self.breaker);
        let fence = Fence {
            id: t.id,
            attempt: t.attempt,
            owner: t.owner.clone(),
        };
        match &t.outcome {
            Outcome::Completed { result } => {
                let completion = Completion {
                    fence,
                    result: result.clone(),
                };
                match breaker.call(self.writes.complete(completion)).await {
                    Ok(true) => Ok(Applied::Completed),
                    Ok(false) => Ok(Applied::NotOwned),
                    // The database will never take this result (a NUL character in it, say):
                    // the attempt failed, with a reason a human can act on.
                    Err(err) if err.is_data_rejected() => {
                        tracing::warn!(task = %t.id, error = %err, "result refused by the database");
                        let failed = Transition {
                            outcome: Outcome::Failed {
                                error: format!(
                                    "the handler's result could not be stored: {:#}",
                                    anyhow::Error::from(err)
                                ),
                            },
                            ..t.clone()
                        };
                        Box::pin(self.apply(spec, &failed)).await
                    }
                    Err(err) => Err(err.into()),
                }
            }
            Outcome::Failed { error } => {
                let max_retries = spec.max_retries as i32;
                let failure = db.begin_failure(&fence, error, max_retries);
                let Some(pending) = breaker.call(failure).await? else {
                    return Ok(Applied::NotOwned);
                };
                let route = pending.tasks.first().map(|r| r.route);
                requeue::publish(&self.publisher, &pending, spec)
                    .await
                    .map_err(ApplyError::Publish)?;
                // A reset here leaves the commit's fate unknown: a retry or a replay finds
                // out (the task is no longer ours at this attempt if it landed).
                breaker.call(pending.commit()).await?;
                Ok(if route == Some(Requeue::Remediation) {
                    Applied::DeadLettered
                } else {
                    Applied::Retried
                })
            }
        }
    }

    /// Appends `t` to the buffer (fsynced) and opens the breaker: the worker is degraded
    /// until the buffer has been replayed.
    pub async fn buffer(&self, t: Transition) -> Result<(), BufferError> {
        let buffer = self.buffer.clone();
        tokio::task::spawn_blocking(move || buffer.append(&t))
            .await
            .unwrap_or_else(|join| {
                Err(BufferError::Io {
                    path: "(append)".into(),
                    source: std::io::Error::other(join.to_string()),
                })
            })?;
        self.buffer.report(&self.metrics);
        self.breaker.open("an outcome had to be buffered");
        Ok(())
    }

    /// Pings the database, then writes every buffered outcome, oldest first, and forgets
    /// those written. Returns how many were.
    ///
    /// An outcome the database refuses for good (or whose re-queue has no queue to go to) is
    /// moved to the buffer's quarantine file and counted, not retried for ever: it would wedge
    /// the replay, keep its task heartbeated and the worker degraded. Its task is no longer
    /// heartbeated, so the reaper re-runs it after its heartbeat timeout.
    pub async fn replay(&self) -> anyhow::Result<usize> {
        self.breaker.call(self.db.ping()).await.context("probe")?;
        let mut settled = HashSet::new();
        let mut refused = Vec::new();
        let mut failed = None;
        for t in self.buffer.entries() {
            let Some(spec) = self.types.get(&t.task_type) else {
                // Configuration changed under a restart: leave the task to the reaper.
                tracing::error!(task = %t.id, task_type = t.task_type,
                    "buffered outcome of a task type this worker no longer consumes; set aside");
                refused.push((t, "task type no longer consumed here".to_owned()));
                continue;
            };
            match self.apply(spec, &t).await {
                Ok(applied) => {
                    applied.count(&self.metrics, &spec.name);
                    self.metrics
                        .replayed
                        .with_label_values(&[&spec.name, applied.name()])
                        .inc();
                    settled.insert((t.id, t.attempt));
                }
                Err(err) if err.is_permanent() => {
                    let why = format!("{:#}", anyhow::Error::from(err));
                    tracing::error!(task = %t.id, attempt = t.attempt, why,
                        "buffered outcome refused for good; quarantined, the task re-runs");
                    self.metrics
                        .quarantined
                        .with_label_values(&[&spec.name])
                        .inc();
                    refused.push((t, why));
                }
                Err(err) => {
                    failed = Some(err);
                    break;
                }
            }
        }
        let replayed = settled.len();
        if replayed > 0 || !refused.is_empty() {
            let buffer = self.buffer.clone();
            tokio::task::spawn_blocking(move || {
                buffer.quarantine(&refused)?;
                buffer.remove(|t| settled.contains(&(t.id, t.attempt)))
            })
            .await
            .context("buffer rewrite")??;
            self.buffer.report(&self.metrics);
        }
        match failed {
            Some(err) => Err(err).context("replay"),
            None => Ok(replayed),
        }
    }
}

impl Applied {
    pub fn name(self) -> &'static str {
        match self {
            Applied::Completed => "completed",
            Applied::Retried => "retried",
            Applied::DeadLettered => "dead_lettered",
            Applied::NotOwned => "not_owned",
        }
    }

    /// Counts the outcome in the task metrics.
    pub fn count(self, metrics: &Metrics, task_type: &str) {
        let path: &[_] = match self {
            Applied::Completed => &[Processing, Completed],
            Applied::Retried => {
                metrics.retries.with_label_values(&[task_type]).inc();
                &[Processing, Failed, Queued]
            }
            Applied::DeadLettered => {
                metrics.dead_letters.with_label_values(&[task_type]).inc();
                &[Processing, Failed, DeadLetter]
            }
            Applied::NotOwned => return,
        };
        metrics
            .tasks
            .with_label_values(&[task_type, self.name()])
            .inc();
        metrics.record_path(task_type, path);
    }
}
