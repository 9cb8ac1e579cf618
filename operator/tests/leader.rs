//! Leader election against a mock API server: take a free lease, wait on a held one, take
//! over an expired one.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use conveyor_operator::leader::Leader;
use http::{Method, Request, Response};
use kube::client::Body;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// Answers requests from a script of (method, status, body); returns what was sent.
fn api(script: Vec<(Method, u16, Value)>) -> (kube::Client, tokio::task::JoinHandle<Vec<Value>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let served = tokio::spawn(async move {
        let mut bodies = Vec::new();
        for (method, status, answer) in script {
            let (request, send) = handle.next_request().await.unwrap();
            assert_eq!(request.method(), method);
            assert!(request
                .uri()
                .path()
                .starts_with("/apis/coordination.k8s.io/v1/namespaces/ops/leases"));
            let body = request.into_body().collect_bytes().await.unwrap();
            bodies.push(serde_json::from_slice(&body).unwrap_or(Value::Null));
            let response = Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(&answer).unwrap()));
            send.send_response(response.unwrap());
        }
        bodies
    });
    (kube::Client::new(service, "default"), served)
}

fn lease(holder: &str, renewed: &str) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "conveyor-operator", "namespace": "ops", "resourceVersion": "7"},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": renewed, "leaseTransitions": 2}
    })
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"})
}

#[tokio::test]
async fn a_free_lease_is_taken() {
    let (client, served) = api(vec![
        (Method::GET, 404, not_found()),
        (
            Method::POST,
            201,
            lease("me", "2026-01-01T00:00:00.000000Z"),
        ),
    ]);
    let leader = Leader::new(
        client,
        "ops",
        "conveyor-operator",
        "me",
        Duration::from_secs(15),
    );
    assert!(leader.acquire(&CancellationToken::new()).await.unwrap());
    let bodies = served.await.unwrap();
    assert_eq!(bodies[1]["spec"]["holderIdentity"], "me");
}

#[tokio::test]
async fn a_lease_held_by_another_live_operator_is_left_alone() {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let (client, served) = api(vec![(Method::GET, 200, lease("other", &now))]);
    let leader = Leader::new(
        client,
        "ops",
        "conveyor-operator",
        "me",
        Duration::from_secs(15),
    );
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        stop.cancel();
    });
    assert!(
        !leader.acquire(&shutdown).await.unwrap(),
        "stood by until shutdown"
    );
    assert_eq!(served.await.unwrap().len(), 1);
}

#[tokio::test]
async fn an_expired_lease_is_taken_over() {
    let (client, served) = api(vec![
        (
            Method::GET,
            200,
            lease("crashed", "2020-01-01T00:00:00.000000Z"),
        ),
        (Method::PUT, 200, lease("me", "2026-01-01T00:00:00.000000Z")),
    ]);
    let leader = Leader::new(
        client,
        "ops",
        "conveyor-operator",
        "me",
        Duration::from_secs(15),
    );
    assert!(leader.acquire(&CancellationToken::new()).await.unwrap());
    let bodies = served.await.unwrap();
    assert_eq!(bodies[1]["spec"]["holderIdentity"], "me");
    assert_eq!(bodies[1]["spec"]["leaseTransitions"], 3);
    assert_eq!(
        bodies[1]["metadata"]["resourceVersion"], "7",
        "optimistic replace"
    );
}
