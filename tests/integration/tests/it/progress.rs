//! Handlers report progress (issue 16): an exec handler by writing lines on descriptor 3 or
//! appending them to `$CONVEYOR_PROGRESS_FILE`, an http handler by POSTing to `X-Conveyor-Progress-Url`. Each
//! report is judged where a client sees it: the gateway's answer for the task. The handler
//! moves on only when the test opens a gate, so no step depends on timing.

use std::time::Duration;

use axum::http::HeaderMap;
use conveyor_core::testing::wait_until;
use conveyor_core::TaskState::Completed;
use conveyor_worker::handler::Handler;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::{test_type, Harness, TOKEN};

async fn progress_of(h: &Harness, id: Uuid) -> Value {
    h.get_json(TOKEN, &format!("/v1/tasks/{id}")).await.1["progress"].clone()
}

async fn wait_for_progress(h: &Harness, id: Uuid, want: Value) {
    wait_until(
        &format!("progress {want}"),
        Duration::from_secs(30),
        || async { progress_of(h, id).await == want },
    )
    .await;
}

/// A directory of gate files a test creates to let a handler's script go on.
fn gate_dir() -> std::path::PathBuf {
    let gates = std::env::temp_dir().join(format!("conveyor-gates-{}", Uuid::new_v4()));
    std::fs::create_dir_all(&gates).unwrap();
    gates
}

/// An exec handler running `script` with `sh -c`.
fn shell(script: String) -> Handler {
    Handler::Exec {
        command: "sh".into(),
        args: vec!["-c".into(), script],
    }
}

#[tokio::test]
async fn an_exec_handlers_progress_lines_reach_the_api_while_it_runs() {
    let spec = test_type("progress-exec");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let gates = gate_dir();
    let g = gates.display();
    let script = format!(
        "p=\"$CONVEYOR_PROGRESS_FILE\"; \
         echo 10 >&3; while [ ! -e {g}/1 ]; do sleep 0.05; done; \
         printf '{{\"frame\": 50, \"of\": 100}}\\n' >&3; while [ ! -e {g}/2 ]; do sleep 0.05; done; \
         echo muxing >> \"$p\"; printf 'half a line' >> \"$p\"; while [ ! -e {g}/3 ]; do sleep 0.05; done; \
         printf ' done\\n100\\n' >> \"$p\"; echo '{{\"done\": true}}'"
    );
    harness.start_worker(&[&name], shell(script), 1);
    let id = harness.submit_ok(&name, json!({})).await;
    wait_for_progress(&harness, id, json!({"percent": 10})).await;
    std::fs::write(gates.join("1"), "").unwrap();
    wait_for_progress(&harness, id, json!({"frame": 50, "of": 100})).await;
    std::fs::write(gates.join("2"), "").unwrap();
    // A line still being written is not a report yet.
    wait_for_progress(&harness, id, json!({"message": "muxing"})).await;
    std::fs::write(gates.join("3"), "").unwrap();
    harness
        .wait_for_state(&name, Completed, 1, Duration::from_secs(30))
        .await;
    let task = harness.db.task(id).await.unwrap().unwrap();
    assert_eq!(task.result, Some(json!({"done": true})));
    // The last line, written just before the command exited, is stored before COMPLETED.
    assert_eq!(
        task.progress,
        Some(json!({"percent": 100})),
        "the last report stays"
    );
    let _ = std::fs::remove_dir_all(&gates);
    harness.shutdown().await;
}

#[tokio::test]
async fn an_http_handler_reports_through_its_callback_and_bad_reports_are_refused() {
    let spec = test_type("progress-http");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let gateway = harness.gateway_url.clone();
    let http = harness.http.clone();
    // The sidecar: reports 70 %, waits until a client can see it, then answers.
    let sidecar = axum::Router::new().route(
        "/",
        axum::routing::post(move |headers: HeaderMap| {
            let (gateway, http) = (gateway.clone(), http.clone());
            async move {
                let callback = headers["x-conveyor-progress-url"]
                    .to_str()
                    .unwrap()
                    .to_owned();
                let id = headers["x-conveyor-task-id"].to_str().unwrap().to_owned();
                let post = |body: Value| http.post(&callback).json(&body).send();
                let too_big = json!({"message": "x".repeat(2000)});
                assert_eq!(post(too_big).await.unwrap().status().as_u16(), 413);
                // What the database would refuse is refused here, alone (issue 33, item 4): a
                // NUL, or numbers jsonb writes out in full (7 × 301 bytes from 42 of JSON).
                let nul = json!({"message": "frame\u{0}10"});
                assert_eq!(post(nul).await.unwrap().status().as_u16(), 400);
                let long = json!([1e300, 1e300, 1e300, 1e300, 1e300, 1e300, 1e300]);
                assert_eq!(post(long).await.unwrap().status().as_u16(), 400);
                assert_eq!(
                    post(json!({"percent": 70}))
                        .await
                        .unwrap()
                        .status()
                        .as_u16(),
                    204
                );
                // Only the URL given reports: not another attempt's, not one without its
                // secret or with a guessed one (any pod may reach the admin port).
                let (attempt_url, secret) = callback.rsplit_once('/').unwrap();
                let task_url = attempt_url.rsplit_once('/').unwrap().0;
                for (url, why) in [
                    (format!("{task_url}/99/{secret}"), "another attempt"),
                    (attempt_url.to_owned(), "no secret"),
                    (
                        format!("{attempt_url}/{}", "0".repeat(secret.len())),
                        "a guessed secret",
                    ),
                ] {
                    let status = http
                        .post(url)
                        .json(&json!({"percent": 99}))
                        .send()
                        .await
                        .unwrap()
                        .status();
                    assert_eq!(status.as_u16(), 404, "{why}");
                }
                for _ in 0..300 {
                    let task: Value = http
                        .get(format!("{gateway}/v1/tasks/{id}"))
                        .bearer_auth(TOKEN)
                        .send()
                        .await
                        .unwrap()
                        .json()
                        .await
                        .unwrap();
                    if task["progress"] == json!({"percent": 70}) {
                        return axum::Json(json!({"seen": true}));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                axum::Json(json!({"seen": false}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, sidecar).await });
    let handler = Handler::Http {
        url,
        client: reqwest::Client::new(),
    };
    let config = harness.worker_config(&[&name], handler, 1);
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    harness.start_serving(config, Some(admin));
    let id = harness.submit_ok(&name, json!({})).await;
    harness
        .wait_for_state(&name, Completed, 1, Duration::from_secs(60))
        .await;
    let task = harness.db.task(id).await.unwrap().unwrap();
    assert_eq!(
        task.result,
        Some(json!({"seen": true})),
        "the sidecar saw its report"
    );
    assert_eq!(task.progress, Some(json!({"percent": 70})));
    harness.shutdown().await;
}

#[tokio::test]
async fn a_failed_attempts_progress_is_cleared_when_the_task_goes_back_to_work() {
    let spec = test_type("progress-retry");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let gates = gate_dir();
    let g = gates.display();
    // The first attempt reports 40 % and fails when let go; the second reports nothing
    // and waits, so what a client sees meanwhile is the second attempt's progress.
    let script = format!(
        "if [ -e {g}/failed ]; then touch {g}/second; while [ ! -e {g}/2 ]; do sleep 0.05; done; \
           echo '{{}}'; exit 0; fi; \
         echo 40 >&3; while [ ! -e {g}/1 ]; do sleep 0.05; done; touch {g}/failed; exit 1"
    );
    harness.start_worker(&[&name], shell(script), 1);
    let id = harness.submit_ok(&name, json!({})).await;
    wait_for_progress(&harness, id, json!({"percent": 40})).await;
    std::fs::write(gates.join("1"), "").unwrap();
    wait_until(
        "the second attempt to run",
        Duration::from_secs(30),
        || async { gates.join("second").exists() },
    )
    .await;
    assert_eq!(
        progress_of(&harness, id).await,
        Value::Null,
        "the failed attempt's 40 % is not the second attempt's"
    );
    std::fs::write(gates.join("2"), "").unwrap();
    harness
        .wait_for_state(&name, Completed, 1, Duration::from_secs(30))
        .await;
    let task = harness.db.task(id).await.unwrap().unwrap();
    assert_eq!(task.retries, 1, "one failure, then a success");
    assert_eq!(task.progress, None);
    let _ = std::fs::remove_dir_all(&gates);
    harness.shutdown().await;
}

#[tokio::test]
async fn the_database_refuses_an_oversized_report_written_around_the_worker() {
    let spec = test_type("progress-bound");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let id = harness.submit_ok(&name, json!({})).await;
    let write = |report: Value| {
        sqlx::query("UPDATE tasks SET progress = $2 WHERE id = $1")
            .bind(id)
            .bind(report)
            .execute(harness.db.pool())
    };
    write(json!({"message": "x".repeat(1000)}))
        .await
        .expect("a report the worker would send is stored");
    let refused = write(json!({"message": "x".repeat(3000)}))
        .await
        .expect_err("3 KB of progress is refused");
    assert!(
        refused.to_string().contains("tasks_progress_bounded"),
        "{refused}"
    );
    assert_eq!(
        progress_of(&harness, id).await,
        json!({"message": "x".repeat(1000)}),
        "the refused write changed nothing"
    );
    harness.shutdown().await;
}
