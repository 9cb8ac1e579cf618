//! The gateway's answers, and that no refused request leaves a task or a message behind.

use std::time::Duration;

use conveyor_core::task_type::RateLimit;
use conveyor_core::TaskState::*;
use reqwest::StatusCode;
use uuid::Uuid;

use crate::support::*;

/// Posts a raw body to /v1/tasks.
async fn post_raw(
    harness: &Harness,
    token: Option<&str>,
    body: Vec<u8>,
) -> (StatusCode, serde_json::Value) {
    let mut request = harness
        .http
        .post(format!("{}/v1/tasks", harness.gateway_url))
        .header("content-type", "application/json")
        .body(body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.unwrap();
    (response.status(), response.json().await.unwrap_or_default())
}

#[tokio::test]
async fn the_same_idempotency_key_gives_the_same_task() {
    let spec = test_type("idem");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let key = Uuid::new_v4();
    let payload = serde_json::json!({"video": "a.mp4"});
    let (first, body) = harness.submit(&name, payload.clone(), Some(key)).await;
    assert_eq!(first, StatusCode::CREATED);
    assert_eq!(body["state"], "QUEUED");
    assert_eq!(body["idempotencyKey"], key.to_string());
    let (again, body2) = harness.submit(&name, payload.clone(), Some(key)).await;
    assert_eq!(again, StatusCode::OK);
    assert_eq!(body2["id"], body["id"]);
    let (reused, err) = harness
        .submit(&name, serde_json::json!({"video": "b.mp4"}), Some(key))
        .await;
    assert_eq!(reused, StatusCode::CONFLICT);
    assert_eq!(err["error"]["code"], "idempotency_key_reused");
    let (bad_key, err) = {
        let response = harness
            .http
            .post(format!("{}/v1/tasks", harness.gateway_url))
            .bearer_auth(TOKEN)
            .header("Idempotency-Key", "not-a-uuid")
            .json(&serde_json::json!({"taskType": name, "payload": {}}))
            .send()
            .await
            .unwrap();
        (
            response.status(),
            response.json::<serde_json::Value>().await.unwrap(),
        )
    };
    assert_eq!(bad_key, StatusCode::BAD_REQUEST);
    assert_eq!(err["error"]["code"], "invalid_idempotency_key");

    assert_eq!(harness.total_tasks(&name).await, 1);
    wait_until("one message", Duration::from_secs(5), || async {
        harness.ready_count(&queue(&name).main).await == 1
    })
    .await;
    harness.shutdown().await;
}

#[tokio::test]
async fn bad_requests_are_refused_with_clear_codes_and_leave_nothing_behind() {
    let mut spec = test_type("strict");
    spec.schema = Some(serde_json::json!({
        "type": "object",
        "required": ["source"],
        "properties": {
            "source": {"type": "string"},
            "renditions": {"type": "array", "items": {"type": "integer", "minimum": 144}}
        }
    }));
    spec.max_payload_bytes = 200;
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let body = |v: serde_json::Value| serde_json::to_vec(&v).unwrap();
    let ok_payload = serde_json::json!({"source": "s3://in/a.mp4", "renditions": [720]});

    // (what, token, body, expected status, expected code)
    type Case<'a> = (&'a str, Option<&'a str>, Vec<u8>, StatusCode, &'a str);
    let cases: Vec<Case> = vec![
        (
            "no token",
            None,
            body(serde_json::json!({"taskType": name, "payload": ok_payload})),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            "wrong token",
            Some("wrong-token-xyz"),
            body(serde_json::json!({"taskType": name, "payload": ok_payload})),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            "not JSON",
            Some(TOKEN),
            b"{not json".to_vec(),
            StatusCode::BAD_REQUEST,
            "invalid_json",
        ),
        (
            "missing payload",
            Some(TOKEN),
            body(serde_json::json!({"taskType": name})),
            StatusCode::BAD_REQUEST,
            "invalid_json",
        ),
        (
            "unknown type",
            Some(TOKEN),
            body(serde_json::json!({"taskType": "nope", "payload": {}})),
            StatusCode::NOT_FOUND,
            "unknown_task_type",
        ),
        (
            "schema",
            Some(TOKEN),
            body(
                serde_json::json!({"taskType": name, "payload": {"source": "x", "renditions": [720, 100]}}),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_payload",
        ),
        (
            "payload over the type's limit",
            Some(TOKEN),
            body(serde_json::json!({"taskType": name, "payload": {"source": "x".repeat(300)}})),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            "body over the gateway's limit",
            Some(TOKEN),
            body(serde_json::json!({"taskType": name, "payload": {"source": "x".repeat(100_000)}})),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
    ];
    for (what, token, request, status, code) in cases {
        let (got, answer) = post_raw(&harness, token, request).await;
        assert_eq!(got, status, "{what}: {answer}");
        assert_eq!(answer["error"]["code"], code, "{what}: {answer}");
        assert!(
            answer["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}"
        );
        if code == "invalid_payload" {
            assert_eq!(answer["error"]["path"], "/renditions/1", "{answer}");
        }
    }
    assert_eq!(harness.total_tasks(&name).await, 0, "no task was recorded");
    assert_eq!(
        harness.ready_count(&queue(&name).main).await,
        0,
        "no message was queued"
    );

    // And a good one still goes through.
    harness.submit_ok(&name, ok_payload).await;
    assert_eq!(harness.total_tasks(&name).await, 1);
    harness.shutdown().await;
}

#[tokio::test]
async fn rate_limits_and_backpressure_answer_429_with_retry_after() {
    let mut limited = test_type("limited");
    // Slow enough that no token comes back however long the first two requests take.
    limited.rate_limit = Some(RateLimit {
        per_second: 0.01,
        burst: Some(2.0),
    });
    let mut shallow = test_type("shallow");
    shallow.max_queue_depth = 3;
    let (limited_name, shallow_name) = (limited.name.clone(), shallow.name.clone());
    let harness = Harness::start(vec![limited, shallow]).await;

    harness
        .submit_ok(&limited_name, serde_json::json!({}))
        .await;
    harness
        .submit_ok(&limited_name, serde_json::json!({}))
        .await;
    let response = harness
        .http
        .post(format!("{}/v1/tasks", harness.gateway_url))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"taskType": limited_name, "payload": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=100).contains(&retry_after), "{retry_after}");
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_eq!(harness.total_tasks(&limited_name).await, 2);

    // No workers: the queue fills past maxQueueDepth and the gateway pushes back.
    for _ in 0..4 {
        harness
            .submit_ok(&shallow_name, serde_json::json!({}))
            .await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let refused = loop {
        let response = harness
            .http
            .post(format!("{}/v1/tasks", harness.gateway_url))
            .bearer_auth(TOKEN)
            .json(&serde_json::json!({"taskType": shallow_name, "payload": {}}))
            .send()
            .await
            .unwrap();
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            let retry_after = response.headers().get("retry-after").cloned();
            break Some((
                retry_after,
                response.json::<serde_json::Value>().await.unwrap(),
            ));
        }
        assert_eq!(response.status(), StatusCode::CREATED);
        assert!(std::time::Instant::now() < deadline, "no backpressure");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (retry_after, body) = refused.unwrap();
    assert!(retry_after.is_some(), "Retry-After is set");
    assert_eq!(body["error"]["code"], "queue_full");
    let accepted = harness.total_tasks(&shallow_name).await;
    assert_eq!(
        accepted,
        i64::from(harness.ready_count(&queue(&shallow_name).main).await)
    );
    // Every accepted task is marked QUEUED, a moment after its answer (decision 0020).
    harness
        .wait_for_state(&shallow_name, Queued, accepted, Duration::from_secs(30))
        .await;
    harness.shutdown().await;
}

#[tokio::test]
async fn batches_answer_per_task_and_tasks_and_timelines_can_be_read() {
    let mut spec = test_type("batch");
    spec.schema = Some(serde_json::json!({"type": "object", "required": ["n"]}));
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let key = Uuid::new_v4();
    let response = harness
        .http
        .post(format!("{}/v1/tasks:batch", harness.gateway_url))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"tasks": [
            {"taskType": name, "payload": {"n": 1}, "idempotencyKey": key},
            {"taskType": name, "payload": {}},
            {"taskType": "nope", "payload": {"n": 3}},
            {"taskType": name, "payload": {"n": 1}, "idempotencyKey": key},
        ]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body: serde_json::Value = response.json().await.unwrap();
    let results = body["results"].as_array().unwrap();
    let statuses: Vec<u64> = results
        .iter()
        .map(|r| r["status"].as_u64().unwrap())
        .collect();
    assert_eq!(statuses, [201, 400, 404, 200]);
    assert_eq!(results[0]["id"], results[3]["id"]);
    assert_eq!(results[1]["error"]["code"], "invalid_payload");
    assert_eq!(harness.total_tasks(&name).await, 1);

    let id = results[0]["id"].as_str().unwrap();
    let (_, task) = harness.get_json(TOKEN, &format!("/v1/tasks/{id}")).await;
    assert_eq!(task["state"], "QUEUED");
    let (_, events) = harness
        .get_json(TOKEN, &format!("/v1/tasks/{id}/events"))
        .await;
    let states: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["toState"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["INGESTED", "QUEUED"]);
    let missing = harness
        .http
        .get(format!(
            "{}/v1/tasks/{}",
            harness.gateway_url,
            Uuid::new_v4()
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    harness.shutdown().await;
}

#[tokio::test]
async fn retries_waiting_out_their_backoff_count_against_max_queue_depth() {
    let mut shallow = test_type("retrying");
    shallow.max_queue_depth = 3;
    let name = shallow.name.clone();
    let harness = Harness::start(vec![shallow]).await;
    // Five failed attempts wait in the retry queue for a minute; the work queue is empty.
    let publisher = harness.publisher();
    let waiting: Vec<conveyor_core::amqp::Outgoing> = (0..5)
        .map(|_| conveyor_core::amqp::Outgoing {
            message: conveyor_core::task::TaskMessage {
                id: Uuid::new_v4(),
                task_type: name.clone(),
                attempt: 1,
                idempotency_key: Uuid::new_v4(),
                payload: serde_json::json!({}),
                submitted_at: chrono::Utc::now(),
                suspect: false,
                traceparent: None,
            },
            route: conveyor_core::task::Requeue::Retry,
            delay: Some(Duration::from_secs(60)),
            retry_tier: 0,
        })
        .collect();
    assert!(publisher.publish(&waiting).await.iter().all(Result::is_ok));
    assert_eq!(harness.ready_count(&queue(&name).main).await, 0);
    wait_until(
        "the gateway counts the retry backlog",
        Duration::from_secs(30),
        || async {
            let (status, body) = harness.submit(&name, serde_json::json!({}), None).await;
            status == StatusCode::TOO_MANY_REQUESTS && body["error"]["code"] == "queue_full"
        },
    )
    .await;
    harness.shutdown().await;
}

#[tokio::test]
async fn every_answer_carries_a_request_id_and_every_request_is_timed() {
    let spec = test_type("observed");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let (status, task) = harness.submit(&name, serde_json::json!({}), None).await;
    assert_eq!(status, StatusCode::CREATED);
    // The client's id comes back as it was sent; without one, the gateway makes one.
    let get = |id: Option<&'static str>| {
        let mut request = harness
            .http
            .get(format!(
                "{}/v1/tasks/{}",
                harness.gateway_url,
                task["id"].as_str().unwrap()
            ))
            .bearer_auth(TOKEN);
        if let Some(id) = id {
            request = request.header("x-request-id", id);
        }
        request.send()
    };
    let answer = get(Some("client-chosen-7")).await.unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(answer.headers()["x-request-id"], "client-chosen-7");
    let made = get(None).await.unwrap();
    let made = made.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert!(Uuid::parse_str(&made).is_ok(), "{made}");
    // A refusal gets one too, and is timed under its route.
    let (unauthorized, _) = post_raw(&harness, None, b"{}".to_vec()).await;
    assert_eq!(unauthorized, StatusCode::UNAUTHORIZED);

    let page = harness
        .http
        .get(format!("{}/metrics", harness.admin_url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for series in [
        r#"conveyor_http_request_duration_seconds_count{method="POST",route="/v1/tasks",status="201"} 1"#,
        r#"conveyor_http_request_duration_seconds_count{method="GET",route="/v1/tasks/{id}",status="200"} 2"#,
        r#"conveyor_http_request_duration_seconds_count{method="POST",route="/v1/tasks",status="401"} 1"#,
    ] {
        assert!(
            page.lines().any(|l| l.starts_with(series) || l == series),
            "no {series} in\n{page}"
        );
    }
    harness.shutdown().await;
}
