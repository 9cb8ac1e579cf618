//! The operator's own failures: killed under load, a second replica whose clock is off,
//! and a pool's objects edited by hand.

use std::time::Duration;

use conveyor_core::testing::{self, wait_until};
use conveyor_core::TaskState;
use conveyor_e2e_tests::{
    kill_operator, operators_to_myself, restart_operator, standby_operator, start_operator,
};
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use serde_json::json;

use crate::{pool_stack, MINUTE};

/// Reconciles the operator whose admin routes are at `listen` has run; `None` while it
/// does not answer.
async fn reconciles(listen: &str) -> Option<f64> {
    let page = testing::metrics_page(&testing::http_client(), listen).await?;
    Some(
        page.lines()
            .filter(|l| l.starts_with("conveyor_operator_reconciles_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

fn lease_holder() -> String {
    conveyor_e2e_tests::lease_holder().unwrap_or_else(|err| panic!("the operator's lease: {err}"))
}

/// Kills the child on the way out, however the test ends, and makes sure the stack's
/// operator runs again.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        start_operator();
    }
}

/// libfaketime's preload library (Debian's `faketime` package; `make test` installs it).
fn libfaketime() -> String {
    std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|dir| dir.path().join("faketime/libfaketimeMT.so.1"))
        .find(|lib| lib.exists())
        .expect("libfaketime is installed (scripts/services.sh up installs faketime)")
        .display()
        .to_string()
}

#[tokio::test]
async fn two_operators_with_skewed_clocks_never_both_act() {
    // A standby whose wall clock is 15 minutes ahead: every renewal of the leader's looks
    // 15 minutes old to it.
    skewed_standby_beside_the_leader("skew", "+15m").await;
}

#[tokio::test]
async fn a_standby_whose_clock_is_behind_still_takes_over_from_a_dead_leader() {
    // 5 minutes behind: the leader's last renewal looks 5 minutes in the future to it, so
    // judging expiry by timestamps it would wait that long to take over. (Not more: the
    // services' certificates are not valid before they were made, which on a fresh machine
    // may be only minutes before this test.)
    skewed_standby_beside_the_leader("skewbehind", "-5m").await;
}

/// The stack's operator leads, a standby with its clock off by `skew` (libfaketime's
/// FAKETIME) acts on nothing while the leader renews, takes over within a lease duration
/// once the leader dies, and hands the lease back when stopped.
async fn skewed_standby_beside_the_leader(namespace: &str, skew: &str) {
    let _operators = operators_to_myself().await;
    let (stack, _t) = pool_stack(namespace, "watched", "  replicas: 1\n", 1).await;
    let listen = format!("127.0.0.1:{}", testing::free_port());
    let skewed = Reaped(standby_operator(
        "skewed-standby",
        &listen,
        &[("LD_PRELOAD", &libfaketime()), ("FAKETIME", skew)],
    ));
    wait_until("the skewed operator answering", MINUTE, || async {
        reconciles(&listen).await.is_some()
    })
    .await;
    // Work for whoever leads: a scale the leader acts on.
    stack.kubectl(&["scale", "workerpool/watched", "--replicas=2"]);
    wait_until("the leader scaled the pool", MINUTE, || async {
        stack.running_pods("watched").await.len() == 2
    })
    .await;
    // Three lease durations: the standby acts on nothing while the leader renews.
    for _ in 0..30 {
        assert_eq!(
            reconciles(&listen).await,
            Some(0.0),
            "the skewed standby reconciled while {} held the lease",
            lease_holder()
        );
        assert_eq!(lease_holder(), "conveyor-operator");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The leader dies: the standby takes over within a lease duration and a retry.
    assert!(kill_operator(), "the stack's operator runs here");
    wait_until("the skewed standby leading", MINUTE, || async {
        lease_holder() == "skewed-standby" && reconciles(&listen).await.unwrap_or(0.0) > 0.0
    })
    .await;
    stack.kubectl(&["scale", "workerpool/watched", "--replicas=1"]);
    wait_until("the new leader scaled the pool", 2 * MINUTE, || async {
        stack.deployment_replicas("watched").await == Some(1)
    })
    .await;

    // The first one comes back as a standby; the skewed one stops and hands the lease on.
    start_operator();
    let stopped = std::process::Command::new("kill")
        .args(["-TERM", &skewed.0.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    wait_until("the stack's operator leading again", MINUTE, || async {
        lease_holder() == "conveyor-operator"
    })
    .await;
    drop(skewed);
    stack.finish().await;
}

#[tokio::test]
async fn an_operator_restarted_under_load_does_not_shrink_a_busy_pool() {
    let _operators = operators_to_myself().await;
    let autoscaling =
        "  concurrency: 2\n  autoscaling:\n    minReplicas: 1\n    maxReplicas: 4\n    \
        targetBacklogPerReplica: 50\n    scaleDownStabilizationSeconds: 120\n";
    let (stack, t) = pool_stack("restartload", "busy", autoscaling, 1).await;
    let total = 600;
    stack
        .submit_all(&t, vec![json!({"sleepMs": 300}); total])
        .await;
    wait_until("the pool at 4 workers", 2 * MINUTE, || async {
        stack.deployment_replicas("busy").await == Some(4)
    })
    .await;
    // Restart once the backlog alone would ask for fewer workers than there are.
    let queue = stack.queue_of(&t, "");
    wait_until(
        "the backlog below what 4 workers need",
        5 * MINUTE,
        || async {
            stack
                .queue(&queue)
                .await
                .and_then(|q| q["messages_ready"].as_u64())
                .is_some_and(|ready| ready < 100)
        },
    )
    .await;
    restart_operator();
    let desired = || {
        stack.kubectl(&[
            "get",
            "workerpool/busy",
            "-o",
            "jsonpath={.status.desiredReplicas}/{.status.draining}",
        ])
    };
    // Until every task is done and the restarted operator has had two autoscaling periods
    // (10 s each) to look at the pool; its stabilization window (120 s) outlasts both.
    let restarted = std::time::Instant::now();
    let deadline = restarted + 5 * MINUTE;
    loop {
        assert_eq!(
            stack.deployment_replicas("busy").await,
            Some(4),
            "the restarted operator shrank the busy pool"
        );
        let now = desired();
        assert!(
            now == "4/0",
            "the restarted operator wanted fewer workers while the pool was busy: {now}"
        );
        if restarted.elapsed() >= Duration::from_secs(25)
            && stack.count(&t, TaskState::Completed).await == total as i64
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not every task done within 5 minutes of the restart"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    stack.finish().await;
}

/// A pool's ConfigMap edited and its Service deleted by hand are applied again within a
/// minute: their watches wake the pool (before, only a periodic re-apply every five to
/// seven and a half minutes repaired them, and it wrote every pool's four objects).
#[tokio::test]
async fn a_pools_objects_edited_or_deleted_by_hand_are_applied_again() {
    let (stack, _t) = pool_stack("repair", "repaired", "  replicas: 1\n", 1).await;
    let maps: kube::Api<ConfigMap> = kube::Api::namespaced(stack.client.clone(), &stack.namespace);
    let services: kube::Api<Service> =
        kube::Api::namespaced(stack.client.clone(), &stack.namespace);
    let applied = maps.get("repaired-worker").await.unwrap().data;
    let edited: std::collections::BTreeMap<String, String> = applied
        .clone()
        .unwrap_or_default()
        .into_keys()
        .map(|key| (key, "edited by hand".to_owned()))
        .collect();
    stack.kubectl(&[
        "patch",
        "configmap",
        "repaired-worker",
        "--type=merge",
        "-p",
        &json!({ "data": edited }).to_string(),
    ]);
    stack.kubectl(&["delete", "service", "repaired-worker-metrics"]);
    wait_until(
        "the ConfigMap as the operator applies it, and the Service back",
        MINUTE,
        || async {
            let map = maps.get_opt("repaired-worker").await.ok().flatten();
            let service = services.get_opt("repaired-worker-metrics").await;
            map.is_some_and(|m| m.data == applied) && service.is_ok_and(|s| s.is_some())
        },
    )
    .await;
    stack.finish().await;
}
