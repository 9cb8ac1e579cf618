//! Finding and fixing tasks over the API (issue 16), on the real services: labels and lists
//! with selectors and cursors, cancel, retry and redrive. Side effects are judged from
//! outside: an exec handler appends each task id it runs to a file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use conveyor_core::testing::{assert_valid_chain, states, wait_until};
use conveyor_core::TaskState::{self, *};
use conveyor_worker::handler::Handler;
use reqwest::StatusCode;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::{test_type, Harness, TOKEN};

async fn submit_labelled(h: &Harness, task_type: &str, labels: Value) -> Uuid {
    let (status, body) = h
        .post_json(
            TOKEN,
            "/v1/tasks",
            json!({"taskType": task_type, "payload": {}, "labels": labels}),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    body["id"].as_str().unwrap().parse().unwrap()
}

fn ids(page: &Value) -> Vec<Uuid> {
    page["tasks"]
        .as_array()
        .expect("tasks")
        .iter()
        .map(|t| t["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

/// Every id a list walks to, page by page, following `nextCursor`.
async fn walk(h: &Harness, query: &str) -> Vec<Uuid> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/tasks?{query}&cursor={c}"),
            None => format!("/v1/tasks?{query}"),
        };
        let (status, page) = h.get_json(TOKEN, &path).await;
        assert_eq!(status, StatusCode::OK, "{path}: {page}");
        all.extend(ids(&page));
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return all,
        }
    }
}

/// An exec handler that records the id of every task it runs in `file`.
fn recording_handler(file: &Path) -> Handler {
    Handler::Exec {
        command: "sh".into(),
        args: vec![
            "-c".into(),
            format!("echo \"$CONVEYOR_TASK_ID\" >> {}", file.display()),
        ],
    }
}

fn ran(file: &Path) -> Vec<Uuid> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect()
}

fn scratch_file() -> PathBuf {
    std::env::temp_dir().join(format!("conveyor-ran-{}", Uuid::new_v4()))
}

#[tokio::test]
async fn labelled_tasks_are_listed_by_selector_state_and_time_a_page_at_a_time() {
    let spec = test_type("listed");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let before = chrono::Utc::now() - chrono::Duration::seconds(1);
    let mut gold = Vec::new();
    let mut plain = Vec::new();
    for i in 0..7 {
        gold.push(
            submit_labelled(
                &harness,
                &name,
                json!({"tier": "gold", "example.com/asset": format!("a{i}")}),
            )
            .await,
        );
        plain.push(submit_labelled(&harness, &name, json!({"tier": "silver"})).await);
    }
    plain.push(harness.submit_ok(&name, json!({})).await);

    // Newest first, in pages of 3, each task once.
    let everything = walk(&harness, &format!("type={name}&limit=3")).await;
    let mut expected: Vec<Uuid> = gold.iter().chain(&plain).copied().collect();
    expected.sort();
    expected.reverse();
    assert_eq!(everything, expected);

    let gold_listed = walk(&harness, "labelSelector=tier%3Dgold&limit=2").await;
    assert_eq!(gold_listed.iter().rev().copied().collect::<Vec<_>>(), gold);
    let (_, page) = harness
        .get_json(
            TOKEN,
            &format!("/v1/tasks?type={name}&labelSelector=example.com%2Fasset%20in%20(a1,a3)"),
        )
        .await;
    assert_eq!(ids(&page), vec![gold[3], gold[1]]);
    let (_, page) = harness
        .get_json(TOKEN, &format!("/v1/tasks?type={name}&labelSelector=!tier"))
        .await;
    assert_eq!(ids(&page), vec![*plain.last().unwrap()]);
    let listed = &page["tasks"][0];
    assert_eq!(listed["taskType"], json!(name));
    assert!(listed.get("payload").is_none(), "lists leave payloads out");

    // The last QUEUED marks follow the answers within moments (decision 0020).
    wait_until(
        "all 15 listed as QUEUED",
        Duration::from_secs(10),
        || async {
            let query = format!("/v1/tasks?type={name}&state=QUEUED&limit=500");
            ids(&harness.get_json(TOKEN, &query).await.1).len() == 15
        },
    )
    .await;
    let (_, page) = harness
        .get_json(TOKEN, &format!("/v1/tasks?type={name}&state=DEAD_LETTER"))
        .await;
    assert_eq!(ids(&page), Vec::<Uuid>::new());
    assert_eq!(page["nextCursor"], Value::Null);
    let after = (chrono::Utc::now() + chrono::Duration::seconds(1)).to_rfc3339();
    let since = before.to_rfc3339();
    let encode = |s: &str| s.replace('+', "%2B");
    let (_, page) = harness
        .get_json(
            TOKEN,
            &format!("/v1/tasks?type={name}&createdAfter={}", encode(&after)),
        )
        .await;
    assert_eq!(ids(&page).len(), 0);
    let (_, page) = harness
        .get_json(
            TOKEN,
            &format!(
                "/v1/tasks?type={name}&createdAfter={}&createdBefore={}&limit=500",
                encode(&since),
                encode(&after)
            ),
        )
        .await;
    assert_eq!(ids(&page).len(), 15);
    harness.shutdown().await;
}

#[tokio::test]
async fn bad_labels_and_bad_queries_are_refused_and_record_nothing() {
    let spec = test_type("badlabels");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    for labels in [
        json!({"bad key": "x"}),
        json!({"ok": "no spaces"}),
        json!({"ok": 3}),
        json!(["not", "a", "map"]),
        Value::Object((0..17).map(|i| (format!("k{i}"), json!("v"))).collect()),
    ] {
        let (status, body) = harness
            .post_json(
                TOKEN,
                "/v1/tasks",
                json!({"taskType": name, "payload": {}, "labels": labels}),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{labels}: {body}");
        let code = body["error"]["code"].as_str().unwrap();
        assert!(
            ["invalid_labels", "invalid_json"].contains(&code),
            "{labels}: {body}"
        );
    }
    assert_eq!(harness.total_tasks(&name).await, 0);

    for (query, code) in [
        ("labelSelector=a%20in%20(x", "invalid_label_selector"),
        ("state=DONE", "invalid_query"),
        ("limit=0", "invalid_query"),
        ("limit=501", "invalid_query"),
        ("cursor=nope", "invalid_cursor"),
        ("createdAfter=yesterday", "invalid_query"),
        ("colour=red", "invalid_query"),
    ] {
        let (status, body) = harness.get_json(TOKEN, &format!("/v1/tasks?{query}")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {body}");
        assert_eq!(body["error"]["code"], json!(code), "{query}: {body}");
    }
    let (status, body) = harness.get_json(TOKEN, "/v1/tasks?type=nosuchtype").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    harness.shutdown().await;
}

#[tokio::test]
async fn a_waiting_task_can_be_cancelled_and_never_runs() {
    let spec = test_type("cancel");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let file = scratch_file();
    // No worker yet: both tasks wait in the queue.
    let doomed = harness.submit_ok(&name, json!({})).await;
    let kept = harness.submit_ok(&name, json!({})).await;
    let (status, task) = harness
        .post_json(TOKEN, &format!("/v1/tasks/{doomed}:cancel"), json!({}))
        .await;
    assert_eq!(status, StatusCode::OK, "{task}");
    assert_eq!(task["state"], json!("CANCELLED"));
    let (status, body) = harness
        .post_json(TOKEN, &format!("/v1/tasks/{doomed}:cancel"), json!({}))
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], json!("not_cancellable"));

    harness.start_worker(&[&name], recording_handler(&file), 4);
    harness
        .wait_for_state(&name, Completed, 1, Duration::from_secs(30))
        .await;
    // The cancelled task's message was delivered too (it was in the queue first) and
    // dropped: once the queue is empty it can no longer run.
    wait_until("the queue drained", Duration::from_secs(20), || async {
        harness
            .ready_count(&crate::support::queue(&name).main)
            .await
            == 0
    })
    .await;
    assert_eq!(ran(&file), vec![kept]);
    assert_eq!(
        harness.db.task(doomed).await.unwrap().unwrap().state,
        Cancelled
    );
    let events = harness.events(doomed).await;
    assert_valid_chain(&events);
    assert_eq!(states(&events), vec![Ingested, Queued, Cancelled]);
    assert_eq!(
        events.last().unwrap().detail.as_deref(),
        Some("cancelled by client tests")
    );
    // A completed task cannot be cancelled; a malformed action is refused.
    let (status, body) = harness
        .post_json(TOKEN, &format!("/v1/tasks/{kept}:cancel"), json!({}))
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let (status, body) = harness
        .post_json(TOKEN, &format!("/v1/tasks/{kept}:explode"), json!({}))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(body["error"]["code"], json!("unknown_action"));
    let (status, _) = harness
        .post_json(TOKEN, &format!("/v1/tasks/{kept}"), json!({}))
        .await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    let _ = std::fs::remove_file(&file);
    harness.shutdown().await;
}

/// Dead letters of a type with `max_retries` 0, made by a failing worker that then stops.
async fn dead_letters(harness: &mut Harness, name: &str, labels: &[Value]) -> Vec<Uuid> {
    let failing = harness.start_worker(&[name], Handler::Fail, 4);
    let mut ids = Vec::new();
    for labels in labels {
        ids.push(submit_labelled(harness, name, labels.clone()).await);
    }
    harness
        .wait_for_state(
            name,
            DeadLetter,
            labels.len() as i64,
            Duration::from_secs(30),
        )
        .await;
    harness.take_worker(&failing).stop().await;
    ids
}

#[tokio::test]
async fn a_dead_letter_is_retried_and_a_selected_set_redriven_over_the_api() {
    let mut spec = test_type("retried");
    spec.max_retries = 0;
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let file = scratch_file();
    let batches = [
        json!({"batch": "a"}),
        json!({"batch": "a"}),
        json!({"batch": "b"}),
    ];
    let failed = dead_letters(&mut harness, &name, &batches).await;
    let mut unhappy = walk(&harness, &format!("type={name}&state=DEAD_LETTER&limit=1")).await;
    unhappy.sort();
    let mut expected = failed.clone();
    expected.sort();
    assert_eq!(unhappy, expected, "dead letters are listed");

    // A task that is not dead-lettered cannot be retried.
    let waiting = harness.submit_ok(&name, json!({})).await;
    let (status, body) = harness
        .post_json(TOKEN, &format!("/v1/tasks/{waiting}:retry"), json!({}))
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], json!("not_dead_lettered"));

    // One retried by id, the `batch=a` one left over redriven by selector; `b` stays.
    let (status, task) = harness
        .post_json(TOKEN, &format!("/v1/tasks/{}:retry", failed[0]), json!({}))
        .await;
    assert_eq!(status, StatusCode::OK, "{task}");
    assert_eq!(
        (task["state"].clone(), task["retries"].clone()),
        (json!("QUEUED"), json!(0))
    );
    let (status, answer) = harness
        .post_json(
            TOKEN,
            "/v1/tasks:redrive",
            json!({"taskType": name, "labelSelector": "batch=a"}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["redriven"], json!(1), "{answer}");
    assert_eq!(answer["more"], json!(false), "{answer}");
    // Their parked copies are stale now and dropped in the background; b's stays parked.
    wait_until(
        "stale remediation copies dropped",
        Duration::from_secs(20),
        || async {
            harness
                .ready_count(&crate::support::queue(&name).remediation)
                .await
                == 1
        },
    )
    .await;

    harness.start_worker(&[&name], recording_handler(&file), 4);
    harness
        .wait_for_state(&name, Completed, 3, Duration::from_secs(30))
        .await;
    let done: BTreeSet<Uuid> = ran(&file).into_iter().collect();
    assert_eq!(done, BTreeSet::from([failed[0], failed[1], waiting]));
    let record = harness.db.task(failed[2]).await.unwrap().unwrap();
    assert_eq!(record.state, DeadLetter, "batch b was not selected");
    for (id, how) in failed[..2].iter().zip(["retried", "redriven"]) {
        let events = harness.events(*id).await;
        assert_valid_chain(&events);
        let back = events
            .iter()
            .find(|e| e.from_state == Some(DeadLetter))
            .expect("sent back");
        assert_eq!(back.to_state, Queued);
        assert_eq!(back.detail, Some(format!("{how} by client tests")));
        assert_eq!(events.last().unwrap().to_state, Completed);
    }
    let (status, body) = harness
        .post_json(
            TOKEN,
            "/v1/tasks:redrive",
            json!({"taskType": name, "limit": 0}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let _ = std::fs::remove_file(&file);
    harness.shutdown().await;
}

#[tokio::test]
async fn the_lists_state_filter_follows_the_database() {
    // Tasks resting in four states: dead-lettered, cancelled, waiting and completed. For
    // every state, and for the partial index's pair, a list holds exactly the tasks the rows
    // say are in it.
    let mut spec = test_type("bystate");
    spec.max_retries = 0;
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    dead_letters(&mut harness, &name, &[json!({})]).await;
    let cancelled = harness.submit_ok(&name, json!({})).await;
    let (status, _) = harness
        .post_json(TOKEN, &format!("/v1/tasks/{cancelled}:cancel"), json!({}))
        .await;
    assert_eq!(status, StatusCode::OK);
    let done = harness.start_worker(&[&name], Handler::Noop, 1);
    harness.submit_ok(&name, json!({})).await;
    harness
        .wait_for_state(&name, Completed, 1, Duration::from_secs(30))
        .await;
    harness.take_worker(&done).stop().await;
    harness.submit_ok(&name, json!({})).await;
    let expected = |state: TaskState| match state {
        DeadLetter | Cancelled | Completed | Queued => 1,
        _ => 0,
    };
    for state in TaskState::ALL {
        // The waiting task's QUEUED mark follows its answer within moments (decision 0020).
        wait_until(
            &format!("{state} listed"),
            Duration::from_secs(10),
            || async {
                let (_, page) = harness
                    .get_json(TOKEN, &format!("/v1/tasks?type={name}&state={state}"))
                    .await;
                ids(&page).len() == expected(state)
            },
        )
        .await;
        assert_eq!(
            harness.count(&name, state).await,
            expected(state) as i64,
            "{state}"
        );
    }
    let (_, page) = harness
        .get_json(
            TOKEN,
            &format!("/v1/tasks?type={name}&state=DEAD_LETTER,CANCELLED"),
        )
        .await;
    assert_eq!(ids(&page).len(), 2);
    harness.shutdown().await;
}

#[tokio::test]
async fn the_api_description_is_served_without_a_token_and_matches_docs() {
    let harness = Harness::start(vec![test_type("described")]).await;
    let response = harness
        .http
        .get(format!("{}/openapi.json", harness.gateway_url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let served = response.text().await.unwrap();
    let committed = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json"),
    )
    .unwrap();
    assert_eq!(served, committed);
    harness.shutdown().await;
}

/// Runs `conveyorctl` against the harness's gateway with the token only: no database or
/// broker credentials in its environment. Returns whether it succeeded and what it printed.
async fn ctl(h: &Harness, args: &[&str]) -> (bool, String, String) {
    let output = tokio::process::Command::new(conveyor_core::testing::binary("conveyorctl"))
        .args(args)
        .env("CONVEYOR_GATEWAY_URL", &h.gateway_url)
        .env("CONVEYOR_TOKEN", TOKEN)
        .env_remove("CONVEYOR_DATABASE_URL")
        .env_remove("CONVEYOR_AMQP_URL")
        .output()
        .await
        .expect("run conveyorctl");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn conveyorctl_lists_waits_retries_cancels_and_redrives_over_the_api() {
    let mut spec = test_type("ctl");
    spec.max_retries = 0;
    let idle = test_type("ctl-idle");
    let (name, idle_name) = (spec.name.clone(), idle.name.clone());
    let mut harness = Harness::start(vec![spec, idle]).await;
    let labels = [
        json!({"batch": "x"}),
        json!({"batch": "x"}),
        json!({"batch": "y"}),
    ];
    let failed = dead_letters(&mut harness, &name, &labels).await;

    let (ok, out, err) = ctl(
        &harness,
        &[
            "list",
            "--type",
            &name,
            "--state",
            "DEAD_LETTER",
            "-o",
            "json",
        ],
    )
    .await;
    assert!(ok, "{err}");
    let listed: Value = serde_json::from_str(&out).unwrap();
    let mut json_ids = ids(&listed);
    json_ids.sort();
    let mut expected = failed.clone();
    expected.sort();
    assert_eq!(json_ids, expected);
    let (ok, out, _) = ctl(
        &harness,
        &[
            "list", "--type", &name, "-o", "yaml", "--limit", "1", "--all",
        ],
    )
    .await;
    assert!(ok);
    let listed: Value = serde_yaml::from_str(&out).unwrap();
    assert_eq!(ids(&listed).len(), 3, "{out}");
    let (ok, out, _) = ctl(&harness, &["list", "--type", &name, "-l", "batch=x"]).await;
    assert!(ok);
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("ID ") && lines[0].contains("STATE"),
        "{out}"
    );
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines[1..].iter().all(|l| l.contains("DEAD_LETTER")),
        "{out}"
    );
    let (ok, _, err) = ctl(&harness, &["list", "-l", "batch in (x"]).await;
    assert!(!ok && err.contains("invalid_label_selector"), "{err}");

    let (ok, out, err) = ctl(&harness, &["retry", &failed[2].to_string()]).await;
    assert!(ok && out.contains("QUEUED"), "{out} {err}");
    let (ok, out, err) = ctl(&harness, &["redrive", "--type", &name, "-l", "batch=x"]).await;
    assert!(ok && out.contains("redriven: 2"), "{out} {err}");
    harness.start_worker(&[&name], Handler::Noop, 4);
    let mut wait_args = vec![
        "wait".to_owned(),
        "--timeout".into(),
        "60s".into(),
        "-o".into(),
        "json".into(),
    ];
    wait_args.extend(failed.iter().map(Uuid::to_string));
    let wait_args: Vec<&str> = wait_args.iter().map(String::as_str).collect();
    let (ok, out, err) = ctl(&harness, &wait_args).await;
    assert!(ok, "{out} {err}");
    let waited: Value = serde_json::from_str(&out).unwrap();
    assert!(waited["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["state"] == "COMPLETED"));
    for id in &failed {
        let task = harness.db.task(*id).await.unwrap().unwrap();
        assert_eq!(task.state, Completed, "judged from the database too");
    }
    let (ok, _, err) = ctl(&harness, &["retry", &failed[0].to_string()]).await;
    assert!(!ok && err.contains("1 of 1"), "{err}");
    let (ok, out, _) = ctl(&harness, &["watch", &failed[0].to_string()]).await;
    assert!(
        ok && out.lines().last().unwrap().contains("COMPLETED"),
        "{out}"
    );

    // Nobody consumes the idle type: its task waits, is cancelled, and `wait` says so.
    let waiting = harness.submit_ok(&idle_name, json!({})).await.to_string();
    let (ok, out, _) = ctl(&harness, &["cancel", &waiting]).await;
    assert!(ok && out.contains("CANCELLED"), "{out}");
    let (ok, _, err) = ctl(&harness, &["wait", &waiting, "--timeout", "10s"]).await;
    assert!(!ok && err.contains("did not complete"), "{err}");
    // Labels given on the command line find the task again.
    let (ok, out, err) = ctl(
        &harness,
        &[
            "submit", "--type", &idle_name, "-l", "team=ops", "-l", "asset=a1", "-o", "json",
        ],
    )
    .await;
    assert!(ok, "{err}");
    let submitted: Value = serde_json::from_str(&out).unwrap();
    let (ok, out, _) = ctl(&harness, &["list", "-l", "team=ops,asset=a1", "-o", "json"]).await;
    assert!(ok);
    let listed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        ids(&listed),
        vec![submitted["id"].as_str().unwrap().parse::<Uuid>().unwrap()]
    );
    let (ok, _, err) = ctl(
        &harness,
        &["submit", "--type", &idle_name, "-l", "no spaces=x"],
    )
    .await;
    assert!(!ok && err.contains("invalid_labels"), "{err}");
    harness.shutdown().await;
}

/// The `data:` of every `event: task` in a server-sent event stream, in order.
fn task_events(stream: &str) -> Vec<Value> {
    stream
        .split("\n\n")
        .filter(|block| block.lines().any(|l| l == "event: task"))
        .filter_map(|block| block.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|data| serde_json::from_str(data).unwrap())
        .collect()
}

#[tokio::test]
async fn a_followed_task_streams_each_change_and_the_stream_ends_when_it_settles() {
    let spec = test_type("followed");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let id = harness.submit_ok(&name, json!({"sleepMs": 2500})).await;
    let mut response = harness
        .http
        .get(format!("{}/v1/tasks/{id}/stream", harness.gateway_url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    // The task as it is now comes first, before any worker exists.
    let mut seen = String::new();
    while task_events(&seen).is_empty() {
        let chunk = response
            .chunk()
            .await
            .unwrap()
            .expect("the stream stays open");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(["INGESTED", "QUEUED"].contains(&task_events(&seen)[0]["state"].as_str().unwrap()));
    harness.start_worker(&[&name], Handler::Sleep, 1);
    // Then each change, to COMPLETED, after which the gateway ends the stream.
    let rest = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(chunk) = response.chunk().await.unwrap() {
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await;
    assert!(rest.is_ok(), "the stream did not end: {seen}");
    let states: Vec<String> = task_events(&seen)
        .iter()
        .map(|t| t["state"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        states.last().map(String::as_str),
        Some("COMPLETED"),
        "{seen}"
    );
    assert!(
        states.contains(&"PROCESSING".to_owned()),
        "a 2.5 s task is seen running (reads are at most 1 s apart): {states:?}"
    );
    assert_eq!(harness.db.task(id).await.unwrap().unwrap().state, Completed);
    let (status, _) = harness
        .get_json(TOKEN, &format!("/v1/tasks/{}/stream", Uuid::now_v7()))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    harness.shutdown().await;
}

/// The first task type of `GET /v1/task-types`.
async fn glance(h: &Harness) -> Value {
    let (status, body) = h.get_json(TOKEN, "/v1/task-types").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body["taskTypes"][0].clone()
}

/// Task types at a glance (`GET /v1/task-types`, the console's first page): the backlog the
/// gateway reads from the broker, the rate work leaves it, and the dead letters, each held
/// against what was submitted and what the workers did.
#[tokio::test]
async fn task_types_at_a_glance_show_backlog_rate_and_dead_letters() {
    let mut spec = test_type("glance");
    spec.max_retries = 0;
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let dead = dead_letters(&mut harness, &name, &[json!({}), json!({})]).await;
    for _ in 0..40 {
        harness.submit_ok(&name, json!({"sleepMs": 100})).await;
    }
    wait_until(
        "a backlog of 40 at a glance",
        Duration::from_secs(30),
        || async { glance(&harness).await["backlog"] == 40 },
    )
    .await;
    let seen = glance(&harness).await;
    assert_eq!(seen["deadLetters"], dead.len(), "{seen}");
    assert_eq!(seen["name"], harness.spec(&name).local_name(), "{seen}");
    // Two slots of 100 ms: about 20 tasks a second leave the queue for two seconds.
    harness.start_worker(&[&name], Handler::Sleep, 2);
    wait_until(
        "work seen leaving the queue",
        Duration::from_secs(30),
        || async {
            let seen = glance(&harness).await;
            seen["takenPerSecond"].as_f64().is_some_and(|r| r > 0.0)
                && seen["backlog"].as_u64().is_some_and(|b| b < 40)
        },
    )
    .await;
    harness
        .wait_for_state(&name, Completed, 40, Duration::from_secs(60))
        .await;
    wait_until(
        "an empty backlog at a glance",
        Duration::from_secs(30),
        || async { glance(&harness).await["backlog"] == 0 },
    )
    .await;
    harness.shutdown().await;
}
