//! The Conveyor gateway: authenticates, rate-limits and validates task submissions, records
//! them, publishes them with confirms, and answers only once the broker holds them.
#![forbid(unsafe_code)]

pub mod access;
pub mod admission;
pub mod api;
pub mod auth;
pub mod backpressure;
pub mod cluster;
pub mod console;
pub mod error;
pub mod feed;
pub mod find;
pub mod follow;
pub mod ingest;
pub mod limits;
pub mod openapi;
pub mod overview;
pub mod rate_limit;
pub mod registry;
pub mod remedy;
pub mod request;
pub mod state;
pub mod tasks;
pub mod tls;
pub mod upkeep;
pub mod views;

use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::registry::Registry;
use anyhow::Context;
use conveyor_core::admin;
use conveyor_core::amqp::{Publisher, QueueObserver, Via};
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::metrics::Metrics;
use conveyor_core::task_type::TaskTypes;
use conveyor_core::watch_scope::WatchScope;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::auth::{TokenSet, Tokens};
use crate::backpressure::DepthMonitor;
use crate::ingest::{ClientLimits, Ingestor};
use crate::rate_limit::RateLimiter;
use crate::state::ApiState;

/// The task types once checked, before anything connects: a file's read and compiled.
enum Checked<'a> {
    File(Registry),
    Cluster(&'a kube::Client, &'a WatchScope, Duration),
}

/// Where the gateway learns its task types.
#[derive(Clone)]
pub enum TaskTypeSource {
    /// A file, fixed for the process's life; the gateway declares their queues itself.
    File(TaskTypes),
    /// The TaskType resources, watched, their changes taken in at most every `refresh`; the
    /// operator declares the queues.
    Cluster {
        client: kube::Client,
        /// The namespaces whose TaskTypes and ClientTokens are read: all, or a listed few
        /// (a namespace-scoped install, with Roles in each).
        scope: WatchScope,
        refresh: Duration,
    },
}

/// Everything the gateway needs, already parsed.
#[derive(Clone)]
pub struct GatewayConfig {
    pub database: DbOptions,
    pub amqp_url: String,
    pub confirm_timeout: Duration,
    /// Channels the publisher spreads its batches over.
    pub publish_channels: usize,
    pub task_types: TaskTypeSource,
    pub tokens: Tokens,
    pub client_limits: ClientLimits,
    pub requests: api::RequestLimits,
    /// Largest body of `POST /v1/tasks`.
    pub max_body_bytes: usize,
    /// Largest body of `POST /v1/tasks:batch`.
    pub max_batch_bytes: usize,
    pub max_batch_tasks: usize,
    /// How often queue depths are read for backpressure.
    pub depth_interval: Duration,
    /// Run migrations at start.
    pub migrate: bool,
    /// The upkeep loop (reaper, orphan sweeper, audit partitions); `None` runs none, for a
    /// gateway beside others that do.
    pub upkeep: Option<upkeep::UpkeepConfig>,
    /// Serve the API over TLS with this certificate; `None` serves plain HTTP (behind a
    /// TLS-terminating Ingress, or on loopback).
    pub tls: Option<tls::TlsFiles>,
    /// Where request and publish spans go (`conveyor_core::trace`).
    pub tracer: conveyor_core::trace::Tracer,
}

/// Where the gateway answers: the API, and apart from it `/metrics`, `/healthz` and
/// `/readyz`, which clients of the API have no business reaching.
pub struct Listeners {
    pub api: TcpListener,
    pub admin: TcpListener,
}

/// Serves the gateway on `listeners` until `shutdown`, then drains in-flight requests.
pub async fn run(
    config: GatewayConfig,
    listeners: Listeners,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // In a cluster, clients may come from ClientToken resources alone.
    if config.tokens.is_empty() && matches!(config.task_types, TaskTypeSource::File(_)) {
        anyhow::bail!("no client tokens configured (--tokens-file or CONVEYOR_GATEWAY_TOKENS)");
    }
    let tokens = Arc::new(TokenSet::new(config.tokens.clone()));
    // Before anything connects: an unusable certificate is a configuration error.
    let tls = config
        .tls
        .clone()
        .map(|files| tls::ServerTls::start(files, shutdown.clone()))
        .transpose()
        .context("gateway TLS settings")?;
    // So is a task type from a file that cannot be served (a schema that does not compile).
    let source = match &config.task_types {
        TaskTypeSource::File(types) => {
            Checked::File(Registry::from_file(types).map_err(anyhow::Error::msg)?)
        }
        TaskTypeSource::Cluster {
            client,
            scope,
            refresh,
        } => Checked::Cluster(client, scope, *refresh),
    };
    let db = Db::connect(&config.database).context("database settings")?;
    if config.migrate {
        db.migrate_or_check()
            .await
            .context("migrating the task database")?;
    } else {
        match db.check_schema().await {
            // Degraded mode starts without the database; the schema is checked by the
            // statements themselves then.
            Err(err) if err.is_unavailable() => {
                tracing::warn!(error = %err, "the database schema is not checked: unreachable")
            }
            checked => checked.context("checking the task database's schema")?,
        }
    }
    // Through the default exchange: a tenant's missing exchange fails only its own tasks.
    let publisher = Arc::new(
        Publisher::with_channels(
            &config.amqp_url,
            "conveyor-gateway",
            config.confirm_timeout,
            config.publish_channels,
        )
        .via(Via::DefaultExchange),
    );
    let declared = Arc::new(AtomicBool::new(false));
    let types = match source {
        Checked::File(registry) => {
            tokio::spawn(declare_topology(
                publisher.clone(),
                registry
                    .snapshot()
                    .values()
                    .map(|k| k.spec.clone())
                    .collect(),
                declared.clone(),
                shutdown.clone(),
            ));
            Arc::new(registry)
        }
        Checked::Cluster(client, scope, refresh) => {
            let registry = Arc::new(Registry::default());
            let listed = cluster::list_types(client, scope)
                .await
                .context("listing TaskType resources")?;
            registry.replace(listed);
            declared.store(true, Ordering::Release);
            let listed = cluster::list_tokens(client, scope, &config.tokens)
                .await
                .context("listing ClientToken resources (are the CRDs of crds/ applied?)")?;
            tokens.replace(listed);
            tokio::spawn(cluster::follow(
                registry.clone(),
                tokens.clone(),
                config.tokens.clone(),
                client.clone(),
                scope.clone(),
                refresh,
                shutdown.clone(),
            ));
            registry
        }
    };
    // Depth polls and readiness probes get a connection of their own: a missing queue
    // must not close the publishing connection.
    let observer = Arc::new(QueueObserver::new(
        &config.amqp_url,
        "conveyor-gateway/depths",
    ));
    let depths = Arc::new(DepthMonitor::default());
    tokio::spawn(depths.clone().run(
        observer.clone(),
        types.clone(),
        config.depth_interval,
        metrics.clone(),
        shutdown.clone(),
    ));

    if let Some(upkeep) = config.upkeep.clone() {
        // Pools of its own: a tenant's flood of requests may queue for the API's
        // connections, never the reaper's and the sweeper's (issue 33, item 3).
        let upkeep_db = Db::connect(&config.database.for_purpose("upkeep", UPKEEP_CONNECTIONS))
            .context("database settings")?;
        tokio::spawn(upkeep::run(
            upkeep_db,
            publisher.clone(),
            observer.clone(),
            types.clone(),
            upkeep,
            metrics.clone(),
            shutdown.clone(),
        ));
    }

    // A pool of its own, so that a tenant's requests queueing for the API's connections
    // cannot fail every stream's reads.
    let feed = feed::Feed::new(
        Db::connect(&config.database.for_purpose("streams", FEED_CONNECTIONS))
            .context("database settings")?,
    );
    tokio::spawn(feed.clone().run(shutdown.clone()));
    let writes = db.ingest_writes(&metrics);
    let state = Arc::new(ApiState {
        ingestor: Ingestor {
            db: db.clone(),
            writes: writes.clone(),
            publisher: publisher.clone(),
            types: types.clone(),
            limiter: RateLimiter::new(),
            client_limits: config.client_limits.clone(),
            depths,
            metrics: metrics.clone(),
            tracer: config.tracer.clone(),
        },
        tokens,
        feed,
        amqp_url: config.amqp_url.clone(),
        max_batch_tasks: config.max_batch_tasks,
        limits: config.requests.clone(),
        in_flight: Default::default(),
        bodies: api::BodyBudget::new(
            &config.requests,
            config.max_body_bytes,
            config.max_batch_bytes,
        ),
    });
    let ready: admin::ReadinessCheck = Arc::new(move || {
        let db = db.clone();
        let observer = observer.clone();
        let probe_type = types.names().into_iter().next();
        let declared = declared.clone();
        Box::pin(async move {
            if !declared.load(Ordering::Acquire) {
                return Err("task type queues are not declared yet".to_owned());
            }
            db.ping().await.map_err(|e| format!("database: {e}"))?;
            if let Some(task_type) = probe_type {
                // The broker must answer; a missing queue (one tenant's type being made or
                // deleted) is that tenant's state, not the gateway's.
                let queue = conveyor_core::amqp::QueueNames::of(&task_type).main;
                match observer.ready_count(&queue).await {
                    Ok(_) | Err(conveyor_core::amqp::AmqpError::NoQueue { .. }) => {}
                    Err(e) => return Err(format!("broker: {e}")),
                }
            }
            Ok(())
        })
    });
    let api = api::router(state, config.max_body_bytes, config.max_batch_bytes);
    let admin = admin::router(metrics.registry.clone(), ready);
    tracing::info!(api = ?listeners.api.local_addr().ok(), tls = tls.is_some(),
        admin = ?listeners.admin.local_addr().ok(), "gateway listening");
    let serve_admin = axum::serve(listeners.admin, admin)
        .with_graceful_shutdown(shutdown.clone().cancelled_owned())
        .into_future();
    let serve_api = async {
        match &tls {
            Some(tls) => {
                let listener = tls.listen(listeners.api).context("TLS listener")?;
                axum::serve(listener, api)
                    .with_graceful_shutdown(shutdown.clone().cancelled_owned())
                    .await
            }
            None => {
                axum::serve(listeners.api, api)
                    .with_graceful_shutdown(shutdown.clone().cancelled_owned())
                    .await
            }
        }
        .context("serving the API")
    };
    let serve_admin = async { serve_admin.await.context("serving the admin routes") };
    let served = tokio::try_join!(serve_api, serve_admin);
    // The answers are out; their QUEUED marks should not wait for a claim that may not come.
    writes.queued.flush().await;
    served.map(|_| ())
}

/// Connections of the upkeep loops' own pool: they take turns, and none holds one long.
const UPKEEP_CONNECTIONS: u32 = 4;

/// Connections of the stream feed's pool: it reads one statement at a time.
const FEED_CONNECTIONS: u32 = 2;

/// Longest one task type's declaration may take before it is tried again.
const DECLARE_TIMEOUT: Duration = Duration::from_secs(30);

/// Declares every task type's queues, retrying while the broker is unreachable. (The
/// operator takes this over in a cluster; declaring is idempotent.)
async fn declare_topology(
    publisher: Arc<Publisher>,
    task_types: Vec<conveyor_core::task_type::NamedTaskType>,
    declared: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    for task_type in task_types {
        loop {
            match publisher
                .declare_task_type(&task_type, DECLARE_TIMEOUT)
                .await
            {
                Ok(()) => break,
                Err(err) => {
                    tracing::warn!(task_type = task_type.name, error = %err,
                        "cannot declare queues; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                    }
                }
            }
        }
    }
    declared.store(true, Ordering::Release);
}
