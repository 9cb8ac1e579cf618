//! Pools growing and shrinking: by hand, by the autoscaler, across an operator restart, and
//! never by removing a worker with a task in flight.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use conveyor_core::testing::wait_until;
use conveyor_core::TaskState;
use conveyor_e2e_tests::{
    assert_valid_chain, operators_to_myself, restart_operator, PausedPod, Stack,
};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::json;

use crate::{pool_stack, pool_stack_on, pool_yaml, task_type_yaml, Node, MINUTE};

#[tokio::test]
async fn two_thousand_tasks_grow_and_shrink_the_pool_each_done_once() {
    let autoscaling = "  concurrency: 4\n  drainGraceSeconds: 30\n  autoscaling:\n    \
        minReplicas: 1\n    maxReplicas: 4\n    targetBacklogPerReplica: 400\n    \
        scaleDownStabilizationSeconds: 5\n";
    let (stack, t) = pool_stack("autoscale", "scaler", autoscaling, 1).await;

    let ids = stack
        .submit_all(&t, vec![json!({"sleepMs": 200}); 2000])
        .await;
    assert_eq!(ids.len(), 2000);
    // The most replicas seen while tasks were still pending.
    let most = Cell::new(0);
    wait_until("2,000 tasks completed", 5 * MINUTE, || async {
        let replicas = stack.deployment_replicas("scaler").await.unwrap_or(0);
        most.set(most.get().max(replicas));
        stack.count(&t, TaskState::Completed).await == 2000
    })
    .await;
    assert!(
        most.get() > 1,
        "the pool never grew under a backlog of 2,000 (most {} replicas)",
        most.get()
    );
    // The autoscaler removes only idle workers: under a backlog nobody is idle, so the pool
    // shrinks as the backlog ends, and no task runs twice because of it (checked below).
    wait_until(
        "the pool back at 1 replica and 1 worker",
        3 * MINUTE,
        || async {
            stack.deployment_replicas("scaler").await == Some(1)
                && stack.running_pods("scaler").await.len() == 1
                && stack.consumers(&stack.queue_of(&t, "")).await == 1
        },
    )
    .await;

    let completions = stack.completions(&t).await;
    assert_eq!(completions.len(), 2000, "every task completed");
    let twice: Vec<_> = completions.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "completed more than once: {twice:?}");
    let reruns = stack.reruns(&t).await;
    assert!(reruns.is_empty(), "scaling down re-ran tasks: {reruns:?}");
    for id in ids {
        assert_valid_chain(&stack.events(id).await);
    }
    for state in [
        TaskState::DeadLetter,
        TaskState::Failed,
        TaskState::Processing,
    ] {
        assert_eq!(stack.count(&t, state).await, 0, "tasks left {state}");
    }
    stack.finish().await;
}

#[tokio::test]
async fn scaling_a_pool_with_kubectl_gives_three_workers() {
    let (stack, t) = pool_stack("scale", "manual", "  replicas: 1\n", 1).await;
    stack.kubectl(&["scale", "workerpool/manual", "--replicas=3"]);
    wait_until("3 running workers", MINUTE, || async {
        stack.running_pods("manual").await.len() == 3
            && stack.consumers(&stack.queue_of(&t, "")).await == 3
    })
    .await;
    let replicas = stack.kubectl(&[
        "get",
        "workerpool/manual",
        "-o",
        "jsonpath={.spec.replicas}",
    ]);
    assert_eq!(replicas, "3");
    // What an HPA or KEDA reads before it writes `spec.replicas` through /scale (as kubectl
    // scale did): the count running and a selector that finds the pool's pods.
    let scale_path = format!(
        "/apis/conveyor.dev/v1alpha1/namespaces/{}/workerpools/manual/scale",
        stack.namespace
    );
    wait_until("/scale reports 3 replicas", MINUTE, || async {
        let scale: serde_json::Value =
            serde_json::from_str(&stack.kubectl(&["get", "--raw", &scale_path])).unwrap();
        scale["spec"]["replicas"] == 3 && scale["status"]["replicas"] == 3
    })
    .await;
    let scale: serde_json::Value =
        serde_json::from_str(&stack.kubectl(&["get", "--raw", &scale_path])).unwrap();
    let selector = scale["status"]["selector"].as_str().unwrap().to_owned();
    let selected = stack.kubectl(&["get", "pods", "-l", &selector, "-o", "name"]);
    assert_eq!(selected.lines().count(), 3, "{selector} selects {selected}");
    stack.finish().await;
}

#[tokio::test]
async fn an_operator_restarted_during_a_scale_up_finishes_it() {
    let _operators = operators_to_myself().await;
    let (stack, t) = pool_stack("oprestart", "growing", "  replicas: 1\n", 1).await;
    stack.kubectl(&["scale", "workerpool/growing", "--replicas=3"]);
    restart_operator();
    wait_until(
        "3 running workers after the restart",
        2 * MINUTE,
        || async {
            stack.running_pods("growing").await.len() == 3
                && stack.consumers(&stack.queue_of(&t, "")).await == 3
        },
    )
    .await;
    stack.finish().await;
}

#[tokio::test]
async fn a_scale_down_under_load_removes_no_worker_with_a_task_in_flight() {
    scale_down_under_load(Node::Simulated).await;
}

/// Three busy workers scaled to one: the two removed finish what they hold first.
pub async fn scale_down_under_load(node: Node) {
    let pool = "  replicas: 3\n  concurrency: 2\n  drainGraceSeconds: 120\n";
    let (stack, t) = pool_stack_on(node, "drain", "shrinking", pool, 3).await;
    // Tasks of 4 s, more than the three workers can take at once.
    let ids = stack
        .submit_all(&t, vec![json!({"sleepMs": 4000}); 24])
        .await;
    wait_until("every worker busy", 2 * MINUTE, || async {
        stack.busy_workers(&t).await == 3
    })
    .await;
    stack.kubectl(&["scale", "workerpool/shrinking", "--replicas=1"]);

    // When each pod was seen going (terminating or gone), watched from outside.
    let mut gone: BTreeMap<String, chrono::DateTime<chrono::Utc>> = BTreeMap::new();
    let mut alive: BTreeSet<String> = BTreeSet::new();
    let deadline = std::time::Instant::now() + 5 * MINUTE;
    loop {
        let now = chrono::Utc::now();
        let pods = stack.running_pods("shrinking").await;
        let names: BTreeSet<String> = pods
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        for pod in alive.difference(&names) {
            gone.entry(pod.clone()).or_insert(now);
        }
        alive.extend(names.iter().cloned());
        let done = stack.count(&t, TaskState::Completed).await == ids.len() as i64;
        if done && names.len() == 1 && stack.deployment_replicas("shrinking").await == Some(1) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not settled at 1 worker with every task done within 5 minutes"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(gone.len(), 2, "two workers removed: {gone:?}");

    // Each removed worker had finished its last task before its pod went.
    for (pod, at) in &gone {
        let last: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
            "SELECT max(at) FROM task_events
             WHERE task_type = $1 AND to_state = 'COMPLETED' AND worker_id LIKE $2",
        )
        .bind(stack.key(&t))
        .bind(format!("{pod}%"))
        .fetch_one(stack.db.pool())
        .await
        .unwrap();
        if let Some(last) = last {
            assert!(
                last <= *at,
                "{pod} was removed at {at} with a task in flight (completed at {last})"
            );
        }
    }
    let completions = stack.completions(&t).await;
    assert_eq!(completions.len(), ids.len());
    assert!(completions.values().all(|n| *n == 1), "completed twice");
    // A worker removed mid-task completes nothing, so the check above cannot see it; its
    // task is released or reaped and claimed a second time, which this one sees.
    let reruns = stack.reruns(&t).await;
    assert!(reruns.is_empty(), "the scale-down re-ran tasks: {reruns:?}");
    stack.finish().await;
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Decision 0018's addendum on the real control plane: the ReplicaSet deletes a not-ready
/// pod before any pod-deletion-cost, so while a busy worker is not ready the operator must
/// not shrink the Deployment by the idle worker it drained until that one ranks first too.
/// The busy worker is made unready by stopping its process (no probe answers, as a wedged
/// worker) for the whole scale-down, then let go.
#[tokio::test]
async fn a_busy_worker_that_is_not_ready_is_not_removed_in_place_of_the_idle_one() {
    let mut stack = Stack::namespace("unready").await;
    let t = stack.task_type("e2e-unready");
    // Heartbeats stop while the busy worker is stopped: no reaper may take its task.
    stack.apply(&task_type_yaml(&t, "  heartbeatTimeoutSeconds: 900\n"));
    let pool = "  replicas: 2\n  concurrency: 1\n  drainGraceSeconds: 600\n";
    stack.apply(&pool_yaml("wedged", &t, pool));
    stack.wait_for_workers(&t, 2).await;
    wait_until("both workers ready", 2 * MINUTE, || async {
        let pods = stack.running_pods("wedged").await;
        pods.len() == 2 && pods.iter().all(is_ready)
    })
    .await;

    let ids = stack.submit_all(&t, vec![json!({"sleepMs": 5000})]).await;
    let owner = std::cell::RefCell::new(String::new());
    wait_until("the task in a worker's hands", 2 * MINUTE, || async {
        let found: Option<String> =
            sqlx::query_scalar("SELECT owner FROM tasks WHERE id = $1 AND state = 'PROCESSING'")
                .bind(ids[0])
                .fetch_optional(stack.db.pool())
                .await
                .unwrap()
                .flatten();
        found.map(|o| *owner.borrow_mut() = o).is_some()
    })
    .await;
    let pods = stack.running_pods("wedged").await;
    let (busy, idle): (Vec<Pod>, Vec<Pod>) = pods
        .into_iter()
        .partition(|p| owner.borrow().starts_with(&p.name_any()));
    let (busy, idle) = (busy[0].name_any(), idle[0].name_any());

    let paused = PausedPod::pause(&busy);
    wait_until(&format!("{busy} not ready"), 2 * MINUTE, || async {
        let pods = stack.running_pods("wedged").await;
        pods.iter().any(|p| p.name_any() == busy && !is_ready(p))
    })
    .await;
    stack.kubectl(&["scale", "workerpool/wedged", "--replicas=1"]);
    // The operator drains the idle worker and marks it; the ReplicaSet would still take the
    // unready busy one first, so the Deployment shrinks only once the drained worker is
    // not ready either (its cost then puts it first).
    wait_until(&format!("{idle} removed"), 3 * MINUTE, || async {
        stack.deployment_replicas("wedged").await == Some(1)
            && stack.running_pods("wedged").await.len() == 1
    })
    .await;
    let live = stack.running_pods("wedged").await;
    assert_eq!(
        live[0].name_any(),
        busy,
        "the busy worker was removed in place of the idle one"
    );
    assert!(!is_ready(&live[0]), "{busy} was stopped all along");

    // Let go, the busy worker finishes its task: once, and nothing ran it again.
    paused.resume();
    stack
        .wait_for_state(&t, TaskState::Completed, 1, 2 * MINUTE)
        .await;
    let completions = stack.completions(&t).await;
    assert_eq!(completions.values().copied().collect::<Vec<_>>(), vec![1]);
    let reruns = stack.reruns(&t).await;
    assert!(
        reruns.is_empty(),
        "the scale-down re-ran the task: {reruns:?}"
    );
    stack.finish().await;
}

#[tokio::test]
async fn arrivals_outpacing_the_pool_grow_it_before_the_queue_builds_up() {
    // The backlog term alone would wait for 2,000 queued tasks per worker; one worker runs
    // about 5 tasks/s here, and 25 arrive each second.
    let autoscaling =
        "  concurrency: 1\n  autoscaling:\n    minReplicas: 1\n    maxReplicas: 4\n    \
        targetBacklogPerReplica: 2000\n    scaleDownStabilizationSeconds: 600\n";
    let (stack, t) = pool_stack("arrival", "arrivals", autoscaling, 1).await;
    let queue = stack.queue_of(&t, "");
    let mut submitted = 0;
    let mut grown_at = None;
    let deadline = std::time::Instant::now() + 3 * MINUTE;
    while grown_at.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the pool did not grow within 3 minutes of arrivals outpacing it"
        );
        submitted += stack
            .submit_all(&t, vec![json!({"sleepMs": 200}); 25])
            .await
            .len();
        let ready = stack
            .queue(&queue)
            .await
            .and_then(|q| q["messages_ready"].as_u64())
            .unwrap_or(0);
        if stack.deployment_replicas("arrivals").await.unwrap_or(0) > 1 {
            grown_at = Some(ready);
        }
        assert!(
            ready < 2000,
            "the queue reached the backlog target ({ready} ready) before the pool grew"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    stack
        .wait_for_state(&t, TaskState::Completed, submitted as i64, 5 * MINUTE)
        .await;
    // Each decision is an Event of its own: the first step up says why it was taken.
    let notes = stack.kubectl(&[
        "get",
        "events.events.k8s.io",
        "--field-selector",
        "reason=Scaled",
        "-o",
        "jsonpath={range .items[*]}{.note}{\"\\n\"}{end}",
    ]);
    let first_step = notes.lines().find(|n| n.starts_with("1 → "));
    assert!(
        first_step.is_some_and(|n| n.contains("arriving")),
        "grew with {grown_at:?} ready; Scaled events: {notes}"
    );
    let last = stack.kubectl(&[
        "get",
        "workerpool/arrivals",
        "-o",
        "jsonpath={.status.lastScale.from}",
    ]);
    assert!(!last.is_empty(), "status.lastScale records the last change");
    stack.finish().await;
}
