//! Tenants through the gateway, on the real services: two namespaces with a type of the
//! same name, each client bound to its own; and the limits that keep one client from
//! starving the others (`docs/security.md`, issue 11).

use std::time::Duration;

use conveyor_core::db::DbOptions;
use conveyor_core::task_type::{NamedTaskType, TaskTypeSpec};
use conveyor_core::testing::{self, proxy::Proxy};
use conveyor_core::TaskState;
use conveyor_gateway::auth::Tokens;
use conveyor_worker::handler::Handler;
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

use crate::support::{queue, Harness};

const ALPHA: &str = "alpha-token-1";
const BETA: &str = "beta-token-1";

/// `transcode`-like types of one name in namespaces alpha and beta, and a client of each.
async fn two_tenants(
    adjust: impl FnOnce(&mut conveyor_gateway::GatewayConfig),
) -> (Harness, String) {
    let name = testing::unique_type("transcode");
    let types = ["alpha", "beta"]
        .map(|ns| NamedTaskType::in_namespace(ns, &name, TaskTypeSpec::default()))
        .to_vec();
    let harness = Harness::start_with(types, |config| {
        config.tokens = Tokens::parse_pairs(&format!("a@alpha={ALPHA},b@beta={BETA}")).unwrap();
        adjust(config);
    })
    .await;
    (harness, name)
}

async fn submit(h: &Harness, token: &str, body: Value, key: Uuid) -> (StatusCode, Value) {
    let response = h
        .http
        .post(format!("{}/v1/tasks", h.gateway_url))
        .bearer_auth(token)
        .header("Idempotency-Key", key.to_string())
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn get(h: &Harness, token: &str, path: &str) -> (StatusCode, String) {
    let response = h
        .http
        .get(format!("{}{path}", h.gateway_url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    (response.status(), response.text().await.unwrap())
}

#[tokio::test]
async fn two_tenants_with_one_type_name_and_one_key_stay_apart() {
    let (mut harness, name) = two_tenants(|_| {}).await;
    let key = Uuid::new_v4();
    let (status, alpha) = submit(
        &harness,
        ALPHA,
        json!({"taskType": name, "payload": {"n": 1}}),
        key,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{alpha}");
    // The same key from another tenant is another task, not a 409 naming alpha's.
    let (status, beta) = submit(
        &harness,
        BETA,
        json!({"taskType": name, "payload": {"n": 2}}),
        key,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{beta}");
    assert_ne!(alpha["id"], beta["id"]);
    // Each in its own namespace's queue.
    assert_eq!(
        harness
            .ready_count(&queue(&format!("alpha.{name}")).main)
            .await,
        1
    );
    assert_eq!(
        harness
            .ready_count(&queue(&format!("beta.{name}")).main)
            .await,
        1
    );

    // Alpha reads its task by the name it submitted with, in its namespace.
    let alpha_id = alpha["id"].as_str().unwrap();
    let (status, body) = get(&harness, ALPHA, &format!("/v1/tasks/{alpha_id}")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let task: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (task["taskType"].as_str(), task["namespace"].as_str()),
        (Some(name.as_str()), Some("alpha"))
    );
    assert_eq!(task["payload"], json!({"n": 1}));

    // Beta learns nothing of it: the same 404 as for an id that does not exist.
    let (status, body) = get(&harness, BETA, &format!("/v1/tasks/{alpha_id}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let missing = Uuid::new_v4();
    let (_, unknown) = get(&harness, BETA, &format!("/v1/tasks/{missing}")).await;
    assert_eq!(
        body.replace(alpha_id, "ID"),
        unknown.replace(&missing.to_string(), "ID")
    );
    let (status, body) = get(&harness, BETA, &format!("/v1/tasks/{alpha_id}/events")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert!(!body.contains("\"n\""), "{body}");

    // Nor can beta submit into alpha's namespace, or tell its types from missing ones.
    let (status, into_alpha) = submit(
        &harness,
        BETA,
        json!({"taskType": name, "namespace": "alpha", "payload": {}}),
        Uuid::new_v4(),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{into_alpha}");
    let (_, no_such) = submit(
        &harness,
        BETA,
        json!({"taskType": "no-such-type", "namespace": "alpha", "payload": {}}),
        Uuid::new_v4(),
    )
    .await;
    assert_eq!(into_alpha["error"]["code"], no_such["error"]["code"]);
    assert_eq!(
        harness
            .ready_count(&queue(&format!("alpha.{name}")).main)
            .await,
        1
    );

    // Side by side: each namespace's worker runs its own task (its result is its payload).
    let echo = || Handler::Exec {
        command: "cat".to_owned(),
        args: Vec::new(),
    };
    let (alpha_key, beta_key) = (format!("alpha.{name}"), format!("beta.{name}"));
    let alpha_worker = harness.start_worker(&[&alpha_key], echo(), 2);
    let beta_worker = harness.start_worker(&[&beta_key], echo(), 2);
    for key in [&alpha_key, &beta_key] {
        harness
            .wait_for_state(key, TaskState::Completed, 1, Duration::from_secs(60))
            .await;
    }
    for (answer, worker, payload) in [
        (&alpha, &alpha_worker, json!({"n": 1})),
        (&beta, &beta_worker, json!({"n": 2})),
    ] {
        let id: Uuid = answer["id"].as_str().unwrap().parse().unwrap();
        let task = harness.db.task(id).await.unwrap().unwrap();
        assert_eq!(task.result, Some(payload));
        let ran_by: Vec<_> = harness
            .events(id)
            .await
            .into_iter()
            .filter_map(|e| e.worker_id)
            .collect();
        assert!(ran_by.iter().all(|w| w == worker), "{ran_by:?}");
    }
    harness.shutdown().await;
}

/// Sends a request's head and the first bytes of a body it says is `length` long, and keeps
/// the rest back; returns the open connection.
async fn half_sent(gateway_url: &str, token: Option<&str>, length: usize) -> tokio::net::TcpStream {
    let addr = gateway_url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let head = format!(
        "POST /v1/tasks:batch HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {length}\r\n\r\n{{\"tasks\": ["
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
}

/// The status line of the answer on `stream`.
async fn status_line(stream: &mut tokio::net::TcpStream) -> String {
    let mut buffer = vec![0u8; 4096];
    let n = stream.read(&mut buffer).await.unwrap();
    String::from_utf8_lossy(&buffer[..n])
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn an_unauthenticated_16_mib_body_is_refused_before_it_is_read() {
    let (harness, _) = two_tenants(|config| config.max_batch_bytes = 32 * 1024 * 1024).await;
    // The body never comes: an answer can only be given without reading it.
    let mut stream = half_sent(&harness.gateway_url, None, 16 * 1024 * 1024).await;
    let answer = tokio::time::timeout(Duration::from_secs(30), status_line(&mut stream))
        .await
        .expect("answered without waiting for the body");
    assert!(answer.contains("401"), "{answer}");
    harness.shutdown().await;
}

#[tokio::test]
async fn a_client_over_its_concurrent_requests_gets_429_and_other_clients_do_not() {
    let (harness, name) = two_tenants(|config| config.requests.max_in_flight = 2).await;
    // Two of alpha's requests in flight: each waits for a body that does not come.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(half_sent(&harness.gateway_url, Some(ALPHA), 1024).await);
    }
    let payload = |_: ()| json!({"taskType": name, "payload": {}});
    testing::wait_until(
        "alpha's third request refused",
        Duration::from_secs(30),
        || async {
            let (status, body) = submit(&harness, ALPHA, payload(()), Uuid::new_v4()).await;
            status == StatusCode::TOO_MANY_REQUESTS && body["error"]["code"] == "too_many_requests"
        },
    )
    .await;
    let (status, body) = submit(&harness, BETA, payload(()), Uuid::new_v4()).await;
    assert_eq!(status, StatusCode::CREATED, "beta is not held back: {body}");
    drop(held);
    testing::wait_until("alpha admitted again", Duration::from_secs(30), || async {
        submit(&harness, ALPHA, payload(()), Uuid::new_v4()).await.0 == StatusCode::CREATED
    })
    .await;
    harness.shutdown().await;
}

/// However many clients there are, the gateway holds at most its budget of body bytes: a
/// request past it is answered 503 `gateway_busy` before its body is read, stores nothing,
/// and goes through with the same key once the bodies ahead of it are gone.
#[tokio::test]
async fn the_gateway_bounds_the_body_bytes_it_holds_over_all_clients() {
    let (harness, name) = two_tenants(|config| {
        config.max_batch_bytes = 64 * 1024;
        config.requests.max_bytes_in_flight = 128 * 1024;
    })
    .await;
    // Alpha's two batches of 60 KiB, their bodies held back: 120 KiB of 128 taken.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(half_sent(&harness.gateway_url, Some(ALPHA), 60 * 1024).await);
    }
    let key = Uuid::new_v4();
    let big = json!({"taskType": name, "payload": {"pad": "x".repeat(10 * 1024)}});
    testing::wait_until(
        "beta's 10 KiB request refused while alpha's bodies are held",
        Duration::from_secs(30),
        || async {
            let (status, body) = submit(&harness, BETA, big.clone(), key).await;
            status == StatusCode::SERVICE_UNAVAILABLE && body["error"]["code"] == "gateway_busy"
        },
    )
    .await;
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM tasks WHERE idempotency_key = $1")
        .bind(key)
        .fetch_one(harness.db.pool())
        .await
        .unwrap();
    assert_eq!(stored, 0, "a refused request stored a task");
    // A small request still fits in what is left.
    let (status, body) = submit(
        &harness,
        BETA,
        json!({"taskType": name, "payload": {}}),
        Uuid::new_v4(),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    drop(held);
    testing::wait_until(
        "beta's request admitted with its key",
        Duration::from_secs(30),
        || async { submit(&harness, BETA, big.clone(), key).await.0 == StatusCode::CREATED },
    )
    .await;
    harness.shutdown().await;
}

/// Bytes are a client's own budget too: a client over its byte rate gets 429 before its
/// body is read, and another client's requests of the same size go through.
#[tokio::test]
async fn a_client_over_its_byte_rate_gets_429_and_other_clients_do_not() {
    // 200 bytes/s: a 1,500-byte request empties the bucket for 7.5 s.
    let (harness, name) = two_tenants(|config| config.requests.bytes_per_second = 200.0).await;
    let big = || json!({"taskType": name, "payload": {"pad": "x".repeat(1400)}});
    let (status, body) = submit(&harness, ALPHA, big(), Uuid::new_v4()).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = submit(&harness, ALPHA, big(), Uuid::new_v4()).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(body["error"]["code"], "rate_limited", "{body}");
    let (status, body) = submit(&harness, BETA, big(), Uuid::new_v4()).await;
    assert_eq!(status, StatusCode::CREATED, "beta is not held back: {body}");
    testing::wait_until("alpha admitted again", Duration::from_secs(60), || async {
        submit(&harness, ALPHA, big(), Uuid::new_v4()).await.0 == StatusCode::CREATED
    })
    .await;
    harness.shutdown().await;
}

/// A type's `rateLimit` is each client's: one client spending it leaves another of the same
/// namespace its own, and a payload the schema refuses spends nothing.
#[tokio::test]
async fn a_types_rate_limit_is_each_clients_and_refused_payloads_spend_none() {
    let mut spec = TaskTypeSpec {
        rate_limit: Some(conveyor_core::task_type::RateLimit {
            per_second: 0.01,
            burst: Some(1.0),
        }),
        ..TaskTypeSpec::default()
    };
    spec.schema = Some(json!({"type": "object", "required": ["source"]}));
    let name = testing::unique_type("limited");
    let types = vec![NamedTaskType::in_namespace("alpha", &name, spec)];
    let harness = Harness::start_with(types, |config| {
        config.tokens = Tokens::parse_pairs(&format!("a@alpha={ALPHA},a2@alpha={BETA}")).unwrap();
    })
    .await;
    let valid = || json!({"taskType": name, "payload": {"source": "a.mp4"}});
    // Refused payloads first: they must not spend alpha's one task.
    for _ in 0..3 {
        let (status, body) = submit(
            &harness,
            ALPHA,
            json!({"taskType": name, "payload": {}}),
            Uuid::new_v4(),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    }
    let (status, body) = submit(&harness, ALPHA, valid(), Uuid::new_v4()).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = submit(&harness, ALPHA, valid(), Uuid::new_v4()).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    // Another client of the namespace has its own.
    let (status, body) = submit(&harness, BETA, valid(), Uuid::new_v4()).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    harness.shutdown().await;
}

/// A request that runs past the timeout is answered 503, but its submission runs on (so
/// that a recorded task is published): it keeps the client's in-flight permit until it
/// ends, or a client could pile up submissions past its limit by timing out.
#[tokio::test]
async fn a_timed_out_submission_keeps_its_clients_permit_until_it_ends() {
    let spec = crate::support::test_type("timeout");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let database = Proxy::start(testing::DATABASE_ADDRESS.parse().unwrap()).await;
    let mut config = harness.gateway_config();
    config.database = DbOptions::new(testing::via_port(
        &harness.db_url,
        testing::DATABASE_ADDRESS,
        database.port,
    ));
    // The hung submission outlasts the second request by far: it waits up to 60 s.
    config.database.acquire_timeout = Duration::from_secs(60);
    config.requests.max_in_flight = 1;
    config.requests.timeout = Duration::from_millis(500);
    let (gateway_url, _) = harness.start_gateway(config).await;
    let submit = || {
        harness
            .http
            .post(format!("{gateway_url}/v1/tasks"))
            .bearer_auth(crate::support::TOKEN)
            .json(&json!({"taskType": name, "payload": {}}))
            .send()
    };
    // The database goes silent: the first submission hangs on it past the timeout.
    database.black_hole();
    let first = submit().await.unwrap();
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = first.json().await.unwrap();
    assert_eq!(body["error"]["code"], "request_timeout", "{body}");
    // Its submission still waits on the database, holding the one permit.
    let second = submit().await.unwrap();
    assert_eq!(
        second.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "a second request was let in while the first's submission ran"
    );
    database.restore();
    testing::wait_until(
        "the client admitted again",
        Duration::from_secs(60),
        || async { matches!(submit().await, Ok(r) if r.status() == StatusCode::CREATED) },
    )
    .await;
    harness.shutdown().await;
}

#[tokio::test]
async fn a_catastrophic_backtracking_pattern_does_not_stall_the_gateway() {
    let mut spec = NamedTaskType::named(testing::unique_type("redos"));
    spec.schema = Some(json!({
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": "^(a+)+$"}}
    }));
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    // A backtracking engine takes 2^n steps on this; a linear one answers at once.
    let evil = format!("{}!", "a".repeat(50_000));
    let sends = (0..8).map(|_| harness.submit(&name, json!({"name": evil}), None));
    let answers = tokio::time::timeout(
        Duration::from_secs(60),
        futures_util::future::join_all(sends),
    )
    .await
    .expect("the gateway answered every evil payload");
    for (status, body) in answers {
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["error"]["code"], "invalid_payload");
    }
    let id = harness.submit_ok(&name, json!({"name": "aaaa"})).await;
    assert!(harness.db.task(id).await.unwrap().is_some());
    harness.shutdown().await;
}

/// A backtracking engine (jsonschema's default, fancy-regex) would take such a pattern and
/// stall on a crafted payload; the gateway refuses the type before it serves anything.
#[test]
fn a_pattern_that_needs_backtracking_is_refused_at_start() {
    let types = std::env::temp_dir().join(format!("conveyor-redos-{}.yaml", Uuid::new_v4()));
    std::fs::write(
        &types,
        "taskTypes:\n  - name: lookahead\n    schema:\n      type: object\n      \
         properties: {name: {type: string, pattern: '^(?=(a+)+$)a'}}\n",
    )
    .unwrap();
    let mut gateway = std::process::Command::new(testing::binary("conveyor-gateway"))
        .arg("--task-types")
        .arg(&types)
        .args(["--tokens", "tests=test-token-123"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .env("CONVEYOR_DATABASE_URL", testing::admin_database_url())
        .env("CONVEYOR_AMQP_URL", testing::amqp_url())
        .env("CONVEYOR_NO_MIGRATE", "true")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start conveyor-gateway");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = gateway.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = gateway.kill();
            panic!("the gateway started serving a type whose pattern needs backtracking");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut gateway.stderr.take().unwrap(), &mut stderr).unwrap();
    let _ = std::fs::remove_file(&types);
    assert!(!status.success());
    assert!(
        stderr.contains("lookahead") && stderr.contains("schema"),
        "{stderr}"
    );
}

#[tokio::test]
async fn adopt_moves_a_type_from_before_tenancy_into_its_namespace() {
    // Type `legacy` as it was before tenancy (queues conveyor.<name>, tenant default), and
    // the TaskType of the same name applied in namespace media since.
    let before = crate::support::test_type("legacy");
    let name = before.name.clone();
    let after = NamedTaskType::in_namespace("media", &name, before.spec.clone());
    let key = after.name.clone();
    let mut harness = Harness::start(vec![before, after]).await;
    let ids = [
        harness.submit_ok(&name, json!({})).await,
        harness.submit_ok(&name, json!({})).await,
        harness.submit_ok(&name, json!({})).await,
    ];
    assert_eq!(harness.ready_count(&queue(&name).main).await, 3);

    // Pages of two: the three waiting tasks take two pages.
    let out = harness.conveyorctl(&[
        "adopt",
        "-n",
        "media",
        "--type",
        &name,
        "--by",
        "ops-test",
        "--page-size",
        "2",
    ]);
    assert!(
        out.contains("rows moved: 3") && out.contains("re-published: 3"),
        "{out}"
    );
    for id in ids {
        let task = harness.db.task(id).await.unwrap().unwrap();
        assert_eq!(
            (task.tenant.as_str(), task.task_type.as_str()),
            ("media", key.as_str())
        );
    }
    assert_eq!(harness.ready_count(&queue(&key).main).await, 3);
    let old_queue = conveyor_core::amqp::QueueObserver::new(testing::amqp_url(), "adopt-test")
        .ready_count(&queue(&name).main)
        .await;
    assert!(old_queue.is_err(), "the old queue is deleted");
    // Again: nothing moves twice.
    let again = harness.conveyorctl(&["adopt", "-n", "media", "--type", &name, "--by", "ops-test"]);
    assert!(again.contains("rows moved: 0"), "{again}");

    harness.start_worker(&[&key], conveyor_worker::handler::Handler::Noop, 2);
    harness
        .wait_for_state(
            &key,
            conveyor_core::TaskState::Completed,
            3,
            Duration::from_secs(60),
        )
        .await;
    for chain in harness.chains(&key).await.values() {
        testing::assert_valid_chain(chain);
        let completed = chain
            .iter()
            .filter(|e| e.to_state == conveyor_core::TaskState::Completed);
        assert_eq!(completed.count(), 1, "{chain:?}");
    }
    harness.shutdown().await;
}

#[tokio::test]
async fn lists_cancels_retries_and_redrives_see_only_the_clients_tenant() {
    let (harness, name) = two_tenants(|_| {}).await;
    let labels = json!({"team": "shared"});
    let mut alphas = Vec::new();
    for _ in 0..3 {
        let (status, body) = submit(
            &harness,
            ALPHA,
            json!({"taskType": name, "payload": {}, "labels": labels}),
            Uuid::new_v4(),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        alphas.push(body["id"].as_str().unwrap().to_owned());
    }
    let (_, beta) = submit(
        &harness,
        BETA,
        json!({"taskType": name, "payload": {}, "labels": labels}),
        Uuid::new_v4(),
    )
    .await;
    let beta_id = beta["id"].as_str().unwrap();

    // Lists: every filter a client can write yields its own tenant's tasks only.
    for query in [
        String::new(),
        format!("type={name}"),
        "labelSelector=team%3Dshared".to_owned(),
        // Just answered: its QUEUED mark may still be on its way (decision 0020).
        "state=INGESTED,QUEUED".to_owned(),
    ] {
        let (status, body) = get(&harness, BETA, &format!("/v1/tasks?{query}")).await;
        assert_eq!(status, StatusCode::OK, "{query}: {body}");
        let page: Value = serde_json::from_str(&body).unwrap();
        let listed: Vec<&str> = page["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_str().unwrap())
            .collect();
        assert_eq!(listed, vec![beta_id], "{query}");
    }
    let (status, body) = get(
        &harness,
        BETA,
        &format!("/v1/tasks?type={name}&namespace=alpha"),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let (_, body) = get(&harness, BETA, "/v1/tasks?namespace=alpha").await;
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["tasks"],
        json!([])
    );
    // A cursor taken from another tenant's ids shows nothing of theirs either.
    let (_, body) = get(
        &harness,
        BETA,
        &format!("/v1/tasks?cursor={}", Uuid::now_v7()),
    )
    .await;
    assert!(
        !alphas.iter().any(|id| body.contains(id.as_str())),
        "{body}"
    );

    // conveyorctl with beta's token: the same answers (it is a client of the same API).
    let ctl = tokio::process::Command::new(testing::binary("conveyorctl"))
        .args(["list", "-o", "json"])
        .env("CONVEYOR_GATEWAY_URL", &harness.gateway_url)
        .env("CONVEYOR_TOKEN", BETA)
        .output()
        .await
        .unwrap();
    assert!(ctl.status.success());
    let listed: Value = serde_json::from_slice(&ctl.stdout).unwrap();
    assert_eq!(listed["tasks"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed["tasks"][0]["id"], json!(beta_id));
    // Reads and remedies of alpha's task by id: refused as unknown, and nothing changes
    // (checked below with the API's).
    for args in [
        vec!["get", "-o", "json", &alphas[0]],
        vec!["events", &alphas[0]],
        vec!["cancel", &alphas[0]],
        vec!["retry", &alphas[0]],
    ] {
        let ctl = tokio::process::Command::new(testing::binary("conveyorctl"))
            .args(&args)
            .env("CONVEYOR_GATEWAY_URL", &harness.gateway_url)
            .env("CONVEYOR_TOKEN", BETA)
            .output()
            .await
            .unwrap();
        let said = String::from_utf8_lossy(&ctl.stdout) + String::from_utf8_lossy(&ctl.stderr);
        assert!(!ctl.status.success(), "{args:?}: {said}");
        assert!(
            said.contains("task_not_found") || said.contains("not found"),
            "{args:?}: {said}"
        );
        assert!(
            !said.contains("shared"),
            "{args:?} showed alpha's task: {said}"
        );
    }

    // Types at a glance: beta's own only. A stream of alpha's task: 404.
    let (status, body) = get(&harness, BETA, "/v1/task-types").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let overview: Value = serde_json::from_str(&body).unwrap();
    let namespaces: Vec<&str> = overview["taskTypes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["namespace"].as_str().unwrap())
        .collect();
    assert_eq!(namespaces, vec!["beta"], "{body}");
    let (status, _) = get(&harness, BETA, &format!("/v1/tasks/{}/stream", alphas[0])).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // Cancel and retry of alpha's tasks by beta: 404 as for ids that do not exist, and
    // nothing changes; redrive of alpha's type by beta: an unknown type.
    for action in ["cancel", "retry"] {
        let (status, body) = harness
            .post_json(
                BETA,
                &format!("/v1/tasks/{}:{action}", alphas[0]),
                json!({}),
            )
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{action}: {body}");
        assert_eq!(body["error"]["code"], json!("task_not_found"));
    }
    let (status, body) = harness
        .post_json(
            BETA,
            "/v1/tasks:redrive",
            json!({"taskType": name, "namespace": "alpha"}),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    for id in &alphas {
        let task = harness.db.task(id.parse().unwrap()).await.unwrap().unwrap();
        assert!(matches!(
            task.state,
            TaskState::Queued | TaskState::Ingested
        ));
    }
    // Alpha can cancel its own.
    let (status, body) = harness
        .post_json(ALPHA, &format!("/v1/tasks/{}:cancel", alphas[0]), json!({}))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    harness.shutdown().await;
}
