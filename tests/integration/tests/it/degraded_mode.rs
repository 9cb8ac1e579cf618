//! Degraded mode against a real PostgreSQL behind a proxy: the worker's breaker opens, its
//! finished outcomes go to the fsynced buffer, and they are replayed once the database
//! returns, by the same process or by the next one after a `kill -9`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use conveyor_core::testing::{self, proxy::Proxy};
use conveyor_core::TaskState::*;
use conveyor_worker::breaker::Breaker;
use conveyor_worker::buffer::{Buffer, Outcome, Transition};
use conveyor_worker::outcome::Recorder;
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
    let database = Proxy::start(testing::DATABASE_ADDRESS.parse().unwrap()).await;
    let via_proxy = testing::via_port(&harness.db_url, testing::DATABASE_ADDRESS, database.port);
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
    // Queued before the worker starts, so that it takes all four at once; long enough that
    // the cut comes while they all run, however slow the machine.
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(
            harness
                .submit_ok(&name, serde_json::json!({"sleepMs": 5000}))
                .await,
        );
    }
    let mut first = Reaped(harness.spawn_worker_process("buffering", &[&name], &args));
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

/// A replay that repeats itself (a crash between writing an outcome and forgetting it, or a
/// reset at COMMIT) changes nothing: the write is fenced by owner and attempt.
#[tokio::test]
async fn replaying_an_outcome_twice_writes_and_publishes_it_once() {
    let spec = test_type("replay");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec.clone()]).await;
    let completed = harness.submit_ok(&name, serde_json::json!({})).await;
    let failed = harness.submit_ok(&name, serde_json::json!({})).await;
    for id in [completed, failed] {
        assert!(harness.db.claim(id, 0, "replayer").await.unwrap().won());
    }
    let metrics = conveyor_core::metrics::Metrics::new();
    let dir = std::env::temp_dir().join(format!("conveyor-replay-{}", Uuid::new_v4()));
    let recorder = Recorder {
        db: harness.db.clone(),
        writes: harness.db.owner_writes("replayer", None),
        publisher: Arc::new(harness.publisher()),
        breaker: Arc::new(Breaker::new(false, Duration::from_secs(2), metrics.clone())),
        buffer: Buffer::open(&dir.join("replayer.jsonl"), 1 << 20).unwrap(),
        types: [(name.clone(), spec.clone())].into(),
        metrics: metrics.clone(),
    };
    let outcome = |id, outcome| Transition {
        id,
        attempt: 0,
        owner: "replayer".into(),
        task_type: name.clone(),
        outcome,
    };
    let done = outcome(
        completed,
        Outcome::Completed {
            result: serde_json::json!({"ok": true}),
        },
    );
    let broke = outcome(
        failed,
        Outcome::Failed {
            error: "boom".into(),
        },
    );

    // Buffered (the breaker opens), replayed, then buffered again as if never forgotten.
    for _ in 0..2 {
        recorder.buffer(done.clone()).await.unwrap();
        recorder.buffer(broke.clone()).await.unwrap();
        assert!(!recorder.breaker.is_closed());
        assert_eq!(recorder.replay().await.unwrap(), 2);
        assert!(recorder.buffer.is_empty());
    }
    let replayed = |outcome: &str| metrics.replayed.with_label_values(&[&name, outcome]).get();
    assert_eq!(
        (
            replayed("completed"),
            replayed("retried"),
            replayed("not_owned")
        ),
        (1, 1, 2)
    );
    for id in [completed, failed] {
        let events = harness.events(id).await;
        assert_valid_chain(&events);
        let written = events
            .iter()
            .filter(|e| matches!(e.to_state, Completed | Failed))
            .count();
        assert_eq!(written, 1, "{:?}", states(&events));
    }
    // One retry message: after its backoff the work queue holds the two original messages
    // (nobody consumes here) and that one, no more.
    let main = queue(&name).main;
    wait_until("the retry comes back", Duration::from_secs(10), || async {
        harness.ready_count(&main).await == 3
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(harness.ready_count(&main).await, 3);
    let _ = std::fs::remove_dir_all(&dir);
    harness.shutdown().await;
}

#[tokio::test]
async fn an_outcome_the_database_always_refuses_does_not_wedge_the_replay() {
    let spec = test_type("refused");
    let name = spec.name.clone();
    // A second type whose queues are gone by the time of the replay.
    let gone = test_type("noqueue");
    let gone_name = gone.name.clone();
    let harness = Harness::start(vec![spec.clone(), gone.clone()]).await;
    let nul_result = harness.submit_ok(&name, serde_json::json!({})).await;
    let no_queue = harness.submit_ok(&gone_name, serde_json::json!({})).await;
    let fine = harness.submit_ok(&name, serde_json::json!({})).await;
    for id in [nul_result, no_queue, fine] {
        assert!(harness.db.claim(id, 0, "replayer").await.unwrap().won());
    }
    conveyor_core::testing::delete_queues(&gone_name).await;
    let metrics = conveyor_core::metrics::Metrics::new();
    let dir = std::env::temp_dir().join(format!("conveyor-refused-{}", Uuid::new_v4()));
    let recorder = Recorder {
        db: harness.db.clone(),
        writes: harness.db.owner_writes("replayer", None),
        publisher: Arc::new(harness.publisher()),
        breaker: Arc::new(Breaker::new(false, Duration::from_secs(2), metrics.clone())),
        buffer: Buffer::open(&dir.join("replayer.jsonl"), 1 << 20).unwrap(),
        types: [
            (name.clone(), spec.clone()),
            (gone_name.clone(), gone.clone()),
        ]
        .into(),
        metrics: metrics.clone(),
    };
    let outcome = |id, task_type: &str, outcome| Transition {
        id,
        attempt: 0,
        owner: "replayer".into(),
        task_type: task_type.to_owned(),
        outcome,
    };
    // PostgreSQL refuses a NUL character in jsonb, however often it is asked.
    let entries = [
        outcome(
            nul_result,
            &name,
            Outcome::Completed {
                result: serde_json::json!({"stdout": "a\u{0}b"}),
            },
        ),
        outcome(
            no_queue,
            &gone_name,
            Outcome::Failed {
                error: "boom\u{0}".into(),
            },
        ),
        outcome(
            fine,
            &name,
            Outcome::Completed {
                result: serde_json::json!({"ok": true}),
            },
        ),
    ];
    for entry in entries {
        recorder.buffer(entry).await.unwrap();
    }
    recorder
        .replay()
        .await
        .expect("the replay gets past what it cannot write");
    assert!(
        recorder.buffer.is_empty(),
        "nothing left to wedge the worker"
    );

    // The refused result became a failed attempt that says why, and will be retried.
    let record = harness.db.task(nul_result).await.unwrap().unwrap();
    assert_eq!((record.state, record.attempt), (Queued, 1));
    assert!(
        record
            .error
            .as_deref()
            .unwrap_or("")
            .contains("could not be stored"),
        "{:?}",
        record.error
    );
    assert_eq!(
        harness.db.task(fine).await.unwrap().unwrap().state,
        Completed
    );
    // The re-queue with nowhere to go is set aside for a human, and its task is left to the
    // reaper (no longer heartbeated from the buffer).
    assert_eq!(
        metrics.quarantined.with_label_values(&[&gone_name]).get(),
        1
    );
    let quarantined = std::fs::read_to_string(dir.join("replayer.rejected.jsonl")).unwrap();
    assert!(quarantined.contains(&no_queue.to_string()), "{quarantined}");
    assert_eq!(
        harness.db.task(no_queue).await.unwrap().unwrap().state,
        Processing
    );
    assert!(recorder.buffer.claims().is_empty());
    for id in [nul_result, fine] {
        assert_valid_chain(&harness.events(id).await);
    }
    let _ = std::fs::remove_dir_all(&dir);
    harness.shutdown().await;
}
