//! Leader election against a mock API server, on tokio's paused clock (a lease duration
//! passes in no time): take a free lease, wait on a held one, take over one that nobody
//! renewed for a whole duration by our own clock, never trust the holder's clock, survive API
//! errors while standing by, step down before a standby may act, release at shutdown.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_operator::leader::Leader;
use http::{Method, Request, Response};
use kube::client::Body;
use serde_json::{json, Value};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const LEASE: Duration = Duration::from_secs(15);

/// What the mock answers to one request: a status and body, or nothing ever (a hung call).
enum Answer {
    Reply(u16, Value),
    Hang,
}

/// A request the mock saw: when (on the paused clock), its method and body.
type Seen = Arc<Mutex<Vec<(Instant, Method, Value)>>>;

/// Serves every request with `answer(method, number of requests before it)`.
fn api(mut answer: impl FnMut(&Method, usize) -> Answer + Send + 'static) -> (kube::Client, Seen) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let seen: Seen = Arc::default();
    let log = seen.clone();
    tokio::spawn(async move {
        let mut hung = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            assert!(request
                .uri()
                .path()
                .starts_with("/apis/coordination.k8s.io/v1/namespaces/ops/leases"));
            let method = request.method().clone();
            let body = request.into_body().collect_bytes().await.unwrap();
            let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let n = {
                let mut log = log.lock().unwrap();
                log.push((Instant::now(), method.clone(), body));
                log.len() - 1
            };
            match answer(&method, n) {
                Answer::Reply(status, value) => {
                    let response = Response::builder()
                        .status(status)
                        .body(Body::from(serde_json::to_vec(&value).unwrap()));
                    send.send_response(response.unwrap());
                }
                Answer::Hang => hung.push(send),
            }
        }
    });
    (kube::Client::new(service, "default"), seen)
}

fn lease(holder: Option<&str>, renewed: &str) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "conveyor-operator", "namespace": "ops", "resourceVersion": "7"},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": renewed, "leaseTransitions": 2}
    })
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"})
}

fn leader(client: kube::Client) -> Leader {
    Leader::new(client, "ops", "conveyor-operator", "me", LEASE)
}

fn requests(seen: &Seen) -> Vec<(Instant, Method, Value)> {
    seen.lock().unwrap().clone()
}

/// Cancels a token after `after` of (paused) time.
fn cancel_after(after: Duration) -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        cancel.cancel();
    });
    token
}

#[tokio::test(start_paused = true)]
async fn a_free_lease_is_taken() {
    let (client, seen) = api(|method, _| match *method {
        Method::GET => Answer::Reply(404, not_found()),
        _ => Answer::Reply(201, lease(Some("me"), "2026-01-01T00:00:00.000000Z")),
    });
    assert!(leader(client).acquire(&CancellationToken::new()).await);
    let seen = requests(&seen);
    assert_eq!(seen[1].1, Method::POST);
    assert_eq!(seen[1].2["spec"]["holderIdentity"], "me");
}

#[tokio::test(start_paused = true)]
async fn a_lease_another_operator_renews_is_left_alone_whatever_its_clock_says() {
    // The holder's clock is years behind ours: each renewal writes an old time. Comparing
    // it with our clock would call the lease expired at once.
    let (client, seen) = api(|_, n| {
        Answer::Reply(
            200,
            lease(
                Some("other"),
                &format!("2020-01-01T00:00:{:02}.000000Z", n % 60),
            ),
        )
    });
    let shutdown = cancel_after(LEASE * 3);
    assert!(
        !leader(client).acquire(&shutdown).await,
        "stood by until shutdown"
    );
    let seen = requests(&seen);
    assert!(seen.len() > 3, "kept watching: {} requests", seen.len());
    assert!(
        seen.iter().all(|(_, method, _)| *method == Method::GET),
        "never wrote the lease of a live holder"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lease_nobody_renews_is_taken_after_a_whole_duration_by_our_clock() {
    // A crashed holder whose last renewal our clock would call recent: only our own
    // observation of an unchanged record counts.
    let future = "2099-01-01T00:00:00.000000Z";
    let (client, seen) = api(move |method, _| match *method {
        Method::GET => Answer::Reply(200, lease(Some("crashed"), future)),
        _ => Answer::Reply(200, lease(Some("me"), future)),
    });
    let started = Instant::now();
    assert!(leader(client).acquire(&CancellationToken::new()).await);
    let seen = requests(&seen);
    let (at, method, body) = seen.last().unwrap();
    assert_eq!(*method, Method::PUT);
    assert!(
        *at - started >= LEASE,
        "took the lease after {:?}, before a whole duration passed unchanged",
        *at - started
    );
    assert_eq!(body["spec"]["holderIdentity"], "me");
    assert_eq!(body["spec"]["leaseTransitions"], 3);
    assert_eq!(
        body["metadata"]["resourceVersion"], "7",
        "optimistic replace"
    );
}

#[tokio::test(start_paused = true)]
async fn a_released_lease_is_taken_at_once() {
    let (client, seen) = api(|method, _| match *method {
        Method::GET => Answer::Reply(200, lease(None, "2026-01-01T00:00:00.000000Z")),
        _ => Answer::Reply(200, lease(Some("me"), "2026-01-01T00:00:00.000000Z")),
    });
    assert!(leader(client).acquire(&CancellationToken::new()).await);
    assert_eq!(requests(&seen).len(), 2, "one read, one write");
}

#[tokio::test(start_paused = true)]
async fn api_errors_and_hung_calls_while_standing_by_are_retried() {
    let (client, seen) = api(|method, n| match (method.clone(), n) {
        (_, 0) => Answer::Reply(
            500,
            json!({"kind": "Status", "code": 500, "message": "etcd"}),
        ),
        (_, 1) => Answer::Hang,
        (Method::GET, _) => Answer::Reply(404, not_found()),
        _ => Answer::Reply(201, lease(Some("me"), "2026-01-01T00:00:00.000000Z")),
    });
    assert!(leader(client).acquire(&CancellationToken::new()).await);
    assert_eq!(requests(&seen).len(), 4);
}

#[tokio::test(start_paused = true)]
async fn a_leader_whose_renewals_hang_steps_down_before_a_standby_may_take_over() {
    // Acquired (a create), then every renewal hangs: kube's client would wait forever.
    let (client, seen) = api(|method, n| match (method.clone(), n) {
        (Method::GET, 0) => Answer::Reply(404, not_found()),
        (Method::POST, _) => Answer::Reply(201, lease(Some("me"), "2026-01-01T00:00:00.000000Z")),
        _ => Answer::Hang,
    });
    let leader = leader(client);
    assert!(leader.acquire(&CancellationToken::new()).await);
    let acquired = requests(&seen)[1].0;
    let lost = CancellationToken::new();
    let hold = leader.hold(CancellationToken::new(), lost.clone());
    tokio::time::timeout(LEASE * 2, hold)
        .await
        .expect("hold never gave up");
    assert!(lost.is_cancelled());
    let stepped_down = Instant::now() - acquired;
    assert!(
        stepped_down < LEASE,
        "stepped down {stepped_down:?} after the last renewal: a standby may act after {LEASE:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_releases_the_lease() {
    let held = lease(Some("me"), "2026-01-01T00:00:00.000000Z");
    let (client, seen) = api(move |_, _| Answer::Reply(200, held.clone()));
    leader(client).release().await;
    let seen = requests(&seen);
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].1, Method::PUT);
    assert_eq!(seen[1].2["spec"]["holderIdentity"], Value::Null);
    assert_eq!(seen[1].2["spec"]["leaseDurationSeconds"], 1);
}

#[tokio::test(start_paused = true)]
async fn a_leader_whose_renewals_fail_at_once_stops_acting_before_a_standby_may_take_over() {
    // Renewals answered 500 at once: the step-down must not wait a retry period past the
    // renew deadline, since the controllers then get STOP_WITHIN to stop.
    let (client, seen) = api(|method, n| match (method.clone(), n) {
        (Method::GET, 0) => Answer::Reply(404, not_found()),
        (Method::POST, _) => Answer::Reply(201, lease(Some("me"), "2026-01-01T00:00:00.000000Z")),
        _ => Answer::Reply(500, json!({"kind": "Status", "code": 500})),
    });
    let leader = leader(client);
    assert!(leader.acquire(&CancellationToken::new()).await);
    let acquired = requests(&seen)[1].0;
    let lost = CancellationToken::new();
    tokio::time::timeout(
        LEASE * 2,
        leader.hold(CancellationToken::new(), lost.clone()),
    )
    .await
    .expect("hold never gave up");
    assert!(lost.is_cancelled());
    let acting_until = Instant::now() - acquired + conveyor_operator::app::STOP_WITHIN;
    assert!(
        acting_until < LEASE,
        "may act {acting_until:?} after the last renewal: a standby may act after {LEASE:?}"
    );
}
