//! Whole task lives through gateway, broker, workers and database.

use std::time::Duration;

use conveyor_core::TaskState::*;
use conveyor_worker::handler::Handler;
use futures_util::stream::{self, StreamExt};
use reqwest::StatusCode;
use uuid::Uuid;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_concurrent_tasks_complete_exactly_once_with_full_audit_chains() {
    let spec = test_type("bulk");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let w1 = harness.start_worker(&[&name], Handler::Noop, 32);
    let w2 = harness.start_worker(&[&name], Handler::Noop, 32);

    let answers: Vec<(StatusCode, serde_json::Value)> = stream::iter(0..1000)
        .map(|i| harness.submit(&name, serde_json::json!({ "n": i }), None))
        .buffer_unordered(64)
        .collect()
        .await;
    assert!(answers
        .iter()
        .all(|(s, b)| *s == StatusCode::CREATED && b["state"] == "QUEUED"));

    harness
        .wait_for_state(&name, Completed, 1000, Duration::from_secs(120))
        .await;
    assert_eq!(harness.total_tasks(&name).await, 1000);
    let chains = harness.chains(&name).await;
    for chain in chains.values() {
        assert_valid_chain(chain);
        assert_eq!(
            states(chain),
            [Ingested, Queued, Claimed, Processing, Completed]
        );
        let owner = chain[2]
            .worker_id
            .as_deref()
            .expect("claim names the worker");
        assert!(owner == w1 || owner == w2);
        assert!(chain[2..]
            .iter()
            .all(|e| e.worker_id.as_deref() == Some(owner)));
    }
    let completed = || -> u64 {
        [&w1, &w2]
            .iter()
            .map(|w| {
                harness
                    .worker_metrics(w)
                    .tasks
                    .with_label_values(&[&name, "completed"])
                    .get()
            })
            .sum()
    };
    wait_until(
        "1000 completions counted",
        Duration::from_secs(10),
        || async { completed() == 1000 },
    )
    .await;
    assert_eq!(harness.ready_count(&queue(&name).main).await, 0);
    harness.shutdown().await;
}

#[tokio::test]
async fn failures_retry_with_growing_delays_then_dead_letter_and_redrive_brings_them_back() {
    let spec = test_type("failing");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let failing = harness.start_worker(&[&name], Handler::Fail, 4);
    let id = harness.submit_ok(&name, serde_json::json!({})).await;

    harness
        .wait_for_state(&name, DeadLetter, 1, Duration::from_secs(30))
        .await;
    let events = harness.events(id).await;
    assert_valid_chain(&events);
    assert_eq!(
        events.iter().filter(|e| e.to_state == Failed).count(),
        4,
        "first try + 3 retries"
    );
    // Delay between FAILED → QUEUED and the next CLAIMED: the backoff, growing each time.
    let delays: Vec<Duration> = events
        .windows(2)
        .filter(|w| w[0].from_state == Some(Failed) && w[0].to_state == Queued)
        .map(|w| (w[1].at - w[0].at).to_std().unwrap())
        .collect();
    assert_eq!(delays.len(), 3, "{:?}", states(&events));
    // Growing delays, each at least its backoff (0.2 s × 2^i, jitter takes up to a quarter
    // off): lower bounds only, since a busy machine only makes them longer.
    for (i, delay) in delays.iter().enumerate() {
        let least = Duration::from_millis(140 << i);
        assert!(*delay >= least, "retry {i}: {delays:?}");
    }
    let last = events.last().unwrap();
    assert_eq!(last.to_state, DeadLetter);
    assert!(last
        .detail
        .as_deref()
        .unwrap_or("")
        .contains("retries exhausted"));
    // Counted once each commit has returned, a moment after the database shows it.
    let metrics = harness.worker_metrics(&failing).clone();
    wait_until(
        "retries and the dead letter counted",
        Duration::from_secs(10),
        || async {
            metrics.retries.with_label_values(&[&name]).get() == 3
                && metrics.dead_letters.with_label_values(&[&name]).get() == 1
        },
    )
    .await;
    harness.take_worker(&failing).stop().await;
    wait_until("parked in remediation", Duration::from_secs(10), || async {
        harness.ready_count(&queue(&name).remediation).await == 1
    })
    .await;

    let stdout = harness.conveyorctl(&["redrive-queue", "--type", &name, "--by", "ops-test"]);
    assert!(stdout.contains("redriven: 1"), "{stdout}");
    assert_eq!(harness.ready_count(&queue(&name).remediation).await, 0);
    assert_eq!(harness.ready_count(&queue(&name).main).await, 1);
    let record = harness.db.task(id).await.unwrap().unwrap();
    assert_eq!((record.state, record.retries), (Queued, 0));
    let redrive = harness.events(id).await.pop().unwrap();
    assert_eq!(
        (redrive.from_state, redrive.to_state),
        (Some(DeadLetter), Queued)
    );
    assert_eq!(redrive.worker_id.as_deref(), Some("ops-test"));

    harness.start_worker(&[&name], Handler::Noop, 4);
    harness
        .wait_for_state(&name, Completed, 1, Duration::from_secs(20))
        .await;
    assert_valid_chain(&harness.events(id).await);
    harness.shutdown().await;
}

#[tokio::test]
async fn a_duplicate_delivery_completes_once_and_is_counted() {
    let spec = test_type("dup");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let id = harness.submit_ok(&name, serde_json::json!({"x": 1})).await;
    // Publish the very same message a second time, as a broker redelivery would.
    let task = harness.db.task(id).await.unwrap().unwrap();
    let duplicate = conveyor_core::amqp::Outgoing {
        message: task.message(),
        route: conveyor_core::task::Requeue::Main,
        delay: None,
        retry_tier: 0,
    };
    for result in harness.publisher().publish(&[duplicate]).await {
        result.unwrap();
    }
    assert_eq!(harness.ready_count(&queue(&name).main).await, 2);

    let worker = harness.start_worker(&[&name], Handler::Noop, 1);
    harness
        .wait_for_state(&name, Completed, 1, Duration::from_secs(20))
        .await;
    let metrics = harness.worker_metrics(&worker).clone();
    wait_until("duplicate counted", Duration::from_secs(10), || async {
        metrics.duplicates.with_label_values(&[&name]).get() == 1
    })
    .await;
    assert_eq!(
        metrics.tasks.with_label_values(&[&name, "completed"]).get(),
        1
    );
    let events = harness.events(id).await;
    assert_eq!(events.iter().filter(|e| e.to_state == Completed).count(), 1);
    assert_eq!(harness.ready_count(&queue(&name).main).await, 0);
    harness.shutdown().await;
}

#[tokio::test]
async fn a_short_retry_is_not_held_behind_a_long_one() {
    // Backoff 0.3 s, 3 s, 30 s: three retry queues, one per retry number.
    let mut spec = test_type("tiers");
    spec.backoff.initial_seconds = 0.3;
    spec.backoff.multiplier = 10.0;
    spec.backoff.max_seconds = 30.0;
    assert_eq!(spec.retry_tiers(), 3);
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec.clone()]).await;
    let retry = |attempt: i32, retry_number: u32, delay: Duration| conveyor_core::amqp::Outgoing {
        message: conveyor_core::task::TaskMessage {
            id: Uuid::new_v4(),
            task_type: name.clone(),
            attempt,
            idempotency_key: Uuid::new_v4(),
            payload: serde_json::json!({}),
            submitted_at: chrono::Utc::now(),
            suspect: false,
            traceparent: None,
        },
        route: conveyor_core::task::Requeue::Retry,
        delay: Some(delay),
        retry_tier: spec.retry_tier(retry_number),
    };
    // A third retry (20 s) first, then a first retry (0.3 s) of another task.
    let long = retry(3, 2, Duration::from_secs(20));
    let short = retry(1, 0, Duration::from_millis(300));
    let publisher = harness.publisher();
    for out in [&long, &short] {
        for result in publisher.publish(std::slice::from_ref(out)).await {
            result.unwrap();
        }
    }
    // With one retry queue, the short one would expire only after the long one at its head.
    let conn = conveyor_core::amqp::connect(&conveyor_core::testing::amqp_url(), "tiers-test")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let first = std::cell::Cell::new(None);
    wait_until(
        "a retry back in the work queue",
        Duration::from_secs(60),
        || async {
            if let Some(message) = channel
                .basic_get(&queue(&name).main, Default::default())
                .await
                .unwrap()
            {
                let task: conveyor_core::task::TaskMessage =
                    serde_json::from_slice(&message.delivery.data).unwrap();
                first.set(Some(task.id));
                message
                    .delivery
                    .acker
                    .ack(Default::default())
                    .await
                    .unwrap();
            }
            first.get().is_some()
        },
    )
    .await;
    assert_eq!(
        first.get(),
        Some(short.message.id),
        "the short retry came back first"
    );
    let _ = conn.close(200, "done").await;
    harness.shutdown().await;
}
