//! One delivery, start to finish: claim, run, record, ack.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use conveyor_core::amqp::Publisher;
use conveyor_core::db::{Db, DbError, DbResult};
use conveyor_core::metrics::Metrics;
use conveyor_core::task::{Requeue, TaskMessage};
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::TaskState::{self, *};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use tracing::Instrument;

use crate::handler::Handler;
use crate::inflight::InFlight;
use conveyor_core::requeue::publish_and_commit;

/// Database calls on the path of a claimed task are retried this long before the task is
/// left to the heartbeat reaper.
const DB_RETRY_FOR: Duration = Duration::from_secs(10);

pub struct Processor {
    pub worker_id: String,
    pub types: BTreeMap<String, NamedTaskType>,
    pub handler: Handler,
    pub db: Db,
    pub publisher: Arc<Publisher>,
    pub in_flight: InFlight,
    pub metrics: Metrics,
    /// Every task runs under the read side; a suspect takes the write side and so runs
    /// alone: if it crashes the worker, nothing healthy dies with it (decision 0008).
    pub alone: Arc<tokio::sync::RwLock<()>>,
}

/// What happened to the message once the task's fate is recorded.
enum Settle {
    Ack,
    /// Give it back to the queue: nothing durable was recorded for it.
    Requeue,
}

impl Processor {
    pub async fn handle(&self, delivery: Delivery) {
        let task: TaskMessage = match serde_json::from_slice(&delivery.data) {
            Ok(task) => task,
            Err(err) => {
                // Not ours to interpret: straight to remediation through the dead-letter route.
                tracing::error!(error = %err, "unreadable task message; dead-lettering it");
                self.metrics
                    .errors
                    .with_label_values(&["worker", "unreadable_message"])
                    .inc();
                let reject = BasicRejectOptions { requeue: false };
                let _ = delivery.acker.reject(reject).await;
                return;
            }
        };
        let span = tracing::info_span!("task", id = %task.id, task_type = task.task_type,
            attempt = task.attempt, suspect = task.suspect);
        let settle = if task.suspect {
            let _alone = self.alone.write().await;
            self.process(&task).instrument(span).await
        } else {
            let _beside_others = self.alone.read().await;
            self.process(&task).instrument(span).await
        };
        let acked = match settle {
            Settle::Ack => delivery.acker.ack(BasicAckOptions::default()).await,
            Settle::Requeue => {
                // A short pause keeps a broken dependency from turning into a hot loop.
                tokio::time::sleep(Duration::from_millis(500)).await;
                let nack = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                delivery.acker.nack(nack).await
            }
        };
        if let Err(err) = acked {
            // The channel is gone; the broker redelivers and the claim drops the copy.
            tracing::warn!(task = %task.id, error = %err, "cannot settle delivery");
        }
    }

    async fn process(&self, task: &TaskMessage) -> Settle {
        let Some(spec) = self.types.get(&task.task_type) else {
            tracing::error!("message for a task type this worker does not consume");
            return Settle::Requeue;
        };
        let name = spec.name.as_str();
        match self.db.claim(task.id, task.attempt, &self.worker_id).await {
            Ok(true) => {}
            Ok(false) => {
                // Done, owned by someone else, or an older attempt: this copy is redundant.
                self.metrics.duplicates.with_label_values(&[name]).inc();
                tracing::debug!("duplicate or stale delivery dropped");
                return Settle::Ack;
            }
            Err(err) => {
                self.count_db_error(&err);
                tracing::warn!(error = %err, "cannot claim; leaving the task in the queue");
                return Settle::Requeue;
            }
        }
        self.metrics
            .record_path(name, &[Queued, Claimed, Processing]);
        let cancel = self.in_flight.insert(task.id);
        self.metrics.in_flight.set(self.in_flight.len() as i64);
        let started = Instant::now();
        let outcome = tokio::select! {
            outcome = tokio::time::timeout(spec.timeout(), self.handler.run(task)) => Some(
                outcome.unwrap_or_else(|_| Err(format!("timed out after {:?}", spec.timeout())))),
            _ = cancel.cancelled() => None,
        };
        self.metrics
            .processing_seconds
            .with_label_values(&[name])
            .observe(started.elapsed().as_secs_f64());
        let settle = match outcome {
            Some(Ok(result)) => self.complete(spec, task, &result).await,
            Some(Err(failure)) => self.fail(spec, task, &failure).await,
            None => self.release(spec, task).await,
        };
        self.in_flight.remove(task.id);
        self.metrics.in_flight.set(self.in_flight.len() as i64);
        settle
    }

    async fn complete(
        &self,
        spec: &NamedTaskType,
        task: &TaskMessage,
        result: &serde_json::Value,
    ) -> Settle {
        let name = spec.name.as_str();
        let completed = self
            .with_db_retry(|| {
                self.db
                    .complete(task.id, task.attempt, &self.worker_id, result)
            })
            .await;
        match completed {
            Ok(true) => {
                self.metrics
                    .tasks
                    .with_label_values(&[name, "completed"])
                    .inc();
                self.metrics.record_path(name, &[Processing, Completed]);
                let latency = (Utc::now() - task.submitted_at)
                    .to_std()
                    .unwrap_or_default();
                self.metrics
                    .end_to_end_seconds
                    .with_label_values(&[name])
                    .observe(latency.as_secs_f64());
                Settle::Ack
            }
            Ok(false) => self.fenced(name),
            // The task stays PROCESSING; once heartbeats stop the reaper re-runs it.
            Err(_) => Settle::Requeue,
        }
    }

    async fn fail(&self, spec: &NamedTaskType, task: &TaskMessage, failure: &str) -> Settle {
        let name = spec.name.as_str();
        tracing::info!(failure, "attempt failed");
        let pending = self
            .with_db_retry(|| {
                self.db.begin_failure(
                    task.id,
                    task.attempt,
                    &self.worker_id,
                    failure,
                    spec.max_retries as i32,
                )
            })
            .await;
        let pending = match pending {
            Ok(Some(pending)) => pending,
            Ok(None) => return self.fenced(name),
            Err(_) => return Settle::Requeue,
        };
        let route = pending.tasks.first().map(|t| t.route);
        if let Err(err) = publish_and_commit(&self.publisher, pending, &spec.backoff).await {
            tracing::warn!(error = %err, "cannot re-queue failed task; the reaper will");
            return Settle::Requeue;
        }
        let (outcome, end) = if route == Some(Requeue::Remediation) {
            self.metrics.dead_letters.with_label_values(&[name]).inc();
            ("dead_lettered", DeadLetter)
        } else {
            self.metrics.retries.with_label_values(&[name]).inc();
            ("retried", Queued)
        };
        self.metrics.tasks.with_label_values(&[name, outcome]).inc();
        self.metrics.record_path(name, &[Processing, Failed, end]);
        Settle::Ack
    }

    /// The drain ran out of time: hand the task back without using a retry.
    async fn release(&self, spec: &NamedTaskType, task: &TaskMessage) -> Settle {
        let name = spec.name.as_str();
        let pending = match self
            .db
            .begin_release(task.id, task.attempt, &self.worker_id)
            .await
        {
            Ok(Some(pending)) => pending,
            Ok(None) => return self.fenced(name),
            Err(err) => {
                self.count_db_error(&err);
                return Settle::Requeue;
            }
        };
        match publish_and_commit(&self.publisher, pending, &spec.backoff).await {
            Ok(()) => {
                tracing::info!("released unfinished task on shutdown");
                self.metrics
                    .record_path(name, &[Processing, TaskState::RetryClaimed, Queued]);
                Settle::Ack
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot release task; the reaper will");
                Settle::Requeue
            }
        }
    }

    /// The task was re-queued while this worker held it: its outcome does not count.
    fn fenced(&self, name: &str) -> Settle {
        self.metrics.fenced.with_label_values(&[name]).inc();
        tracing::warn!("lost ownership (heartbeat timeout); result discarded");
        Settle::Ack
    }

    fn count_db_error(&self, err: &DbError) {
        self.metrics
            .errors
            .with_label_values(&["database", err.category()])
            .inc();
    }

    /// Retries a database call while the database is unreachable, for up to
    /// [`DB_RETRY_FOR`]: a short outage must not cost a finished task its result.
    async fn with_db_retry<T, F, Fut>(&self, mut call: F) -> DbResult<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = DbResult<T>>,
    {
        let deadline = Instant::now() + DB_RETRY_FOR;
        let mut delay = Duration::from_millis(100);
        loop {
            match call().await {
                Err(err) if err.is_unavailable() && Instant::now() < deadline => {
                    self.count_db_error(&err);
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(err) => {
                    self.count_db_error(&err);
                    tracing::warn!(error = %err, "database call failed");
                    return Err(err);
                }
                ok => return ok,
            }
        }
    }
}
