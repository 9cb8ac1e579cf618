//! Flag groups shared by the binaries (flattened into each one's clap parser).

use std::fmt;
use std::time::Duration;

use clap::Args;

use crate::db::DbOptions;

/// A value that must never be printed: `Debug` and `Display` show `<redacted>`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret<T>(T);

impl<T> Secret<T> {
    pub fn new(value: T) -> Self {
        Secret(value)
    }
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl<T> fmt::Display for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::str::FromStr for Secret<String> {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

/// The CA `scripts/services.sh` makes for the local services, which speak TLS only.
pub const DEV_CA: &str = "/etc/conveyor/dev-tls/ca.crt";
/// The local database, verified against [`DEV_CA`] (libpq's parameters).
pub const DEV_DATABASE_URL: &str = "postgres://conveyor:conveyor@127.0.0.1:5432/conveyor\
     ?sslmode=verify-full&sslrootcert=/etc/conveyor/dev-tls/ca.crt";
/// The local broker over AMQPS, verified against [`DEV_CA`].
pub const DEV_AMQP_URL: &str =
    "amqps://conveyor:conveyor@127.0.0.1:5671/%2f?cacertfile=/etc/conveyor/dev-tls/ca.crt";

/// Where the task database is.
#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL (contains the password, so it is never logged).
    #[arg(
        id = "database_url",
        long = "database-url",
        env = "CONVEYOR_DATABASE_URL",
        default_value = DEV_DATABASE_URL
    )]
    pub url: Secret<String>,
    /// Connections in the pool.
    #[arg(
        long = "database-connections",
        env = "CONVEYOR_DATABASE_CONNECTIONS",
        default_value_t = 16
    )]
    pub max_connections: u32,
    /// The server cancels any statement that runs longer (PostgreSQL `statement_timeout`),
    /// so a call its caller gave up on cannot commit later; 0 turns it off. Workers use the
    /// smaller of this and their database call timeout.
    #[arg(
        long = "database-statement-timeout-ms",
        env = "CONVEYOR_DATABASE_STATEMENT_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub statement_timeout_ms: u64,
}

impl DatabaseArgs {
    pub fn options(&self) -> DbOptions {
        DbOptions {
            max_connections: self.max_connections,
            statement_timeout: (self.statement_timeout_ms > 0)
                .then(|| Duration::from_millis(self.statement_timeout_ms)),
            ..DbOptions::new(self.url.expose().clone())
        }
    }
}

/// Where the broker is.
#[derive(Debug, Clone, Args)]
pub struct AmqpArgs {
    /// AMQP URL (contains the password, so it is never logged). For a RabbitMQ cluster,
    /// one URL per node separated by commas: connections go to a node that answers.
    #[arg(
        id = "amqp_url",
        long = "amqp-url",
        env = "CONVEYOR_AMQP_URL",
        default_value = DEV_AMQP_URL
    )]
    pub url: Secret<String>,
    /// Longest wait for a publisher confirm before the publish counts as failed.
    #[arg(
        long = "confirm-timeout-ms",
        env = "CONVEYOR_CONFIRM_TIMEOUT_MS",
        default_value_t = 5000
    )]
    pub confirm_timeout_ms: u64,
    /// AMQP heartbeat. A frozen process (SIGSTOP, a stuck VM) holds its prefetched
    /// messages until the broker misses two heartbeats, so keep this short.
    #[arg(
        long = "amqp-heartbeat-seconds",
        env = "CONVEYOR_AMQP_HEARTBEAT_SECONDS",
        default_value_t = 10
    )]
    pub heartbeat_seconds: u16,
    /// Confirm-mode channels a publisher spreads its batches over: the broker runs each
    /// channel in one process, so one channel holds a busy gateway's confirms to one core.
    #[arg(
        long = "publish-channels",
        env = "CONVEYOR_PUBLISH_CHANNELS",
        default_value_t = crate::amqp::DEFAULT_PUBLISH_CHANNELS as u16,
        value_parser = clap::value_parser!(u16).range(1..=64)
    )]
    pub publish_channels: u16,
}

impl AmqpArgs {
    /// The URL with the heartbeat applied (unless the URL sets one itself).
    pub fn connection_url(&self) -> String {
        crate::amqp::with_heartbeat(self.url.expose(), self.heartbeat_seconds)
    }

    pub fn confirm_timeout(&self) -> Duration {
        Duration::from_millis(self.confirm_timeout_ms)
    }
}

/// Logging.
#[derive(Debug, Clone, Args)]
pub struct TelemetryArgs {
    /// Log as JSON lines instead of text.
    #[arg(long = "log-json", env = "CONVEYOR_LOG_JSON")]
    pub json: bool,
    /// Log filter, as RUST_LOG.
    #[arg(long = "log", env = "RUST_LOG", default_value = "info")]
    pub filter: String,
    /// OTLP/HTTP collector for traces (`http://collector:4318`); none: traces are not
    /// exported (their context still travels with each task).
    #[arg(long = "otlp-endpoint", env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

impl TelemetryArgs {
    /// Where this process's spans go (`crate::trace`), as `service`.
    pub fn tracer(&self, service: &str) -> crate::trace::Tracer {
        match &self.otlp_endpoint {
            Some(endpoint) => crate::trace::Tracer::otlp(endpoint, service),
            None => crate::trace::Tracer::disabled(),
        }
    }

    /// Installs the global subscriber (once per process, at start).
    pub fn init(&self) {
        let filter = tracing_subscriber::EnvFilter::try_new(&self.filter)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr);
        if self.json {
            builder.json().init();
        } else {
            builder.init();
        }
    }
}
