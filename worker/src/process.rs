//! One delivery, start to finish: claim, run, record, ack.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use conveyor_core::amqp;
use conveyor_core::amqp::{Settlement, Settler};
use conveyor_core::db::{Claim, Claimed, DbError, Fence};
use conveyor_core::metrics::Metrics;
use conveyor_core::requeue;
use conveyor_core::task::TaskMessage;
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::trace::{SpanKind, TraceContext, Tracer};
use conveyor_core::TaskState::{self, *};
use futures_util::FutureExt;
use lapin::message::Delivery;
use tracing::Instrument;

use crate::buffer::{Outcome, Transition};
use crate::handler::{Failure, Handler};
use crate::inflight::InFlight;
use crate::outcome::{Applied, Recorder};
use crate::unseen::Unseen;

/// Tries at writing an outcome before it goes to the degraded-mode buffer: enough to ride
/// out one dropped connection (a terminated session, a reset at COMMIT).
const RECORD_TRIES: u32 = 3;

pub struct Processor {
    pub worker_id: String,
    pub handler: Handler,
    pub recorder: Recorder,
    pub in_flight: InFlight,
    pub metrics: Metrics,
    /// Every task runs under the read side; a suspect takes the write side and so runs
    /// alone: if it crashes the worker, nothing healthy dies with it (decision 0008).
    pub alone: Arc<tokio::sync::RwLock<()>>,
    pub tracer: Tracer,
    /// Where handlers' progress reports wait to be written.
    pub progress: crate::progress::ProgressBoard,
    /// Types whose deliveries name tasks this worker cannot see (readiness reports them).
    pub unseen: Unseen,
}

/// What happened to the message once the task's fate is recorded.
enum Settle {
    Ack,
    /// Give it back to the queue: nothing durable was recorded for it.
    Requeue,
}

impl Processor {
    /// Settles the delivery through `settler`, its channel's (acks that come together are
    /// sent as one).
    pub async fn handle(&self, delivery: Delivery, settler: &Settler) {
        let tag = delivery.delivery_tag;
        if let Some(probe) = amqp::probe_id(&delivery) {
            // Every message queued before this probe has now been handed out: the sweeper
            // learns that from the seen mark (decision 0011). A mark that cannot be written
            // costs only a later probe.
            if let Err(err) = self
                .recorder
                .breaker
                .call(self.recorder.db.probe_seen(probe))
                .await
            {
                tracing::debug!(%probe, error = %err, "cannot mark the probe seen");
            }
            let _ = settler.settle(tag, Settlement::Ack).await;
            return;
        }
        let task: TaskMessage = match serde_json::from_slice(&delivery.data) {
            Ok(task) => task,
            Err(err) => {
                // Not ours to interpret: straight to remediation through the dead-letter route.
                tracing::error!(error = %err, "unreadable task message; dead-lettering it");
                self.metrics
                    .errors
                    .with_label_values(&["worker", "unreadable_message"])
                    .inc();
                let dead_letter = Settlement::Nack { requeue: false };
                let _ = settler.settle(tag, dead_letter).await;
                return;
            }
        };
        // The trace the gateway opened, from the message's header (or its body).
        let parent = amqp::traceparent(&delivery)
            .or_else(|| task.traceparent.clone())
            .and_then(|h| TraceContext::parse(&h));
        let mut consumer = self.tracer.start(
            format!("conveyor.process {}", task.task_type),
            SpanKind::Consumer,
            parent.as_ref(),
        );
        consumer.set("conveyor.task.id", task.id);
        consumer.set("conveyor.task.attempt", task.attempt);
        consumer.set("conveyor.worker.id", &self.worker_id);
        let span = tracing::info_span!("task", id = %task.id, task_type = task.task_type,
            attempt = task.attempt, suspect = task.suspect,
            trace_id = consumer.context.trace_id());
        let settle = self
            .process(&task, &consumer.context)
            .instrument(span)
            .await;
        consumer.end(matches!(settle, Settle::Requeue).then_some("returned to the queue"));
        let acked = match settle {
            Settle::Ack => settler.settle(tag, Settlement::Ack).await,
            Settle::Requeue => {
                // A short pause keeps a broken dependency from turning into a hot loop.
                tokio::time::sleep(Duration::from_millis(500)).await;
                settler
                    .settle(tag, Settlement::Nack { requeue: true })
                    .await
            }
        };
        if let Err(err) = acked {
            // The channel is gone; the broker redelivers and the claim drops the copy.
            tracing::warn!(task = %task.id, error = %err, "cannot settle delivery");
        }
    }

    async fn process(&self, task: &TaskMessage, trace: &TraceContext) -> Settle {
        let Some(spec) = self.recorder.types.get(&task.task_type) else {
            tracing::error!("message for a task type this worker does not consume");
            return Settle::Requeue;
        };
        let name = spec.name.as_str();
        let breaker = &self.recorder.breaker;
        if !breaker.is_closed() {
            // Degraded: take no new work; the task waits in the queue.
            return Settle::Requeue;
        }
        let claim = Claim {
            id: task.id,
            attempt: task.attempt,
        };
        match breaker.call(self.recorder.writes.claim(claim)).await {
            Ok(Claimed::Won) => self.unseen.seen(name),
            Ok(Claimed::Redundant) => {
                // Done, owned by someone else, or an older attempt: this copy is redundant.
                self.unseen.seen(name);
                self.metrics.duplicates.with_label_values(&[name]).inc();
                tracing::debug!("duplicate or stale delivery dropped");
                return Settle::Ack;
            }
            Ok(Claimed::Unseen) => {
                // Not a copy to drop: a worker that may see the row must get the message.
                self.unseen.hidden(name, task.id);
                self.metrics
                    .errors
                    .with_label_values(&["worker", "task_not_visible"])
                    .inc();
                tracing::error!(
                    "the database does not show this worker the task (another namespace's \
                     database role?); returning the delivery to the queue"
                );
                return Settle::Requeue;
            }
            Err(err) => {
                self.count_db_error(&err);
                tracing::warn!(error = %err, "cannot claim; leaving the task in the queue");
                return Settle::Requeue;
            }
        }
        self.metrics
            .record_path(name, &[Queued, Claimed, Processing]);
        // Heartbeated from the claim on, also while a suspect waits to run alone: a claimed
        // task never sits unclaimed in a worker's hands, where the sweeper would take its
        // message for lost (decision 0011).
        let owned = self.in_flight.insert(task.id, task.attempt);
        self.metrics.in_flight.set(self.in_flight.len() as i64);
        let outcome = tokio::select! {
            outcome = self.run_handler(spec, task, trace) => Some(outcome),
            _ = owned.cancelled() => None,
        };
        self.last_progress(task).await;
        let settle = match outcome {
            Some(Ok(result)) => self.record(spec, task, Outcome::Completed { result }).await,
            Some(Err(error)) => {
                tracing::info!(failure = error, "attempt failed");
                self.record(spec, task, Outcome::Failed { error }).await
            }
            None => self.release(spec, task).await,
        };
        drop(owned);
        self.metrics.in_flight.set(self.in_flight.len() as i64);
        settle
    }

    /// Writes the attempt's report still waiting for the next flush while the task is still
    /// PROCESSING (a command's last line before it exits). Best effort: a task that made no
    /// report costs nothing, and a failed write loses only a progress report.
    async fn last_progress(&self, task: &TaskMessage) {
        let Some(report) = self.progress.take_one(task.id, task.attempt) else {
            return;
        };
        let fence = Fence {
            id: task.id,
            attempt: task.attempt,
            owner: self.worker_id.clone(),
        };
        if let Err(err) = self.recorder.db.report_progress(&[(fence, report)]).await {
            tracing::debug!(error = %err, "last progress report not written");
        }
    }

    /// Runs the handler under the task type's timeout: beside other tasks, or alone for a
    /// suspect (if it crashes the worker, nothing healthy dies with it: decision 0008).
    async fn run_handler(
        &self,
        spec: &NamedTaskType,
        task: &TaskMessage,
        trace: &TraceContext,
    ) -> Result<serde_json::Value, Failure> {
        let (_alone, _beside_others) = if task.suspect {
            (Some(self.alone.write().await), None)
        } else {
            (None, Some(self.alone.read().await))
        };
        let started = Instant::now();
        // The handler continues the trace from its own span (TRACEPARENT, a traceparent
        // header).
        let span = self
            .tracer
            .start("conveyor.handler", SpanKind::Internal, Some(trace));
        let traced = TaskMessage {
            traceparent: Some(span.context.header()),
            ..task.clone()
        };
        let progress = self.progress.sink(task.id, task.attempt);
        // A panic in the handler is the attempt's failure (retried, then dead-lettered
        // like any other), not the worker's: the task is not left owned by nobody.
        let run = AssertUnwindSafe(self.handler.run(&traced, &progress)).catch_unwind();
        let outcome = match tokio::time::timeout(spec.timeout(), run).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(panic)) => Err(format!("the handler panicked: {}", panic_message(&panic))),
            Err(_) => Err(format!("timed out after {:?}", spec.timeout())),
        };
        span.end(outcome.as_ref().err().map(String::as_str));
        self.metrics
            .processing_seconds
            .with_label_values(&[spec.name.as_str()])
            .observe(started.elapsed().as_secs_f64());
        outcome
    }

    /// Writes the outcome, or buffers it when the database is unavailable; either way it
    /// is durable before the delivery is acked.
    async fn record(&self, spec: &NamedTaskType, task: &TaskMessage, outcome: Outcome) -> Settle {
        let name = spec.name.as_str();
        let transition = Transition {
            id: task.id,
            attempt: task.attempt,
            owner: self.worker_id.clone(),
            task_type: spec.name.clone(),
            outcome,
        };
        let mut delay = Duration::from_millis(100);
        for _ in 0..RECORD_TRIES {
            if !self.recorder.breaker.is_closed() {
                break;
            }
            match self.recorder.apply(spec, &transition).await {
                Ok(applied) => return self.applied(name, task, applied),
                Err(err) if err.is_unavailable() => {
                    tracing::debug!(error = %err, "cannot record the outcome yet");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                Err(err) => {
                    tracing::warn!(error = %err,
                        "cannot record the outcome; the task re-runs after its heartbeat timeout");
                    return Settle::Requeue;
                }
            }
        }
        match self.recorder.buffer(transition).await {
            Ok(()) => {
                tracing::info!("database unavailable: outcome buffered for replay");
                Settle::Ack
            }
            Err(err) => {
                tracing::error!(error = %err,
                    "cannot buffer the outcome; the task re-runs after its heartbeat timeout");
                Settle::Requeue
            }
        }
    }

    fn applied(&self, name: &str, task: &TaskMessage, applied: Applied) -> Settle {
        applied.count(&self.metrics, name);
        match applied {
            Applied::NotOwned => return self.fenced(name),
            Applied::Completed => {
                let latency = (Utc::now() - task.submitted_at)
                    .to_std()
                    .unwrap_or_default();
                self.metrics
                    .end_to_end_seconds
                    .with_label_values(&[name])
                    .observe(latency.as_secs_f64());
            }
            Applied::Retried | Applied::DeadLettered => {}
        }
        Settle::Ack
    }

    /// The drain ran out of time: hand the task back without using a retry.
    async fn release(&self, spec: &NamedTaskType, task: &TaskMessage) -> Settle {
        let name = spec.name.as_str();
        let (db, breaker) = (&self.recorder.db, &self.recorder.breaker);
        let fence = Fence {
            id: task.id,
            attempt: task.attempt,
            owner: self.worker_id.clone(),
        };
        let release = db.begin_release(&fence);
        let pending = match breaker.call(release).await {
            Ok(Some(pending)) => pending,
            Ok(None) => return self.fenced(name),
            Err(err) => {
                self.count_db_error(&err);
                return Settle::Requeue;
            }
        };
        let published = requeue::publish(&self.recorder.publisher, &pending, spec).await;
        let released = match published {
            Ok(()) => breaker
                .call(pending.commit())
                .await
                .map_err(|e| e.to_string()),
            Err(err) => Err(err.to_string()),
        };
        match released {
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

    /// The task is no longer this worker's at this attempt: it was re-queued after a
    /// heartbeat timeout (its outcome does not count), or an earlier try of this very write
    /// landed although its answer was lost.
    fn fenced(&self, name: &str) -> Settle {
        self.metrics.fenced.with_label_values(&[name]).inc();
        tracing::warn!("task no longer owned at this attempt (fenced); result discarded");
        Settle::Ack
    }

    fn count_db_error(&self, err: &DbError) {
        self.metrics
            .errors
            .with_label_values(&["database", err.category()])
            .inc();
    }
}

/// What a panic said, when it said it with a string (as `panic!` and `expect` do).
fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}
