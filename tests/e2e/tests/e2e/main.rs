//! End to end, against a real kube-apiserver: what users do with kubectl, and what they must
//! see. Needs the stack `scripts/stack.sh up` runs (make test starts it).

#![allow(clippy::unwrap_used)]

mod at_rest;
mod chart;
mod containers;
mod external_scalers;
mod kind_services;
mod nodes;
mod observability;
mod operator;
mod scaling;
mod scoped_install;
mod tenancy;

use std::time::Duration;

use conveyor_core::testing::wait_until;
use conveyor_core::TaskState;
use conveyor_e2e_tests::real_node::placement;
use conveyor_e2e_tests::{assert_valid_chain, kubectl_with, Stack};
use k8s_openapi::api::apps::v1::Deployment;
use serde_json::json;

pub const MINUTE: Duration = Duration::from_secs(60);

pub use conveyor_e2e_tests::helm::{pool_yaml, task_type_yaml};

/// Where a story's workers run: the simulated nodes (kwok, with the pod runner starting each
/// worker as a process), or the real node (a kubelet running containers; cluster/real-node.sh).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    Simulated,
    Real,
}

/// A namespace with a TaskType and a WorkerPool of it, `workers` of them consuming.
pub async fn pool_stack(
    prefix: &str,
    pool: &str,
    pool_extra: &str,
    workers: u64,
) -> (Stack, String) {
    pool_stack_on(Node::Simulated, prefix, pool, pool_extra, workers).await
}

/// [`pool_stack`] with its workers on `node`.
pub async fn pool_stack_on(
    node: Node,
    prefix: &str,
    pool: &str,
    pool_extra: &str,
    workers: u64,
) -> (Stack, String) {
    let (mut stack, pool_extra) = match node {
        Node::Simulated => (Stack::namespace(prefix).await, pool_extra.to_owned()),
        Node::Real => (
            Stack::on_real_node(prefix).await,
            format!("{pool_extra}{}", placement("")),
        ),
    };
    let t = stack.task_type(&format!("e2e-{prefix}"));
    stack.apply(&task_type_yaml(&t, ""));
    stack.apply(&pool_yaml(pool, &t, &pool_extra));
    stack.wait_for_workers(&t, workers).await;
    (stack, t)
}

#[tokio::test]
async fn every_manifest_and_example_is_accepted_by_the_apiserver() {
    // Namespaced objects are only dry-run in namespaces that exist.
    for namespace in ["conveyor-system", "video"] {
        let _ = kubectl_with(&["create", "namespace", namespace], None);
    }
    for target in [
        ["-k", "manifests/base"],
        ["-k", "manifests/kind"],
        ["-k", "manifests/kind-public"],
        ["-k", "manifests/replicated"],
        ["-f", "examples/video-pipeline/"],
    ] {
        let path = format!("../../{}", target[1]);
        kubectl_with(
            &[
                "apply",
                "--dry-run=server",
                "--server-side",
                // On kind the overlay is installed (with kubectl's imagePullPolicy): the dry
                // run asks whether the apiserver accepts these, not who owns which field.
                "--force-conflicts",
                "--field-manager=e2e",
                target[0],
                &path,
            ],
            None,
        )
        .unwrap_or_else(|err| panic!("the apiserver refused {}: {err}", target[1]));
    }
}

#[tokio::test]
async fn invalid_manifests_are_refused_with_a_clear_message() {
    let stack = Stack::namespace("invalid").await;
    let cases = [
        (
            pool_yaml("p", "t", "  replicas: -1\n"),
            "replicas must be >= 0",
        ),
        (
            "apiVersion: conveyor.dev/v1alpha1\nkind: WorkerPool\nmetadata: {name: p}\nspec:\n  \
             taskTypes: [t]\n  image: x\n  handler: {type: exec}\n"
                .to_owned(),
            "the exec handler needs a command",
        ),
        (
            pool_yaml("p", "t", "  autoscaling: {minReplicas: 5, maxReplicas: 2}\n"),
            "minReplicas must not exceed maxReplicas",
        ),
        (
            pool_yaml(
                "p",
                "t",
                "  replicas: 2\n  autoscaling: {minReplicas: 1, maxReplicas: 2}\n",
            ),
            "replicas and autoscaling are exclusive",
        ),
        (
            task_type_yaml("t", "  backoff: {initialSeconds: 60, maxSeconds: 5, multiplier: 2}\n"),
            "initialSeconds must not exceed maxSeconds",
        ),
        (
            "apiVersion: conveyor.dev/v1alpha1\nkind: TaskType\nmetadata: {name: t}\nspec: {maxRetries: 1000}\n"
                .to_owned(),
            "spec.maxRetries",
        ),
        (
            pool_yaml("p", "t", "  concurency: 4\n"),
            "unknown field \"spec.concurency\"",
        ),
    ];
    for (yaml, message) in cases {
        let err = kubectl_with(&["apply", "-n", &stack.namespace, "-f", "-"], Some(&yaml))
            .expect_err(&format!("accepted:\n{yaml}"));
        assert!(
            err.contains(message),
            "refusal of\n{yaml}\nsays {err:?}, not {message:?}"
        );
    }
    let left = stack.kubectl(&["get", "workerpools,tasktypes", "-o", "name"]);
    assert_eq!(left.trim(), "", "a refused manifest left something behind");
    // `kubectl scale` (what an HPA does through /scale) on an autoscaled pool is refused
    // rather than silently ignored.
    stack.apply(&pool_yaml(
        "auto",
        "t",
        "  autoscaling: {minReplicas: 0, maxReplicas: 2}\n",
    ));
    let ns = stack.namespace.clone();
    let err = kubectl_with(
        &["scale", "-n", &ns, "workerpool/auto", "--replicas=3"],
        None,
    )
    .expect_err("kubectl scale of an autoscaled pool was accepted");
    assert!(
        err.contains("replicas and autoscaling are exclusive"),
        "{err}"
    );
    stack.finish().await;
}

#[tokio::test]
async fn a_pool_applied_before_its_task_type_starts_when_the_type_arrives() {
    let mut stack = Stack::namespace("early").await;
    let t = stack.task_type("e2e-early");
    stack.apply(&pool_yaml("early", &t, "  replicas: 1\n"));
    // The pool is degraded (its type is missing) and would retry only after 300 s; the
    // TaskType's creation wakes it instead.
    wait_until("the pool reports its missing type", MINUTE, || async {
        stack.kubectl(&["get", "workerpool/early", "-o", "jsonpath={.status.phase}"]) == "Degraded"
    })
    .await;
    stack.apply(&task_type_yaml(&t, ""));
    wait_until("a worker consumes the late type", 2 * MINUTE, || async {
        stack.consumers(&stack.queue_of(&t, "")).await == 1
    })
    .await;
    stack.finish().await;
}

#[tokio::test]
async fn an_applied_pool_runs_workers_that_process_tasks() {
    let (stack, t) = pool_stack("pool", "pool", "  replicas: 2\n  concurrency: 4\n", 2).await;
    // Workers consume once the work queue exists; the operator may still be declaring the
    // type's other queues (one quorum queue after another on a busy broker).
    for suffix in ["", ".retry", ".remediation"] {
        let queue = stack.queue_of(&t, suffix);
        wait_until(&format!("queue {queue} declared"), MINUTE, || async {
            stack.queue(&queue).await.is_some()
        })
        .await;
    }
    let deployment = stack.deployments().get("pool-worker").await.unwrap();
    let owner = &deployment.metadata.owner_references.unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("WorkerPool", "pool", Some(true))
    );

    let ids = stack.submit_all(&t, vec![json!({"sleepMs": 10}); 20]).await;
    stack
        .wait_for_state(&t, TaskState::Completed, 20, MINUTE)
        .await;
    for id in ids {
        assert_valid_chain(&stack.events(id).await);
    }

    // The printer columns, as users watch them.
    wait_until("pool columns filled in", MINUTE, || async {
        let table = stack.kubectl(&["get", "taskpools"]);
        let row: Vec<&str> = table
            .lines()
            .nth(1)
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        // NAME TASK-TYPES READY DESIRED QUEUED IN-FLIGHT DEAD-LETTERED STATUS AGE
        row.len() == 9 && row[0] == "pool" && row[2] == "2" && row[3] == "2" && row[7] == "Ready"
    })
    .await;
    stack.finish().await;
}

/// The operator's pods with nothing but the credentials `conveyorctl grant` made for their
/// namespace (decisions 0013, 0015): they consume, complete, retry (a publish through the
/// type's exchange) and dead-letter with them.
#[tokio::test]
async fn deleting_a_worker_pod_mid_task_still_completes_it_once() {
    // A short drain: the deleted worker gives the task back, another pod runs it.
    let (stack, t) = pool_stack(
        "podkill",
        "victim",
        "  replicas: 1\n  drainGraceSeconds: 1\n",
        1,
    )
    .await;
    // Long enough that the deleted pod cannot finish it however slow the deletion is.
    let id = stack.submit_all(&t, vec![json!({"sleepMs": 30000})]).await[0];
    stack
        .wait_for_state(&t, TaskState::Processing, 1, MINUTE)
        .await;
    let pod = stack.running_pods("victim").await[0]
        .metadata
        .name
        .clone()
        .unwrap();
    stack.kubectl(&["delete", "pod", &pod, "--wait=false"]);

    stack
        .wait_for_state(&t, TaskState::Completed, 1, 3 * MINUTE)
        .await;
    let chain = stack.events(id).await;
    assert_valid_chain(&chain);
    let completed_by: Vec<_> = chain
        .iter()
        .filter(|e| e.to_state == TaskState::Completed)
        .map(|e| e.worker_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(completed_by.len(), 1, "completed once: {chain:?}");
    assert!(
        !completed_by[0].starts_with(&pod),
        "the deleted pod's worker completed it: {chain:?}"
    );
    stack.finish().await;
}

#[tokio::test]
async fn task_type_edits_and_deletion_policies_reach_rabbitmq() {
    let mut stack = Stack::namespace("policy").await;
    let kept = stack.task_type("e2e-kept");
    let dropped = stack.task_type("e2e-dropped");
    stack.apply(&task_type_yaml(&kept, ""));
    stack.apply(&task_type_yaml(&dropped, "  deletionPolicy: Delete\n"));
    let delivery_limit =
        |queue: serde_json::Value| queue["effective_policy_definition"]["delivery-limit"].as_i64();
    wait_until("the first policy in force", MINUTE, || async {
        stack
            .queue(&stack.queue_of(&kept, ""))
            .await
            .and_then(delivery_limit)
            .is_some()
    })
    .await;
    let before = stack
        .queue(&stack.queue_of(&kept, ""))
        .await
        .and_then(delivery_limit)
        .unwrap();

    // Editing the retry settings changes the queue's effective policy.
    stack.kubectl(&[
        "patch",
        "tasktype",
        &kept,
        "--type=merge",
        "-p",
        r#"{"spec":{"maxRetries":7}}"#,
    ]);
    wait_until("the edited policy in force", MINUTE, || async {
        stack
            .queue(&stack.queue_of(&kept, ""))
            .await
            .and_then(delivery_limit)
            == Some(before + 5)
    })
    .await;

    // Retain keeps the queues (and what is in them); Delete removes them.
    stack.kubectl(&["delete", "tasktype", &kept, &dropped]);
    wait_until("the Delete type's queues gone", MINUTE, || async {
        stack.queue(&stack.queue_of(&dropped, "")).await.is_none()
            && stack
                .queue(&stack.queue_of(&dropped, ".retry"))
                .await
                .is_none()
    })
    .await;
    assert!(
        stack.queue(&stack.queue_of(&kept, "")).await.is_some(),
        "Retain kept the queue"
    );
    stack.finish().await;
}

#[tokio::test]
async fn deleting_a_pool_garbage_collects_its_deployment_and_workers() {
    let (stack, t) = pool_stack("gc", "doomed", "  replicas: 2\n", 2).await;
    stack.kubectl(&["delete", "workerpool", "doomed", "--wait=false"]);
    wait_until(
        "the Deployment collected and the workers stopped",
        MINUTE,
        || async {
            let gone: bool = stack
                .deployments()
                .get_opt("doomed-worker")
                .await
                .is_ok_and(|d: Option<Deployment>| d.is_none());
            gone && stack.running_pods("doomed").await.is_empty()
                && stack.consumers(&stack.queue_of(&t, "")).await == 0
        },
    )
    .await;
    stack.finish().await;
}

#[tokio::test]
async fn a_rolling_update_under_load_loses_and_repeats_nothing() {
    rolling_update_under_load(Node::Simulated).await;
}

/// A new pod template while two workers are busy: nothing lost, nothing completed twice,
/// nothing re-run because of the rollout.
pub async fn rolling_update_under_load(node: Node) {
    let pool = "  replicas: 2\n  concurrency: 4\n  drainGraceSeconds: 30\n";
    let (stack, t) = pool_stack_on(node, "rollout", "rolling", pool, 2).await;
    let before: Vec<String> = stack
        .running_pods("rolling")
        .await
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    // Load that the old pods are seen working on before the rollout starts.
    let mut ids = stack
        .submit_all(&t, vec![json!({"sleepMs": 100}); 200])
        .await;
    wait_until("the old pods at work", 2 * MINUTE, || async {
        stack.count(&t, TaskState::Completed).await > 0
    })
    .await;
    // A new pod template mid-load: new pods come up, the old ones drain and go.
    stack.kubectl(&[
        "patch",
        "workerpool",
        "rolling",
        "--type=merge",
        "-p",
        r#"{"spec":{"concurrency":5}}"#,
    ]);
    // The load goes on, in waves, until the new pods have completed some of it: however
    // long the rollout takes on a busy machine.
    let by_new_pods = || {
        let before = before.clone();
        let db = stack.db.clone();
        let key = stack.key(&t);
        async move {
            let workers: Vec<String> = sqlx::query_scalar(
                "SELECT DISTINCT worker_id FROM task_events
                 WHERE task_type = $1 AND to_state = 'COMPLETED'",
            )
            .bind(&key)
            .fetch_all(db.pool())
            .await
            .unwrap();
            workers
                .iter()
                .any(|w| !before.iter().any(|pod| w.starts_with(pod.as_str())))
        }
    };
    let deadline = std::time::Instant::now() + 5 * MINUTE;
    while !by_new_pods().await {
        assert!(
            std::time::Instant::now() < deadline,
            "no task completed by a new pod within 5 minutes"
        );
        ids.extend(
            stack
                .submit_all(&t, vec![json!({"sleepMs": 100}); 20])
                .await,
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let total = ids.len();
    stack
        .wait_for_state(&t, TaskState::Completed, total as i64, 3 * MINUTE)
        .await;
    wait_until("the old pods gone", 2 * MINUTE, || async {
        let now = stack.running_pods("rolling").await;
        now.len() == 2
            && now
                .iter()
                .all(|p| !before.contains(p.metadata.name.as_ref().unwrap()))
    })
    .await;

    let completions = stack.completions(&t).await;
    assert_eq!(completions.len(), total);
    assert!(completions.values().all(|n| *n == 1), "completed twice");
    let mut by_old = 0;
    for id in ids {
        let chain = stack.events(id).await;
        assert_valid_chain(&chain);
        let done = chain.iter().find(|e| e.to_state == TaskState::Completed);
        let worker = done.and_then(|e| e.worker_id.clone()).unwrap_or_default();
        by_old += usize::from(before.iter().any(|pod| worker.starts_with(pod.as_str())));
    }
    assert!(
        by_old > 0 && by_old < total,
        "the rollout happened under load ({by_old} of {total} done by the old pods)"
    );
    // Old workers drained what they held: no task was claimed twice because of the change.
    let reruns = stack.reruns(&t).await;
    assert!(reruns.is_empty(), "the rollout re-ran tasks: {reruns:?}");
    stack.finish().await;
}
