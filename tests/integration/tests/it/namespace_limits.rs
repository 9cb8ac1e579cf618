//! What one namespace may take of a gateway, however many ClientTokens it mints (issue 33,
//! item 3): requests in flight, task streams and tasks per second are counted over all of
//! its clients; streams cost the database one read per tick, not one per stream; and a list
//! whose filter no index serves reads a bounded part of the history per page.

use std::time::Duration;

use conveyor_core::db::SCAN_BOUND;
use conveyor_core::task_type::{NamedTaskType, TaskTypeSpec};
use conveyor_core::testing;
use conveyor_gateway::auth::Tokens;
use reqwest::{Response, StatusCode};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::{set_state, Harness, TOKEN};

const CALM: &str = "calm-namespace-token-1";
/// Four clients of one namespace, each under its own limits.
const HOSTILE: [&str; 4] = [
    "hostile-namespace-token-1",
    "hostile-namespace-token-2",
    "hostile-namespace-token-3",
    "hostile-namespace-token-4",
];

/// A type of one name in namespaces `calm` and `hostile`, one client of calm and four of
/// hostile.
async fn namespaces(
    adjust: impl FnOnce(&mut conveyor_gateway::GatewayConfig),
) -> (Harness, String) {
    let name = testing::unique_type("limited");
    let types = ["calm", "hostile"]
        .map(|ns| NamedTaskType::in_namespace(ns, &name, TaskTypeSpec::default()))
        .to_vec();
    let harness = Harness::start_with(types, |config| {
        let hostile: Vec<String> = HOSTILE
            .iter()
            .enumerate()
            .map(|(i, token)| format!("h{i}@hostile={token}"))
            .collect();
        config.tokens =
            Tokens::parse_pairs(&format!("c@calm={CALM},{}", hostile.join(","))).unwrap();
        adjust(config);
    })
    .await;
    (harness, name)
}

async fn submit(h: &Harness, token: &str, task_type: &str) -> (StatusCode, Value) {
    let response = h
        .http
        .post(format!("{}/v1/tasks", h.gateway_url))
        .bearer_auth(token)
        .header("Idempotency-Key", Uuid::new_v4().to_string())
        .json(&json!({"taskType": task_type, "payload": {}}))
        .send()
        .await
        .unwrap();
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Submits one task and returns its id.
async fn submitted(h: &Harness, token: &str, task_type: &str) -> String {
    let (status, body) = submit(h, token, task_type).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    body["id"].as_str().unwrap().to_owned()
}

/// Opens a stream of task `id`: the response, kept open while it is held.
async fn stream(h: &Harness, token: &str, id: &str) -> Response {
    h.http
        .get(format!("{}/v1/tasks/{id}/stream", h.gateway_url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_namespace_gets_no_more_streams_or_tasks_by_minting_tokens() {
    let (harness, name) = namespaces(|config| {
        config.requests.namespace.max_streams = 4;
        config.client_limits.namespace_per_second = 1.0;
        config.client_limits.namespace_burst = 12.0;
    })
    .await;
    let hostile_task = submitted(&harness, HOSTILE[0], &name).await;
    let calm_task = submitted(&harness, CALM, &name).await;

    // Two streams from each of the four clients: each client is far under its own 64.
    let mut open = Vec::new();
    let mut refused = Vec::new();
    for token in HOSTILE {
        for _ in 0..2 {
            let response = stream(&harness, token, &hostile_task).await;
            match response.status() {
                StatusCode::OK => open.push(response),
                status => refused.push((status, response.text().await.unwrap())),
            }
        }
    }
    assert_eq!(
        open.len(),
        4,
        "the namespace's 4 streams, over all its clients: {refused:?}"
    );
    for (status, body) in &refused {
        assert_eq!(*status, StatusCode::TOO_MANY_REQUESTS, "{body}");
        assert!(
            body.contains("namespace hostile has 4 task streams open"),
            "{body}"
        );
    }
    // The other namespace is not counted with it.
    let calm = stream(&harness, CALM, &calm_task).await;
    assert_eq!(calm.status(), StatusCode::OK);
    // A closed stream gives its place back.
    drop(open.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let response = stream(&harness, HOSTILE[3], &hostile_task).await;
        if response.status() == StatusCode::OK {
            open.push(response);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a closed stream's place was not given back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Twenty tasks from four clients, each under its own rate: the namespace's burst of 12
    // (one more each second) is shared. The calm namespace's, within its own, are all taken
    // meanwhile.
    let started = std::time::Instant::now();
    let mut accepted = 0;
    for i in 0..20 {
        let (status, body) = submit(&harness, HOSTILE[i % 4], &name).await;
        match status {
            StatusCode::CREATED => accepted += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(body["error"]["code"], "rate_limited", "{body}");
                let message = body["error"]["message"].as_str().unwrap();
                assert!(message.contains("namespace hostile"), "{message}");
            }
            status => panic!("{status}: {body}"),
        }
        if i % 4 == 0 {
            let (status, body) = submit(&harness, CALM, &name).await;
            assert_eq!(status, StatusCode::CREATED, "{body}");
        }
    }
    // One task was taken before: 11 of the burst were left, and one more each second.
    let refilled = started.elapsed().as_secs_f64().ceil() as usize;
    assert!(
        (11..=11 + refilled).contains(&accepted),
        "{accepted} of 20 accepted in {:?}",
        started.elapsed()
    );
    harness.shutdown().await;
}

#[tokio::test]
async fn a_namespace_gets_no_more_requests_in_flight_by_minting_tokens() {
    let (harness, name) = namespaces(|config| {
        config.requests.namespace.max_in_flight = 3;
    })
    .await;
    let task = submitted(&harness, HOSTILE[0], &name).await;
    // A stream is a request in flight for as long as it is open.
    let mut open = Vec::new();
    for token in &HOSTILE[..3] {
        let response = stream(&harness, token, &task).await;
        assert_eq!(response.status(), StatusCode::OK);
        open.push(response);
    }
    let (status, body) = harness.get_json(HOSTILE[3], "/v1/tasks").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("namespace hostile has 3 requests in flight"),
        "{message}"
    );
    let (status, body) = harness.get_json(CALM, "/v1/tasks").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    drop(open);
    harness.shutdown().await;
}

/// Transactions committed in the harness's own database so far, as the server counts them.
async fn commits(h: &Harness) -> i64 {
    sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(h.db.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn three_hundred_streams_cost_the_database_one_read_per_tick() {
    const STREAMS: usize = 300;
    let spec = crate::support::test_type("followed-many");
    let name = spec.name.clone();
    let harness = Harness::start_with(vec![spec], |config| {
        config.requests.max_in_flight = 1000;
        config.requests.namespace.max_in_flight = 1000;
        config.requests.namespace.max_streams = 1000;
    })
    .await;
    let mut ids = Vec::new();
    for _ in 0..STREAMS {
        ids.push(harness.submit_ok(&name, json!({})).await.to_string());
    }
    let mut open = Vec::new();
    for id in &ids {
        let response = stream(&harness, TOKEN, id).await;
        assert_eq!(response.status(), StatusCode::OK);
        open.push(response);
    }
    // The server's counters reach the view within a second of a busy backend's commits, and
    // within ten of an idle one's: the submissions' (some 600) are all in before the window.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let before = commits(&harness).await;
    tokio::time::sleep(Duration::from_secs(15)).await;
    let during = commits(&harness).await - before;
    // A read per stream per second was 4,500 here; one read per 200 ms tick is 75.
    assert!(
        during < 600,
        "{during} transactions in 15 s with {STREAMS} quiet streams open"
    );
    // Every stream still sees its task change.
    let first = &ids[0];
    harness
        .post_json(TOKEN, &format!("/v1/tasks/{first}:cancel"), json!({}))
        .await;
    let mut seen = String::new();
    let response = &mut open[0];
    tokio::time::timeout(Duration::from_secs(30), async {
        while !seen.contains("CANCELLED") {
            let chunk = response.chunk().await.unwrap().expect("open until settled");
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the cancel never reached the stream: {seen}"));
    drop(open);
    harness.shutdown().await;
}

#[tokio::test]
async fn a_list_by_a_state_no_index_serves_reads_a_bounded_part_of_the_history_per_page() {
    let spec = crate::support::test_type("long-history");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    // One RETRY_CLAIMED task, then more than a page's scan of newer completed ones.
    let old = harness.submit_ok(&name, json!({})).await;
    set_state(&harness.db, old, "RETRY_CLAIMED").await;
    let newer: Vec<Uuid> = (0..SCAN_BOUND + 50).map(|_| Uuid::now_v7()).collect();
    sqlx::query(
        "INSERT INTO tasks (id, tenant, idempotency_key, task_type, state, payload)
         SELECT n.id, t.tenant, gen_random_uuid(), t.task_type, 'COMPLETED', '{}'::jsonb
         FROM tasks t, unnest($2::uuid[]) AS n(id) WHERE t.id = $1",
    )
    .bind(old)
    .bind(&newer)
    .execute(harness.db.pool())
    .await
    .unwrap();

    // The first page reads SCAN_BOUND entries, finds nothing, and says where to go on.
    let path = format!("/v1/tasks?type={name}&state=RETRY_CLAIMED&limit=10");
    let (status, page) = harness.get_json(TOKEN, &path).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert_eq!(page["tasks"].as_array().unwrap().len(), 0, "{page}");
    let cursor = page["nextCursor"].as_str().expect("a cursor past the scan");
    // The next one reaches the old task, and ends the list.
    let (status, page) = harness
        .get_json(TOKEN, &format!("{path}&cursor={cursor}"))
        .await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let found: Vec<&str> = page["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap())
        .collect();
    assert_eq!(found, vec![old.to_string().as_str()], "{page}");
    assert!(page["nextCursor"].is_null(), "{page}");
    // A filter an index serves in id order is not bounded: dead letters are found at once.
    set_state(&harness.db, old, "DEAD_LETTER").await;
    let (_, page) = harness
        .get_json(
            TOKEN,
            &format!("/v1/tasks?type={name}&state=DEAD_LETTER&limit=10"),
        )
        .await;
    assert_eq!(page["tasks"].as_array().unwrap().len(), 1, "{page}");
    harness.shutdown().await;
}

#[tokio::test]
async fn the_reaper_runs_while_every_api_connection_waits_on_a_lock() {
    let held = crate::support::test_type("held");
    let reaped = crate::support::test_type("reaped");
    let (held_name, reaped_name) = (held.name.clone(), reaped.name.clone());
    let harness = Harness::start_with(vec![held, reaped], |config| {
        config.database.max_connections = 2;
        config.upkeep = Some(crate::self_healing::fast_upkeep());
    })
    .await;
    // Two cancels of tasks this test holds locked: each keeps one of the API's two
    // connections while it waits (a tenant's slow requests, as many as the pool holds).
    let ghost = harness.submit_ok(&reaped_name, json!({})).await;
    let a = harness.submit_ok(&held_name, json!({})).await;
    let b = harness.submit_ok(&held_name, json!({})).await;
    // Marked QUEUED first, so that what waits on the lock below is the cancels alone.
    testing::wait_until("both QUEUED", Duration::from_secs(30), || async {
        let mut queued = 0;
        for id in [a, b] {
            let task = harness.db.task(id).await.unwrap().unwrap();
            queued += usize::from(task.state == conveyor_core::TaskState::Queued);
        }
        queued == 2
    })
    .await;
    let mut lock = harness.db.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM tasks WHERE id = ANY($1) FOR UPDATE")
        .bind(vec![a, b])
        .execute(&mut *lock)
        .await
        .unwrap();
    let cancels: Vec<_> = [a, b]
        .map(|id| {
            let (http, url) = (harness.http.clone(), harness.gateway_url.clone());
            tokio::spawn(async move {
                http.post(format!("{url}/v1/tasks/{id}:cancel"))
                    .bearer_auth(TOKEN)
                    .json(&json!({}))
                    .send()
                    .await
                    .map(|r| r.status())
            })
        })
        .into_iter()
        .collect();
    testing::wait_until(
        "both cancels wait on the lock",
        Duration::from_secs(30),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
                 AND query LIKE '%cancelled AS%'",
            )
            .fetch_one(harness.db.pool())
            .await
            .unwrap();
            waiting == 2
        },
    )
    .await;
    // A task whose worker vanished an hour ago: the reaper takes it back.
    sqlx::query(
        "UPDATE tasks SET state = 'PROCESSING', owner = 'vanished-worker', attempt = 1,
             heartbeat_at = now() - interval '1 hour' WHERE id = $1",
    )
    .bind(ghost)
    .execute(harness.db.pool())
    .await
    .unwrap();
    testing::wait_until(
        "the reaper takes the task back while the API's connections wait",
        Duration::from_secs(20),
        || async {
            let task = harness.db.task(ghost).await.unwrap().unwrap();
            task.state != conveyor_core::TaskState::Processing
        },
    )
    .await;
    lock.rollback().await.unwrap();
    for cancel in cancels {
        let status = cancel.await.unwrap().unwrap();
        assert!(
            status.is_success(),
            "a cancel answered {status} once the lock went"
        );
    }
    harness.shutdown().await;
}

#[tokio::test]
async fn a_namespace_lists_no_more_tasks_a_second_by_minting_tokens() {
    let (harness, name) = namespaces(|config| {
        config.requests.namespace.listed_per_second = 1.0;
    })
    .await;
    // Each list counts its limit: 100, then the bucket holds less than one more of them
    // for a long while, whichever of the namespace's clients asks.
    let path = format!("/v1/tasks?type={name}&limit=100");
    let (status, body) = harness.get_json(HOSTILE[0], &path).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for token in &HOSTILE[1..] {
        let (status, body) = harness.get_json(token, &path).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("namespace hostile is over its listing rate"),
            "{message}"
        );
    }
    // The other namespace lists as before.
    let (status, body) = harness.get_json(CALM, &path).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    harness.shutdown().await;
}

#[tokio::test]
async fn a_request_waits_no_longer_than_the_lock_timeout_for_a_row_held_elsewhere() {
    let spec = crate::support::test_type("locked");
    let name = spec.name.clone();
    let harness = Harness::start_with(vec![spec], |config| {
        config.database.lock_timeout = Some(Duration::from_secs(1));
    })
    .await;
    let id = harness.submit_ok(&name, json!({})).await;
    testing::wait_until("QUEUED", Duration::from_secs(30), || async {
        harness.db.task(id).await.unwrap().unwrap().state == conveyor_core::TaskState::Queued
    })
    .await;
    // A tenant's own transaction holds the row, for longer than any request should wait.
    let mut lock = harness.db.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(&mut *lock)
        .await
        .unwrap();
    let answer = tokio::time::timeout(
        Duration::from_secs(15),
        harness.post_json(TOKEN, &format!("/v1/tasks/{id}:cancel"), json!({})),
    )
    .await;
    lock.rollback().await.unwrap();
    let (status, body) = answer.expect("an answer while the row was still held");
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    // Nothing changed: once the row is free, the cancel goes through.
    let (status, body) = harness
        .post_json(TOKEN, &format!("/v1/tasks/{id}:cancel"), json!({}))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    harness.shutdown().await;
}
