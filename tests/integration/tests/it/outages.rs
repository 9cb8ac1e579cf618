//! The broker and the database going away under the gateway and the workers.

use std::time::Duration;

use conveyor_core::TaskState::*;
use conveyor_worker::handler::Handler;
use reqwest::StatusCode;
use uuid::Uuid;

use crate::support::*;
use conveyor_core::testing::{self, proxy::Proxy};

fn amqp_url_via(port: u16) -> String {
    testing::via_port(&testing::amqp_url(), testing::BROKER_ADDRESS, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_connection_loss_answers_503_then_everything_reconnects_without_loss() {
    let spec = test_type("brokerloss");
    let name = spec.name.clone();
    let broker = Proxy::start(testing::BROKER_ADDRESS.parse().unwrap()).await;
    let via = amqp_url_via(broker.port);
    let mut harness = Harness::start_with(vec![spec], |config| config.amqp_url = via.clone()).await;
    harness.start_worker_via(&[&name], Handler::Noop, 8, &via);

    let before: Vec<Uuid> = (0..20).map(|_| Uuid::new_v4()).collect();
    for key in &before {
        let (status, _) = harness
            .submit(&name, serde_json::json!({}), Some(*key))
            .await;
        assert_eq!(status, StatusCode::CREATED);
    }
    harness
        .wait_for_state(&name, Completed, 20, Duration::from_secs(20))
        .await;

    broker.cut();
    let during: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    for key in &during {
        let (status, body) = harness
            .submit(&name, serde_json::json!({}), Some(*key))
            .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(body["error"]["code"], "broker_unavailable");
    }
    broker.restore();

    // The client retries with the same keys: each task is queued once, never twice.
    for key in &during {
        wait_until(
            "gateway publishes again",
            Duration::from_secs(20),
            || async {
                let (status, _) = harness
                    .submit(&name, serde_json::json!({}), Some(*key))
                    .await;
                status.is_success()
            },
        )
        .await;
    }
    for _ in 0..10 {
        harness.submit_ok(&name, serde_json::json!({})).await;
    }
    // The worker reconnected by itself and finishes everything, each task once.
    harness
        .wait_for_state(&name, Completed, 35, Duration::from_secs(60))
        .await;
    assert_eq!(harness.total_tasks(&name).await, 35);
    for chain in harness.chains(&name).await.values() {
        assert_valid_chain(chain);
        assert_eq!(chain.iter().filter(|e| e.to_state == Completed).count(), 1);
    }
    harness.shutdown().await;
}

/// A cluster setting (one URL per node, here two proxies to the one broker): whichever
/// node the gateway and the worker are on goes away, and they carry on through the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_given_every_node_move_to_a_surviving_one() {
    let spec = test_type("nodeloss");
    let name = spec.name.clone();
    let broker = testing::BROKER_ADDRESS.parse().unwrap();
    let nodes = [Proxy::start(broker).await, Proxy::start(broker).await];
    let setting = format!(
        "{}, {}",
        amqp_url_via(nodes[0].port),
        amqp_url_via(nodes[1].port)
    );
    let mut harness =
        Harness::start_with(vec![spec], |config| config.amqp_url = setting.clone()).await;
    harness.start_worker_via(&[&name], Handler::Noop, 8, &setting);
    let mut done = 0;
    for (down, up) in [(0, 1), (1, 0)] {
        nodes[up].restore();
        nodes[down].cut();
        // Each client finds its link gone on its next use (the worker by its heartbeat).
        for _ in 0..10 {
            let key = Uuid::new_v4();
            wait_until(
                "the gateway publishes through the node that is up",
                Duration::from_secs(30),
                || async {
                    let (status, _) = harness
                        .submit(&name, serde_json::json!({}), Some(key))
                        .await;
                    status.is_success()
                },
            )
            .await;
        }
        done += 10;
        harness
            .wait_for_state(&name, Completed, done, Duration::from_secs(60))
            .await;
    }
    assert_eq!(harness.total_tasks(&name).await, 20);
    harness.shutdown().await;
}

#[tokio::test]
async fn database_outage_answers_503_and_records_nothing_half_way() {
    let spec = test_type("dbloss");
    let name = spec.name.clone();
    let database = Proxy::start(testing::DATABASE_ADDRESS.parse().unwrap()).await;
    let port = database.port;
    let harness = Harness::start_with(vec![spec], |config| {
        let url = testing::via_port(&config.database.url, testing::DATABASE_ADDRESS, port);
        config.database.url = url;
        config.database.acquire_timeout = Duration::from_secs(2);
    })
    .await;
    harness.submit_ok(&name, serde_json::json!({})).await;

    database.cut();
    let key = Uuid::new_v4();
    let (status, body) = harness
        .submit(&name, serde_json::json!({}), Some(key))
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "database_unavailable");
    let ready = harness
        .http
        .get(format!("{}/readyz", harness.admin_url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
    database.restore();

    wait_until("gateway records again", Duration::from_secs(20), || async {
        harness
            .submit(&name, serde_json::json!({}), Some(key))
            .await
            .0
            == StatusCode::CREATED
    })
    .await;
    assert_eq!(harness.total_tasks(&name).await, 2);
    assert_eq!(
        harness.ready_count(&queue(&name).main).await,
        2,
        "one message per task"
    );
    harness.shutdown().await;
}
