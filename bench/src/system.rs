//! The system measured: a database of its own, one noop task type, the real
//! `conveyor-gateway` and `conveyor-worker` binaries (release, beside this one) as processes.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::testing::{self, binary, free_port, log_file};
use tokio::process::{Child, Command};

use crate::usage::Processes;

pub const TOKEN: &str = "bench-token";

#[derive(Debug, Clone)]
pub struct Settings {
    pub workers: usize,
    pub concurrency: u16,
    /// `--publish-channels` of the gateway and workers; `None`: their default.
    pub publish_channels: Option<u16>,
    /// Where `conveyor-gateway` and `conveyor-worker` are.
    pub binaries: PathBuf,
}

impl Settings {
    fn publish_channels_args(&self) -> Vec<String> {
        self.publish_channels
            .map(|n| vec!["--publish-channels".to_owned(), n.to_string()])
            .unwrap_or_default()
    }
}

pub struct System {
    pub task_type: String,
    pub gateway_url: String,
    pub database: String,
    pub db_url: String,
    /// Each worker's /metrics address.
    pub worker_metrics: Vec<String>,
    gateway: Child,
    workers: Vec<Child>,
}

impl System {
    pub async fn start(settings: &Settings, logs: &Path) -> anyhow::Result<System> {
        // Empty: the gateway measured migrates it, so an older build gets its own schema.
        let name = format!("conveyor_test_{}", uuid::Uuid::new_v4().simple());
        let admin = Db::connect(&DbOptions::new(testing::admin_database_url()))?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(admin.pool())
            .await
            .context("create the bench database (is `scripts/services.sh up` done?)")?;
        admin.close().await;
        let db_url = testing::with_database(&testing::admin_database_url(), &name);
        let task_type = testing::unique_type("bench");
        std::fs::create_dir_all(logs)?;
        // A buffer left by an interrupted run belongs to its database, long dropped: it would
        // start a worker degraded.
        let _ = std::fs::remove_dir_all(logs.join("buffers"));
        let types_file = logs.join("task-types.yaml");
        // No backpressure in the way (the bench measures the path, not the limit).
        std::fs::write(
            &types_file,
            format!(
                "taskTypes:\n  - name: {task_type}\n    maxRetries: 3\n    timeoutSeconds: 30\n    \
                 heartbeatTimeoutSeconds: 30\n    maxQueueDepth: 10000000\n"
            ),
        )?;
        let port = free_port();
        let admin = format!("127.0.0.1:{}", free_port());
        let gateway_binary = settings.binaries.join("conveyor-gateway");
        let mut gateway = Command::new(&gateway_binary);
        gateway.args(settings.publish_channels_args());
        let gateway = gateway
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-listen", &admin])
            .arg("--task-types")
            .arg(&types_file)
            .args(["--tokens", &format!("bench={TOKEN}")])
            .args(["--client-rate", "10000000", "--client-burst", "10000000"])
            .args(["--client-max-in-flight", "1024"])
            .env("CONVEYOR_DATABASE_URL", &db_url)
            .env("CONVEYOR_AMQP_URL", testing::amqp_url())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log_file(logs, "gateway")?)
            .stderr(log_file(logs, "gateway")?)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {}", gateway_binary.display()))?;
        wait_ready(&admin, logs).await?;
        let mut workers = Vec::new();
        let mut worker_metrics = Vec::new();
        for i in 0..settings.workers {
            let metrics = format!("127.0.0.1:{}", free_port());
            let name = format!("bench-w{i}");
            let child = Command::new(settings.binaries.join("conveyor-worker"))
                .args(settings.publish_channels_args())
                .arg("--task-types")
                .arg(&types_file)
                .args(["--consume", &task_type, "--handler", "noop"])
                .args(["--worker-name", &name])
                .args(["--concurrency", &settings.concurrency.to_string()])
                .args(["--metrics-listen", &metrics])
                .arg("--buffer-dir")
                .arg(logs.join("buffers"))
                .env("CONVEYOR_DATABASE_URL", &db_url)
                .env("CONVEYOR_AMQP_URL", testing::amqp_url())
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(log_file(logs, &name)?)
                .stderr(log_file(logs, &name)?)
                .kill_on_drop(true)
                .spawn()
                .context("start conveyor-worker")?;
            wait_ready(&metrics, logs).await?;
            workers.push(child);
            worker_metrics.push(metrics);
        }
        Ok(System {
            task_type,
            gateway_url: format!("http://127.0.0.1:{port}"),
            database: name,
            db_url,
            worker_metrics,
            gateway,
            workers,
        })
    }

    pub fn processes(&self) -> Processes {
        Processes {
            gateway: self.gateway.id().unwrap_or(0),
            workers: self.workers.iter().filter_map(Child::id).collect(),
        }
    }

    /// Stops the processes and drops the queues and the database.
    pub async fn stop(mut self) {
        let _ = self.gateway.kill().await;
        for worker in &mut self.workers {
            let _ = worker.kill().await;
        }
        testing::delete_queues(&self.task_type).await;
        testing::drop_database(&self.database).await;
    }
}

async fn wait_ready(admin: &str, logs: &Path) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    for _ in 0..300 {
        let ready = http
            .get(format!("http://{admin}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("{admin} did not become ready; see {}", logs.display())
}

/// Where the binaries measured are by default: beside this one.
pub fn default_binaries() -> PathBuf {
    binary("conveyor-gateway")
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// Whether pg_stat_statements counts plannings (off by default: it costs every statement a
/// lock); the report shows its planning columns only when it does.
pub const TRACK_PLANNING: &str = "pg_stat_statements.track_planning";

/// PostgreSQL settings that shape this load, as the server reports them.
const POSTGRES_SETTINGS: &[&str] = &[
    "autovacuum_naptime",
    "autovacuum_vacuum_cost_limit",
    "checkpoint_timeout",
    "fsync",
    "full_page_writes",
    "max_connections",
    "max_wal_size",
    TRACK_PLANNING,
    "shared_buffers",
    "synchronous_commit",
    "wal_buffers",
    "wal_compression",
    "work_mem",
];

/// The services' settings during the run: PostgreSQL's as it reports them, and RabbitMQ's
/// as `scripts/services.sh` configured them (its listeners and TLS files left out).
pub async fn service_settings(admin: &sqlx::PgPool) -> std::collections::BTreeMap<String, String> {
    let mut settings = std::collections::BTreeMap::new();
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY($1) ORDER BY name",
    )
    .bind(POSTGRES_SETTINGS)
    .fetch_all(admin)
    .await
    .unwrap_or_default();
    for (name, value) in rows {
        settings.insert(postgres_key(&name), value);
    }
    let configured = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    for line in configured("/etc/rabbitmq/rabbitmq.conf").lines() {
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let key = key.trim();
        let about_access = ["listeners", "ssl_options", "management"]
            .iter()
            .any(|prefix| key.starts_with(prefix));
        if !key.starts_with('#') && !about_access {
            settings.insert(format!("rabbitmq {key}"), value.trim().to_owned());
        }
    }
    for line in configured("/etc/rabbitmq/rabbitmq-env.conf").lines() {
        if let Some(args) = line.strip_prefix("SERVER_ADDITIONAL_ERL_ARGS=") {
            settings.insert(
                "rabbitmq erl args".to_owned(),
                args.trim_matches('"').to_owned(),
            );
        }
    }
    settings
}

/// The key of a PostgreSQL setting in [`service_settings`].
pub fn postgres_key(name: &str) -> String {
    format!("postgresql {name}")
}
