//! TaskType settings reach the real RabbitMQ as queues and policies.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use conveyor_core::amqp::{self, QueueNames};
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::testing;
use conveyor_operator::rabbitmq::{task_type_policy_names, ManagementApi};

fn management() -> ManagementApi {
    ManagementApi::new(
        testing::MANAGEMENT_API,
        "conveyor",
        "conveyor",
        "/",
        &testing::dev_roots(),
    )
    .unwrap()
}

async fn apply(api: &ManagementApi, spec: &NamedTaskType) {
    api.put_task_type_policies(spec).await.unwrap();
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

    for name in task_type_policy_names(&spec) {
        api.delete_policy(&name).await.unwrap();
    }
    for queue in queues.all(spec.retry_tiers()) {
        api.delete_queue(&queue).await.unwrap();
    }
    assert!(api.depths(&spec).await.is_err(), "queues are gone");
    let _ = conn.close(200, "done").await;
}

#[tokio::test]
async fn a_retry_tier_left_by_an_edit_is_counted_and_deleted_only_once_empty() {
    // Backoff 10 s, 100 s, 1000 s: three retry queues.
    let mut spec = NamedTaskType::named(testing::unique_type("tiers"));
    spec.max_retries = 3;
    spec.backoff.initial_seconds = 10.0;
    spec.backoff.multiplier = 10.0;
    spec.backoff.max_seconds = 1000.0;
    assert_eq!(spec.retry_tiers(), 3);
    let conn = amqp::connect(&testing::amqp_url(), "operator-test")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    amqp::declare_task_type(&channel, &spec).await.unwrap();
    let api = management();
    let queues = QueueNames::of(&spec.name);
    let last = queues.retry_tier(2);
    channel
        .basic_publish(
            "",
            &last,
            lapin::options::BasicPublishOptions::default(),
            b"{}",
            lapin::BasicProperties::default().with_expiration("600000".into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    // Edited to one retry: tier 2 is no longer the type's, but it still holds a retry.
    spec.max_retries = 1;
    assert_eq!(spec.retry_tiers(), 1);
    testing::wait_until(
        "the broker counts the message",
        Duration::from_secs(15),
        || async { api.depths(&spec).await.is_ok_and(|d| d.retry == 1) },
    )
    .await;
    assert!(
        !api.delete_queue_if_empty(&last).await.unwrap(),
        "kept while it holds a retry"
    );
    assert_eq!(api.depths(&spec).await.unwrap().retry, 1, "still counted");

    channel
        .queue_purge(&last, lapin::options::QueuePurgeOptions::default())
        .await
        .unwrap();
    // The management API's counts lag the queue by a stats interval.
    testing::wait_until(
        "the broker counts it empty",
        Duration::from_secs(30),
        || async { api.depths(&spec).await.is_ok_and(|d| d.retry == 0) },
    )
    .await;
    assert!(
        api.delete_queue_if_empty(&last).await.unwrap(),
        "deleted once empty"
    );
    assert!(api.effective_policy(&last).await.is_err(), "{last} is gone");
    assert!(
        api.delete_queue_if_empty(&last).await.unwrap(),
        "a missing queue is fine"
    );

    for queue in queues.all(3) {
        api.delete_queue(&queue).await.unwrap();
    }
    let _ = conn.close(200, "done").await;
}

#[tokio::test]
async fn a_refused_amqp_login_is_reported_as_refused_not_unavailable() {
    // A wrong password is the user's to fix; "RabbitMQ unavailable" would send them to the
    // broker's uptime instead.
    let url = testing::amqp_url().replacen("conveyor:conveyor@", "conveyor:wrong-password@", 1);
    let err = amqp::connect(&url, "operator-test").await.unwrap_err();
    assert!(matches!(err, amqp::AmqpError::LoginRefused(_)), "{err:?}");
    let reported = conveyor_operator::error::Error::Amqp(err);
    assert_eq!(reported.category(), "RabbitMQRefused", "{reported}");
}

#[tokio::test]
async fn a_certificate_the_ca_setting_does_not_match_is_a_tls_setting_not_an_outage() {
    // The broker is up; only the CA given is not the one that signed its certificate (here:
    // the public roots). "RabbitMQ unavailable" would send the user to the broker's uptime.
    let public_roots = "/etc/ssl/certs/ca-certificates.crt";
    let url = testing::amqp_url();
    let (head, _) = url
        .split_once("cacertfile=")
        .expect("the test broker URL names its CA");
    let wrong_ca = format!("{head}cacertfile={public_roots}");
    let err = amqp::connect(&wrong_ca, "operator-test").await.unwrap_err();
    assert!(matches!(err, amqp::AmqpError::Certificate(_)), "{err:?}");
    let reported = conveyor_operator::error::Error::Amqp(err);
    assert_eq!(reported.category(), "TLSSettings", "{reported}");

    let public_only = conveyor_core::tls::TrustedRoots::default();
    let api = ManagementApi::new(
        testing::MANAGEMENT_API,
        "conveyor",
        "conveyor",
        "/",
        &public_only,
    )
    .unwrap();
    let err = api.list_queues().await.unwrap_err();
    assert_eq!(err.category(), "TLSSettings", "{err}");
    assert!(!err.says_broker_out(), "{err}");
}
