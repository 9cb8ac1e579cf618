//! A running Conveyor for one test: its own database, its own task types, an in-process
//! gateway, and workers in-process or as real `conveyor-worker` processes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use conveyor_core::amqp::{Publisher, QueueNames, QueueObserver};
use conveyor_core::db::Db;
use conveyor_core::metrics::Metrics;
use conveyor_core::task::{NewTask, TaskEvent};
use conveyor_core::task_type::{NamedTaskType, TaskTypes};
use conveyor_core::testing::{self, TestDatabase};
pub use conveyor_core::testing::{assert_valid_chain, states, wait_until};
use conveyor_core::TaskState;
use conveyor_gateway::api::RequestLimits;
use conveyor_gateway::auth::Tokens;
use conveyor_gateway::ingest::ClientLimits;
use conveyor_gateway::{GatewayConfig, Listeners, TaskTypeSource};
use conveyor_worker::handler::Handler;
use conveyor_worker::WorkerConfig;
use reqwest::StatusCode;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub const TOKEN: &str = "test-token-123";

pub struct Harness {
    pub db: Db,
    pub db_url: String,
    pub types: Vec<NamedTaskType>,
    pub gateway_url: String,
    /// The gateway's /metrics, /healthz and /readyz.
    pub admin_url: String,
    pub http: reqwest::Client,
    types_file: PathBuf,
    shutdown: CancellationToken,
    workers: Vec<InProcessWorker>,
}

pub struct InProcessWorker {
    pub id: String,
    pub metrics: Metrics,
    stop: CancellationToken,
    handle: JoinHandle<anyhow::Result<()>>,
}

impl InProcessWorker {
    /// SIGTERM, in-process: drain and return.
    pub async fn stop(self) {
        self.stop.cancel();
        self.handle.await.expect("worker task").expect("worker ran");
    }
}

/// A gateway over `db_url` serving `types` from a file, with the test token.
fn gateway_config(db_url: &str, types: &[NamedTaskType]) -> GatewayConfig {
    let task_types: TaskTypes = types.iter().map(|t| (t.name.clone(), t.clone())).collect();
    GatewayConfig {
        database: conveyor_core::db::DbOptions::new(db_url),
        amqp_url: testing::amqp_url(),
        confirm_timeout: Duration::from_secs(5),
        // More than one, so that every gateway test runs batches cut over channels.
        publish_channels: 3,
        task_types: TaskTypeSource::File(task_types),
        tokens: Tokens::parse_pairs(&format!("tests={TOKEN}")).expect("token"),
        client_limits: ClientLimits {
            per_second: 100_000.0,
            burst: 100_000.0,
            namespace_per_second: 200_000.0,
            namespace_burst: 200_000.0,
        },
        requests: RequestLimits::default(),
        max_body_bytes: 64 * 1024,
        max_batch_bytes: 1024 * 1024,
        max_batch_tasks: 500,
        depth_interval: Duration::from_millis(200),
        migrate: false,
        // Tests that need the reaper or the sweeper in the gateway ask for it.
        upkeep: None,
        // Plain HTTP on loopback; the gateway's TLS has tests of its own (tls.rs).
        tls: None,
        // Traces are exported only by the test that collects them (tracing.rs).
        tracer: conveyor_core::trace::Tracer::disabled(),
    }
}

/// Runs a gateway in-process on two free loopback ports; returns its API and admin URLs.
async fn spawn_gateway(config: GatewayConfig, shutdown: CancellationToken) -> (String, String) {
    let bind = || async {
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind")
    };
    let listeners = Listeners {
        api: bind().await,
        admin: bind().await,
    };
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let gateway_url = format!("{scheme}://{}", listeners.api.local_addr().expect("addr"));
    let admin_url = format!("http://{}", listeners.admin.local_addr().expect("addr"));
    tokio::spawn(conveyor_gateway::run(
        config,
        listeners,
        Metrics::new(),
        shutdown,
    ));
    (gateway_url, admin_url)
}

async fn wait_ready(http: &reqwest::Client, admin_url: &str) {
    let url = format!("{admin_url}/readyz");
    wait_until("gateway ready", Duration::from_secs(30), || async {
        matches!(http.get(&url).send().await, Ok(r) if r.status().is_success())
    })
    .await;
}

/// A connection to the test database as `user` (a tenant's role, say).
pub fn connect_as(database: &TestDatabase, user: &str, password: &str) -> Db {
    let (scheme, rest) = database.url.split_once("://").unwrap();
    let (_, server) = rest.split_once('@').unwrap();
    let url = format!("{scheme}://{user}:{password}@{server}");
    Db::connect(&conveyor_core::db::DbOptions::new(&url)).unwrap()
}

/// Noon UTC, `days` days before today.
/// A database migrated up to, not including, migration `version`: an upgrade's "before".
pub async fn migrated_before(version: i64) -> TestDatabase {
    let test = TestDatabase::create_empty().await;
    let mut before = sqlx::migrate::Migrator::new(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations"),
    )
    .await
    .expect("the migrations folder");
    before.migrations = before
        .migrations
        .iter()
        .filter(|m| m.version < version)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    before.run(test.db.pool()).await.expect("migrations before");
    test
}

pub fn days_ago(days: u64) -> chrono::DateTime<chrono::Utc> {
    (chrono::Utc::now().date_naive() - chrono::Days::new(days))
        .and_time(chrono::NaiveTime::from_hms_opt(12, 0, 0).unwrap())
        .and_utc()
}

/// Sets a task's state directly, as the tables' owner (a test's shortcut past the lifecycle).
pub async fn set_state(db: &Db, id: Uuid, state: &str) {
    sqlx::query("UPDATE tasks SET state = $2 WHERE id = $1")
        .bind(id)
        .bind(state)
        .execute(db.pool())
        .await
        .unwrap();
}

/// A task of `task_type` in tenant `default` with an empty payload, keyed by its id, as a
/// gateway would record it.
pub fn new_task(task_type: &str, id: Uuid) -> NewTask {
    NewTask {
        id,
        tenant: "default".into(),
        idempotency_key: id,
        task_type: task_type.to_owned(),
        payload: serde_json::json!({}),
        labels: Default::default(),
        trace_id: None,
    }
}

/// A type with short timeouts for tests.
pub fn test_type(prefix: &str) -> NamedTaskType {
    let mut spec = NamedTaskType::named(testing::unique_type(prefix));
    spec.heartbeat_timeout_seconds = 2.0;
    spec.backoff.initial_seconds = 0.2;
    spec.backoff.max_seconds = 5.0;
    spec
}

impl Harness {
    pub async fn start(types: Vec<NamedTaskType>) -> Harness {
        Self::start_with(types, |_| {}).await
    }

    pub async fn start_with(
        types: Vec<NamedTaskType>,
        adjust: impl FnOnce(&mut GatewayConfig),
    ) -> Harness {
        let test_db = TestDatabase::create().await;
        let mut config = gateway_config(&test_db.url, &types);
        adjust(&mut config);
        let shutdown = CancellationToken::new();
        let (gateway_url, admin_url) = spawn_gateway(config, shutdown.clone()).await;
        let types_file =
            std::env::temp_dir().join(format!("conveyor-types-{}.json", Uuid::new_v4()));
        // JSON is YAML: the worker binary reads this file as its --task-types.
        std::fs::write(
            &types_file,
            serde_json::to_vec(&serde_json::json!({ "taskTypes": types })).expect("json"),
        )
        .expect("write task types file");
        let harness = Harness {
            db: test_db.db,
            db_url: test_db.url,
            types,
            gateway_url,
            admin_url,
            http: testing::http_client(),
            types_file,
            shutdown,
            workers: Vec::new(),
        };
        wait_ready(&harness.http, &harness.admin_url).await;
        harness
    }

    /// The settings of this harness's gateway, for another one beside it.
    pub fn gateway_config(&self) -> GatewayConfig {
        gateway_config(&self.db_url, &self.types)
    }

    /// Another gateway with `config`, stopped with the harness; returns its API and admin
    /// URLs once it is ready.
    pub async fn start_gateway(&self, config: GatewayConfig) -> (String, String) {
        let urls = spawn_gateway(config, self.shutdown.child_token()).await;
        wait_ready(&self.http, &urls.1).await;
        urls
    }

    pub fn spec(&self, name: &str) -> &NamedTaskType {
        self.types
            .iter()
            .find(|t| t.name == name)
            .expect("known type")
    }

    /// A call to the gateway's API as the client with `token`: the status and the JSON body
    /// (`null` when there is none).
    pub async fn call_api(
        &self,
        method: reqwest::Method,
        token: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (StatusCode, serde_json::Value) {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.gateway_url))
            .bearer_auth(token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("gateway answers");
        let status = response.status();
        (status, response.json().await.unwrap_or_default())
    }

    pub async fn get_json(&self, token: &str, path: &str) -> (StatusCode, serde_json::Value) {
        self.call_api(reqwest::Method::GET, token, path, None).await
    }

    pub async fn post_json(
        &self,
        token: &str,
        path: &str,
        body: serde_json::Value,
    ) -> (StatusCode, serde_json::Value) {
        self.call_api(reqwest::Method::POST, token, path, Some(body))
            .await
    }

    pub async fn submit(
        &self,
        task_type: &str,
        payload: serde_json::Value,
        key: Option<Uuid>,
    ) -> (StatusCode, serde_json::Value) {
        let mut request = self
            .http
            .post(format!("{}/v1/tasks", self.gateway_url))
            .bearer_auth(TOKEN)
            .json(&serde_json::json!({ "taskType": task_type, "payload": payload }));
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key.to_string());
        }
        let response = request.send().await.expect("gateway answers");
        let status = response.status();
        (
            status,
            response.json().await.unwrap_or(serde_json::Value::Null),
        )
    }

    /// Submits and expects 201; returns the task id.
    pub async fn submit_ok(&self, task_type: &str, payload: serde_json::Value) -> Uuid {
        let (status, body) = self.submit(task_type, payload, None).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        body["id"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .expect("id")
    }

    pub fn start_worker(&mut self, types: &[&str], handler: Handler, concurrency: u16) -> String {
        self.start_worker_via(types, handler, concurrency, &testing::amqp_url())
    }

    /// A worker that reaches the broker at `amqp_url` (through a proxy, say).
    pub fn start_worker_via(
        &mut self,
        types: &[&str],
        handler: Handler,
        concurrency: u16,
        amqp_url: &str,
    ) -> String {
        let config = WorkerConfig {
            amqp_url: amqp_url.to_owned(),
            ..self.worker_config(types, handler, concurrency)
        };
        self.start_configured(config)
    }

    /// The settings `start_worker` uses, for a test to change before `start_configured`.
    pub fn worker_config(
        &self,
        types: &[&str],
        handler: Handler,
        concurrency: u16,
    ) -> WorkerConfig {
        let id = format!("inproc-{}", &Uuid::new_v4().simple().to_string()[..8]);
        WorkerConfig {
            buffer_path: std::env::temp_dir()
                .join("conveyor-it-buffers")
                .join(format!("{id}.jsonl")),
            worker_id: id,
            task_types: types.iter().map(|t| self.spec(t).clone()).collect(),
            handler,
            concurrency,
            database: conveyor_core::db::DbOptions::new(&self.db_url),
            amqp_url: testing::amqp_url(),
            confirm_timeout: Duration::from_secs(5),
            publish_channels: 2,
            drain_grace: Duration::from_secs(10),
            buffer_max_bytes: 1 << 20,
            declare_queues: true,
            db_call_timeout: Duration::from_secs(2),
            tracer: conveyor_core::trace::Tracer::disabled(),
            admin_token: None,
        }
    }

    pub fn start_configured(&mut self, config: WorkerConfig) -> String {
        self.start_serving(config, None)
    }

    /// A worker with its admin server (metrics, drain, progress callbacks) on `admin`.
    pub fn start_serving(
        &mut self,
        config: WorkerConfig,
        admin: Option<tokio::net::TcpListener>,
    ) -> String {
        let id = config.worker_id.clone();
        let metrics = Metrics::new();
        let stop = CancellationToken::new();
        let handle = tokio::spawn(conveyor_worker::run(
            config,
            admin,
            metrics.clone(),
            stop.clone(),
        ));
        self.workers.push(InProcessWorker {
            id: id.clone(),
            metrics,
            stop,
            handle,
        });
        id
    }

    pub fn take_worker(&mut self, id: &str) -> InProcessWorker {
        let index = self
            .workers
            .iter()
            .position(|w| w.id == id)
            .expect("worker");
        self.workers.remove(index)
    }

    pub fn worker_metrics(&self, id: &str) -> &Metrics {
        &self
            .workers
            .iter()
            .find(|w| w.id == id)
            .expect("worker")
            .metrics
    }

    /// A real `conveyor-worker` process (for signals). Its id starts with `name`.
    pub fn spawn_worker_process(&self, name: &str, types: &[&str], args: &[&str]) -> Child {
        self.worker_command(&[], name, types, args)
            .spawn()
            .expect("start conveyor-worker (run `cargo build --bins` first)")
    }

    /// The command of [`Harness::spawn_worker_process`], run through `wrapper` (`setpriv`
    /// to drop to another user, say) when it is not empty.
    pub fn worker_command(
        &self,
        wrapper: &[&str],
        name: &str,
        types: &[&str],
        args: &[&str],
    ) -> Command {
        let mut command = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut command = Command::new(program);
                command.args(rest).arg(binary("conveyor-worker"));
                command
            }
            None => Command::new(binary("conveyor-worker")),
        };
        command
            .arg("--task-types")
            .arg(&self.types_file)
            .arg("--consume")
            .arg(types.join(","))
            .arg("--worker-name")
            .arg(name)
            .args(args)
            .env("CONVEYOR_DATABASE_URL", &self.db_url)
            .env("CONVEYOR_AMQP_URL", testing::amqp_url())
            // Short, so that the broker notices a SIGSTOPped worker quickly.
            .env("CONVEYOR_AMQP_HEARTBEAT_SECONDS", "2")
            .env(
                "CONVEYOR_BUFFER_DIR",
                std::env::temp_dir().join("conveyor-it-buffers"),
            )
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null());
        command
    }

    pub fn publisher(&self) -> Publisher {
        Self::publisher_for_tests()
    }

    pub fn publisher_for_tests() -> Publisher {
        Publisher::new(testing::amqp_url(), "conveyor-test", Duration::from_secs(5))
    }

    /// Runs `conveyorctl` against this harness's database and the broker; asserts it
    /// succeeded and returns what it printed.
    pub fn conveyorctl(&self, args: &[&str]) -> String {
        let output = Command::new(binary("conveyorctl"))
            .args(args)
            .env("CONVEYOR_DATABASE_URL", &self.db_url)
            .env("CONVEYOR_AMQP_URL", testing::amqp_url())
            .env("CONVEYOR_CA_FILE", testing::DEV_CA)
            .output()
            .expect("run conveyorctl");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "conveyorctl {args:?}: {stdout} {}",
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    }

    pub async fn ready_count(&self, queue: &str) -> u32 {
        QueueObserver::new(testing::amqp_url(), "conveyor-test/depths")
            .ready_count(queue)
            .await
            .expect("queue exists")
    }

    /// Waits until `n` tasks of `task_type` are in `state`.
    pub async fn wait_for_state(
        &self,
        task_type: &str,
        state: TaskState,
        n: i64,
        timeout: Duration,
    ) {
        testing::wait_for_state(&self.db, task_type, state, n, timeout).await;
    }

    pub async fn count(&self, task_type: &str, state: TaskState) -> i64 {
        testing::count_in_state(&self.db, task_type, state).await
    }

    pub async fn total_tasks(&self, task_type: &str) -> i64 {
        let counts = self.db.state_counts(task_type).await.expect("counts");
        counts.iter().map(|(_, n)| n).sum()
    }

    /// Every audit event of a type, by task, in order.
    pub async fn chains(&self, task_type: &str) -> BTreeMap<Uuid, Vec<TaskEvent>> {
        let ids: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM tasks WHERE task_type = $1")
            .bind(task_type)
            .fetch_all(self.db.pool())
            .await
            .expect("ids");
        let mut chains = BTreeMap::new();
        for id in ids {
            chains.insert(id, self.db.events(id).await.expect("events"));
        }
        chains
    }

    pub async fn events(&self, id: Uuid) -> Vec<TaskEvent> {
        self.db.events(id).await.expect("events")
    }

    pub async fn shutdown(mut self) {
        for worker in std::mem::take(&mut self.workers) {
            worker.stop().await;
        }
        self.shutdown.cancel();
        for spec in &self.types {
            testing::delete_queues(&spec.name).await;
        }
        let _ = std::fs::remove_file(&self.types_file);
    }
}

pub use conveyor_core::testing::{binary, free_port};

/// The value of the sample `line` (metric name and labels) on a worker's /metrics page, or
/// `None` while the worker does not answer or has no such sample.
pub async fn scrape(http: &reqwest::Client, listen: &str, line: &str) -> Option<f64> {
    testing::metric_value(&testing::metrics_page(http, listen).await?, line)
}

pub fn queue(task_type: &str) -> QueueNames {
    QueueNames::of(task_type)
}

pub fn kill(child: &Child, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{signal} failed");
}
