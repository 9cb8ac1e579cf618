//! The Conveyor worker: consumes task messages, claims each task with a compare-and-set,
//! heartbeats while its handler runs, records the outcome, and only then acks.
#![forbid(unsafe_code)]

pub mod breaker;
pub mod buffer;
pub mod handler;
pub mod inflight;
pub mod intake;
pub mod outcome;
pub mod process;
pub mod progress;
pub mod readiness;
pub mod reaper;
pub mod recovery;
pub mod unseen;

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use conveyor_core::admin;
use conveyor_core::amqp::{self, Publisher, QueueNames};
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::metrics::Metrics;
use conveyor_core::task_type::NamedTaskType;
use futures_util::stream::{select_all, SelectAll, StreamExt};
use futures_util::FutureExt;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::breaker::Breaker;
use crate::buffer::Buffer;
use crate::handler::Handler;
use crate::inflight::InFlight;
use crate::intake::Intake;
use crate::outcome::Recorder;
use crate::process::Processor;
use crate::unseen::Unseen;

/// Everything a worker needs, already parsed.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Unique per process; owner of the tasks it claims.
    pub worker_id: String,
    pub task_types: Vec<NamedTaskType>,
    pub handler: Handler,
    /// Tasks run at once; also the prefetch.
    pub concurrency: u16,
    pub database: DbOptions,
    pub amqp_url: String,
    pub confirm_timeout: Duration,
    /// Channels the publisher of retries and re-queues spreads its batches over.
    pub publish_channels: usize,
    /// After SIGTERM, how long in-flight tasks may run before they are released.
    pub drain_grace: Duration,
    /// The degraded-mode buffer file; keep it where the next process of this worker (same
    /// pod) finds it.
    pub buffer_path: PathBuf,
    pub buffer_max_bytes: u64,
    /// Longest a database call may take before the database counts as unavailable.
    pub db_call_timeout: Duration,
    /// Declare the queues before consuming (task types from a file). In a cluster the
    /// operator declares them and deletes them with a `Delete` TaskType; there a worker
    /// consumes only the queues that exist, so that it never re-makes a deleted one.
    pub declare_queues: bool,
    /// Where the spans of each task's processing go (`conveyor_core::trace`).
    pub tracer: conveyor_core::trace::Tracer,
    /// The bearer token `POST`/`DELETE /drain` need ([`conveyor_core::drain::ADMIN_TOKEN_ENV`]);
    /// `None` leaves them open to anything that reaches the admin port.
    pub admin_token: Option<String>,
}

/// How often a worker that found some of its queues missing looks for them again.
const MISSING_QUEUE_RECHECK: Duration = Duration::from_secs(30);

impl WorkerConfig {
    /// A third of the shortest heartbeat timeout, so two missed beats still leave margin.
    fn heartbeat_interval(&self) -> Duration {
        self.task_types
            .iter()
            .map(|t| t.heartbeat_timeout())
            .min()
            .unwrap_or(Duration::from_secs(30))
            .div_f64(3.0)
            .max(Duration::from_millis(100))
    }
}

/// The worker's database settings: the server gives up on a statement before the worker's
/// own call timeout does, so a claim or an outcome that timed out here cannot commit
/// afterwards behind the worker's back.
pub fn database_options(options: &DbOptions, call_timeout: Duration) -> DbOptions {
    let server_limit = call_timeout.mul_f64(0.8);
    DbOptions {
        statement_timeout: Some(
            options
                .statement_timeout
                .map_or(server_limit, |t| t.min(server_limit)),
        ),
        ..options.clone()
    }
}

/// Runs the worker until `shutdown`, then drains. `admin` serves /metrics and health.
pub async fn run(
    config: WorkerConfig,
    admin_listener: Option<TcpListener>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        !config.task_types.is_empty(),
        "the worker consumes no task type"
    );
    let db = Db::connect(&database_options(&config.database, config.db_call_timeout))
        .context("database settings")?;
    let publisher = Arc::new(Publisher::with_channels(
        &config.amqp_url,
        format!("{}/publish", config.worker_id),
        config.confirm_timeout,
        config.publish_channels,
    ));
    let buffer = Buffer::open(&config.buffer_path, config.buffer_max_bytes)?;
    buffer.report(&metrics);
    if !buffer.is_empty() {
        tracing::warn!(buffered = buffer.len(), path = %config.buffer_path.display(),
            "outcomes buffered by a previous process: replaying them before taking work");
    }
    // Open from the start while anything is buffered: nothing new until it is replayed.
    let breaker = Arc::new(Breaker::new(
        !buffer.is_empty(),
        config.db_call_timeout,
        metrics.clone(),
    ));
    let recorder = Recorder {
        db: db.clone(),
        // The breaker times each call at db_call_timeout and the server's statement timeout
        // is 0.8 of it: a claim or completion that waited longer than the rest for its
        // statement is not run, so that none commits after its call timed out.
        writes: db.owner_writes(&config.worker_id, Some(config.db_call_timeout.mul_f64(0.2))),
        publisher: publisher.clone(),
        breaker: breaker.clone(),
        buffer,
        types: config
            .task_types
            .iter()
            .map(|s| (s.name.clone(), s.clone()))
            .collect(),
        metrics: metrics.clone(),
    };
    let in_flight = InFlight::default();
    let unseen = Unseen::default();
    let intake = Intake::new(metrics.draining.clone());
    // http handlers report progress to the admin port, from beside the worker (a sidecar).
    let callback_base = admin_listener
        .as_ref()
        .and_then(|l| l.local_addr().ok())
        .map(|addr| {
            let host = if addr.ip().is_unspecified() {
                "127.0.0.1".to_owned()
            } else {
                addr.ip().to_string()
            };
            format!("http://{host}:{}", addr.port())
        });
    let progress = progress::ProgressBoard::new(callback_base);
    // Background loops outlive the consumer: they stop after the drain.
    let background = CancellationToken::new();

    if let Some(listener) = admin_listener {
        let ready = readiness::check(recorder.clone(), intake.clone(), unseen.clone());
        let app = admin::router(metrics.registry.clone(), ready)
            .merge(intake::router(intake.clone(), config.admin_token.clone()))
            .merge(progress::router(progress.clone(), in_flight.clone()));
        let stop = background.clone();
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
            if let Err(err) = served {
                tracing::error!(error = %err, "admin server failed");
            }
        });
    }
    tokio::spawn(recovery::recovery_loop(
        recorder.clone(),
        background.clone(),
    ));
    tokio::spawn(progress::flush_loop(
        recorder.clone(),
        config.worker_id.clone(),
        progress.clone(),
        in_flight.clone(),
        background.clone(),
    ));
    tokio::spawn(inflight::heartbeat_loop(
        recorder.clone(),
        config.worker_id.clone(),
        in_flight.clone(),
        config.heartbeat_interval(),
        background.clone(),
    ));
    for spec in &config.task_types {
        tokio::spawn(reaper::reap_loop(
            db.clone(),
            publisher.clone(),
            breaker.clone(),
            spec.clone(),
            config.worker_id.clone(),
            metrics.clone(),
            background.clone(),
        ));
    }

    let processor = Arc::new(Processor {
        worker_id: config.worker_id.clone(),
        handler: config.handler.clone(),
        recorder,
        in_flight: in_flight.clone(),
        metrics,
        alone: Arc::default(),
        tracer: config.tracer.clone(),
        progress,
        unseen,
    });
    tracing::info!(worker = config.worker_id, types = ?processor.recorder.types.keys().collect::<Vec<_>>(),
        concurrency = config.concurrency, "worker started");
    let recorder = processor.recorder.clone();
    let result = consume(&config, processor, in_flight, intake, shutdown).await;
    background.cancel();
    last_replay(&recorder).await;
    result
}

/// On the way out, one more try at what is still buffered: a pod scaled away takes its
/// buffer with it, and those tasks would then run again after their heartbeat timeout.
async fn last_replay(recorder: &Recorder) {
    if recorder.buffer.is_empty() {
        return;
    }
    match recorder.replay().await {
        Ok(replayed) => tracing::info!(replayed, "buffered outcomes replayed before exit"),
        Err(err) => tracing::warn!(
            error = format!("{err:#}"),
            buffered = recorder.buffer.len(),
            "outcomes stay buffered: the next worker of this pod replays them, or, if the pod \
             is gone, their tasks re-run after their heartbeat timeout"
        ),
    }
}

/// Consumes until `shutdown`, reconnecting after connection loss, then drains.
async fn consume(
    config: &WorkerConfig,
    processor: Arc<Processor>,
    in_flight: InFlight,
    intake: Intake,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let queues: Vec<String> = config
        .task_types
        .iter()
        .map(|s| QueueNames::of(&s.name).main)
        .collect();
    let permits = Arc::new(Semaphore::new(usize::from(config.concurrency)));
    let mut running = JoinSet::new();
    let mut retry_delay = Duration::from_millis(200);
    while !shutdown.is_cancelled() {
        let session = async {
            let conn =
                amqp::connect(&config.amqp_url, &format!("{}/consume", config.worker_id)).await?;
            let channel = conn
                .create_channel()
                .await
                .map_err(amqp::AmqpError::Unavailable)?;
            let present = if config.declare_queues {
                for spec in &config.task_types {
                    amqp::declare_task_type(&channel, spec).await?;
                }
                queues.clone()
            } else {
                let mut present = Vec::new();
                for queue in &queues {
                    if amqp::queue_exists(&conn, queue).await? {
                        present.push(queue.clone());
                    } else {
                        tracing::warn!(
                            queue,
                            "queue missing (its TaskType deleted, or not declared yet); not \
                             consuming it"
                        );
                    }
                }
                if present.is_empty() {
                    return Err(amqp::AmqpError::NoQueue {
                        queue: queues.join(", "),
                    });
                }
                present
            };
            // The prefetch is per consumer (quorum queues have no channel-wide one): split
            // the concurrency between the types, so that deliveries do not sit unclaimed
            // behind busy permits, where a probe would take their messages for lost
            // (decision 0011).
            let per_type = config
                .concurrency
                .div_ceil(present.len().max(1) as u16)
                .max(1);
            let (channel, consumers) =
                amqp::consume(&conn, &present, per_type, &config.worker_id).await?;
            let missing = present.len() < queues.len();
            Ok::<_, amqp::AmqpError>((conn, channel, consumers, missing, present, per_type))
        };
        let (conn, channel, consumers, missing, present, per_type) = match session.await {
            Ok(session) => session,
            Err(err) => {
                tracing::warn!(error = %err, "cannot consume; retrying in {retry_delay:?}");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(retry_delay) => {}
                }
                retry_delay = (retry_delay * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        retry_delay = Duration::from_millis(200);
        tracing::info!(?queues, missing, "consuming");
        let mut channel = channel;
        // Deliveries are settled on the channel they came on (tags are per channel).
        let mut settler = amqp::Settler::spawn(channel.clone());
        // Channels whose consumers a drain cancelled: their deliveries in flight still ack
        // on them, so they stay open until the connection closes.
        let mut retired = Vec::new();
        let mut deliveries = select_all(consumers);
        let mut cancelled = false;
        let recheck = async {
            if missing {
                tokio::time::sleep(MISSING_QUEUE_RECHECK).await
            } else {
                std::future::pending().await
            }
        };
        tokio::pin!(recheck);
        loop {
            let permit = tokio::select! {
                _ = shutdown.cancelled() => break,
                () = intake.drain_requested(), if !cancelled => {
                    cancel_consumers(&channel, &deliveries).await;
                    cancelled = true;
                    continue;
                }
                permit = permits.clone().acquire_owned() => permit?,
            };
            // Degraded (breaker open): take nothing new; deliveries wait in the broker.
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = processor.recorder.breaker.wait_closed() => {}
            }
            let next = tokio::select! {
                _ = shutdown.cancelled() => break,
                () = intake.drain_requested(), if !cancelled => {
                    cancel_consumers(&channel, &deliveries).await;
                    cancelled = true;
                    continue;
                }
                () = &mut recheck, if !cancelled => {
                    tracing::info!("looking for the missing queues again");
                    break;
                }
                next = deliveries.next() => next,
            };
            match next {
                Some(Ok(delivery)) => {
                    let processor = processor.clone();
                    let settler = settler.clone();
                    let held = intake.handling();
                    running.spawn(async move {
                        let tag = delivery.delivery_tag;
                        let handled = AssertUnwindSafe(processor.handle(delivery, &settler))
                            .catch_unwind()
                            .await;
                        if handled.is_err() {
                            // Give the delivery back rather than hold it (and keep the
                            // settler's acks one by one) for the channel's whole life. One
                            // settled before the panic is refused by the settler.
                            tracing::error!(tag, "a task's processing panicked; requeueing");
                            let requeue = amqp::Settlement::Nack { requeue: true };
                            let _ = settler.settle(tag, requeue).await;
                        }
                        drop(held);
                        drop(permit);
                    });
                }
                Some(Err(err)) => {
                    tracing::warn!(error = %err, "consumer failed; reconnecting");
                    break;
                }
                None if cancelled => {
                    // Drained: what the broker had sent is in hand, nothing more comes.
                    intake.set_stopped(true);
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        () = intake.resume_requested() => {}
                    }
                    intake.set_stopped(false);
                    match amqp::consume(&conn, &present, per_type, &config.worker_id).await {
                        Ok((fresh, consumers)) => {
                            settler = amqp::Settler::spawn(fresh.clone());
                            retired.push(std::mem::replace(&mut channel, fresh));
                            // Nothing in hand acks on the old channels any more.
                            if intake.state().in_flight == 0 {
                                for old in retired.drain(..) {
                                    let closing = old.close(200, "drained");
                                    let _ =
                                        tokio::time::timeout(amqp::CLOSE_TIMEOUT, closing).await;
                                }
                            }
                            deliveries = select_all(consumers);
                            cancelled = false;
                        }
                        Err(err) => {
                            tracing::warn!(error = %err, "cannot consume again; reconnecting");
                            break;
                        }
                    }
                }
                None => {
                    tracing::warn!("broker closed the consumer; reconnecting");
                    break;
                }
            }
            // Reap finished handler tasks so the set does not grow.
            while running.try_join_next().is_some() {}
        }
        if shutdown.is_cancelled() {
            // Stop deliveries but keep the channel open: in-flight tasks still need to ack.
            cancel_consumers(&channel, &deliveries).await;
            drain(&mut running, &in_flight, config.drain_grace).await;
            amqp::close_bounded(&conn, 200, "worker shutting down").await;
        } else {
            // The consumer ended while the connection may live on (a deleted queue, a
            // cancelled consumer): close it rather than leak it; unacked deliveries return
            // to the queue and their duplicates are dropped by the claim.
            amqp::close_bounded(&conn, 320, "reconnecting").await;
        }
    }
    drain(&mut running, &in_flight, config.drain_grace).await;
    Ok(())
}

/// Asks the broker to send no more; what it already sent still arrives, then each
/// consumer's stream ends.
async fn cancel_consumers(channel: &lapin::Channel, deliveries: &SelectAll<lapin::Consumer>) {
    for consumer in deliveries.iter() {
        let _ = channel
            .basic_cancel(consumer.tag().as_str(), Default::default())
            .await;
    }
}

/// Lets in-flight tasks finish within `grace`, then cancels the rest, which release their
/// tasks back to the queue before they return.
async fn drain(running: &mut JoinSet<()>, in_flight: &InFlight, grace: Duration) {
    if running.is_empty() {
        return;
    }
    tracing::info!(in_flight = in_flight.len(), ?grace, "draining");
    let finished = tokio::time::timeout(grace, async {
        while running.join_next().await.is_some() {}
    })
    .await;
    if finished.is_err() {
        tracing::warn!(
            remaining = in_flight.len(),
            "grace period over; releasing tasks"
        );
        in_flight.cancel_all();
        while running.join_next().await.is_some() {}
    }
}
