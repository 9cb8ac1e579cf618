//! Real worker processes killed, paused and stopped in the middle of their tasks.

use std::time::Duration;

use conveyor_core::TaskState::*;
use conveyor_worker::handler::Handler;

use crate::support::*;

/// Waits until the task is PROCESSING by a worker whose id starts with `prefix`.
async fn wait_owned_by(harness: &Harness, id: uuid::Uuid, prefix: &str) {
    wait_until(
        &format!("task owned by {prefix}"),
        Duration::from_secs(20),
        || async {
            let task = harness.db.task(id).await.unwrap().unwrap();
            task.state == Processing && task.owner.as_deref().unwrap_or("").starts_with(prefix)
        },
    )
    .await;
}

#[tokio::test]
async fn a_worker_killed_mid_task_has_its_task_rerun_after_the_heartbeat_timeout() {
    let spec = test_type("kill9");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let mut victim = harness.spawn_worker_process("victim", &[&name], &["--handler", "sleep"]);
    let id = harness
        .submit_ok(&name, serde_json::json!({"sleepMs": 1500}))
        .await;
    wait_owned_by(&harness, id, "victim").await;
    kill(&victim, "KILL");
    victim.wait().unwrap();

    let rescuer = harness.start_worker(&[&name], Handler::Sleep, 4);
    harness
        .wait_for_state(&name, Completed, 1, Duration::from_secs(30))
        .await;
    let events = harness.events(id).await;
    assert_valid_chain(&events);
    let timeout = events
        .iter()
        .find(|e| e.to_state == RetryClaimed)
        .expect("re-queued");
    assert!(timeout
        .detail
        .as_deref()
        .unwrap()
        .contains("heartbeat timeout"));
    assert!(timeout.detail.as_deref().unwrap().contains("victim"));
    let completed: Vec<_> = events.iter().filter(|e| e.to_state == Completed).collect();
    assert_eq!(completed.len(), 1);
    assert_eq!(completed[0].worker_id.as_deref(), Some(rescuer.as_str()));
    assert_eq!(completed[0].attempt, 1);
    harness.shutdown().await;
}

#[tokio::test]
async fn a_paused_owner_is_fenced_when_it_wakes_up() {
    let spec = test_type("sigstop");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut sleeper = harness.spawn_worker_process(
        "sleeper",
        &[&name],
        &["--handler", "sleep", "--metrics-listen", &listen],
    );
    let id = harness
        .submit_ok(&name, serde_json::json!({"sleepMs": 1500}))
        .await;
    wait_owned_by(&harness, id, "sleeper").await;
    kill(&sleeper, "STOP");

    // The re-queued copy may be delivered to the frozen worker, which holds it until the
    // broker misses its AMQP heartbeats (2 s here) and closes the connection.
    let rescuer = harness.start_worker(&[&name], Handler::Sleep, 4);
    harness
        .wait_for_state(&name, Completed, 1, Duration::from_secs(45))
        .await;
    kill(&sleeper, "CONT");
    // The woken worker finishes its sleep, tries to complete, and is refused.
    let metrics_url = format!("http://{listen}/metrics");
    let fenced_line = format!("conveyor_fenced_total{{task_type=\"{name}\"}} 1");
    wait_until("late owner fenced", Duration::from_secs(20), || async {
        let text = match harness.http.get(&metrics_url).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        text.contains(&fenced_line)
    })
    .await;
    let events = harness.events(id).await;
    assert_valid_chain(&events);
    let completed: Vec<_> = events.iter().filter(|e| e.to_state == Completed).collect();
    assert_eq!(completed.len(), 1, "{:?}", states(&events));
    assert_eq!(completed[0].worker_id.as_deref(), Some(rescuer.as_str()));
    kill(&sleeper, "KILL");
    sleeper.wait().unwrap();
    harness.shutdown().await;
}

#[tokio::test]
async fn sigterm_drains_in_flight_work_and_releases_what_cannot_finish() {
    let spec = test_type("drain");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    // Two short tasks finish within the grace period; two long ones cannot. All four are
    // queued before the worker starts, so that it takes them together.
    let short: Vec<_> = futures_util::future::join_all(
        (0..2).map(|_| harness.submit_ok(&name, serde_json::json!({"sleepMs": 3000}))),
    )
    .await;
    let long: Vec<_> = futures_util::future::join_all(
        (0..2).map(|_| harness.submit_ok(&name, serde_json::json!({"sleepMs": 120000}))),
    )
    .await;
    let mut worker = harness.spawn_worker_process(
        "draining",
        &[&name],
        &[
            "--handler",
            "sleep",
            "--concurrency",
            "4",
            "--drain-grace-seconds",
            "15",
        ],
    );
    wait_until("all four running", Duration::from_secs(20), || async {
        harness.count(&name, Processing).await == 4
    })
    .await;
    kill(&worker, "TERM");
    let status = worker.wait().unwrap();
    assert!(status.success(), "worker exit: {status}");

    for id in &short {
        let task = harness.db.task(*id).await.unwrap().unwrap();
        assert_eq!(
            (task.state, task.attempt),
            (Completed, 0),
            "finished during the drain"
        );
    }
    for id in &long {
        let task = harness.db.task(*id).await.unwrap().unwrap();
        assert_eq!(
            (task.state, task.attempt, task.retries),
            (Queued, 1, 0),
            "released"
        );
        let events = harness.events(*id).await;
        assert!(events
            .iter()
            .any(|e| e.detail.as_deref() == Some("released by a worker shutting down")));
    }
    assert_eq!(
        harness.ready_count(&queue(&name).main).await,
        2,
        "released tasks are queued"
    );
    harness.shutdown().await;
}

/// A worker's answer to a drain request (`POST` drains, `DELETE` resumes).
/// The admin token the drained worker below is started with (the operator sets one per
/// pool).
const ADMIN_TOKEN: &str = "drain-test-admin-token";

async fn ask_drain(harness: &Harness, method: reqwest::Method, url: &str) -> serde_json::Value {
    harness
        .http
        .request(method, url)
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_drained_worker_finishes_what_it_holds_takes_nothing_new_and_resumes() {
    let spec = test_type("quiesce");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let listen = format!("127.0.0.1:{}", free_port());
    let mut worker = harness.spawn_worker_process(
        "quiesced",
        &[&name],
        &[
            "--handler",
            "sleep",
            "--concurrency",
            "2",
            "--metrics-listen",
            &listen,
            "--admin-token",
            ADMIN_TOKEN,
        ],
    );
    // Another pod reaches the admin port, but without the token it cannot pause the worker
    // (issue 33, item 2).
    let drain = format!("http://{listen}/drain");
    wait_until(
        "the admin port answers",
        Duration::from_secs(20),
        || async { harness.http.get(&drain).send().await.is_ok() },
    )
    .await;
    for (token, method) in [
        (None, reqwest::Method::POST),
        (Some("a-guess"), reqwest::Method::POST),
        (None, reqwest::Method::DELETE),
    ] {
        let mut request = harness.http.request(method.clone(), &drain);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let status = request.send().await.unwrap().status();
        assert_eq!(status, 401, "{method} with {token:?}");
    }
    let state: serde_json::Value = harness
        .http
        .get(&drain)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(state["draining"], false, "{state}");
    let held: Vec<_> = futures_util::future::join_all(
        (0..2).map(|_| harness.submit_ok(&name, serde_json::json!({"sleepMs": 3000}))),
    )
    .await;
    wait_until("both tasks running", Duration::from_secs(20), || async {
        harness.count(&name, Processing).await == 2
    })
    .await;

    // The operator's scale-down handshake: stop taking tasks, finish what is held.
    let answer = ask_drain(&harness, reqwest::Method::POST, &drain).await;
    assert_eq!(answer["draining"], true, "{answer}");
    assert_eq!(answer["idle"], false, "two tasks in hand: {answer}");
    let ready = harness
        .http
        .get(format!("http://{listen}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503, "a draining worker is not ready");
    let later: Vec<_> = futures_util::future::join_all(
        (0..3).map(|_| harness.submit_ok(&name, serde_json::json!({"sleepMs": 10}))),
    )
    .await;
    wait_until("drained and idle", Duration::from_secs(30), || async {
        let state: serde_json::Value = match harness.http.get(&drain).send().await {
            Ok(r) => r.json().await.unwrap_or_default(),
            Err(_) => return false,
        };
        state["idle"] == true
    })
    .await;
    // What it held finished where it ran; what came later waits in the queue.
    for id in &held {
        let task = harness.db.task(*id).await.unwrap().unwrap();
        assert_eq!((task.state, task.attempt), (Completed, 0));
    }
    assert_eq!(harness.count(&name, Completed).await, 2);
    assert_eq!(harness.ready_count(&queue(&name).main).await, 3);

    // Needed again: it takes tasks as before.
    let answer = ask_drain(&harness, reqwest::Method::DELETE, &drain).await;
    assert_eq!(answer["draining"], false, "{answer}");
    harness
        .wait_for_state(&name, Completed, 5, Duration::from_secs(30))
        .await;
    for id in held.iter().chain(&later) {
        let events = harness.events(*id).await;
        assert_valid_chain(&events);
        assert!(
            !events.iter().any(|e| e.to_state == RetryClaimed),
            "re-run: {:?}",
            states(&events)
        );
    }
    kill(&worker, "TERM");
    worker.wait().unwrap();
    harness.shutdown().await;
}

/// A bug in a handler (a panic) used to leave its task owned by the worker for the worker's
/// whole life: heartbeated, never reaped, its redelivery dropped by the claim (issue 32).
#[tokio::test]
async fn a_handler_that_panics_fails_its_attempt_and_strands_nothing() {
    let mut spec = test_type("panics");
    spec.max_retries = 1;
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let worker = harness.start_worker(&[&name], Handler::Panic, 2);
    let id = harness.submit_ok(&name, serde_json::json!({})).await;

    harness
        .wait_for_state(&name, DeadLetter, 1, Duration::from_secs(60))
        .await;
    let events = harness.events(id).await;
    assert_valid_chain(&events);
    let failures: Vec<_> = events.iter().filter(|e| e.to_state == Failed).collect();
    assert_eq!(failures.len(), 2, "first try + 1 retry: {events:?}");
    for failure in failures {
        let detail = failure.detail.as_deref().unwrap_or("");
        assert!(detail.contains("the handler panicked"), "{detail}");
    }
    // Nothing is left heartbeated: the worker owns no task.
    wait_until("no task in flight", Duration::from_secs(10), || async {
        harness.worker_metrics(&worker).in_flight.get() == 0
    })
    .await;
    harness.shutdown().await;
}
