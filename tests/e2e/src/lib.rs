//! The e2e suite's view of a running stack (`scripts/stack.sh up`, or kind with
//! `make e2e-kind`): kubectl and the API server, the gateway, PostgreSQL and RabbitMQ's
//! management API. Each test works in a namespace of its own with task types of its own, so
//! tests run side by side and next to `make dev`'s examples.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use conveyor_core::config::{DEV_AMQP_URL, DEV_DATABASE_URL};
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::task::TaskEvent;
use conveyor_core::testing::{self, wait_until};
use conveyor_core::TaskState;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::{json, Value};
use uuid::Uuid;

pub use conveyor_core::testing::{assert_valid_chain, unique_type};

pub mod audit;
pub mod helm;
pub mod real_node;

/// The stack's addresses; `scripts/stack.sh` and the Makefile provide these defaults.
fn env_or(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// Runs kubectl (from PATH, against $KUBECONFIG) and returns stdout; panics with its stderr
/// when it fails.
pub fn kubectl(args: &[&str]) -> String {
    kubectl_with(args, None).unwrap_or_else(|err| panic!("kubectl {}: {err}", args.join(" ")))
}

/// Runs kubectl with `stdin`; Err holds stderr when it fails.
pub fn kubectl_with(args: &[&str], stdin: Option<&str>) -> Result<String, String> {
    let mut child = Command::new("kubectl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl on PATH (make test puts the control plane's there)");
    let mut input = child.stdin.take().expect("stdin");
    input
        .write_all(stdin.unwrap_or_default().as_bytes())
        .expect("write kubectl stdin");
    drop(input);
    let out = child.wait_with_output().expect("kubectl runs");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// One test's namespace, with the connection Secret the operator gives its workers.
pub struct Stack {
    pub namespace: String,
    pub client: kube::Client,
    pub db: Db,
    http: reqwest::Client,
    /// The gateway's URL and a token it accepts.
    pub gateway: String,
    pub token: String,
    management: String,
    task_types: Vec<String>,
    /// The admin URLs this test reaches the services with.
    database_url: String,
    amqp_url: String,
    /// The namespace's Secret holds credentials `conveyorctl grant` made.
    granted: bool,
}

impl Stack {
    /// Connects to the running stack and creates a fresh namespace.
    pub async fn namespace(prefix: &str) -> Stack {
        let client = kube::Client::try_default()
            .await
            .expect("a cluster (KUBECONFIG); `scripts/stack.sh up` starts one");
        let namespace = unique_type(&format!("e2e-{prefix}"));
        kubectl(&["create", "namespace", &namespace]);
        let database_url = env_or("CONVEYOR_DATABASE_URL", DEV_DATABASE_URL);
        // What the workers' pods get through secretKeyRef. In the local cluster the pods are
        // processes on this machine and the test's own addresses are right; on kind they
        // are the in-cluster services (CONVEYOR_WORKER_*).
        let worker_database_url = env_or("CONVEYOR_WORKER_DATABASE_URL", &database_url);
        let amqp_url = env_or("CONVEYOR_AMQP_URL", DEV_AMQP_URL);
        let worker_amqp_url = env_or("CONVEYOR_WORKER_AMQP_URL", &amqp_url);
        kubectl(&[
            "-n",
            &namespace,
            "create",
            "secret",
            "generic",
            "conveyor-connections",
            &format!("--from-literal=database-url={worker_database_url}"),
            &format!("--from-literal=amqp-url={worker_amqp_url}"),
        ]);
        let db = Db::connect(&DbOptions::new(&database_url)).expect("database URL");
        Stack {
            namespace,
            client,
            db,
            // The local stack's gateway serves HTTPS with the dev CA's certificate.
            http: testing::http_client(),
            gateway: env_or("CONVEYOR_GATEWAY_URL", "https://127.0.0.1:8080"),
            token: env_or("CONVEYOR_TOKEN", "dev-token-change-me"),
            management: testing::management_url(),
            task_types: Vec::new(),
            database_url,
            amqp_url,
            granted: false,
        }
    }

    /// Replaces the namespace's connection Secret with the least-privilege credentials
    /// `conveyorctl grant` makes for it (decision 0013), withdrawn at `finish`. `false`
    /// where the pods reach the services by other addresses than this test (kind).
    pub fn use_granted_credentials(&mut self) -> bool {
        if on_kind() {
            return false;
        }
        let secret = self.conveyorctl(&["-n", &self.namespace, "grant"]);
        kubectl_with(&["apply", "-f", "-"], Some(&secret))
            .unwrap_or_else(|err| panic!("applying the granted Secret: {err}"));
        self.granted = true;
        true
    }

    /// Runs `conveyorctl` with this test's admin URLs; returns what it printed.
    fn conveyorctl(&self, args: &[&str]) -> String {
        conveyorctl(&self.database_url, &self.amqp_url, args)
    }

    /// A TaskType name for this test (its queues are deleted at `finish`). The stack's
    /// helpers take this name; the queues and rows are keyed by [`Stack::key`].
    pub fn task_type(&mut self, prefix: &str) -> String {
        let name = unique_type(prefix);
        self.task_types.push(name.clone());
        name
    }

    /// A TaskType name another stack made, used in this namespace too (its queues here are
    /// deleted at `finish`).
    pub fn share_task_type(&mut self, name: &str) {
        self.task_types.push(name.to_owned());
    }

    /// What this namespace's TaskType `task_type` keys its queues and rows by.
    pub fn key(&self, task_type: &str) -> String {
        format!("{}.{task_type}", self.namespace)
    }

    /// The work queue of this namespace's TaskType `task_type` (`suffix` such as `.retry`).
    pub fn queue_of(&self, task_type: &str, suffix: &str) -> String {
        format!("conveyor.{}{suffix}", self.key(task_type))
    }

    /// `kubectl apply` of `yaml` in this namespace.
    pub fn apply(&self, yaml: &str) {
        kubectl_with(&["apply", "-n", &self.namespace, "-f", "-"], Some(yaml))
            .unwrap_or_else(|err| panic!("kubectl apply:\n{yaml}\n{err}"));
    }

    /// kubectl in this namespace.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let mut all = vec!["-n", &self.namespace];
        all.extend_from_slice(args);
        kubectl(&all)
    }

    pub fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Every pod of the pool, deleted or not, whatever its phase.
    pub async fn pool_pods(&self, pool: &str) -> kube::Result<Vec<Pod>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let selector = format!("conveyor.dev/pool={pool}");
        Ok(pods
            .list(&ListParams::default().labels(&selector))
            .await?
            .items)
    }

    /// The pool's pods kwok reports Running (the pod runner runs a worker for each).
    pub async fn running_pods(&self, pool: &str) -> Vec<Pod> {
        self.pool_pods(pool)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|p| {
                p.metadata.deletion_timestamp.is_none()
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
            .collect()
    }

    /// The Deployment's desired replicas (None while it does not exist).
    pub async fn deployment_replicas(&self, pool: &str) -> Option<i32> {
        let deployment = self
            .deployments()
            .get_opt(&format!("{pool}-worker"))
            .await
            .ok()??;
        deployment.spec.and_then(|s| s.replicas)
    }

    /// Submits every payload through the gateway with its own idempotency key. Refusals
    /// (a type the gateway has not listed yet, a full queue) are retried with the same
    /// key, as a client would: no task is created twice.
    pub async fn submit_all(&self, task_type: &str, payloads: Vec<Value>) -> Vec<Uuid> {
        let mut pending: Vec<(Uuid, Value)> =
            payloads.into_iter().map(|p| (Uuid::new_v4(), p)).collect();
        let mut ids = Vec::new();
        let mut last_refusal = Value::Null;
        for _round in 0..120 {
            let mut refused = Vec::new();
            for chunk in pending.chunks(1000) {
                let tasks: Vec<Value> = chunk
                    .iter()
                    .map(|(key, payload)| {
                        json!({"taskType": task_type, "namespace": self.namespace,
                        "payload": payload, "idempotencyKey": key})
                    })
                    .collect();
                let answer: Value = self
                    .http
                    .post(format!("{}/v1/tasks:batch", self.gateway))
                    .bearer_auth(&self.token)
                    .json(&json!({ "tasks": tasks }))
                    .send()
                    .await
                    .expect("gateway reachable")
                    .json()
                    .await
                    .expect("batch answer is JSON");
                let results = answer["results"].as_array().cloned().unwrap_or_default();
                assert_eq!(results.len(), chunk.len(), "one answer per task: {answer}");
                for (result, task) in results.iter().zip(chunk) {
                    match result["id"].as_str() {
                        Some(id) => ids.push(id.parse().expect("task id")),
                        None => {
                            last_refusal = result.clone();
                            refused.push(task.clone());
                        }
                    }
                }
            }
            if refused.is_empty() {
                return ids;
            }
            pending = refused;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!(
            "the gateway kept refusing {} {task_type} tasks; the last refusal: {last_refusal}",
            pending.len()
        );
    }

    /// The task as the gateway answers `GET /v1/tasks/{id}`, once it is COMPLETED or
    /// DEAD_LETTER (panics when it is not within `timeout`).
    pub async fn task_when_settled(&self, id: Uuid, timeout: Duration) -> Value {
        let answer = std::cell::RefCell::new(Value::Null);
        wait_until(&format!("task {id} settled"), timeout, || async {
            let now: Value = self
                .http
                .get(format!("{}/v1/tasks/{id}", self.gateway))
                .bearer_auth(&self.token)
                .send()
                .await
                .expect("gateway reachable")
                .json()
                .await
                .expect("a task is JSON");
            let settled = matches!(now["state"].as_str(), Some("COMPLETED" | "DEAD_LETTER"));
            *answer.borrow_mut() = now;
            settled
        })
        .await;
        answer.into_inner()
    }

    /// How many workers hold a task of `task_type` in PROCESSING now.
    pub async fn busy_workers(&self, task_type: &str) -> usize {
        sqlx::query_scalar::<_, String>(
            "SELECT DISTINCT owner FROM tasks WHERE task_type = $1 AND state = 'PROCESSING'",
        )
        .bind(self.key(task_type))
        .fetch_all(self.db.pool())
        .await
        .expect("busy workers")
        .len()
    }

    /// How many tasks of `task_type` are in `state`.
    pub async fn count(&self, task_type: &str, state: TaskState) -> i64 {
        testing::count_in_state(&self.db, &self.key(task_type), state).await
    }

    pub async fn wait_for_state(
        &self,
        task_type: &str,
        state: TaskState,
        n: i64,
        timeout: Duration,
    ) {
        testing::wait_for_state(&self.db, &self.key(task_type), state, n, timeout).await;
    }

    pub async fn events(&self, id: Uuid) -> Vec<TaskEvent> {
        self.db.events(id).await.expect("events")
    }

    /// Tasks of `task_type` that were claimed more than once (re-runs), with their claims.
    pub async fn reruns(&self, task_type: &str) -> BTreeMap<Uuid, i64> {
        sqlx::query_as::<_, (Uuid, i64)>(
            "SELECT task_id, count(*) FROM task_events \
             WHERE task_type = $1 AND to_state = 'CLAIMED' GROUP BY task_id HAVING count(*) > 1",
        )
        .bind(self.key(task_type))
        .fetch_all(self.db.pool())
        .await
        .expect("claim counts")
        .into_iter()
        .collect()
    }

    /// COMPLETED events per task of `task_type` (exactly-once means all of them are 1).
    pub async fn completions(&self, task_type: &str) -> BTreeMap<Uuid, i64> {
        sqlx::query_as::<_, (Uuid, i64)>(
            "SELECT task_id, count(*) FROM task_events \
             WHERE task_type = $1 AND to_state = 'COMPLETED' GROUP BY task_id",
        )
        .bind(self.key(task_type))
        .fetch_all(self.db.pool())
        .await
        .expect("completion counts")
        .into_iter()
        .collect()
    }

    /// A queue as RabbitMQ's management API shows it (None when it does not exist).
    pub async fn queue(&self, queue: &str) -> Option<Value> {
        let (base, user, password) = split_credentials(&self.management);
        let response = self
            .http
            .get(format!("{base}/api/queues/%2f/{queue}"))
            .basic_auth(user, Some(password))
            .send()
            .await
            .expect("management API reachable");
        if response.status() == reqwest::StatusCode::NOT_FOUND {
            return None;
        }
        Some(response.json().await.expect("queue JSON"))
    }

    /// Consumers on a queue: one per running worker process.
    pub async fn consumers(&self, queue: &str) -> u64 {
        self.queue(queue)
            .await
            .and_then(|q| q["consumers"].as_u64())
            .unwrap_or(0)
    }

    /// Waits until `n` workers consume `task_type`'s queue; on a timeout, says what the
    /// namespace's pods and the nodes looked like (a node under DiskPressure, an image that
    /// could not be found), since the test's own message cannot.
    pub async fn wait_for_workers(&self, task_type: &str, n: u64) {
        let queue = self.queue_of(task_type, "");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while self.consumers(&queue).await != n {
            if std::time::Instant::now() >= deadline {
                panic!(
                    "timed out after 60s waiting for: {n} workers on {queue}\n{}",
                    self.picture()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The namespace's pods and events and the nodes' pressure conditions, for a failure
    /// message.
    pub fn picture(&self) -> String {
        let show = |args: &[&str]| kubectl_with(args, None).unwrap_or_else(|err| err);
        let ns = self.namespace.as_str();
        format!(
            "pods:\n{}\nevents:\n{}\nnodes:\n{}",
            show(&["-n", ns, "get", "pods", "-o", "wide"]),
            show(&["-n", ns, "get", "events", "--sort-by=.lastTimestamp"]),
            show(&[
                "get",
                "nodes",
                "-o",
                "custom-columns=NAME:.metadata.name,CONDITIONS:.status.conditions[?(@.status==\"True\")].type,TAINTS:.spec.taints[*].key",
            ]),
        )
    }

    /// Deletes the namespace (and with it everything the test applied) and the queues.
    pub async fn finish(self) {
        // The TaskTypes go first, and are gone, before their queues: while a type exists the
        // operator declares its missing queues again, and every test left four queues
        // behind (over weeks, thousands that slowed the broker for every later run).
        let _ = kubectl_with(
            &[
                "-n",
                &self.namespace,
                "delete",
                "tasktypes",
                "--all",
                "--timeout=60s",
            ],
            None,
        );
        let _ = kubectl_with(
            &["delete", "namespace", &self.namespace, "--wait=false"],
            None,
        );
        for task_type in &self.task_types {
            testing::delete_queues(&self.key(task_type)).await;
        }
        if self.granted {
            self.conveyorctl(&["-n", &self.namespace, "revoke"]);
        }
    }
}

pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The pid of the operator `scripts/stack.sh` runs; `None` on kind (or when it is not
/// running here).
fn stack_operator_pid() -> Option<String> {
    if on_kind() {
        // The stack may run beside kind (`make test` runs both): its operator is not kind's.
        return None;
    }
    let pid = std::fs::read_to_string(repo_root().join(".dev/operator.pid")).ok()?;
    let alive = std::process::Command::new("kill")
        .args(["-0", pid.trim()])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    alive.then(|| pid.trim().to_owned())
}

/// A local pod's processes stopped (SIGSTOP): the worker answers no probe and no request,
/// as a wedged one would. They run again (SIGCONT) on [`PausedPod::resume`] or when this is
/// dropped, so a failed test leaves nothing stopped.
pub struct PausedPod {
    pod: String,
    pids: Vec<String>,
}

impl PausedPod {
    /// Stops the processes the local pod runner runs for `pod` (found by the `POD_NAME` a
    /// kubelet would give them). Local cluster only: panics when none is found (a kind
    /// pod runs in a container this test cannot signal).
    pub fn pause(pod: &str) -> PausedPod {
        let wanted = format!("POD_NAME={pod}\0");
        let pids: Vec<String> = std::fs::read_dir("/proc")
            .expect("/proc")
            .filter_map(|entry| {
                let name = entry.ok()?.file_name().into_string().ok()?;
                name.parse::<u32>().ok()?;
                let environ = std::fs::read(format!("/proc/{name}/environ")).ok()?;
                environ
                    .windows(wanted.len())
                    .any(|w| w == wanted.as_bytes())
                    .then_some(name)
            })
            .collect();
        assert!(!pids.is_empty(), "no local process runs pod {pod}");
        let paused = PausedPod {
            pod: pod.to_owned(),
            pids,
        };
        assert!(
            paused.signal("STOP"),
            "kill -STOP {:?} ({pod})",
            paused.pids
        );
        paused
    }

    /// Lets the processes run again (dropping does the same).
    pub fn resume(self) {}

    fn signal(&self, signal: &str) -> bool {
        std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .args(&self.pids)
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for PausedPod {
    fn drop(&mut self) {
        // Not asserted: this may run while a failed test unwinds.
        if !self.signal("CONT") {
            eprintln!("could not resume pod {} ({:?})", self.pod, self.pids);
        }
    }
}

/// Runs `conveyorctl` as the administrator of `database_url` and `amqp_url` (the dev CA
/// trusted); returns what it printed, or fails the test with what it said.
pub fn conveyorctl(database_url: &str, amqp_url: &str, args: &[&str]) -> String {
    conveyorctl_at(
        &testing::binary("conveyorctl"),
        database_url,
        amqp_url,
        args,
    )
}

/// [`conveyorctl`] of another build (a previous release's), at `binary`.
pub fn conveyorctl_at(
    binary: &std::path::Path,
    database_url: &str,
    amqp_url: &str,
    args: &[&str],
) -> String {
    let output = Command::new(binary)
        .args(args)
        .env("CONVEYOR_DATABASE_URL", database_url)
        .env("CONVEYOR_AMQP_URL", amqp_url)
        .env("CONVEYOR_CA_FILE", testing::DEV_CA)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", binary.display()));
    assert!(
        output.status.success(),
        "{} {args:?}: {}",
        binary.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Whether the suite runs on kind (`make e2e-kind`), whose pods reach the services by other
/// addresses than this test, rather than on the local cluster of `scripts/stack.sh`.
pub fn on_kind() -> bool {
    std::env::var_os("CONVEYOR_WORKER_DATABASE_URL").is_some()
}

/// Kills the stack's operator with -9 and waits until it is gone; false on kind.
pub fn kill_operator() -> bool {
    let Some(pid) = stack_operator_pid() else {
        return false;
    };
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .expect("kill runs");
    assert!(killed.success(), "kill -9 of the operator");
    for _ in 0..100 {
        if stack_operator_pid().is_none() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    true
}

/// Who holds the operator's lease now (its `holderIdentity`); Err holds kubectl's stderr.
pub fn lease_holder() -> Result<String, String> {
    kubectl_with(
        &[
            "-n",
            "conveyor-system",
            "get",
            "lease",
            "conveyor-operator",
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ],
        None,
    )
}

/// Starts the stack's operator again (a no-op while it runs).
pub fn start_operator() {
    // On kind, `scripts/stack.sh up` would start this machine's services where the suite
    // runs (in kind's network namespace on these machines), out of the host's reach.
    assert!(
        !on_kind(),
        "a story that starts the local stack's operator cannot run on kind"
    );
    let started = std::process::Command::new(repo_root().join("scripts/stack.sh"))
        .arg("up")
        .status()
        .expect("stack.sh runs");
    assert!(
        started.success(),
        "scripts/stack.sh up restarts the operator"
    );
}

/// Tests that stop or start operators hold this, so that one test's restart does not
/// take the lease in another's story.
pub async fn operators_to_myself() -> tokio::sync::MutexGuard<'static, ()> {
    static OPERATORS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    OPERATORS.lock().await
}

/// Kills the operator at once (kill -9 of the local process; on kind, its pod) and has it
/// started again (scripts/stack.sh here, the Deployment on kind).
pub fn restart_operator() {
    if !on_kind() {
        kill_operator();
        start_operator();
        return;
    }
    kubectl_with(
        &[
            "-n",
            "conveyor-system",
            "delete",
            "pod",
            "-l",
            "app.kubernetes.io/name=conveyor-operator",
            "--wait=false",
        ],
        None,
    )
    .expect("delete the operator pod");
}

/// The key `scripts/stack.sh` gave its operator for the workers' admin tokens (empty when
/// there is none). Every operator of the cluster needs the same one: with another, it would
/// rewrite every pool's token and roll its pods.
pub fn stack_admin_key() -> String {
    std::fs::read_to_string(repo_root().join(".dev/admin-key"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// A second operator beside the stack's, with identity `identity`, its admin routes on
/// `listen`, and `env` added (libfaketime's, say): the same binary, credentials, admin key
/// and lease settings as `scripts/stack.sh` gives the first.
pub fn standby_operator(identity: &str, listen: &str, env: &[(&str, &str)]) -> std::process::Child {
    let kubeconfig = repo_root().join(".dev/cluster/conveyor-operator.kubeconfig");
    let mut all = vec![("POD_NAMESPACE", "conveyor-system")];
    all.extend_from_slice(env);
    operator_process(identity, listen, &kubeconfig, &all)
}

/// An operator process as [`standby_operator`]'s, acting as the account of `kubeconfig`
/// (`env` may set its POD_NAMESPACE, the lease's).
pub fn operator_process(
    identity: &str,
    listen: &str,
    kubeconfig: &std::path::Path,
    env: &[(&str, &str)],
) -> std::process::Child {
    let root = repo_root();
    let tls = "/etc/conveyor/dev-tls";
    let mut command = std::process::Command::new(root.join("target/debug/conveyor-operator"));
    command
        .env("CONVEYOR_CA_FILE", format!("{tls}/ca.crt"))
        .env("CONVEYOR_AMQP_URL", testing::amqp_url())
        .env("CONVEYOR_ADMIN_KEY", stack_admin_key())
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAME", identity)
        .env("CONVEYOR_OPERATOR_LISTEN", listen)
        .env("CONVEYOR_LEASE_SECONDS", "5")
        .envs(env.iter().copied());
    let log = std::fs::File::create(root.join(format!(".dev/operator-{identity}.log")))
        .expect("log file");
    command
        .arg("run")
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log)
        .spawn()
        .expect("start a conveyor-operator")
}

/// A kubeconfig acting as ServiceAccount `account` of `namespace`, as `scripts/stack.sh`
/// makes for its own processes (the admin token impersonates it): its RBAC is the account's.
pub fn kubeconfig_as(namespace: &str, account: &str) -> std::path::PathBuf {
    let dir = repo_root().join(".dev/cluster");
    let stack = std::fs::read_to_string(dir.join("conveyor-operator.kubeconfig"))
        .expect("scripts/stack.sh wrote the operator's kubeconfig");
    let this = stack.replace(
        "system:serviceaccount:conveyor-system:conveyor-operator",
        &format!("system:serviceaccount:{namespace}:{account}"),
    );
    assert_ne!(
        this, stack,
        "the stack's kubeconfig impersonates its operator"
    );
    let path = dir.join(format!("{namespace}-{account}.kubeconfig"));
    std::fs::write(&path, this).expect("write a kubeconfig");
    path
}

/// `http://user:password@host:port` → (`http://host:port`, user, password).
fn split_credentials(url: &str) -> (String, String, String) {
    let (scheme, rest) = url.split_once("://").unwrap_or(("http", url));
    match rest.split_once('@') {
        Some((auth, host)) => {
            let (user, password) = auth.split_once(':').unwrap_or((auth, ""));
            (
                format!("{scheme}://{host}"),
                user.to_owned(),
                password.to_owned(),
            )
        }
        None => (url.to_owned(), "guest".to_owned(), "guest".to_owned()),
    }
}
