//! The web console in a real headless browser (Debian's Chromium through ChromeDriver and
//! Selenium; `scripts/browser.sh` installs them): the story in `tests/browser/console_story.py`
//! loads the console, filters to the dead letters, opens a failed task, retries it and sees
//! it complete; then another tenant's client signs in and sees only its own. This side sets
//! the scene and then judges from outside: the task's row and its audit log.

use std::process::Command;
use std::time::Duration;

use conveyor_core::task_type::{NamedTaskType, TaskTypeSpec};
use conveyor_core::TaskState::*;
use conveyor_gateway::auth::Tokens;
use conveyor_worker::handler::Handler;
use serde_json::json;

use crate::support::{test_type, Harness, TOKEN};

/// A client of tenant `elsewhere`, which has a type of its own and one task.
const OTHER_TOKEN: &str = "elsewhere-token-1";

#[tokio::test]
async fn a_failed_task_is_found_retried_and_completed_in_the_console() {
    let mut transcode = test_type("transcode");
    transcode.max_retries = 0;
    let thumbnail = test_type("thumbnail");
    let (failing, other) = (transcode.name.clone(), thumbnail.name.clone());
    let elsewhere = NamedTaskType::in_namespace("elsewhere", &other, TaskTypeSpec::default());
    let mut harness = Harness::start_with(vec![transcode, thumbnail, elsewhere], |config| {
        config.tokens =
            Tokens::parse_pairs(&format!("tests={TOKEN},outsider@elsewhere={OTHER_TOKEN}"))
                .unwrap();
    })
    .await;

    // Scene: thumbnails complete; one transcode fails and is dead-lettered, another waits.
    harness.start_worker(&[&other], Handler::Noop, 4);
    for i in 0..3 {
        harness.submit_ok(&other, json!({"frame": i})).await;
    }
    let breaking = harness.start_worker(&[&failing], Handler::Fail, 1);
    let (status, body) = harness
        .http
        .post(format!("{}/v1/tasks", harness.gateway_url))
        .bearer_auth(TOKEN)
        .json(
            &json!({"taskType": failing, "payload": {"video": "broken.mp4"},
                      "labels": {"pipeline": "vod", "asset": "broken"}}),
        )
        .send()
        .await
        .map(|r| (r.status(), r))
        .unwrap();
    assert_eq!(status, reqwest::StatusCode::CREATED);
    let failed: serde_json::Value = body.json().await.unwrap();
    let failed_id = failed["id"].as_str().unwrap().to_owned();
    harness
        .wait_for_state(&failing, DeadLetter, 1, Duration::from_secs(30))
        .await;
    harness
        .wait_for_state(&other, Completed, 3, Duration::from_secs(30))
        .await;
    // Another tenant's one task (a type of the same name as ours; no worker: it waits).
    let outsiders = harness
        .http
        .post(format!("{}/v1/tasks", harness.gateway_url))
        .bearer_auth(OTHER_TOKEN)
        .json(&json!({"taskType": other, "payload": {}, "labels": {"asset": "broken"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(outsiders.status(), reqwest::StatusCode::CREATED);
    let outsiders: serde_json::Value = outsiders.json().await.unwrap();
    let other_id = outsiders["id"].as_str().unwrap().to_owned();
    // The handler is mended: the next attempt succeeds.
    harness.take_worker(&breaking).stop().await;
    harness.start_worker(&[&failing], Handler::Noop, 1);

    let story =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../browser/console_story.py");
    let screenshots = std::env::var("CONVEYOR_SCREENSHOTS").unwrap_or_default();
    let url = harness.gateway_url.clone();
    let (task_type, id) = (failing.clone(), failed_id.clone());
    let output = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(story)
            .env("CONVEYOR_URL", url)
            .env("CONVEYOR_TOKEN", TOKEN)
            .env("CONVEYOR_FAILED_TYPE", task_type)
            .env("CONVEYOR_FAILED_ID", id)
            .env("CONVEYOR_OTHER_TOKEN", OTHER_TOKEN)
            .env("CONVEYOR_OTHER_ID", other_id)
            .env("CONVEYOR_SCREENSHOTS", screenshots)
            .output()
            .expect("python3 runs")
    })
    .await
    .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    println!("{said}");
    assert!(output.status.success(), "the console story failed:\n{said}");

    // From outside: the row, the audit log (retried by the console's client), completed.
    let task = harness
        .db
        .task(failed_id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(task.state, Completed);
    let events = harness.events(task.id).await;
    conveyor_core::testing::assert_valid_chain(&events);
    assert!(
        events.iter().any(|e| e.from_state == Some(DeadLetter)
            && e.detail.as_deref() == Some("retried by client tests")),
        "{events:?}"
    );
    harness.shutdown().await;
}
