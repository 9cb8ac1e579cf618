use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use conveyor_core::config::{AmqpArgs, DatabaseArgs, Secret, TelemetryArgs};
use conveyor_core::db::DbOptions;
use conveyor_core::metrics::Metrics;
use conveyor_core::plaintext::Link;
use conveyor_core::task_type::load_task_types;
use conveyor_core::upkeep::SweepSettings;
use conveyor_core::watch_scope::WatchScope;
use conveyor_gateway::api::RequestLimits;
use conveyor_gateway::auth::Tokens;
use conveyor_gateway::ingest::ClientLimits;
use conveyor_gateway::limits::NamespaceLimits;
use conveyor_gateway::tls::TlsFiles;
use conveyor_gateway::upkeep::{TaskRetention, UpkeepConfig};
use conveyor_gateway::{GatewayConfig, Listeners, TaskTypeSource};
use tokio_util::sync::CancellationToken;

/// Conveyor API gateway and task ingestor.
#[derive(Debug, Parser)]
#[command(name = "conveyor-gateway", version)]
struct Args {
    /// Address to serve the API on.
    #[arg(
        long,
        env = "CONVEYOR_GATEWAY_LISTEN",
        default_value = "127.0.0.1:8080"
    )]
    listen: String,
    /// Address to serve /metrics, /healthz and /readyz on (never on the API's port).
    #[arg(
        long,
        env = "CONVEYOR_GATEWAY_ADMIN_LISTEN",
        default_value = "127.0.0.1:9091"
    )]
    admin_listen: String,
    /// PEM certificate chain to serve the API over HTTPS with (needs --tls-key-file).
    /// Re-read when it changes, without a restart.
    #[arg(
        long,
        env = "CONVEYOR_GATEWAY_TLS_CERT_FILE",
        requires = "tls_key_file"
    )]
    tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(
        long,
        env = "CONVEYOR_GATEWAY_TLS_KEY_FILE",
        requires = "tls_cert_file"
    )]
    tls_key_file: Option<PathBuf>,
    /// How often the certificate files are checked for a replacement, in seconds.
    #[arg(
        long,
        env = "CONVEYOR_GATEWAY_TLS_RELOAD_SECONDS",
        default_value_t = 10
    )]
    tls_reload_seconds: u64,
    /// YAML file with the task types (`taskTypes: [...]`).
    #[arg(
        long,
        env = "CONVEYOR_TASK_TYPES",
        default_value = "examples/task-types.yaml"
    )]
    task_types: PathBuf,
    /// Read task types (and client tokens) from the TaskType and ClientToken resources of
    /// the cluster, watched, instead of --task-types.
    #[arg(long, env = "CONVEYOR_TASK_TYPES_FROM_CLUSTER")]
    task_types_from_cluster: bool,
    /// With --task-types-from-cluster: the namespaces whose TaskTypes and ClientTokens are
    /// read, separated by commas (Roles in each suffice; the chart's `watchNamespaces`).
    /// Empty: every namespace, with a ClusterRole.
    #[arg(
        long,
        env = "CONVEYOR_WATCH_NAMESPACES",
        default_value = "",
        value_parser = WatchScope::parse
    )]
    watch_namespaces: WatchScope,
    /// The longest a watched change waits to be taken in: changes within it are taken in
    /// together.
    #[arg(
        long,
        env = "CONVEYOR_TASK_TYPES_REFRESH_SECONDS",
        default_value_t = 10
    )]
    task_types_refresh_seconds: u64,
    /// YAML file with client tokens (`clients: [{name, token | tokenSha256, namespaces}]`).
    #[arg(long, env = "CONVEYOR_GATEWAY_TOKENS_FILE")]
    tokens_file: Option<PathBuf>,
    /// Client tokens as `name=token` (tenant `default`) or `name@ns1+ns2=token`, separated
    /// by commas (never logged).
    #[arg(long, env = "CONVEYOR_GATEWAY_TOKENS", hide_env_values = true)]
    tokens: Option<Secret<String>>,
    /// Tasks per second each client may submit.
    #[arg(long, env = "CONVEYOR_CLIENT_RATE", default_value_t = 20000.0)]
    client_rate: f64,
    /// Burst each client may submit at once.
    #[arg(long, env = "CONVEYOR_CLIENT_BURST", default_value_t = 40000.0)]
    client_burst: f64,
    /// Requests each client may have in flight at once (more answer 429).
    #[arg(long, env = "CONVEYOR_CLIENT_MAX_IN_FLIGHT", default_value_t = 64)]
    client_max_in_flight: usize,
    /// Request body bytes each client may send per second.
    #[arg(long, env = "CONVEYOR_CLIENT_BYTES_PER_SECOND", default_value_t = 64.0 * 1024.0 * 1024.0)]
    client_bytes_per_second: f64,
    /// Tasks per second the clients of one namespace may submit together, on this replica
    /// (however many ClientTokens the namespace makes).
    #[arg(long, env = "CONVEYOR_NAMESPACE_RATE", default_value_t = 40000.0)]
    namespace_rate: f64,
    /// Burst the clients of one namespace may submit at once together, on this replica.
    #[arg(long, env = "CONVEYOR_NAMESPACE_BURST", default_value_t = 80000.0)]
    namespace_burst: f64,
    /// Requests the clients of one namespace may have in flight at once together, on this
    /// replica (more answer 429).
    #[arg(long, env = "CONVEYOR_NAMESPACE_MAX_IN_FLIGHT", default_value_t = 256)]
    namespace_max_in_flight: usize,
    /// Requests the clients of one namespace may make per second together, on this replica.
    #[arg(
        long,
        env = "CONVEYOR_NAMESPACE_REQUESTS_PER_SECOND",
        default_value_t = 10000.0
    )]
    namespace_requests_per_second: f64,
    /// Request body bytes the clients of one namespace may send per second together, on
    /// this replica.
    #[arg(long, env = "CONVEYOR_NAMESPACE_BYTES_PER_SECOND", default_value_t = 128.0 * 1024.0 * 1024.0)]
    namespace_bytes_per_second: f64,
    /// Task streams the clients of one namespace may hold open at once, on this replica.
    #[arg(long, env = "CONVEYOR_NAMESPACE_MAX_STREAMS", default_value_t = 256)]
    namespace_max_streams: usize,
    /// Tasks the lists of one namespace's clients may ask for per second together, on this
    /// replica (a list counts its limit).
    #[arg(
        long,
        env = "CONVEYOR_NAMESPACE_LISTED_PER_SECOND",
        default_value_t = 5000.0
    )]
    namespace_listed_per_second: f64,
    /// Request body bytes the gateway holds at once over all clients (more answer 503
    /// `gateway_busy`); at least --max-batch-bytes.
    #[arg(long, env = "CONVEYOR_MAX_BYTES_IN_FLIGHT", default_value_t = 256 * 1024 * 1024)]
    max_bytes_in_flight: usize,
    /// Longest a request is served, in seconds.
    #[arg(long, env = "CONVEYOR_REQUEST_TIMEOUT_SECONDS", default_value_t = 30)]
    request_timeout_seconds: u64,
    /// Largest body of POST /v1/tasks, in bytes.
    #[arg(long, env = "CONVEYOR_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
    max_body_bytes: usize,
    /// Largest body of POST /v1/tasks:batch, in bytes.
    #[arg(long, env = "CONVEYOR_MAX_BATCH_BYTES", default_value_t = 16 * 1024 * 1024)]
    max_batch_bytes: usize,
    /// Most tasks in one batch.
    #[arg(long, env = "CONVEYOR_MAX_BATCH_TASKS", default_value_t = 1000)]
    max_batch_tasks: usize,
    /// How often queue depths are read for backpressure, in milliseconds.
    #[arg(long, env = "CONVEYOR_DEPTH_INTERVAL_MS", default_value_t = 1000)]
    depth_interval_ms: u64,
    /// Do not run database migrations at start, only check that the schema has them. (A
    /// role that owns nothing, as `conveyorctl grant --component gateway` makes, is refused
    /// the migrations and checks anyway: decision 0015.)
    #[arg(long, env = "CONVEYOR_NO_MIGRATE")]
    no_migrate: bool,
    /// Run no upkeep here (reaper, orphan sweeper, audit partitions): only for a gateway
    /// beside others that run it.
    #[arg(long, env = "CONVEYOR_NO_UPKEEP")]
    no_upkeep: bool,
    /// How often the upkeep loop passes over every task type, in milliseconds.
    #[arg(long, env = "CONVEYOR_UPKEEP_INTERVAL_MS", default_value_t = 2000)]
    upkeep_interval_ms: u64,
    /// A task that waited unclaimed this long makes the sweeper send a probe through its
    /// work queue, and probes are sent at most this often per type (decision 0011).
    #[arg(long, env = "CONVEYOR_PROBE_INTERVAL_MS", default_value_t = 10_000)]
    probe_interval_ms: u64,
    /// A probe seen this long ago proves lost the messages of tasks queued before it.
    #[arg(long, env = "CONVEYOR_PROBE_GRACE_MS", default_value_t = 5000)]
    probe_grace_ms: u64,
    /// How often audit partitions are made ahead and rescued from the default partition.
    #[arg(
        long,
        env = "CONVEYOR_PARTITIONS_EVERY_SECONDS",
        default_value_t = 3600
    )]
    partitions_every_seconds: u64,
    /// Audit partitions older than this many days are dropped (0 keeps them for ever).
    #[arg(long, env = "CONVEYOR_AUDIT_RETENTION_DAYS", default_value_t = 90)]
    audit_retention_days: i32,
    /// COMPLETED and CANCELLED tasks (and their idempotency keys) are deleted this many days
    /// after they settled, for types that do not set `settledRetentionDays` (0 keeps them).
    #[arg(long, env = "CONVEYOR_TASK_RETENTION_DAYS", default_value_t = 30)]
    task_retention_days: u32,
    /// Expired tasks are appended here first, as `<day they settled>/<type>.ndjson`.
    #[arg(long, env = "CONVEYOR_TASK_ARCHIVE_DIR")]
    task_archive_dir: Option<std::path::PathBuf>,
    /// How often settled tasks past their retention are looked for, in seconds.
    #[arg(
        long,
        env = "CONVEYOR_TASK_RETENTION_EVERY_SECONDS",
        default_value_t = 600
    )]
    task_retention_every_seconds: u64,
    /// Seconds in a day of settled-task retention. Only a soak sets it (`make soak`, which
    /// compresses months into hours); a real deployment keeps 86400.
    #[arg(long, env = "CONVEYOR_RETENTION_DAY_SECONDS", default_value_t = 86_400)]
    retention_day_seconds: u64,
    /// How often the indexes of `tasks` are measured, and those expiry left sparse rebuilt
    /// (`REINDEX CONCURRENTLY`, which only the table's owner may), in seconds.
    #[arg(
        long,
        env = "CONVEYOR_INDEX_UPKEEP_EVERY_SECONDS",
        default_value_t = 3600
    )]
    index_upkeep_every_seconds: u64,
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    amqp: AmqpArgs,
    #[command(flatten)]
    telemetry: TelemetryArgs,
    #[command(flatten)]
    require_tls: conveyor_core::plaintext::RequireTls,
}

/// How often the upkeep looks for open tasks of types no TaskType defines any more.
const RETIRED_EVERY: Duration = Duration::from_secs(30);

fn upkeep_config(args: &Args) -> UpkeepConfig {
    let mut sweep = SweepSettings::for_confirm_timeout(args.amqp.confirm_timeout());
    let probe_interval = Duration::from_millis(args.probe_interval_ms.max(100));
    sweep.probe.min_wait = probe_interval;
    sweep.probe.interval = probe_interval;
    sweep.grace = Duration::from_millis(args.probe_grace_ms);
    UpkeepConfig {
        interval: Duration::from_millis(args.upkeep_interval_ms.max(50)),
        sweep,
        partitions_every: Duration::from_secs(args.partitions_every_seconds.max(1)),
        retired_every: RETIRED_EVERY,
        tasks_every: Duration::from_secs(args.task_retention_every_seconds.max(1)),
        tasks: TaskRetention {
            default_days: (args.task_retention_days > 0).then_some(args.task_retention_days),
            archive: args.task_archive_dir.clone(),
            day: Duration::from_secs(args.retention_day_seconds.max(1)),
        },
        retention_days: (args.audit_retention_days > 0).then_some(args.audit_retention_days),
        indexes_every: Duration::from_secs(args.index_upkeep_every_seconds.max(1)),
        name: format!("gateway-upkeep/{}", std::process::id()),
        scope: args.watch_namespaces.clone(),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    args.telemetry.init();
    if args.watch_namespaces != WatchScope::Cluster && !args.task_types_from_cluster {
        anyhow::bail!("--watch-namespaces needs --task-types-from-cluster: a file's task types have no namespace to watch");
    }
    args.require_tls
        .check(&[
            Link::Database(args.database.url.expose()),
            Link::Broker(args.amqp.url.expose()),
            Link::Served {
                tls: args.tls_cert_file.is_some(),
            },
        ])
        .map_err(anyhow::Error::msg)?;
    let mut tokens = Tokens::default();
    if let Some(path) = &args.tokens_file {
        tokens = tokens.merge(Tokens::load(path).map_err(anyhow::Error::msg)?);
    }
    if let Some(pairs) = &args.tokens {
        tokens = tokens.merge(Tokens::parse_pairs(pairs.expose()).map_err(anyhow::Error::msg)?);
    }
    let tracer = args.telemetry.tracer("conveyor-gateway");
    let config = GatewayConfig {
        // A request waits at most 2 s for a row another session holds (a tenant's own open
        // transaction): then 503, and its connection serves everyone else's requests again.
        database: DbOptions {
            lock_timeout: Some(Duration::from_secs(2)),
            ..args.database.options()
        },
        amqp_url: args.amqp.connection_url(),
        confirm_timeout: args.amqp.confirm_timeout(),
        publish_channels: args.amqp.publish_channels.into(),
        task_types: if args.task_types_from_cluster {
            TaskTypeSource::Cluster {
                client: kube::Client::try_default()
                    .await
                    .context("connecting to Kubernetes for TaskTypes")?,
                scope: args.watch_namespaces.clone(),
                refresh: Duration::from_secs(args.task_types_refresh_seconds.max(1)),
            }
        } else {
            TaskTypeSource::File(load_task_types(&args.task_types)?)
        },
        tokens,
        client_limits: ClientLimits {
            per_second: args.client_rate,
            burst: args.client_burst,
            namespace_per_second: args.namespace_rate,
            namespace_burst: args.namespace_burst,
        },
        requests: RequestLimits {
            max_in_flight: args.client_max_in_flight.max(1),
            bytes_per_second: args.client_bytes_per_second,
            timeout: Duration::from_secs(args.request_timeout_seconds.max(1)),
            max_bytes_in_flight: args.max_bytes_in_flight,
            namespace: NamespaceLimits {
                max_in_flight: args.namespace_max_in_flight.max(1),
                requests_per_second: args.namespace_requests_per_second,
                bytes_per_second: args.namespace_bytes_per_second,
                max_streams: args.namespace_max_streams.max(1),
                listed_per_second: args.namespace_listed_per_second,
            },
        },
        max_body_bytes: args.max_body_bytes,
        max_batch_bytes: args.max_batch_bytes,
        max_batch_tasks: args.max_batch_tasks,
        depth_interval: Duration::from_millis(args.depth_interval_ms.max(50)),
        migrate: !args.no_migrate,
        tracer: tracer.clone(),
        upkeep: (!args.no_upkeep).then(|| upkeep_config(&args)),
        tls: args
            .tls_cert_file
            .clone()
            .zip(args.tls_key_file.clone())
            .map(|(cert, key)| TlsFiles {
                cert,
                key,
                reload_every: Duration::from_secs(args.tls_reload_seconds.max(1)),
            }),
    };
    let listeners = Listeners {
        api: bind(&args.listen).await?,
        admin: bind(&args.admin_listen).await?,
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(conveyor_core::shutdown_on_signals(shutdown.clone()));
    let metrics = Metrics::new();
    conveyor_core::metrics::describe_process(&metrics.registry, "gateway");
    let served = conveyor_gateway::run(config, listeners, metrics, shutdown).await;
    // The last spans, before the process goes.
    tracer.flush().await;
    served
}

async fn bind(address: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address}"))
}
