//! TaskType settings reach the real RabbitMQ as queues and policies.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use conveyor_core::amqp::{self, QueueNames};
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::testing;
use conveyor_operator::rabbitmq::{task_type_policies, ManagementApi};

fn management() -> ManagementApi {
    ManagementApi::new("http://127.0.0.1:15672", "conveyor", "conveyor", "/")
}

async fn apply(api: &ManagementApi, spec: &NamedTaskType) {
    for policy in task_type_policies(spec) {
        api.put_policy(&policy).await.unwrap();
    }
}

/// Policies reach queues asynchronously; wait until the broker reports `key = value`.
async fn wait_effective(api: &ManagementApi, queue: &str, key: &str, value: serde_json::Value) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let effective = api.effective_policy(queue).await.unwrap();
        if effective[key] == value {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{queue}: {key} is {} not {value}",
            effective[key]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn changing_retries_and_backoff_changes_the_effective_policy() {
    let mut spec = NamedTaskType::named(testing::unique_type("policy"));
    spec.max_retries = 3;
    spec.backoff.max_seconds = 60.0;
    let conn = amqp::connect(&testing::amqp_url(), "operator-test")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    amqp::declare_task_type(&channel, &spec).await.unwrap();
    let api = management();
    let queues = QueueNames::of(&spec.name);

    apply(&api, &spec).await;
    wait_effective(&api, &queues.main, "delivery-limit", 5.into()).await;
    wait_effective(&api, &queues.retry, "message-ttl", 60_000.into()).await;

    spec.max_retries = 7;
    spec.backoff.max_seconds = 120.0;
    apply(&api, &spec).await;
    wait_effective(&api, &queues.main, "delivery-limit", 9.into()).await;
    wait_effective(&api, &queues.retry, "message-ttl", 120_000.into()).await;
    let depths = api.depths(&spec).await.unwrap();
    assert_eq!(
        depths.ready + depths.in_flight + depths.retry + depths.remediation,
        0
    );

    for policy in task_type_policies(&spec) {
        api.delete_policy(&policy.name).await.unwrap();
    }
    for queue in queues.all(spec.retry_tiers()) {
        api.delete_queue(&queue).await.unwrap();
    }
    assert!(api.depths(&spec).await.is_err(), "queues are gone");
    let _ = conn.close(200, "done").await;
}
