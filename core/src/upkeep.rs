//! Upkeep passes that keep non-terminal tasks moving without a human and without a worker of
//! their type: the heartbeat reaper (decision 0003) and the orphan sweeper (decision 0011).
//! Workers run the reaper for the types they consume; the gateway runs both for every type
//! it knows, so an autoscaled pool at zero still gets its dead pods' tasks back.

use std::time::Duration;

use crate::amqp::{AmqpError, Publisher, QueueCounts, QueueNames, QueueObserver};
use crate::db::{Db, DbError, OrphanRule, ProbePolicy, Reap};
use crate::metrics::Metrics;
use crate::requeue::{publish_and_commit, RequeueError};
use crate::task::Requeue;
use crate::task_type::NamedTaskType;
use crate::TaskState;

/// Rows a pass takes at once; a pass repeats while it finds full batches.
pub const BATCH: i64 = 100;

/// Batches the sweeper re-publishes per type and pass, at most.
pub const MAX_BATCHES_PER_PASS: usize = 50;

#[derive(Debug, thiserror::Error)]
pub enum UpkeepError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Requeue(#[from] RequeueError),
    #[error("publishing a probe failed")]
    Probe(#[source] AmqpError),
    #[error("writing the task archive {path} failed")]
    Archive {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("reading queue {queue} failed")]
    QueueRead {
        queue: String,
        #[source]
        source: AmqpError,
    },
}

impl UpkeepError {
    /// The database could not be reached: every owner's heartbeat may be stale after this.
    pub fn is_db_unavailable(&self) -> bool {
        match self {
            UpkeepError::Db(err) | UpkeepError::Requeue(RequeueError::Commit(err)) => {
                err.is_unavailable()
            }
            _ => false,
        }
    }
}

/// One reaper pass over `spec`'s tasks: returns how many were re-queued.
pub async fn reap_once(
    db: &Db,
    publisher: &Publisher,
    spec: &NamedTaskType,
    reaper: &str,
    metrics: &Metrics,
) -> Result<usize, UpkeepError> {
    let pending = db
        .begin_reap(&Reap {
            task_type: &spec.name,
            timeout: spec.heartbeat_timeout(),
            max_retries: spec.max_retries as i32,
            reaper,
            limit: BATCH,
        })
        .await?;
    let Some(pending) = pending else {
        return Ok(0);
    };
    let tasks = pending.tasks.clone();
    publish_and_commit(publisher, pending, spec).await?;
    let name = spec.name.as_str();
    for task in &tasks {
        metrics.heartbeat_timeouts.with_label_values(&[name]).inc();
        let end = if task.route == Requeue::Remediation {
            metrics.dead_letters.with_label_values(&[name]).inc();
            TaskState::DeadLetter
        } else {
            TaskState::Queued
        };
        metrics.record_path(name, &[TaskState::RetryClaimed, end]);
        tracing::info!(task = %task.message.id, attempt = task.message.attempt, ?end, reaper,
            "owner stopped heartbeating; task re-queued");
    }
    Ok(tasks.len())
}

/// How the sweeper finds tasks whose message is gone (decision 0011).
#[derive(Debug, Clone, Copy)]
pub struct SweepSettings {
    pub probe: ProbePolicy,
    /// See [`OrphanRule`]; the retry delay cap comes from each task type's backoff.
    pub grace: Duration,
    pub margin: Duration,
}

impl SweepSettings {
    /// Production defaults for a gateway whose confirm timeout is `confirm_timeout`.
    pub fn for_confirm_timeout(confirm_timeout: Duration) -> Self {
        SweepSettings {
            probe: ProbePolicy {
                min_wait: Duration::from_secs(10),
                interval: Duration::from_secs(10),
                timeout: Duration::from_secs(120),
            },
            grace: Duration::from_secs(5),
            margin: confirm_timeout + Duration::from_secs(1),
        }
    }
}

/// What one sweep of a task type did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    pub republished: usize,
    pub probe_sent: bool,
}

/// One sweep of `spec`: re-publishes tasks the last seen probe proved lost, then sends a
/// new probe if one is due, unless the work queue has messages and no consumer (read
/// through `observer`).
pub async fn sweep_once(
    db: &Db,
    publisher: &Publisher,
    observer: &QueueObserver,
    spec: &NamedTaskType,
    settings: &SweepSettings,
    metrics: &Metrics,
) -> Result<Swept, UpkeepError> {
    let name = spec.name.as_str();
    let rule = OrphanRule {
        grace: settings.grace,
        margin: settings.margin,
        retry_delay_cap: Duration::from_secs_f64(spec.backoff.max_seconds.clamp(0.0, 86_400.0)),
    };
    let mut swept = Swept::default();
    // Bounded per pass, so that every type gets its turn whatever one type's rows say.
    for _ in 0..MAX_BATCHES_PER_PASS {
        let Some(pending) = db.begin_republish(name, &rule, BATCH).await? else {
            break;
        };
        let tasks = pending.tasks.clone();
        publish_and_commit(publisher, pending, spec).await?;
        metrics
            .republished
            .with_label_values(&[name])
            .inc_by(tasks.len() as u64);
        for task in &tasks {
            tracing::warn!(task = %task.message.id, attempt = task.message.attempt,
                task_type = name, "task waited past a probe: its message was lost; re-published");
        }
        swept.republished += tasks.len();
        if (tasks.len() as i64) < BATCH {
            break;
        }
    }
    if let Some(probe) = db.record_probe_if_due(name, &settings.probe).await? {
        // Nobody sees a probe in a queue without consumers: it only waits there and, once
        // presumed lost, lets another in, without bound while the queue is unread. There
        // a probe only wakes the autoscaler, which a message already waiting does too:
        // into an unread queue a probe goes only when it is empty.
        let main = QueueNames::of(name).main;
        match observer.counts(&main).await {
            Ok(QueueCounts {
                consumers: 0,
                ready: 1..,
            }) => {
                db.forget_probe(probe).await?;
                tracing::debug!(task_type = name, "unread queue with messages: no probe");
                return Ok(swept);
            }
            Ok(_) => {}
            Err(source) => {
                db.forget_probe(probe).await?;
                return Err(UpkeepError::QueueRead {
                    queue: main,
                    source,
                });
            }
        }
        if let Err(err) = publisher.publish_probe(name, probe).await {
            // An unpublished probe would hold the next one back until its timeout.
            let _ = db.forget_probe(probe).await;
            return Err(UpkeepError::Probe(err));
        }
        metrics.probes.with_label_values(&[name]).inc();
        swept.probe_sent = true;
    }
    Ok(swept)
}
