//! Integration-test support: one database per test and unique task types, so tests run in
//! parallel against the same PostgreSQL and RabbitMQ without seeing each other.

pub mod proxy;
pub mod resources;

use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::amqp::{self, QueueNames};
use crate::db::{Db, DbOptions};
use crate::task::TaskEvent;
use crate::TaskState;

pub use crate::config::DEV_CA;
/// The loopback server certificate (127.0.0.1, localhost) and its key, signed by [`DEV_CA`],
/// for tests that serve HTTPS themselves.
pub const DEV_SERVER_CERT: &str = "/etc/conveyor/dev-tls/server.crt";
pub const DEV_SERVER_KEY: &str = "/etc/conveyor/dev-tls/server.key";
/// Where PostgreSQL and RabbitMQ listen; both speak TLS only.
pub const DATABASE_ADDRESS: &str = "127.0.0.1:5432";
pub const BROKER_ADDRESS: &str = "127.0.0.1:5671";
/// The RabbitMQ management API (HTTPS only), without credentials.
pub const MANAGEMENT_API: &str = "https://127.0.0.1:15671";

/// Where the test services are; `scripts/services.sh up` provides these defaults, over TLS
/// verified against [`DEV_CA`].
pub fn admin_database_url() -> String {
    std::env::var("CONVEYOR_TEST_DATABASE_URL").unwrap_or_else(|_| {
        format!(
            "postgres://conveyor:conveyor@{DATABASE_ADDRESS}/postgres\
             ?sslmode=verify-full&sslrootcert={DEV_CA}"
        )
    })
}

pub fn amqp_url() -> String {
    std::env::var("CONVEYOR_TEST_AMQP_URL")
        .unwrap_or_else(|_| crate::config::DEV_AMQP_URL.to_owned())
}

/// The RabbitMQ management API, for tests that close connections or read queue counts.
pub fn management_url() -> String {
    std::env::var("CONVEYOR_TEST_MANAGEMENT_URL")
        .unwrap_or_else(|_| "https://conveyor:conveyor@127.0.0.1:15671".to_owned())
}

/// [`DEV_CA`], for HTTPS clients (none where the services are not this machine's, as on
/// kind, whose services speak plain inside the cluster).
pub fn dev_roots() -> crate::tls::TrustedRoots {
    let ca = std::path::Path::new(DEV_CA);
    if !ca.exists() {
        return crate::tls::TrustedRoots::default();
    }
    crate::tls::TrustedRoots::from_file(ca).expect("the dev CA is a PEM certificate")
}

/// An HTTP client that trusts [`DEV_CA`] (for the management API and HTTPS gateways).
pub fn http_client() -> reqwest::Client {
    dev_roots().client_builder().build().expect("HTTP client")
}

/// `url` with its database name replaced (its parameters, such as TLS settings, kept).
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let server = base
        .rsplit_once('/')
        .map(|(server, _)| server)
        .expect("database URL ends in /dbname");
    match query {
        Some(query) => format!("{server}/{name}?{query}"),
        None => format!("{server}/{name}"),
    }
}

pub use crate::urls::with_params;

/// `url` pointed at another port of the same host (a fault proxy in front of a service).
pub fn via_port(url: &str, address: &str, port: u16) -> String {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    url.replacen(address, &format!("{host}:{port}"), 1)
}

/// A fresh, migrated database.
pub struct TestDatabase {
    pub db: Db,
    pub url: String,
    pub name: String,
}

/// Where a test's services are: the single ones of `scripts/services.sh` by default, or a
/// replicated set (the chaos suite's RabbitMQ cluster and PostgreSQL pair).
#[derive(Debug, Clone)]
pub struct Services {
    /// A database URL with rights to create databases (its database name is replaced).
    pub admin_database_url: String,
    /// The broker setting (one URL, or one per node separated by commas).
    pub amqp_url: String,
    /// The management API, with credentials.
    pub management_url: String,
}

impl Services {
    /// The single PostgreSQL and RabbitMQ of `scripts/services.sh` (or the test
    /// environment's overrides).
    pub fn single() -> Services {
        Services {
            admin_database_url: admin_database_url(),
            amqp_url: amqp_url(),
            management_url: management_url(),
        }
    }
}

impl TestDatabase {
    pub async fn create() -> TestDatabase {
        Self::create_in(&Services::single()).await
    }

    /// A fresh, migrated database on `services`' PostgreSQL.
    pub async fn create_in(services: &Services) -> TestDatabase {
        let test = Self::create_empty_in(services).await;
        test.db.migrate().await.expect("migrations apply");
        test
    }

    /// A fresh database with no schema (for a test that migrates it step by step).
    pub async fn create_empty() -> TestDatabase {
        Self::create_empty_in(&Services::single()).await
    }

    async fn create_empty_in(services: &Services) -> TestDatabase {
        let admin_url = services.admin_database_url.clone();
        let name = format!("conveyor_test_{}", Uuid::new_v4().simple());
        let admin = Db::connect(&DbOptions::new(&admin_url)).expect("admin database URL");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(admin.pool())
            .await
            .expect("create the test database (is `scripts/services.sh up` done?)");
        admin.close().await;
        let url = with_database(&admin_url, &name);
        let db = Db::connect(&DbOptions::new(&url)).expect("test database URL");
        TestDatabase { db, url, name }
    }
}

/// A task type name no other test uses.
pub fn unique_type(prefix: &str) -> String {
    format!("{prefix}-{}", &Uuid::new_v4().simple().to_string()[..10])
}

/// Deletes a task type's queues (best effort, at the end of a test).
pub async fn delete_queues(task_type: &str) {
    delete_queues_in(&Services::single(), task_type).await
}

/// Deletes a task type's queues, exchange and policies on `services`' broker.
pub async fn delete_queues_in(services: &Services, task_type: &str) {
    let Ok(conn) = amqp::connect(&services.amqp_url, "conveyor-test-cleanup").await else {
        return;
    };
    let names = QueueNames::of(task_type);
    amqp::delete_queues(&conn, &names.all(crate::task_type::MAX_RETRY_TIERS)).await;
    amqp::delete_exchange(&conn, &names).await;
    let _ = conn.close(200, "test cleanup").await;
    // Left-over policies slow every later policy write on the shared test broker.
    let http = http_client();
    for name in
        crate::policies::task_type_policy_names(&crate::task_type::NamedTaskType::named(task_type))
    {
        let url = format!("{}/api/policies/%2f/{name}", services.management_url);
        let _ = http.delete(url).send().await;
    }
}

/// Polls `check` every 50 ms until it holds; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The states of a chain, in order.
pub fn states(chain: &[TaskEvent]) -> Vec<TaskState> {
    chain.iter().map(|e| e.to_state).collect()
}

/// Asserts that a chain is a valid lifecycle path.
pub fn assert_valid_chain(chain: &[TaskEvent]) {
    let steps: Vec<_> = chain.iter().map(|e| (e.from_state, e.to_state)).collect();
    if let Err(err) = crate::lifecycle::check_chain(&steps) {
        panic!("invalid audit chain {:?}: {err}", states(chain));
    }
    for pair in chain.windows(2) {
        assert!(
            pair[0].at <= pair[1].at,
            "timestamps go backwards in {:?}",
            states(chain)
        );
    }
}

/// How many tasks of `task_type` are in `state`.
pub async fn count_in_state(db: &Db, task_type: &str, state: TaskState) -> i64 {
    let counts = db.state_counts(task_type).await.expect("counts");
    counts
        .iter()
        .find(|(s, _)| *s == state)
        .map_or(0, |(_, n)| *n)
}

/// Waits until `n` tasks of `task_type` are in `state`.
pub async fn wait_for_state(db: &Db, task_type: &str, state: TaskState, n: i64, timeout: Duration) {
    wait_until(
        &format!("{n} {task_type} tasks {state}"),
        timeout,
        || async { count_in_state(db, task_type, state).await == n },
    )
    .await;
}

/// A workspace binary: next to the running executable (`target/debug/conveyor-chaos`) or
/// one level up (a test in `target/debug/deps/`).
pub fn binary(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_default();
    let here = dir.join(name);
    if here.is_file() {
        return here;
    }
    dir.parent().map(|d| d.join(name)).unwrap_or(here)
}

/// A loopback port nobody listens on right now, from 20000-22999: below the kernel's
/// ephemeral range (a port the kernel hands out for port 0 may be taken by any outgoing
/// connection before the process it is meant for listens on it: the soak's gateway once
/// failed "address already in use" that way), and clear of the local services' fixed ports
/// (RabbitMQ's 15671 and 25672, the control plane's 16443 and 23790), which a restart
/// must find free.
pub fn free_port() -> u16 {
    let (low, high) = (20_000u16, 23_000u16);
    for _ in 0..1000 {
        let port = low + (uuid::Uuid::new_v4().as_u128() % u128::from(high - low)) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A process's /metrics page at `listen` (`None` while it does not answer).
pub async fn metrics_page(http: &reqwest::Client, listen: &str) -> Option<String> {
    let answer = http
        .get(format!("http://{listen}/metrics"))
        .timeout(Duration::from_millis(500))
        .send()
        .await
        .ok()?;
    answer.text().await.ok()
}

/// The value of the sample `line` (a metric name with its labels, exactly).
pub fn metric_value(page: &str, line: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(line)?.strip_prefix(' ')?.parse().ok())
}

/// The sum of the samples whose name (and labels) start with `prefix`.
pub fn metric_sum(page: &str, prefix: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Drops a test database and closes its sessions (best effort, at the end of a run).
pub async fn drop_database(name: &str) {
    drop_database_in(&Services::single(), name).await
}

/// Drops a test database on `services`' PostgreSQL.
pub async fn drop_database_in(services: &Services, name: &str) {
    let Ok(admin) = Db::connect(&DbOptions::new(&services.admin_database_url)) else {
        return;
    };
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(admin.pool())
        .await;
    admin.close().await;
}

/// A memory field of `/proc/<pid>/status` (`VmRSS`, `VmHWM`: kB there), in MiB.
pub fn proc_status_mib(pid: u32, field: &str) -> Option<f64> {
    proc_file_mib(pid, "status", field)
}

/// A `<field>: <n> kB` line of `/proc/<pid>/<file>` (`status`, `smaps_rollup`), in MiB.
pub fn proc_file_mib(pid: u32, file: &str, field: &str) -> Option<f64> {
    proc_file_fields_mib(pid, file, &[field])?[0]
}

/// Several `<field>: <n> kB` lines of `/proc/<pid>/<file>`, in MiB, from one read (fields
/// read apart could come from two moments); `None` when the file cannot be read.
pub fn proc_file_fields_mib(pid: u32, file: &str, fields: &[&str]) -> Option<Vec<Option<f64>>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
    let mib = |field: &str| {
        let kib: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib / 1024.0)
    };
    Some(fields.iter().map(|field| mib(field)).collect())
}

/// A process's log file `<dir>/<name>.log`, appended to across its restarts.
pub fn log_file(dir: &std::path::Path, name: &str) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))
}
