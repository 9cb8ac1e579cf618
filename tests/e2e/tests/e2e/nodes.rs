//! The local cluster's nodes and their pod runners, as users of a real cluster would see
//! them: a pod is Ready only while its worker runs and answers its readiness probe.

use crate::{pool_yaml, task_type_yaml, MINUTE};
use conveyor_core::testing::wait_until;
use conveyor_e2e_tests::{kubectl_with, Stack};

/// The pool's pods' (Ready condition, container waiting reason), one per pod.
pub async fn readiness(stack: &Stack, pool: &str) -> Vec<(String, Option<String>)> {
    stack
        .pool_pods(pool)
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let status = p.status?;
            let ready = status
                .conditions?
                .into_iter()
                .find(|c| c.type_ == "Ready")?
                .status;
            let waiting = status
                .container_statuses?
                .first()?
                .state
                .as_ref()?
                .waiting
                .as_ref()
                .and_then(|w| w.reason.clone());
            Some((ready, waiting))
        })
        .collect()
}

/// The READY column of `kubectl get taskpools` for the pool.
pub fn ready_column(stack: &Stack) -> Option<String> {
    let table = stack.kubectl(&["get", "taskpools"]);
    let row: Vec<String> = table
        .lines()
        .nth(1)?
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    row.get(2).cloned()
}

/// A worker that cannot start (its namespace has no connection Secret) is not Ready, and
/// neither is the pool; once the Secret is there the same pods start and turn Ready.
#[tokio::test]
async fn a_pool_whose_workers_cannot_start_is_not_ready_until_they_can() {
    let mut stack = Stack::namespace("unready").await;
    let t = stack.task_type("e2e-unready");
    let secret = stack.kubectl(&["get", "secret", "conveyor-connections", "-o", "json"]);
    stack.kubectl(&["delete", "secret", "conveyor-connections"]);
    stack.apply(&task_type_yaml(&t, ""));
    stack.apply(&pool_yaml("unready", &t, "  replicas: 2\n"));

    wait_until(
        "both pods waiting on their missing Secret",
        MINUTE,
        || async {
            let pods = readiness(&stack, "unready").await;
            pods.len() == 2
                && pods.iter().all(|(ready, waiting)| {
                    ready == "False" && waiting.as_deref() == Some("CreateContainerConfigError")
                })
        },
    )
    .await;
    assert_eq!(ready_column(&stack).as_deref(), Some("0"));
    assert_eq!(stack.consumers(&stack.queue_of(&t, "")).await, 0);

    // The Secret back (as it was, without its server-set fields): the workers start.
    let mut secret: serde_json::Value = serde_json::from_str(&secret).unwrap();
    for field in [
        "resourceVersion",
        "uid",
        "creationTimestamp",
        "managedFields",
    ] {
        secret["metadata"].as_object_mut().unwrap().remove(field);
    }
    kubectl_with(&["apply", "-f", "-"], Some(&secret.to_string())).unwrap();
    wait_until("both pods ready", MINUTE, || async {
        let pods = readiness(&stack, "unready").await;
        pods.len() == 2 && pods.iter().all(|(ready, _)| ready == "True")
    })
    .await;
    wait_until("the pool shows them ready", MINUTE, || async {
        ready_column(&stack).as_deref() == Some("2")
    })
    .await;
    stack.wait_for_workers(&t, 2).await;
    stack.finish().await;
}
