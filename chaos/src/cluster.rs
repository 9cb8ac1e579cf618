//! Scenarios through Kubernetes: the stack `scripts/stack.sh up` runs (operator, gateway,
//! pod runner) hosts a WorkerPool whose pods call the suite's sidecar, and the faults are a
//! pod deleted mid-task, the operator killed during a scale-up, a rolling update, the pool
//! scaled to zero after its node died, and RabbitMQ stopped under the operator, each under
//! load. The run loop, load generator and oracle are the other scenarios' own
//! (`run.rs`); this is the target and its faults.

use std::process::Command;
use std::time::{Duration, Instant};

use conveyor_core::testing::{self, wait_until};
use conveyor_e2e_tests::{kubectl_with, restart_operator, Stack};
use serde_json::json;

use crate::node_loss;
use crate::oracle;
use crate::scenarios::Scenario;

const POOL: &str = "chaos";
const REPLICAS: usize = 2;

/// The pool's workers: one per node where a node is lost.
fn replicas(scenario: Scenario) -> usize {
    match scenario {
        Scenario::NodeLoss => 3,
        _ => REPLICAS,
    }
}
const MINUTE: Duration = Duration::from_secs(60);
/// The scenario TaskType's `heartbeatTimeoutSeconds`.
const HEARTBEAT_TIMEOUT_SECONDS: u64 = 3;

/// A scenario's WorkerPool and TaskType in a namespace of their own.
pub struct ClusterTarget {
    pub stack: Stack,
    /// The TaskType's name in the scenario's namespace.
    pub name: String,
    /// What its queues and rows are keyed by (`<namespace>.<name>`).
    pub task_type: String,
    /// Keeps the handler the pods call alive as long as the target.
    pub sidecar_url: String,
}

impl ClusterTarget {
    /// Applies the scenario's TaskType and a WorkerPool whose pods call `sidecar_url`, and
    /// waits until its workers consume and the gateway knows the type.
    pub async fn start(scenario: Scenario, sidecar_url: &str) -> anyhow::Result<ClusterTarget> {
        let reachable = Command::new("kubectl")
            .args(["get", "--raw", "/readyz"])
            .output()
            .is_ok_and(|out| out.status.success());
        anyhow::ensure!(
            reachable,
            "{} needs the local cluster: `make chaos` starts it (or `scripts/stack.sh up`, with \
             KUBECONFIG and kubectl from `scripts/stack.sh env`)",
            scenario.name()
        );
        let mut stack = Stack::namespace(&format!("chaos-{}", scenario.name())).await;
        let name = stack.task_type("chaos-cluster");
        stack.apply(&format!(
            "apiVersion: conveyor.dev/v1alpha1\nkind: TaskType\nmetadata: {{name: {name}}}\n\
             spec:\n  maxRetries: 3\n  heartbeatTimeoutSeconds: {HEARTBEAT_TIMEOUT_SECONDS}\n  \
             backoff: {{initialSeconds: 0.2, maxSeconds: 1, multiplier: 2}}\n  \
             schema: {{type: object, properties: {{sleepMs: {{type: integer}}}}}}\n"
        ));
        stack.apply(&format!(
            "apiVersion: conveyor.dev/v1alpha1\nkind: WorkerPool\nmetadata: {{name: {POOL}}}\n\
             spec:\n  taskTypes: [{name}]\n  image: conveyor:dev\n  \
             handler: {{type: http, url: \"{sidecar_url}\"}}\n  replicas: {}\n  concurrency: 8\n  \
             drainGraceSeconds: 20\n",
            replicas(scenario)
        ));
        stack
            .wait_for_workers(&name, replicas(scenario) as u64)
            .await;
        wait_for_gateway(&stack, &name).await;
        Ok(ClusterTarget {
            task_type: stack.key(&name),
            name,
            stack,
            sidecar_url: sidecar_url.to_owned(),
        })
    }

    /// Injects the fault through Kubernetes; returns when it healed, with what went wrong.
    pub async fn inject(
        &self,
        scenario: Scenario,
        notes: &mut Vec<String>,
    ) -> (Instant, Vec<String>) {
        inject(scenario, &self.stack, &self.task_type, notes).await
    }

    pub async fn finish(self) {
        self.stack.finish().await;
    }
}

/// The gateway lists new TaskTypes every few seconds: wait until it validates against this
/// one's schema (400) rather than not knowing it (404).
async fn wait_for_gateway(stack: &Stack, task_type: &str) {
    let http = testing::http_client();
    wait_until("the gateway knows the task type", MINUTE, || async {
        let answer = http
            .post(format!("{}/v1/tasks", stack.gateway))
            .bearer_auth(&stack.token)
            .json(&json!({"taskType": task_type, "namespace": stack.namespace,
                "payload": {"sleepMs": "soon"}}))
            .send()
            .await;
        answer.is_ok_and(|a| a.status() == reqwest::StatusCode::BAD_REQUEST)
    })
    .await;
}

/// Injects the fault through Kubernetes; returns when it healed (the last pod deleted, the
/// operator back, the rollout or the pool's return applied), with what went wrong.
async fn inject(
    scenario: Scenario,
    stack: &Stack,
    task_type: &str,
    notes: &mut Vec<String>,
) -> (Instant, Vec<String>) {
    let mut failures = Vec::new();
    let ns = stack.namespace.as_str();
    let healed = match scenario {
        Scenario::PodDelete => {
            // A pod running a task, deleted as an eviction would (its worker drains); then
            // twice as if its node died: the worker killed at once, the pod deleted.
            let mut healed = Instant::now();
            for node_dies in [false, true, true] {
                let Some(pod) = busy_pod(stack, task_type).await else {
                    failures.push("no pod was running a task to delete".to_owned());
                    continue;
                };
                if node_dies {
                    kill_workers(&format!("/pods/{ns}/{pod}/"));
                }
                let deleted =
                    kubectl_with(&["-n", ns, "delete", "pod", &pod, "--wait=false"], None);
                if let Err(err) = deleted {
                    failures.push(format!("kubectl delete pod {pod}: {}", err.trim()));
                }
                healed = Instant::now();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            healed
        }
        Scenario::OperatorRestart => {
            stack.kubectl(&["scale", &format!("workerpool/{POOL}"), "--replicas=4"]);
            restart_operator();
            let healed = Instant::now();
            let grown = tokio::time::timeout(2 * MINUTE, async {
                while stack.running_pods(POOL).await.len() != 4 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            })
            .await;
            if grown.is_err() {
                failures.push("the restarted operator did not finish the scale-up".to_owned());
            }
            healed
        }
        Scenario::RollingUpdate => {
            let before: Vec<String> = pod_names(stack).await;
            stack.kubectl(&[
                "patch",
                "workerpool",
                POOL,
                "--type=merge",
                "-p",
                r#"{"spec":{"concurrency":6}}"#,
            ]);
            let rolled = tokio::time::timeout(2 * MINUTE, async {
                loop {
                    let now = pod_names(stack).await;
                    if now.len() == REPLICAS && now.iter().all(|p| !before.contains(p)) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            })
            .await;
            if rolled.is_err() {
                failures.push("the rollout did not finish".to_owned());
            }
            Instant::now()
        }
        Scenario::PoolScaledToZero => {
            pool_scaled_to_zero(stack, task_type, &mut failures).await;
            Instant::now()
        }
        Scenario::BrokerStoppedCluster => broker_stopped(stack, &mut failures).await,
        Scenario::NodeLoss => {
            let replicas = replicas(scenario);
            node_loss::inject(stack, POOL, replicas, task_type, &mut failures, notes).await
        }
        _ => {
            failures.push(format!("{} is not a cluster scenario", scenario.name()));
            Instant::now()
        }
    };
    (healed, failures)
}

/// The node dies with every pod of the pool on it, and the pool is scaled to zero before
/// anything replaces them. No worker of the type runs anywhere, so only the gateway's reaper
/// can move the dead workers' tasks on (invariant 8, `docs/invariants.md`); the pool comes
/// back afterwards.
async fn pool_scaled_to_zero(stack: &Stack, task_type: &str, failures: &mut Vec<String>) {
    if busy_pod(stack, task_type).await.is_none() {
        failures.push("no pod was running a task when the node died".to_owned());
    }
    kill_workers(&format!("/pods/{}/", stack.namespace));
    stack.kubectl(&["scale", &format!("workerpool/{POOL}"), "--replicas=0"]);
    let owned = || oracle::count_in(&stack.db, task_type, &["CLAIMED", "PROCESSING"]);
    let orphaned = owned().await;
    let emptied = tokio::time::timeout(MINUTE, async {
        while !stack.running_pods(POOL).await.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    if emptied.is_err() {
        failures.push("the pool did not reach zero pods".to_owned());
    }
    if orphaned == 0 {
        failures.push("no task was owned by the dead workers".to_owned());
    }
    // At least two heartbeat timeouts with the pool at zero, and then until the reaper has
    // handed every orphan back to the queue (or a minute has passed).
    let timeouts = Duration::from_secs(2 * HEARTBEAT_TIMEOUT_SECONDS);
    let zero_since = Instant::now();
    let mut left = orphaned;
    while zero_since.elapsed() < MINUTE {
        left = owned().await;
        if left == 0 && zero_since.elapsed() >= timeouts {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let pods = stack.running_pods(POOL).await.len();
    eprintln!("chaos: pool-scaled-to-zero: {orphaned} tasks orphaned, {left} still owned with {pods} pods");
    if pods != 0 {
        failures.push(format!("{pods} pods ran while the pool was at zero"));
    }
    if left > 0 {
        failures.push(format!(
            "{left} tasks still owned by dead workers with the pool at zero"
        ));
    }
    stack.kubectl(&[
        "scale",
        &format!("workerpool/{POOL}"),
        &format!("--replicas={REPLICAS}"),
    ]);
}

/// An autoscaled pool (2 to 3 workers) while RabbitMQ is stopped: the operator says so on
/// the TaskType and the pool, holds the pool within its bounds, reading nothing as zero,
/// and applies a minReplicas raised meanwhile; once the broker is back, both are Ready and
/// read their queues again.
async fn broker_stopped(stack: &Stack, failures: &mut Vec<String>) -> Instant {
    stack.kubectl(&[
        "patch",
        "workerpool",
        POOL,
        "--type=merge",
        "-p",
        r#"{"spec":{"replicas":null,"autoscaling":{"minReplicas":2,"maxReplicas":3,"targetBacklogPerReplica":1000}}}"#,
    ]);
    let type_name = stack
        .kubectl(&[
            "get",
            "tasktypes",
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ])
        .trim()
        .to_owned();
    let condition = |kind: &str, name: &str, condition: &str| {
        stack.kubectl(&[
            "get",
            kind,
            name,
            "-o",
            &format!(
                "jsonpath={{.status.conditions[?(@.type==\"{condition}\")].status}}/{{.status.conditions[?(@.type==\"{condition}\")].reason}}"
            ),
        ])
    };
    if let Err(e) = crate::faults::as_root("rabbitmqctl -q shutdown") {
        failures.push(format!("rabbitmqctl shutdown failed: {e:#}"));
    }
    // Up to two minutes for the operator to notice (its statistics go stale after 30 s,
    // a TaskType looks again every 15 s), checking the pool's bounds all along.
    let mut seen_type = false;
    let mut seen_pool = false;
    let until = Instant::now() + 2 * MINUTE;
    while Instant::now() < until && !(seen_type && seen_pool) {
        seen_type |= condition("tasktype", &type_name, "Ready") == "False/RabbitMQUnavailable";
        seen_pool |= condition("workerpool", POOL, "MetricsAvailable").starts_with("False/");
        if let Some(replicas) = stack.deployment_replicas(POOL).await {
            if !(2..=3).contains(&replicas) {
                failures.push(format!(
                    "the pool ran {replicas} workers without statistics (bounds 2 to 3)"
                ));
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    if !seen_type {
        failures.push(format!(
            "the TaskType never reported RabbitMQ down: {}",
            condition("tasktype", &type_name, "Ready")
        ));
    }
    if !seen_pool {
        failures.push(format!(
            "the pool never reported its statistics missing: {}",
            condition("workerpool", POOL, "MetricsAvailable")
        ));
    }
    // An edited minReplicas applies while the statistics are missing: the pool goes to 3.
    stack.kubectl(&[
        "patch",
        "workerpool",
        POOL,
        "--type=merge",
        "-p",
        r#"{"spec":{"autoscaling":{"minReplicas":3,"maxReplicas":4}}}"#,
    ]);
    let raised = tokio::time::timeout(MINUTE, async {
        while stack.deployment_replicas(POOL).await != Some(3) {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    if raised.is_err() {
        failures.push(format!(
            "minReplicas 3 did not apply without statistics: the Deployment has {:?}",
            stack.deployment_replicas(POOL).await
        ));
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/services.sh");
    if !Command::new(&script)
        .arg("up")
        .status()
        .is_ok_and(|s| s.success())
    {
        failures.push("scripts/services.sh up did not bring RabbitMQ back".to_owned());
    }
    let healed = Instant::now();
    let recovered = tokio::time::timeout(2 * MINUTE, async {
        while condition("tasktype", &type_name, "Ready") != "True/QueuesDeclared"
            || !condition("workerpool", POOL, "MetricsAvailable").starts_with("True/")
        {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
    .await;
    if recovered.is_err() {
        failures.push(format!(
            "not recovered 2 minutes after RabbitMQ came back: TaskType {}, pool {}",
            condition("tasktype", &type_name, "Ready"),
            condition("workerpool", POOL, "MetricsAvailable")
        ));
    }
    healed
}

/// Kills at once every worker whose command line matches `pattern` (the pod runner starts
/// each pod's worker with its own volume paths, `/pods/<namespace>/<pod>/`).
fn kill_workers(pattern: &str) {
    let _ = Command::new("pkill")
        .args(["-KILL", "-f", pattern])
        .status();
}

async fn pod_names(stack: &Stack) -> Vec<String> {
    stack
        .running_pods(POOL)
        .await
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect()
}

/// The pod whose worker owns a PROCESSING task (worker ids are `<pod>-<suffix>`).
async fn busy_pod(stack: &Stack, task_type: &str) -> Option<String> {
    let pods = pod_names(stack).await;
    // Up to 20 s: a busy machine is slow to show the first PROCESSING row.
    for _ in 0..200 {
        let owners = oracle::processing_owners(&stack.db, task_type).await;
        let busy = owners.into_iter().find_map(|owner| {
            pods.iter()
                .find(|pod| owner.starts_with(&format!("{pod}-")))
                .cloned()
        });
        if busy.is_some() {
            return busy;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}
