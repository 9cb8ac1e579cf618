//! Degraded mode against a real PostgreSQL behind a proxy: the worker's breaker opens, its
//! finished outcomes go to the fsynced buffer, and they are replayed once the database
//! returns, by the same process or by the next one after a `kill -9`.

use std::path::Path;
use std::time::Duration;

use conveyor_core::testing::proxy::Proxy;
use conveyor_core::TaskState::*;
use uuid::Uuid;

use crate::support::*;

/// A worker process that is killed when the test ends, passed or not.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[tokio::test]
async fn outcomes_buffered_through_an_outage_survive_a_kill_and_are_replayed_once() {
    let spec = test_type("degraded");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let database = Proxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let via_proxy = harness
        .db_url
        .replace(":5432/", &format!(":{}/", database.port));
    let dir = std::env::temp_dir().join(format!("conveyor-degraded-{}", Uuid::new_v4()));
    let buffer = dir.join("buffering.jsonl");
    let listen = format!("127.0.0.1:{}", free_port());
    let args = [
        "--handler",
        "sleep",
        "--concurrency",
        "4",
        "--database-timeout-seconds",
        "1",
        "--database-url",
        &via_proxy,
        "--buffer-dir",
        dir.to_str().unwrap(),
        "--metrics-listen",
        &listen,
    ];
    let mut first = Reaped(harness.spawn_worker_process("buffering", &[&name], &args));
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(
            harness
                .submit_ok(&name, serde_json::json!({"sleepMs": 1500}))
                .await,
        );
    }
    harness
        .wait_for_state(&name, Processing, 4, Duration::from_secs(20))
        .await;
    let owner = harness.db.task(ids[0]).await.unwrap().unwrap().owner;

    // The database goes away while the handlers run: their outcomes are buffered.
    database.cut();
    wait_until(
        "four outcomes buffered",
        Duration::from_secs(20),
        || async { lines(&buffer) == 4 },
    )
    .await;
    let open = scrape(&harness.http, &listen, "conveyor_database_breaker_state").await;
    assert_eq!(open, Some(2.0), "the breaker is open");
    let ready = harness
        .http
        .get(format!("http://{listen}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    assert!(ready.text().await.unwrap().contains("4 outcomes buffered"));

    // Killed while degraded, past the heartbeat timeout; the next process of the same pod
    // (same buffer) comes up before the database does.
    kill(&first.0, "KILL");
    first.0.wait().unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let second = Reaped(harness.spawn_worker_process("buffering", &[&name], &args));
    tokio::time::sleep(Duration::from_secs(1)).await;
    database.restore();

    harness
        .wait_for_state(&name, Completed, 4, Duration::from_secs(30))
        .await;
    for id in &ids {
        let events = harness.events(*id).await;
        assert_valid_chain(&events);
        let done: Vec<_> = events.iter().filter(|e| e.to_state == Completed).collect();
        assert_eq!(done.len(), 1, "{:?}", states(&events));
        let reruns = events.iter().filter(|e| e.to_state == RetryClaimed).count();
        assert_eq!(reruns, 0, "not re-run: {:?}", states(&events));
        assert_eq!(done[0].worker_id, owner, "the first process's outcome");
    }
    wait_until("buffer emptied", Duration::from_secs(10), || async {
        lines(&buffer) == 0
    })
    .await;
    let replayed = format!(
        "conveyor_replayed_transitions_total{{outcome=\"completed\",task_type=\"{name}\"}}"
    );
    assert_eq!(scrape(&harness.http, &listen, &replayed).await, Some(4.0));

    // Closed again: new work flows.
    harness.submit_ok(&name, serde_json::json!({})).await;
    harness
        .wait_for_state(&name, Completed, 5, Duration::from_secs(20))
        .await;
    drop(second);
    let _ = std::fs::remove_dir_all(&dir);
    harness.shutdown().await;
}
