//! Pools without `autoscaling`, driven through their /scale by the scalers platform teams
//! bring: the control plane's own HorizontalPodAutoscaler, and KEDA scaling on the queue.

use std::path::Path;
use std::process::Command;

use conveyor_core::testing::{self, wait_until};
use conveyor_core::TaskState;
use conveyor_e2e_tests::{assert_valid_chain, on_kind};
use serde_json::json;

use crate::{pool_stack, MINUTE};

#[tokio::test]
async fn a_horizontal_pod_autoscaler_drives_a_pool_through_scale() {
    // The control plane's own HPA controller, as a user who brings an HPA (or KEDA, which
    // makes one) would run it. Its bounds apply before any metric is read, so no metrics
    // server is needed: below minReplicas it scales up, above maxReplicas down, each by
    // writing `spec.replicas` through the pool's /scale.
    let (stack, t) = pool_stack("hpa", "hpa-driven", "  replicas: 1\n", 1).await;
    let hpa = |min: i32, max: i32| {
        format!(
            "apiVersion: autoscaling/v2\nkind: HorizontalPodAutoscaler\nmetadata:\n  name: \
             hpa-driven\nspec:\n  scaleTargetRef:\n    apiVersion: conveyor.dev/v1alpha1\n    \
             kind: WorkerPool\n    name: hpa-driven\n  minReplicas: {min}\n  maxReplicas: \
             {max}\n  metrics:\n  - type: Resource\n    resource:\n      name: cpu\n      \
             target:\n        type: Utilization\n        averageUtilization: 80\n"
        )
    };
    stack.apply(&hpa(3, 4));
    let queue = stack.queue_of(&t, "");
    wait_until(
        "the HPA raised the pool to 3 workers",
        3 * MINUTE,
        || async {
            stack.running_pods("hpa-driven").await.len() == 3 && stack.consumers(&queue).await == 3
        },
    )
    .await;
    let replicas = stack.kubectl(&[
        "get",
        "workerpool/hpa-driven",
        "-o",
        "jsonpath={.spec.replicas}",
    ]);
    assert_eq!(replicas, "3", "the HPA wrote the pool's spec.replicas");
    stack.apply(&hpa(1, 2));
    wait_until(
        "the HPA lowered the pool to 2 workers",
        3 * MINUTE,
        || async {
            stack.deployment_replicas("hpa-driven").await == Some(2)
                && stack.running_pods("hpa-driven").await.len() == 2
                && stack.consumers(&queue).await == 2
        },
    )
    .await;
    stack.kubectl(&["delete", "hpa/hpa-driven"]);
    stack.finish().await;
}

/// KEDA's operator and metrics adapter (`scripts/keda.sh`), stopped when the test ends, also
/// when it fails or KEDA did not come up: an aggregated API left without its server would
/// break discovery, and namespace deletion with it, for every other test.
struct Keda;

impl Keda {
    fn start() -> Keda {
        // The guard first, so that a failed start is cleaned up too.
        let keda = Keda;
        let status = keda_script("up");
        assert!(status.success(), "scripts/keda.sh up (see .dev/keda/*.log)");
        keda
    }
}

impl Drop for Keda {
    fn drop(&mut self) {
        keda_script("down");
    }
}

fn keda_script(command: &str) -> std::process::ExitStatus {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    Command::new(repo.join("scripts/keda.sh"))
        .arg(command)
        .current_dir(&repo)
        .status()
        .expect("run scripts/keda.sh")
}

#[tokio::test]
async fn keda_scales_a_pool_on_its_queue_through_scale() {
    if on_kind() {
        eprintln!("skipped: scripts/keda.sh runs KEDA on the local cluster only");
        return;
    }
    let _keda = Keda::start();
    let pool = "  replicas: 1\n  concurrency: 1\n  drainGraceSeconds: 60\n";
    let (stack, t) = pool_stack("keda", "keda-driven", pool, 1).await;
    let queue = stack.queue_of(&t, "");
    // As a KEDA user writes it: the management API's URL (with its credentials) in a Secret,
    // a TriggerAuthentication that reads it, and a ScaledObject aimed at the pool's /scale.
    // One worker per 4 messages (ready and unacknowledged), 1 to 4 workers, and no
    // scale-down stabilization so that the test need not wait out the HPA's 5 minutes.
    let management = testing::management_url();
    stack.kubectl(&[
        "create",
        "secret",
        "generic",
        "keda-rabbitmq",
        &format!("--from-literal=host={management}/"),
    ]);
    stack.apply(&format!(
        r#"apiVersion: keda.sh/v1alpha1
kind: TriggerAuthentication
metadata:
  name: rabbitmq
spec:
  secretTargetRef:
  - parameter: host
    name: keda-rabbitmq
    key: host
---
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: keda-driven
spec:
  scaleTargetRef:
    apiVersion: conveyor.dev/v1alpha1
    kind: WorkerPool
    name: keda-driven
  minReplicaCount: 1
  maxReplicaCount: 4
  pollingInterval: 5
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        scaleDown:
          stabilizationWindowSeconds: 0
  triggers:
  - type: rabbitmq
    metadata:
      protocol: http
      queueName: {queue}
      mode: QueueLength
      value: "4"
    authenticationRef:
      name: rabbitmq
"#
    ));
    wait_until("KEDA made its HPA for the pool", 2 * MINUTE, || async {
        stack
            .kubectl(&["get", "hpa", "-o", "name"])
            .contains("keda-hpa-keda-driven")
    })
    .await;

    // 40 tasks of 3 s: two minutes of work for one worker.
    let ids = stack
        .submit_all(&t, vec![json!({"sleepMs": 3000}); 40])
        .await;
    wait_until(
        "KEDA raised the pool to 4 workers on the backlog",
        3 * MINUTE,
        // Through the pool's spec.replicas, which KEDA's HPA writes by /scale.
        || async {
            let replicas = stack.kubectl(&[
                "get",
                "workerpool/keda-driven",
                "-o",
                "jsonpath={.spec.replicas}",
            ]);
            replicas == "4"
                && stack.running_pods("keda-driven").await.len() == 4
                && stack.consumers(&queue).await == 4
        },
    )
    .await;
    stack
        .wait_for_state(&t, TaskState::Completed, 40, 3 * MINUTE)
        .await;
    wait_until(
        "KEDA lowered the pool to 1 worker once the queue was empty",
        3 * MINUTE,
        || async {
            stack.deployment_replicas("keda-driven").await == Some(1)
                && stack.running_pods("keda-driven").await.len() == 1
                && stack.consumers(&queue).await == 1
        },
    )
    .await;
    // Growing and shrinking under KEDA ran each task once.
    let completions = stack.completions(&t).await;
    assert_eq!(completions.len(), ids.len(), "every task completed");
    assert!(
        completions.values().all(|n| *n == 1),
        "each task completed once: {completions:?}"
    );
    let reruns = stack.reruns(&t).await;
    assert!(reruns.is_empty(), "scaling down re-ran tasks: {reruns:?}");
    for id in ids {
        assert_valid_chain(&stack.events(id).await);
    }
    stack.kubectl(&["delete", "scaledobject/keda-driven"]);
    stack.finish().await;
}
