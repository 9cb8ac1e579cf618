//! The kind overlay's PostgreSQL and RabbitMQ (`manifests/kind`), from the images
//! `scripts/images.sh` builds from Debian's packages (`images/services/`), as pods of a real
//! kubelet (the real node), with the overlay's own Deployments, security contexts and probes.
//! Judged from this machine through the pods' addresses: this build's `conveyorctl migrate`
//! applies every migration with the overlay's password, a TaskType's quorum queues are
//! declared over AMQP with the overlay's user, and the management API lists them.

use conveyor_core::amqp::{self, QueueNames};
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::testing::wait_until;
use conveyor_e2e_tests::real_node::{self, NODE_PATIENCE};
use conveyor_e2e_tests::{conveyorctl, kubectl_with, repo_root, Stack};

#[tokio::test]
async fn the_kind_overlays_postgres_and_rabbitmq_run_from_images_built_from_debian_packages() {
    let _node = real_node::shared().await;
    let stack = Stack::namespace("kind-services").await;
    for file in ["postgres.yaml", "rabbitmq.yaml"] {
        let manifest = std::fs::read_to_string(repo_root().join("manifests/kind").join(file))
            .unwrap()
            .replace(
                "namespace: conveyor-system",
                &format!("namespace: {}", stack.namespace),
            );
        kubectl_with(&["apply", "-f", "-"], Some(&on_the_real_node(&manifest))).unwrap();
    }
    for deployment in ["postgres", "rabbitmq"] {
        let status = format!("deployment/{deployment}");
        let rollout = [
            "-n",
            &stack.namespace,
            "rollout",
            "status",
            &status,
            "--timeout=300s",
        ];
        kubectl_with(&rollout, None)
            .unwrap_or_else(|err| panic!("{deployment} on the real node: {err}"));
    }
    let postgres = pod_ip(&stack, "postgres").await;
    let rabbitmq = pod_ip(&stack, "rabbitmq").await;

    // PostgreSQL: the overlay's user, password and database, over the pod's address.
    let database = format!("postgres://conveyor:conveyor@{postgres}:5432/conveyor");
    conveyorctl(&database, "amqp://unused", &["migrate"]);
    let db = Db::connect(&DbOptions::new(&database)).unwrap();
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(db.pool())
        .await
        .unwrap();
    let migrations = std::fs::read_dir(repo_root().join("migrations"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "sql")
        })
        .count();
    assert_eq!(
        applied as usize, migrations,
        "migrations applied on the pod"
    );
    db.close().await;

    // RabbitMQ: a TaskType's topology (quorum queues, a dead-letter exchange) over AMQP.
    let url = format!("amqp://conveyor:conveyor@{rabbitmq}:5672/%2f");
    let task_type = NamedTaskType::named("kind-services");
    let conn = amqp::connect(&url, "e2e-kind-services").await.unwrap();
    let channel = conn.create_channel().await.unwrap();
    amqp::declare_task_type(&channel, &task_type).await.unwrap();
    let main = QueueNames::of(&task_type.name).main;
    assert_eq!(amqp::ready_count(&channel, &main).await.unwrap(), 0);
    amqp::close_bounded(&conn, 200, "done").await;
    // The management plugin, enabled by the image, lists the queue as a quorum queue.
    let queue: serde_json::Value = reqwest::Client::new()
        .get(format!("http://{rabbitmq}:15672/api/queues/%2f/{main}"))
        .basic_auth("conveyor", Some("conveyor"))
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(queue["type"], "quorum", "{queue}");
    stack.finish().await;
}

/// The overlay's Deployment pinned to the real node (its pods are otherwise the simulated
/// nodes' fakes): a nodeSelector and the node's toleration in each pod template.
fn on_the_real_node(manifest: &str) -> String {
    manifest.replace(
        "    spec:\n      securityContext:",
        "    spec:\n      nodeSelector: {conveyor.dev/node: real}\n      \
         tolerations: [{key: conveyor.dev/real-node, operator: Exists, effect: NoSchedule}]\n      \
         securityContext:",
    )
}

/// The address of `app`'s Ready pod on the real node.
async fn pod_ip(stack: &Stack, app: &str) -> String {
    let ip = std::cell::RefCell::new(String::new());
    wait_until(&format!("{app}'s pod address"), NODE_PATIENCE, || async {
        let pods = stack.pods_on(&real_node::node()).await;
        let found = pods.iter().find_map(|p| {
            let labelled = p.metadata.labels.as_ref()?.get("app.kubernetes.io/name")? == app;
            labelled.then(|| p.status.as_ref()?.pod_ip.clone())?
        });
        let seen = found.is_some();
        *ip.borrow_mut() = found.unwrap_or_default();
        seen
    })
    .await;
    ip.into_inner()
}
