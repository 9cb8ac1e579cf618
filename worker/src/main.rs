use conveyor_core::plaintext::Link;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use conveyor_core::config::{AmqpArgs, DatabaseArgs, TelemetryArgs};
use conveyor_core::metrics::Metrics;
use conveyor_core::task_type::load_task_types;
use conveyor_worker::handler::Handler;
use conveyor_worker::WorkerConfig;
use tokio_util::sync::CancellationToken;

/// Conveyor worker.
#[derive(Debug, Parser)]
#[command(name = "conveyor-worker", version)]
struct Args {
    /// YAML file with the task types (`taskTypes: [...]`).
    #[arg(
        long,
        env = "CONVEYOR_TASK_TYPES",
        default_value = "examples/task-types.yaml"
    )]
    task_types: std::path::PathBuf,
    /// Task types to consume, comma-separated.
    #[arg(long, env = "CONVEYOR_CONSUME", value_delimiter = ',', required = true)]
    consume: Vec<String>,
    /// exec, http, noop, sleep, fail or crash.
    #[arg(long, env = "CONVEYOR_HANDLER", default_value = "noop")]
    handler: String,
    /// Command line for the exec handler, split on whitespace (or give the command and its
    /// arguments after `--`).
    #[arg(long, env = "CONVEYOR_EXEC_COMMAND")]
    exec_command: Option<String>,
    /// The exec handler's command and arguments, after `--`.
    #[arg(last = true)]
    exec_args: Vec<String>,
    /// Sidecar URL for the http handler.
    #[arg(long, env = "CONVEYOR_HTTP_URL")]
    http_url: Option<String>,
    /// Tasks run at once (and the prefetch).
    #[arg(long, env = "CONVEYOR_CONCURRENCY", default_value_t = 16)]
    concurrency: u16,
    /// Identity in the audit log; a random suffix keeps each process distinct.
    #[arg(long, env = "POD_NAME", default_value = "worker")]
    worker_name: String,
    /// Seconds in-flight tasks may run after SIGTERM before they are released.
    #[arg(long, env = "CONVEYOR_DRAIN_GRACE_SECONDS", default_value_t = 25.0)]
    drain_grace_seconds: f64,
    /// Directory of the degraded-mode buffer (`<worker-name>.jsonl`): outcomes the database
    /// could not take, kept until they are replayed. Keep it across restarts of the worker.
    #[arg(long, env = "CONVEYOR_BUFFER_DIR", default_value = ".conveyor/buffer")]
    buffer_dir: std::path::PathBuf,
    /// Most bytes the buffer may hold; past it, outcomes are not buffered and their tasks
    /// re-run after their heartbeat timeout.
    #[arg(long, env = "CONVEYOR_BUFFER_MAX_BYTES", default_value_t = 16 << 20)]
    buffer_max_bytes: u64,
    /// Seconds a database call may take before the database counts as unavailable.
    #[arg(long, env = "CONVEYOR_DATABASE_TIMEOUT_SECONDS", default_value_t = 5.0)]
    database_timeout_seconds: f64,
    /// Address for /metrics, /healthz and /readyz (none when absent).
    #[arg(long, env = "CONVEYOR_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Do not declare the queues, consume only those that exist: the operator declares
    /// them (and deletes them with a `Delete` TaskType), as in every pod it runs.
    #[arg(long, env = "CONVEYOR_NO_DECLARE")]
    no_declare: bool,
    /// The bearer token `POST` and `DELETE /drain` need on the admin port (the operator sets
    /// it per pool). Without one, anything that reaches the port may pause this worker.
    #[arg(long, env = conveyor_core::drain::ADMIN_TOKEN_ENV, hide_env_values = true)]
    admin_token: Option<String>,
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    amqp: AmqpArgs,
    #[command(flatten)]
    telemetry: TelemetryArgs,
    #[command(flatten)]
    require_tls: conveyor_core::plaintext::RequireTls,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    args.telemetry.init();
    // Handlers run as this uid with a scrubbed environment; without this they could still
    // read this process's environment (database and broker passwords) in /proc/<ppid>/environ.
    if let Err(err) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!(error = %err, "cannot hide the worker's environment from its handlers");
    }
    args.require_tls
        .check(&[
            Link::Database(args.database.url.expose()),
            Link::Broker(args.amqp.url.expose()),
        ])
        .map_err(anyhow::Error::msg)?;
    let known = load_task_types(&args.task_types)?;
    let task_types = args
        .consume
        .iter()
        .map(|name| {
            known.get(name).cloned().with_context(|| {
                format!("task type {name:?} is not in {}", args.task_types.display())
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let exec = if args.exec_args.is_empty() {
        let line = args.exec_command.as_deref().unwrap_or_default();
        line.split_whitespace().map(str::to_owned).collect()
    } else {
        args.exec_args.clone()
    };
    let handler = Handler::parse(&args.handler, &exec, args.http_url.as_deref())
        .map_err(anyhow::Error::msg)?;
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let tracer = args.telemetry.tracer("conveyor-worker");
    let admin_token = args.admin_token.clone().filter(|t| !t.is_empty());
    if admin_token.is_none() && args.metrics_listen.is_some() {
        tracing::warn!(
            "no admin token: anything that reaches the admin port may pause this worker's intake"
        );
    }
    let config = WorkerConfig {
        admin_token,
        tracer: tracer.clone(),
        worker_id: format!("{}-{}", args.worker_name, &suffix[..8]),
        task_types,
        handler,
        concurrency: args.concurrency.max(1),
        database: args.database.options(),
        amqp_url: args.amqp.connection_url(),
        confirm_timeout: args.amqp.confirm_timeout(),
        publish_channels: args.amqp.publish_channels.into(),
        drain_grace: seconds(args.drain_grace_seconds),
        buffer_path: args.buffer_dir.join(format!("{}.jsonl", args.worker_name)),
        buffer_max_bytes: args.buffer_max_bytes,
        declare_queues: !args.no_declare,
        db_call_timeout: seconds(args.database_timeout_seconds).max(Duration::from_millis(100)),
    };
    let admin = match &args.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr}"))?,
        ),
        None => None,
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(conveyor_core::shutdown_on_signals(shutdown.clone()));
    let metrics = Metrics::new();
    conveyor_core::metrics::describe_process(&metrics.registry, "worker");
    let ran = conveyor_worker::run(config, admin, metrics, shutdown).await;
    // The last spans, before the process goes.
    tracer.flush().await;
    ran
}

/// A duration from a command-line number of seconds (clamped to [0, one day]).
fn seconds(value: f64) -> Duration {
    Duration::try_from_secs_f64(value.clamp(0.0, 86_400.0)).unwrap_or_default()
}
