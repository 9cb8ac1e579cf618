//! The system under test for one scenario: a database and a task type of its own, the real
//! `conveyor-gateway` and `conveyor-worker` binaries as processes, and proxies on the links
//! a scenario breaks. Workers are restarted the way a Deployment would replace them.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::Context as _;
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::policies::{shared_policies, task_type_policies};
use conveyor_core::task_type::load_task_types;
use conveyor_core::testing::{
    self, binary, free_port, log_file, proxy::Proxy, Services, TestDatabase,
};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use crate::replicated::Replicated;

pub const TOKEN: &str = "chaos-token";

/// How a scenario wants its system.
#[derive(Debug, Clone)]
pub struct Options {
    pub workers: usize,
    pub concurrency: u16,
    /// Worker 0 reaches the broker through a proxy (`System::worker_broker`).
    pub worker_broker_proxy: bool,
    /// The gateway reaches the broker through a proxy (`System::gateway_broker`).
    pub gateway_broker_proxy: bool,
    /// Every worker reaches PostgreSQL through one proxy (`System::worker_database`).
    pub worker_database_proxy: bool,
    pub max_queue_depth: u64,
    pub heartbeat_timeout_seconds: f64,
    pub max_retries: i32,
    /// Workers start with the system (else `start_workers` later).
    pub start_workers: bool,
    /// Against the RabbitMQ cluster and the PostgreSQL pair (`System::replicated`) instead
    /// of the single services.
    pub replicated: bool,
    /// More of the gateway's settings, as environment variables (the soak's retention).
    pub gateway_env: Vec<(String, String)>,
    /// A second namespace beside the scenario's (`crate::hostile`): a type of the same name
    /// in it, and a client of it. Nothing consumes its type.
    pub hostile_tenant: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            workers: 3,
            concurrency: 8,
            worker_broker_proxy: false,
            gateway_broker_proxy: false,
            worker_database_proxy: false,
            max_queue_depth: 100_000,
            heartbeat_timeout_seconds: 3.0,
            max_retries: 3,
            start_workers: true,
            replicated: false,
            gateway_env: Vec::new(),
            hostile_tenant: false,
        }
    }
}

pub struct System {
    pub task_type: String,
    gateway_port: u16,
    pub gateway_url: String,
    /// The gateway's /readyz and /metrics.
    gateway_admin: String,
    /// The suite's own connection (application_name conveyor-chaos, spared by faults).
    pub db: Db,
    pub database: String,
    db_url: String,
    types_file: PathBuf,
    logs: PathBuf,
    handler_url: String,
    options: Options,
    gateway: Child,
    workers: Vec<Option<Child>>,
    /// Each worker's /metrics address, kept across its restarts.
    metrics_listen: Vec<String>,
    pub worker_broker: Option<Proxy>,
    pub gateway_broker: Option<Proxy>,
    pub worker_database: Option<Proxy>,
    /// Where the services are.
    services: Services,
    pub replicated: Option<Replicated>,
}

use testing::{BROKER_ADDRESS as BROKER, DATABASE_ADDRESS as DATABASE};

impl System {
    pub async fn start(
        scenario: &str,
        options: Options,
        handler_url: &str,
        logs: &Path,
    ) -> anyhow::Result<System> {
        let replicated = match options.replicated {
            true => Some(Replicated::up().await?),
            false => None,
        };
        let services = replicated
            .as_ref()
            .map_or_else(Services::single, |r| r.services.clone());
        let test_db = TestDatabase::create_in(&services).await;
        let database = test_db.name.clone();
        test_db.db.close().await;
        let db_url = test_db.url.clone();
        let own_url = testing::with_params(&db_url, &[("application_name", "conveyor-chaos")])?;
        let db = Db::connect(&DbOptions::new(&own_url))?;
        let task_type = testing::unique_type(&format!("chaos-{scenario}"));
        let logs = logs.join(scenario);
        std::fs::create_dir_all(&logs)?;
        // Buffers of an earlier run belong to its database, long dropped.
        let _ = std::fs::remove_dir_all(logs.join("buffers"));
        let types_file = logs.join("task-types.yaml");
        std::fs::write(
            &types_file,
            format!(
                "taskTypes:\n  - name: {task_type}\n    maxRetries: {}\n    \
                 backoff: {{initialSeconds: 0.2, maxSeconds: 1, multiplier: 2}}\n    \
                 timeoutSeconds: 30\n    heartbeatTimeoutSeconds: {}\n    maxQueueDepth: {}\n",
                options.max_retries, options.heartbeat_timeout_seconds, options.max_queue_depth
            ) + &hostile_type(&task_type, options.hostile_tenant),
        )?;
        let proxy = |wanted: bool, to: &'static str| async move {
            match wanted {
                true => Some(Proxy::start(to.parse().expect("address")).await),
                false => None,
            }
        };
        let worker_broker = proxy(options.worker_broker_proxy, BROKER).await;
        let gateway_broker = proxy(options.gateway_broker_proxy, BROKER).await;
        // TLS ended at the proxy, so that commit-reset can see the statements.
        let worker_database = match options.worker_database_proxy {
            true => Some(Proxy::start_postgres_tls(DATABASE.parse().expect("address")).await),
            false => None,
        };

        let port = free_port();
        let gateway_url = format!("http://127.0.0.1:{port}");
        let gateway_admin = format!("127.0.0.1:{}", free_port());
        let gateway = spawn_gateway(
            port,
            &gateway_admin,
            &types_file,
            &db_url,
            &amqp_url(&services, gateway_broker.as_ref()),
            &gateway_env(&task_type, &options),
            &logs,
        )?;
        let mut system = System {
            task_type,
            gateway_port: port,
            gateway_url,
            gateway_admin,
            db,
            database,
            db_url,
            types_file,
            logs,
            handler_url: handler_url.to_owned(),
            workers: (0..options.workers).map(|_| None).collect(),
            metrics_listen: (0..options.workers)
                .map(|_| format!("127.0.0.1:{}", free_port()))
                .collect(),
            options,
            gateway,
            worker_broker,
            gateway_broker,
            worker_database,
            services,
            replicated,
        };
        system.wait_gateway_ready().await?;
        system.put_policies().await?;
        if system.options.start_workers {
            system.start_workers()?;
        }
        Ok(system)
    }

    /// The production topology: the policies the operator puts on a TaskType's queues
    /// (delivery limit, length limit, TTL cap), put the same way.
    async fn put_policies(&self) -> anyhow::Result<()> {
        let spec = self.spec()?;
        let http = testing::http_client();
        for policy in shared_policies()
            .into_iter()
            .chain(task_type_policies(&spec))
        {
            let url = format!(
                "{}/api/policies/%2f/{}",
                self.services.management_url, policy.name
            );
            let response = http.put(&url).json(&policy).send().await?;
            anyhow::ensure!(
                response.status().is_success(),
                "putting policy {}: {}",
                policy.name,
                response.text().await.unwrap_or_default()
            );
        }
        Ok(())
    }

    /// The scenario's task type, as the gateway and workers read it.
    pub fn spec(&self) -> anyhow::Result<conveyor_core::task_type::NamedTaskType> {
        load_task_types(&self.types_file)?
            .get(&self.task_type)
            .cloned()
            .context("the scenario's task type")
    }

    /// `kill -9` of the gateway, as a node dying under it.
    pub async fn kill_gateway(&mut self) {
        let _ = self.gateway.kill().await;
    }

    /// A new gateway process on the same address (its broker link through the same proxy).
    pub async fn restart_gateway(&mut self) -> anyhow::Result<()> {
        self.gateway = spawn_gateway(
            self.gateway_port,
            &self.gateway_admin,
            &self.types_file,
            &self.db_url,
            &amqp_url(&self.services, self.gateway_broker.as_ref()),
            &gateway_env(&self.task_type, &self.options),
            &self.logs,
        )?;
        self.wait_gateway_ready().await
    }

    async fn wait_gateway_ready(&self) -> anyhow::Result<()> {
        let http = reqwest::Client::new();
        for _ in 0..200 {
            let ready = http
                .get(format!("http://{}/readyz", self.gateway_admin))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        anyhow::bail!(
            "the gateway did not become ready; see {}",
            self.logs.display()
        )
    }

    pub fn start_workers(&mut self) -> anyhow::Result<()> {
        for i in 0..self.workers.len() {
            if self.workers[i].is_none() {
                self.restart_worker(i)?;
            }
        }
        Ok(())
    }

    /// Starts worker `i` (again: same name, so same degraded-mode buffer, like the next
    /// container of a pod).
    pub fn restart_worker(&mut self, i: usize) -> anyhow::Result<()> {
        let name = format!("chaos-w{i}");
        let broker = if i == 0 {
            self.worker_broker.as_ref()
        } else {
            None
        };
        let database_url = match &self.worker_database {
            Some(proxy) => testing::via_port(&self.db_url, DATABASE, proxy.port),
            None => self.db_url.clone(),
        };
        let child = Command::new(binary("conveyor-worker"))
            .arg("--task-types")
            .arg(&self.types_file)
            .args(["--consume", &self.task_type, "--handler", "http"])
            .args(["--http-url", &self.handler_url, "--worker-name", &name])
            .args(["--concurrency", &self.options.concurrency.to_string()])
            .args(["--metrics-listen", &self.metrics_listen[i]])
            .arg("--buffer-dir")
            .arg(self.logs.join("buffers"))
            .args(["--database-timeout-seconds", "2"])
            .env("CONVEYOR_DATABASE_URL", database_url)
            .env("CONVEYOR_AMQP_URL", amqp_url(&self.services, broker))
            // Short, so that a silent broker link is noticed within seconds.
            .env("CONVEYOR_AMQP_HEARTBEAT_SECONDS", "2")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log_file(&self.logs, &name)?)
            .stderr(log_file(&self.logs, &name)?)
            .kill_on_drop(true)
            .spawn()
            .context("start conveyor-worker")?;
        self.workers[i] = Some(child);
        Ok(())
    }

    /// Sends `signal` to worker `i`; SIGKILL also reaps it.
    pub async fn signal_worker(&mut self, i: usize, signal: Signal) {
        let Some(child) = self.workers[i].as_mut() else {
            return;
        };
        if let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok()) {
            let _ = kill(Pid::from_raw(pid), signal);
        }
        if signal == Signal::SIGKILL {
            let _ = child.wait().await;
            self.workers[i] = None;
        }
    }

    /// Stops worker `i` as a rolling update would (SIGTERM: it drains), and waits for it.
    pub async fn drain_worker(&mut self, i: usize) {
        self.signal_worker(i, Signal::SIGTERM).await;
        if let Some(child) = self.workers[i].as_mut() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait()).await;
        }
        self.workers[i] = None;
    }

    /// The gateway's process id (none once it has exited).
    pub fn gateway_pid(&self) -> Option<u32> {
        self.gateway.id()
    }

    /// The scenario's database, as the gateway and workers reach it.
    pub fn database_url(&self) -> String {
        self.db_url.clone()
    }

    /// Stops every worker as a scale-down would (SIGTERM: each drains), and waits for them.
    pub async fn drain_workers(&mut self) {
        for i in 0..self.workers.len() {
            self.signal_worker(i, Signal::SIGTERM).await;
        }
        for slot in &mut self.workers {
            if let Some(child) = slot.as_mut() {
                let _ =
                    tokio::time::timeout(std::time::Duration::from_secs(30), child.wait()).await;
            }
            *slot = None;
        }
    }

    /// The worker index of an audit-log owner (`chaos-w3-1a2b…` → 3).
    pub fn worker_of(owner: &str) -> Option<usize> {
        owner
            .strip_prefix("chaos-w")?
            .split('-')
            .next()?
            .parse()
            .ok()
    }

    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// The most tasks the workers can own at once: every slot of every worker.
    pub fn capacity(&self) -> usize {
        self.worker_count() * usize::from(self.options.concurrency)
    }

    /// The broker's management API.
    pub fn management_url(&self) -> &str {
        &self.services.management_url
    }

    /// The scenario's database as `user`.
    pub fn database_url_as(&self, user: &str, password: &str) -> anyhow::Result<String> {
        let mut url = url::Url::parse(&self.db_url)?;
        url.set_username(user)
            .and_then(|()| url.set_password(Some(password)))
            .map_err(|()| anyhow::anyhow!("the database URL takes no user"))?;
        Ok(url.into())
    }

    /// The running workers: index, process id and /metrics address.
    pub fn running_workers(&self) -> Vec<(usize, u32, &str)> {
        self.workers
            .iter()
            .enumerate()
            .filter_map(|(i, child)| {
                let pid = child.as_ref()?.id()?;
                Some((i, pid, self.metrics_listen[i].as_str()))
            })
            .collect()
    }

    /// Stops everything (SIGTERM, so workers drain) and drops the queues, and the database
    /// unless `keep_database` (a failed scenario keeps it for inspection).
    pub async fn stop(mut self, keep_database: bool) {
        for i in 0..self.workers.len() {
            self.signal_worker(i, Signal::SIGCONT).await;
            self.signal_worker(i, Signal::SIGTERM).await;
        }
        for child in self.workers.iter_mut().flatten() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait()).await;
        }
        let _ = self.gateway.kill().await;
        self.db.close().await;
        // Its queues, exchange and own policies (and the hostile namespace's).
        testing::delete_queues_in(&self.services, &self.task_type).await;
        if self.options.hostile_tenant {
            let hostile = crate::hostile::namespace(&self.task_type);
            testing::delete_queues_in(&self.services, &format!("{hostile}.{}", self.task_type))
                .await;
        }
        if keep_database {
            eprintln!("chaos: kept database {} for inspection", self.database);
        } else {
            testing::drop_database_in(&self.services, &self.database).await;
        }
    }
}

/// The gateway, with upkeep on the suite's time scale: probes every 2 s, seen-for 1 s.
fn spawn_gateway(
    port: u16,
    admin: &str,
    types_file: &Path,
    db_url: &str,
    amqp_url: &str,
    env: &[(String, String)],
    logs: &Path,
) -> anyhow::Result<Child> {
    Command::new(binary("conveyor-gateway"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", admin])
        .arg("--task-types")
        .arg(types_file)
        // An environment value, so that a scenario's `env` may add clients.
        .env("CONVEYOR_GATEWAY_TOKENS", format!("chaos={TOKEN}"))
        .env("CONVEYOR_DATABASE_URL", db_url)
        .env("CONVEYOR_AMQP_URL", amqp_url)
        .env("CONVEYOR_DEPTH_INTERVAL_MS", "200")
        .env("CONVEYOR_UPKEEP_INTERVAL_MS", "250")
        .env("CONVEYOR_PROBE_INTERVAL_MS", "2000")
        .env("CONVEYOR_PROBE_GRACE_MS", "1000")
        .env("CONVEYOR_CONFIRM_TIMEOUT_MS", "3000")
        .env("CONVEYOR_PARTITIONS_EVERY_SECONDS", "2")
        .env("RUST_LOG", "warn")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(log_file(logs, "gateway")?)
        .stderr(log_file(logs, "gateway")?)
        .kill_on_drop(true)
        .spawn()
        .context("start conveyor-gateway (run `cargo build --bins` first)")
}

/// The gateway's extra settings: the scenario's, and the hostile namespace's client.
fn gateway_env(task_type: &str, options: &Options) -> Vec<(String, String)> {
    let mut env = options.gateway_env.clone();
    if options.hostile_tenant {
        let hostile = crate::hostile::namespace(task_type);
        let clients: Vec<String> = (0..crate::hostile::LOOPS)
            .map(|c| format!("hostile{c}@{hostile}={}", crate::hostile::token(c)))
            .collect();
        env.push((
            "CONVEYOR_GATEWAY_TOKENS".to_owned(),
            format!("chaos={TOKEN},{}", clients.join(",")),
        ));
        // Namespace limits sized to this machine, as an operator sizes them to the replica's
        // capacity over its tenants: the defaults (40,000 tasks a second) are past what a
        // 2-core machine takes, and a namespace within them may take it all.
        for (name, value) in [
            ("CONVEYOR_NAMESPACE_RATE", "500"),
            ("CONVEYOR_NAMESPACE_BURST", "500"),
            ("CONVEYOR_NAMESPACE_REQUESTS_PER_SECOND", "200"),
        ] {
            env.push((name.to_owned(), value.to_owned()));
        }
    }
    env
}

/// The hostile namespace's type in the types file: the scenario's type's name, in its own
/// namespace.
fn hostile_type(task_type: &str, wanted: bool) -> String {
    if !wanted {
        return String::new();
    }
    let hostile = crate::hostile::namespace(task_type);
    format!(
        "  - name: {hostile}.{task_type}\n    tenant: {hostile}\n    maxRetries: 3\n    \
         timeoutSeconds: 30\n    heartbeatTimeoutSeconds: 3\n"
    )
}

/// The broker setting a process gets: through `proxy` where a scenario breaks its link.
fn amqp_url(services: &Services, proxy: Option<&Proxy>) -> String {
    match proxy {
        Some(proxy) => testing::via_port(&services.amqp_url, BROKER, proxy.port),
        None => services.amqp_url.clone(),
    }
}
