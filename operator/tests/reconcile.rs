//! Reconcile flows against a mock API server (scripted requests and answers) and the real
//! RabbitMQ: what the reconcilers ask Kubernetes to do, in order.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use conveyor_core::amqp::{Publisher, QueueNames};
use conveyor_core::crd::task_type::DeletionPolicy;
use conveyor_core::crd::{TaskType, TaskTypeSpec, WorkerPool};
use conveyor_core::testing;
use conveyor_operator::build::ConnectionSecret;
use conveyor_operator::context::{Context, OperatorMetrics};
use conveyor_operator::rabbitmq::{ManagementApi, ManagementError};
use conveyor_operator::{task_types, worker_pools};
use http::{Method, Request, Response};
use k8s_openapi::api::apps::v1::Deployment;
use kube::client::Body;
use kube::runtime::events::Reporter;
use kube::runtime::{reflector, watcher};
use kube::Client;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// One expected API call and the answer to give.
#[derive(Clone)]
struct Expect {
    method: Method,
    /// The request path (without query) must end with this.
    path: String,
    status: u16,
    answer: Value,
}

fn expect(method: Method, path: &str, status: u16, answer: Value) -> Expect {
    Expect {
        method,
        path: path.to_owned(),
        status,
        answer,
    }
}

/// A seen request: method, path with query, body.
type Seen = (Method, String, Value);

/// Serves the script in order, then checks that nothing more is asked.
fn api_server(script: Vec<Expect>) -> (Client, JoinHandle<Vec<Seen>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let verifier = tokio::spawn(async move {
        let mut seen = Vec::new();
        for step in script {
            let next = tokio::time::timeout(Duration::from_secs(60), handle.next_request()).await;
            let (request, send) = next
                .unwrap_or_else(|_| panic!("no request; expected {} …{}", step.method, step.path))
                .expect("client dropped");
            let method = request.method().clone();
            let uri = request.uri().to_string();
            let body = request.into_body().collect_bytes().await.unwrap();
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            assert_eq!(method, step.method, "{uri}");
            assert!(
                uri.split('?').next().unwrap().ends_with(&step.path),
                "{uri} should end with {}",
                step.path
            );
            let response = Response::builder()
                .status(step.status)
                .body(Body::from(serde_json::to_vec(&step.answer).unwrap()))
                .unwrap();
            send.send_response(response);
            seen.push((method, uri, body));
        }
        seen
    });
    (Client::new(service, "default"), verifier)
}

fn context(client: Client, management_url: &str) -> Arc<Context> {
    context_with(client, management_url, &testing::amqp_url())
}

/// A context whose broker is at `amqp_url` (an address nobody answers, say).
fn context_with(client: Client, management_url: &str, amqp_url: &str) -> Arc<Context> {
    let reporter = Reporter {
        controller: "conveyor-operator".into(),
        instance: None,
    };
    Arc::new(Context::new(
        client.clone(),
        reporter,
        ManagementApi::new(
            management_url,
            "conveyor",
            "conveyor",
            "/",
            &testing::dev_roots(),
        )
        .unwrap(),
        Publisher::new(amqp_url, "operator-test", Duration::from_secs(1)),
        ConnectionSecret::default(),
        OperatorMetrics::new(),
    ))
}

/// Declarations the operator made over AMQP (its own counter of broker requests).
fn amqp_declarations(ctx: &Context) -> u64 {
    ctx.metrics
        .broker_requests
        .with_label_values(&["amqp"])
        .get()
}

fn task_type(name: &str, spec: TaskTypeSpec) -> TaskType {
    TaskType::test(name).spec(spec).build()
}

fn status_answer(object: &impl serde::Serialize) -> Value {
    serde_json::to_value(object).unwrap()
}

/// The data path's view of TaskType `name` in namespace `video`, where these tests apply it.
fn in_video(name: &str) -> conveyor_core::task_type::NamedTaskType {
    conveyor_core::task_type::NamedTaskType::in_namespace("video", name, Default::default())
}

/// Whether the type's queues exist (the broker may not have counted them yet).
async fn declared(ctx: &Context, name: &str) -> bool {
    match ctx.management.depths(&in_video(name)).await {
        Ok(_) | Err(ManagementError::StatsMissing { .. }) => true,
        Err(ManagementError::QueueMissing { .. }) => false,
        Err(err) => panic!("cannot tell whether {name}'s queues exist: {err}"),
    }
}

/// A context whose API server takes `patches` status patches of `tt` (TaskType `name` in
/// `video`), after a first reconcile of it.
async fn reconciled_once(
    tt: &TaskType,
    name: &str,
    patches: usize,
) -> (Arc<Context>, JoinHandle<Vec<Seen>>) {
    let path = format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{name}/status");
    let script = (0..patches)
        .map(|_| expect(Method::PATCH, &path, 200, status_answer(tt)))
        .collect();
    let (client, verifier) = api_server(script);
    let ctx = context(client, MANAGEMENT);
    task_types::reconcile(Arc::new(tt.clone()), ctx.clone())
        .await
        .unwrap();
    (ctx, verifier)
}

const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/video/events";
const MANAGEMENT: &str = testing::MANAGEMENT_API;

#[tokio::test]
async fn a_new_task_type_gets_queues_policies_and_a_ready_status() {
    let name = testing::unique_type("op");
    let tt = task_type(
        &name,
        TaskTypeSpec {
            max_retries: 4,
            ..TaskTypeSpec::default()
        },
    );
    let path = format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{name}/status");
    let (client, verifier) =
        api_server(vec![expect(Method::PATCH, &path, 200, status_answer(&tt))]);
    let ctx = context(client, MANAGEMENT);

    task_types::reconcile(Arc::new(tt.clone()), ctx.clone())
        .await
        .unwrap();
    let seen = verifier.await.unwrap();
    let (_, uri, body) = &seen[0];
    assert!(
        uri.contains("fieldManager=conveyor-operator") && uri.contains("force=true"),
        "{uri}"
    );
    assert_eq!(body["status"]["observedGeneration"], 2);
    assert_eq!(body["status"]["conditions"][0]["type"], "Ready");
    assert_eq!(body["status"]["conditions"][0]["status"], "True");
    // Unknown until the broker has counted the new queues, never a made-up zero.
    let ready = &body["status"]["depths"]["ready"];
    assert!(ready.is_null() || *ready == 0, "{ready}");
    // The broker applies policies asynchronously.
    let mut delivery_limit = Value::Null;
    for _ in 0..75 {
        let effective = ctx
            .management
            .effective_policy(&QueueNames::of(&in_video(&name).name).main)
            .await
            .unwrap();
        delivery_limit = effective["delivery-limit"].clone();
        if delivery_limit == 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(delivery_limit, 6, "maxRetries 4 + 2");
    testing::delete_queues(&in_video(&name).name).await;
}

/// The policy RabbitMQ applies to `queue` once it settles (it applies them asynchronously):
/// its name, or null when none matches.
async fn settled_policy(queue: &str, expected: &Value) -> Value {
    let url = format!("{}/api/queues/%2f/{queue}", testing::management_url());
    let mut policy = Value::Null;
    for _ in 0..75 {
        let info: Value = testing::http_client()
            .get(&url)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        policy = info["policy"].clone();
        if policy == *expected || (expected.is_null() && policy.as_str() == Some("")) {
            return expected.clone();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    policy
}

#[tokio::test]
async fn an_unchanged_type_reconciled_again_declares_nothing_and_writes_no_policy() {
    // A thousand types resynced must not mean a thousand declarations and policy writes:
    // only a new generation (or a queue gone from the broker) declares again. Seen from
    // the broker: the type's own policy, deleted by hand after the first reconcile, stays
    // gone through a rerun of the same generation, and is back after a spec change.
    let name = testing::unique_type("rerun");
    let mut tt = task_type(
        &name,
        TaskTypeSpec {
            max_retries: 4,
            ..TaskTypeSpec::default()
        },
    );
    let queues = QueueNames::of(&in_video(&name).name);
    let policy = format!(
        "{}/api/policies/%2f/{}",
        testing::management_url(),
        queues.main
    );
    let path = format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{name}/status");
    let (client, verifier) = api_server(vec![
        expect(Method::PATCH, &path, 200, status_answer(&tt)),
        expect(Method::PATCH, &path, 200, status_answer(&tt)),
        expect(Method::PATCH, &path, 200, status_answer(&tt)),
    ]);
    let ctx = context(client, MANAGEMENT);
    task_types::reconcile(Arc::new(tt.clone()), ctx.clone())
        .await
        .unwrap();
    let http = testing::http_client();
    let deleted = http.delete(&policy).send().await.unwrap();
    assert!(deleted.status().is_success(), "the own policy was written");
    // The poller lists the type's queues (a rerun declares again when one is missing).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !matches!(
        ctx.broker.depths(&in_video(&name)),
        Ok(_) | Err(ManagementError::StatsMissing { .. })
    ) {
        assert!(std::time::Instant::now() < deadline, "queues never listed");
        ctx.broker.refresh(&ctx.management).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let declarations = || amqp_declarations(&ctx);
    let before = declarations();
    task_types::reconcile(Arc::new(tt.clone()), ctx.clone())
        .await
        .unwrap();
    let status = http.get(&policy).send().await.unwrap().status();
    assert_eq!(status, 404, "the rerun wrote the policy again");
    assert_eq!(
        declarations(),
        before,
        "the rerun declared the queues again"
    );

    tt.metadata.generation = Some(3);
    task_types::reconcile(Arc::new(tt), ctx.clone())
        .await
        .unwrap();
    let status = http.get(&policy).send().await.unwrap().status();
    assert!(status.is_success(), "a new generation declares: {status}");
    verifier.await.unwrap();
    testing::delete_queues(&in_video(&name).name).await;
}

#[tokio::test]
async fn an_exchange_deleted_by_hand_is_declared_again_at_the_next_reconcile() {
    // A tenant's broker user may configure its own `conveyor.NS.` objects, so it can delete
    // its type's exchange: its workers' publishes then fail until the exchange is back.
    // The poller lists exchanges too, and the next reconcile declares it again (decision
    // 0045), not the re-declaration half an hour later. Seen from the broker.
    let name = testing::unique_type("unbound");
    let tt = task_type(&name, TaskTypeSpec::default());
    let names = QueueNames::of(&in_video(&name).name);
    let exchange = format!(
        "{}/api/exchanges/%2f/{}",
        testing::management_url(),
        names.exchange()
    );
    let (ctx, verifier) = reconciled_once(&tt, &name, 2).await;
    let http = testing::http_client();
    let conn = conveyor_core::amqp::connect(&testing::amqp_url(), "tenant-by-hand")
        .await
        .unwrap();
    conveyor_core::amqp::delete_exchange(&conn, &names).await;
    let status = http.get(&exchange).send().await.unwrap().status();
    assert_eq!(status, 404, "the exchange was deleted");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        ctx.broker.refresh(&ctx.management).await.unwrap();
        match ctx.broker.declared(&in_video(&name)) {
            Err(ManagementError::ExchangeMissing { .. }) => break,
            other => assert!(
                std::time::Instant::now() < deadline,
                "the missing exchange was never seen: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    task_types::reconcile(Arc::new(tt), ctx.clone())
        .await
        .unwrap();
    let status = http.get(&exchange).send().await.unwrap().status();
    assert!(status.is_success(), "declared again: {status}");
    // With its bindings: a mandatory publish through it reaches the work queue.
    let publisher = Publisher::new(testing::amqp_url(), "tenant-worker", Duration::from_secs(5));
    publisher
        .publish_probe(&in_video(&name).name, uuid::Uuid::new_v4())
        .await
        .unwrap();
    verifier.await.unwrap();
    conn.close(200, "done").await.ok();
    testing::delete_queues(&in_video(&name).name).await;
}

#[tokio::test]
async fn a_current_type_is_not_declared_again_when_the_queue_list_cannot_be_read() {
    // An operator that has no queue list yet (just started, under load) knows nothing
    // about the queues: had that counted as queues missing, every type would declare again
    // at once, the declarations time out, and Ready types flap to False. (One slow list
    // never shows: the poller's snapshot is trusted for 30 s.)
    let name = testing::unique_type("unread");
    let tt = task_type(&name, TaskTypeSpec::default());
    // The poller has no list yet.
    let (ctx, verifier) = reconciled_once(&tt, &name, 2).await;
    let declarations = || amqp_declarations(&ctx);
    assert_eq!(declarations(), 1, "the first reconcile declares");
    assert!(ctx.broker.depths(&in_video(&name)).is_err());
    task_types::reconcile(Arc::new(tt), ctx.clone())
        .await
        .unwrap();
    assert_eq!(declarations(), 1, "declared again on an unreadable list");
    let seen = verifier.await.unwrap();
    assert_eq!(seen[1].2["status"]["conditions"][0]["status"], "True");
    testing::delete_queues(&in_video(&name).name).await;
}

#[tokio::test]
async fn a_declared_type_reports_a_stopped_broker() {
    // RabbitMQ stopped: its management API and AMQP refuse connections.
    declared_then_unanswered(
        "stopped",
        "https://127.0.0.1:1",
        "amqp://conveyor:conveyor@127.0.0.1:1/%2f",
    )
    .await;
}

#[tokio::test]
async fn a_declared_type_reports_a_hung_broker() {
    // RabbitMQ paused or cut off: connections are taken and nothing answers.
    let (amqp_url, _) = hung_broker().await;
    let address = amqp_url
        .rsplit_once('@')
        .unwrap()
        .1
        .trim_end_matches("/%2f");
    declared_then_unanswered("hungafter", &format!("https://{address}"), &amqp_url).await;
}

/// A type declared a moment ago, then its operator's broker answers nothing at these
/// addresses: once the poller has no list, the type must not go on saying Ready.
async fn declared_then_unanswered(prefix: &str, management_url: &str, amqp_url: &str) {
    let name = testing::unique_type(prefix);
    let tt = task_type(&name, TaskTypeSpec::default());
    let path = format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{name}/status");
    let (client, verifier) = api_server(vec![
        expect(Method::PATCH, &path, 200, status_answer(&tt)),
        expect(Method::PATCH, &path, 200, status_answer(&tt)),
    ]);
    let ctx = context(client.clone(), MANAGEMENT);
    task_types::reconcile(Arc::new(tt.clone()), ctx.clone())
        .await
        .unwrap();
    let unanswered = context_with(client, management_url, amqp_url);
    *unanswered.declared.lock().unwrap() = ctx.declared.lock().unwrap().clone();
    assert!(unanswered
        .broker
        .refresh(&unanswered.management)
        .await
        .is_err());
    let err = task_types::reconcile(Arc::new(tt), unanswered)
        .await
        .unwrap_err();
    assert_eq!(err.category(), "RabbitMQUnavailable", "{err}");
    let seen = verifier.await.unwrap();
    let ready = &seen[1].2["status"]["conditions"][0];
    assert_eq!(ready["status"], "False", "still Ready with the broker out");
    assert_eq!(ready["reason"], "RabbitMQUnavailable");
    testing::delete_queues(&in_video(&name).name).await;
}

#[tokio::test]
async fn a_type_with_default_settings_writes_no_policy_of_its_own() {
    // A thousand types must not cost a thousand pairs of policy writes (each re-matches
    // every queue of the vhost): default settings come from two shared policies, and an own
    // policy left from earlier settings goes.
    let name = testing::unique_type("shared");
    let tt = task_type(&name, TaskTypeSpec::default());
    let queues = QueueNames::of(&in_video(&name).name);
    let http = testing::http_client();
    let leftover = format!(
        "{}/api/policies/%2f/{}",
        testing::management_url(),
        queues.main
    );
    let put = http
        .put(&leftover)
        .json(
            &json!({"pattern": format!("^{}$", queues.main.replace('.', "\\.")),
            "apply-to": "queues", "priority": 10, "definition": {"delivery-limit": 1}}),
        )
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success());
    let path = format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{name}/status");
    let (client, verifier) =
        api_server(vec![expect(Method::PATCH, &path, 200, status_answer(&tt))]);
    let ctx = context(client, MANAGEMENT);
    task_types::reconcile(Arc::new(tt), ctx.clone())
        .await
        .unwrap();
    verifier.await.unwrap();

    let shared = |name: &str| Value::from(name);
    assert_eq!(
        settled_policy(&queues.main, &shared("conveyor-defaults")).await,
        "conveyor-defaults",
        "the left-over own policy was deleted and the shared one applies"
    );
    assert_eq!(
        settled_policy(&queues.retry, &shared("conveyor-defaults-retry")).await,
        "conveyor-defaults-retry"
    );
    assert_eq!(
        settled_policy(&queues.remediation, &Value::Null).await,
        Value::Null,
        "remediation queues keep no length limit"
    );
    let effective = ctx.management.effective_policy(&queues.main).await.unwrap();
    assert_eq!(effective["delivery-limit"], 5, "maxRetries 3 + 2");
    let own = http.get(&leftover).send().await.unwrap();
    assert_eq!(own.status(), 404, "no own policy is left");
    testing::delete_queues(&in_video(&name).name).await;
}

#[tokio::test]
async fn an_old_finalizer_on_an_aliasing_name_is_released_and_deletes_nothing() {
    // TaskType `foo`'s retry queue is `conveyor.video.foo.retry`; a TaskType named
    // `foo.retry` (given a finalizer by an operator from before names were checked) must not
    // delete it.
    let foo = testing::unique_type("op");
    let publisher = Publisher::new(testing::amqp_url(), "operator-test", Duration::from_secs(5));
    publisher
        .declare_task_type(&in_video(&foo), Duration::from_secs(30))
        .await
        .unwrap();
    let alias = format!("{foo}.retry");
    let mut deleting = task_type(
        &alias,
        TaskTypeSpec {
            deletion_policy: DeletionPolicy::Delete,
            ..TaskTypeSpec::default()
        },
    );
    deleting.metadata.finalizers = Some(vec![task_types::FINALIZER.into()]);
    deleting.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()),
    );
    let object = format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{alias}");
    let (client, verifier) = api_server(vec![
        expect(Method::POST, EVENTS, 201, json!({})),
        expect(Method::PATCH, &object, 200, status_answer(&deleting)),
    ]);
    let ctx = context(client, MANAGEMENT);
    task_types::reconcile(Arc::new(deleting), ctx.clone())
        .await
        .unwrap();
    let seen = verifier.await.unwrap();
    assert_eq!(seen[0].2["type"], "Warning");
    assert!(
        seen[0].2["note"]
            .as_str()
            .unwrap_or_default()
            .contains("no queue is deleted"),
        "{}",
        seen[0].2
    );
    assert_eq!(seen[1].2["metadata"]["finalizers"], json!([]));
    assert!(
        declared(&ctx, &foo).await,
        "foo's queues, its retry queue among them, are still there"
    );
    testing::delete_queues(&in_video(&foo).name).await;
}

#[tokio::test]
async fn delete_policy_adds_a_finalizer_and_deletion_removes_the_queues() {
    let name = testing::unique_type("op");
    let spec = TaskTypeSpec {
        deletion_policy: DeletionPolicy::Delete,
        ..TaskTypeSpec::default()
    };
    let tt = task_type(&name, spec);
    let object = format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{name}");
    let (client, verifier) = api_server(vec![
        expect(Method::PATCH, &object, 200, status_answer(&tt)),
        expect(
            Method::PATCH,
            &format!("{object}/status"),
            200,
            status_answer(&tt),
        ),
    ]);
    let ctx = context(client, MANAGEMENT);
    task_types::reconcile(Arc::new(tt.clone()), ctx.clone())
        .await
        .unwrap();
    let seen = verifier.await.unwrap();
    assert_eq!(
        seen[0].2["metadata"]["finalizers"],
        json!([task_types::FINALIZER])
    );
    assert_eq!(seen[0].2["metadata"]["resourceVersion"], "41");
    assert!(declared(&ctx, &name).await, "queues exist");

    // kubectl delete: the finalizer deletes the queues, then lets go.
    let mut deleting = tt.clone();
    deleting.metadata.finalizers = Some(vec![task_types::FINALIZER.into()]);
    deleting.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()),
    );
    let (client, verifier) = api_server(vec![
        expect(Method::POST, EVENTS, 201, json!({})),
        expect(Method::PATCH, &object, 200, status_answer(&tt)),
    ]);
    let ctx = context(client, MANAGEMENT);
    task_types::reconcile(Arc::new(deleting), ctx.clone())
        .await
        .unwrap();
    let seen = verifier.await.unwrap();
    assert_eq!(seen[0].2["reason"], "QueuesDeleted");
    assert_eq!(seen[1].2["metadata"]["finalizers"], json!([]));
    assert!(!declared(&ctx, &name).await, "queues are gone");
}

#[tokio::test]
async fn deleting_a_retained_task_type_touches_nothing() {
    let name = testing::unique_type("op");
    let mut tt = task_type(&name, TaskTypeSpec::default());
    tt.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::now(),
    ));
    let (client, verifier) = api_server(vec![]);
    task_types::reconcile(Arc::new(tt), context(client, MANAGEMENT))
        .await
        .unwrap();
    assert!(verifier.await.unwrap().is_empty());
}

#[tokio::test]
async fn an_invalid_spec_is_reported_not_applied() {
    let name = testing::unique_type("op");
    // Bypasses the CRD schema (as an older CRD version might): the operator checks again.
    let tt = task_type(
        &name,
        TaskTypeSpec {
            heartbeat_timeout_seconds: 0.0,
            ..TaskTypeSpec::default()
        },
    );
    let path = format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{name}/status");
    let (client, verifier) = api_server(vec![
        expect(Method::PATCH, &path, 200, status_answer(&tt)),
        expect(Method::POST, EVENTS, 201, json!({})),
    ]);
    let ctx = context(client, MANAGEMENT);
    let err = task_types::reconcile(Arc::new(tt), ctx.clone())
        .await
        .unwrap_err();
    assert_eq!(err.category(), "InvalidSpec");
    let seen = verifier.await.unwrap();
    assert_eq!(seen[0].2["status"]["conditions"][0]["status"], "False");
    assert_eq!(
        seen[0].2["status"]["conditions"][0]["reason"],
        "InvalidSpec"
    );
    assert_eq!(seen[1].2["type"], "Warning");
    assert!(!declared(&ctx, &name).await, "no queue was declared");
}

#[tokio::test]
async fn rabbitmq_down_makes_the_type_not_ready_with_a_category() {
    let name = testing::unique_type("op");
    let tt = task_type(&name, TaskTypeSpec::default());
    let path = format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{name}/status");
    let (client, verifier) =
        api_server(vec![expect(Method::PATCH, &path, 200, status_answer(&tt))]);
    let ctx = context_with(
        client,
        "http://127.0.0.1:1",
        "amqp://conveyor:conveyor@127.0.0.1:1/%2f",
    );
    let err = task_types::reconcile(Arc::new(tt), ctx).await.unwrap_err();
    assert_eq!(err.category(), "RabbitMQUnavailable");
    let seen = verifier.await.unwrap();
    let ready = &seen[0].2["status"]["conditions"][0];
    assert_eq!(ready["type"], "Ready");
    assert_eq!(
        ready["status"], "False",
        "a type whose queues cannot be declared is not ready"
    );
    assert_eq!(ready["reason"], "RabbitMQUnavailable");
    let message = ready["message"].as_str().unwrap();
    assert!(
        message.contains("declaring queues failed: "),
        "the cause is kept: {message}"
    );
}

#[tokio::test]
async fn a_payload_schema_that_does_not_compile_is_not_ready() {
    let name = testing::unique_type("op");
    let tt = task_type(
        &name,
        TaskTypeSpec {
            schema: Some(json!({"type": "object", "properties": {"x": {"type": "no-such-type"}}})),
            ..TaskTypeSpec::default()
        },
    );
    let path = format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{name}/status");
    let (client, verifier) = api_server(vec![
        expect(Method::PATCH, &path, 200, status_answer(&tt)),
        expect(Method::POST, EVENTS, 201, json!({})),
    ]);
    let ctx = context(client, MANAGEMENT);
    let err = task_types::reconcile(Arc::new(tt), ctx.clone())
        .await
        .unwrap_err();
    assert_eq!(err.category(), "InvalidSpec");
    let seen = verifier.await.unwrap();
    let ready = &seen[0].2["status"]["conditions"][0];
    assert_eq!(ready["status"], "False");
    assert!(
        ready["message"]
            .as_str()
            .unwrap()
            .contains("invalid payload schema"),
        "{ready}"
    );
    assert!(
        !declared(&ctx, &name).await,
        "no queue was declared for a type the gateway would refuse"
    );
}

fn task_type_list(names: &[&str]) -> Value {
    let items: Vec<Value> = names
        .iter()
        .map(|n| serde_json::to_value(task_type(n, TaskTypeSpec::default())).unwrap())
        .collect();
    json!({"apiVersion": "conveyor.dev/v1alpha1", "kind": "TaskTypeList", "metadata": {}, "items": items})
}

/// The four server-side applies of a pool's objects, in the order the reconciler makes them.
fn applies(pool: &str) -> Vec<Expect> {
    let core = "/api/v1/namespaces/video";
    vec![
        expect(
            Method::PATCH,
            &format!("{core}/configmaps/{pool}-worker"),
            200,
            json!({}),
        ),
        expect(
            Method::PATCH,
            &format!("{core}/services/{pool}-worker-metrics"),
            200,
            json!({}),
        ),
        expect(
            Method::PATCH,
            &format!("/apis/policy/v1/namespaces/video/poddisruptionbudgets/{pool}-worker"),
            200,
            json!({}),
        ),
        expect(
            Method::PATCH,
            &format!("/apis/apps/v1/namespaces/video/deployments/{pool}-worker"),
            200,
            json!({}),
        ),
    ]
}

/// What a reconcile of `wp` in `video` that scales it asks of the API server: the TaskType
/// list answered with `listed` (`None`: the watch cache serves it, no request), its
/// Deployment (answered by `deployment`), the four applies, one Event and the status.
fn scaling_round(wp: &WorkerPool, listed: Option<&[&str]>, deployment: Expect) -> Vec<Expect> {
    let pool = wp.metadata.name.as_deref().unwrap();
    let list = listed.map(|names| {
        expect(
            Method::GET,
            "/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes",
            200,
            task_type_list(names),
        )
    });
    [
        list.into_iter().chain([deployment]).collect(),
        applies(pool),
        vec![
            expect(Method::POST, EVENTS, 201, json!({})),
            expect(
                Method::PATCH,
                &format!("/apis/conveyor.dev/v1alpha1/namespaces/video/workerpools/{pool}/status"),
                200,
                serde_json::to_value(wp).unwrap(),
            ),
        ],
    ]
    .concat()
}

/// A GET of `pool`'s Deployment in `video`, answered 404.
fn no_deployment(pool: &str) -> Expect {
    expect(
        Method::GET,
        &format!("/apis/apps/v1/namespaces/video/deployments/{pool}-worker"),
        404,
        not_found(),
    )
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"})
}

/// A new task type in `video` with its queues declared on the test broker; its name.
async fn declared_type() -> String {
    let name = testing::unique_type("tt");
    let publisher = Publisher::new(testing::amqp_url(), "operator-test", Duration::from_secs(5));
    publisher
        .declare_task_type(&in_video(&name), Duration::from_secs(30))
        .await
        .unwrap();
    name
}

/// A pool whose Deployment the operator's watch holds reads it there: the round has no GET
/// of the Deployment, and the watched count (1) is the one the scale-up starts from.
#[tokio::test]
async fn a_pool_reads_its_deployment_from_the_watch_not_the_apiserver() {
    let name = declared_type().await;
    let wp = WorkerPool::test()
        .named("watched")
        .consumes(&name)
        .replicas(2)
        .build();
    let list = expect(
        Method::GET,
        "/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes",
        200,
        task_type_list(&[&name]),
    );
    // The types' list where the Deployment's GET would be: no GET of it follows.
    let (client, verifier) = api_server(scaling_round(&wp, None, list));
    let ctx = context(client, MANAGEMENT);
    let (deployments, mut writer) = reflector::store::<Deployment>();
    let watched: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "watched-worker", "namespace": "video", "generation": 1},
        "spec": {"replicas": 1, "selector": {}, "template": {}}
    }))
    .unwrap();
    writer.apply_watcher_event(&watcher::Event::Init);
    writer.apply_watcher_event(&watcher::Event::InitApply(watched));
    writer.apply_watcher_event(&watcher::Event::InitDone);
    let _ = ctx.deployments.set(deployments);
    worker_pools::reconcile(Arc::new(wp), ctx).await.unwrap();
    let seen = verifier.await.unwrap();
    assert!(
        seen.iter()
            .all(|(method, uri, _)| !(*method == Method::GET && uri.contains("/deployments/"))),
        "{seen:?}"
    );
    assert!(seen[5].2["note"].as_str().unwrap().contains("1 → 2"));
    testing::delete_queues(&in_video(&name).name).await;
}

#[tokio::test]
async fn a_new_pool_gets_its_objects_applied_and_a_scaling_event() {
    let name = declared_type().await;
    let wp = WorkerPool::test()
        .named("transcode")
        .consumes(&name)
        .replicas(2)
        .build();
    let (client, verifier) = api_server(scaling_round(
        &wp,
        Some(&[&name]),
        no_deployment("transcode"),
    ));
    worker_pools::reconcile(Arc::new(wp), context(client, MANAGEMENT))
        .await
        .unwrap();
    let seen = verifier.await.unwrap();
    for (_, uri, _) in &seen[2..6] {
        assert!(
            uri.contains("fieldManager=conveyor-operator") && uri.contains("force=true"),
            "{uri}"
        );
    }
    let deployment = &seen[5].2;
    assert_eq!(deployment["kind"], "Deployment");
    assert_eq!(
        deployment["spec"]["replicas"], 2,
        "spec.replicas rules without autoscaling"
    );
    assert_eq!(
        deployment["metadata"]["ownerReferences"][0]["kind"],
        "WorkerPool"
    );
    assert_eq!(seen[6].2["reason"], "Scaled");
    assert!(seen[6].2["note"].as_str().unwrap().contains("0 → 2"));
    let status = &seen[7].2["status"];
    assert_eq!(status["desiredReplicas"], 2);
    assert_eq!(status["selector"], "conveyor.dev/pool=transcode");
    testing::delete_queues(&in_video(&name).name).await;
}

#[tokio::test]
async fn drift_is_repaired_by_applying_again_and_a_missing_task_type_degrades_the_pool() {
    let name = declared_type().await;
    let wp = WorkerPool::test()
        .named("thumbs")
        .consumes(&name)
        .replicas(2)
        .build();
    // Someone edited the Deployment by hand (image and replicas): the next reconcile
    // applies the pool's version over it, with force.
    let drifted = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "thumbs-worker", "namespace": "video"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"conveyor.dev/pool": "thumbs"}},
                 "template": {"spec": {"containers": [{"name": "worker", "image": "hand-edited"}]}}},
        "status": {"readyReplicas": 2}
    });
    let (client, verifier) = api_server(
        [
            vec![
                expect(
                    Method::GET,
                    "/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes",
                    200,
                    task_type_list(&[&name]),
                ),
                expect(
                    Method::GET,
                    "/apis/apps/v1/namespaces/video/deployments/thumbs-worker",
                    200,
                    drifted.clone(),
                ),
            ],
            applies("thumbs"),
            vec![expect(
                Method::PATCH,
                "/apis/conveyor.dev/v1alpha1/namespaces/video/workerpools/thumbs/status",
                200,
                serde_json::to_value(&wp).unwrap(),
            )],
        ]
        .into_iter()
        .flatten()
        .collect(),
    );
    worker_pools::reconcile(Arc::new(wp.clone()), context(client, MANAGEMENT))
        .await
        .unwrap();
    let seen = verifier.await.unwrap();
    assert_eq!(
        seen[5].2["spec"]["template"]["spec"]["containers"][0]["image"],
        "conveyor:dev"
    );
    assert_eq!(seen[6].2["status"]["phase"], "Ready");

    // The pool names a TaskType that does not exist: Warning Event, Degraded, nothing
    // applied, and its running Deployment keeps its 2 workers, which /scale still reports
    // (status.replicas), so an HPA or KEDA does not take the pool for empty.
    let (client, verifier) = api_server(vec![
        expect(
            Method::GET,
            "/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes",
            200,
            task_type_list(&[]),
        ),
        expect(
            Method::GET,
            "/apis/apps/v1/namespaces/video/deployments/thumbs-worker",
            200,
            drifted.clone(),
        ),
        expect(Method::POST, EVENTS, 201, json!({})),
        expect(
            Method::PATCH,
            "/apis/conveyor.dev/v1alpha1/namespaces/video/workerpools/thumbs/status",
            200,
            serde_json::to_value(&wp).unwrap(),
        ),
    ]);
    let err = worker_pools::reconcile(Arc::new(wp), context(client, MANAGEMENT))
        .await
        .unwrap_err();
    assert_eq!(err.category(), "UnknownTaskType");
    let seen = verifier.await.unwrap();
    assert_eq!(seen[2].2["type"], "Warning");
    let status = &seen[3].2["status"];
    assert_eq!(status["phase"], "Degraded");
    assert_eq!(status["replicas"], 2, "{status}");
    assert_eq!(status["readyReplicas"], 2);
    testing::delete_queues(&in_video(&name).name).await;
}

#[tokio::test]
async fn a_pool_reads_its_task_types_from_the_watch_cache_not_the_api() {
    // A thousand pools must not list TaskTypes a thousand times a period: with the TaskType
    // controller's cache synced, a pool reconcile asks the API server only about its own
    // objects (the script has no GET of the TaskType list; the fallback would send one).
    let name = testing::unique_type("tt");
    let wp = WorkerPool::test()
        .named("transcode")
        .consumes(&name)
        .replicas(2)
        .build();
    let (client, verifier) = api_server(scaling_round(&wp, None, no_deployment("transcode")));
    let ctx = context(client, MANAGEMENT);
    let (store, mut writer) = kube::runtime::reflector::store::<TaskType>();
    writer.apply_watcher_event(&kube::runtime::watcher::Event::Init);
    writer.apply_watcher_event(&kube::runtime::watcher::Event::InitApply(
        TaskType::test(&name).build(),
    ));
    writer.apply_watcher_event(&kube::runtime::watcher::Event::InitDone);
    assert!(ctx.task_types.set(store).is_ok());
    worker_pools::reconcile(Arc::new(wp), ctx).await.unwrap();
    let seen = verifier.await.unwrap();
    assert!(
        seen.iter().all(|(_, uri, _)| !uri.contains("/tasktypes")),
        "{seen:?}"
    );
}

#[tokio::test]
async fn an_autoscaled_pool_grows_with_its_backlog_and_says_why() {
    let name = declared_type().await;
    let backlog: Vec<conveyor_core::amqp::Outgoing> = (0..250)
        .map(|_| conveyor_core::amqp::Outgoing {
            message: conveyor_core::task::TaskMessage {
                id: uuid::Uuid::new_v4(),
                task_type: in_video(&name).name,
                attempt: 0,
                idempotency_key: uuid::Uuid::new_v4(),
                payload: json!({}),
                submitted_at: chrono::Utc::now(),
                suspect: false,
                traceparent: None,
            },
            route: conveyor_core::task::Requeue::Main,
            delay: None,
            retry_tier: 0,
        })
        .collect();
    let publisher = Publisher::new(testing::amqp_url(), "operator-test", Duration::from_secs(5));
    assert!(publisher.publish(&backlog).await.iter().all(Result::is_ok));
    let ctx_management = ManagementApi::new(
        MANAGEMENT,
        "conveyor",
        "conveyor",
        "/",
        &testing::dev_roots(),
    )
    .unwrap();
    // The management API's counts lag the broker (statistics refresh every 5 s).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while ctx_management
        .depths(&in_video(&name))
        .await
        .ok()
        .map(|d| d.ready)
        != Some(250)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the management API never counted the backlog"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let wp = WorkerPool::test()
        .named("scaled")
        .consumes(&name)
        .autoscaled(0, 10)
        .build();
    let current = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "scaled-worker", "namespace": "video"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"conveyor.dev/pool": "scaled"}}, "template": {}},
        "status": {"readyReplicas": 1}
    });
    let (client, verifier) = api_server(
        [
            vec![
                expect(
                    Method::GET,
                    "/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes",
                    200,
                    task_type_list(&[&name]),
                ),
                expect(
                    Method::GET,
                    "/apis/apps/v1/namespaces/video/deployments/scaled-worker",
                    200,
                    current,
                ),
            ],
            applies("scaled"),
            vec![
                expect(Method::POST, EVENTS, 201, json!({})),
                expect(
                    Method::PATCH,
                    "/apis/conveyor.dev/v1alpha1/namespaces/video/workerpools/scaled/status",
                    200,
                    serde_json::to_value(&wp).unwrap(),
                ),
            ],
        ]
        .into_iter()
        .flatten()
        .collect(),
    );
    let ctx = context(client, MANAGEMENT);
    // The poller's list is what the reconcile reads: wait until it has every counter of
    // the type's queues (a busy broker counts a new retry queue late).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        ctx.broker.refresh(&ctx.management).await.unwrap();
        if ctx
            .broker
            .depths(&in_video(&name))
            .is_ok_and(|d| d.ready == 250)
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the poller never listed the backlog with every counter: {:?}",
            ctx.broker.depths(&in_video(&name))
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    worker_pools::reconcile(Arc::new(wp), ctx).await.unwrap();
    let seen = verifier.await.unwrap();
    assert_eq!(
        seen[5].2["spec"]["replicas"], 3,
        "250 ready at 100 per worker"
    );
    let note = seen[6].2["note"].as_str().unwrap();
    assert!(
        note.contains("1 → 3") && note.contains("backlog 250"),
        "{note}"
    );
    let status = &seen[7].2["status"];
    assert_eq!(status["queued"], 250);
    // Ready means serving: a scaling step leaves it True, so health checks do not flap.
    assert_eq!(status["conditions"][0]["type"], "Ready");
    assert_eq!(status["conditions"][0]["status"], "True", "{status}");
    assert_eq!(status["conditions"][1]["type"], "Scaling");
    assert_eq!(status["conditions"][1]["status"], "True");
    assert!(status["conditions"][1]["message"]
        .as_str()
        .unwrap()
        .contains("backlog 250"));
    testing::delete_queues(&in_video(&name).name).await;
}

#[tokio::test]
async fn two_scaling_reconciles_of_one_pool_make_two_events_each_with_its_reason() {
    // Through the reconcile itself: a pool scaled 0 → 2, then 2 → 3, by one operator. kube's
    // recorder would send the second as a PATCH of the first (a series keeping the first
    // note); the strict script takes only POSTs.
    let name = testing::unique_type("tt");
    let pool = |replicas| {
        WorkerPool::test()
            .named("transcode")
            .consumes(&name)
            .replicas(replicas)
            .build()
    };
    let deployment_at_2 = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "transcode-worker", "namespace": "video", "generation": 1},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"conveyor.dev/pool": "transcode"}}, "template": {}},
        "status": {"readyReplicas": 2}
    });
    let deployments = "/apis/apps/v1/namespaces/video/deployments/transcode-worker";
    let (client, verifier) = api_server(
        [
            scaling_round(&pool(2), Some(&[&name]), no_deployment("transcode")),
            scaling_round(
                &pool(3),
                Some(&[&name]),
                expect(Method::GET, deployments, 200, deployment_at_2),
            ),
        ]
        .concat(),
    );
    let ctx = context(client, MANAGEMENT);
    for replicas in [2, 3] {
        worker_pools::reconcile(Arc::new(pool(replicas)), ctx.clone())
            .await
            .unwrap();
    }
    let seen = verifier.await.unwrap();
    let notes: Vec<&str> = seen
        .iter()
        .filter(|(_, uri, _)| uri.contains("/events"))
        .map(|(_, _, body)| body["note"].as_str().unwrap())
        .collect();
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(notes[0].contains("0 → 2"), "{notes:?}");
    assert!(notes[1].contains("2 → 3"), "{notes:?}");
}

#[tokio::test]
async fn each_scaling_decision_is_an_event_of_its_own_with_its_own_note() {
    // kube's event recorder folds Events of one reason into a series that keeps the first
    // note (a PATCH of the first Event, `Scaled (x12)` with the oldest reason): every
    // decision must be created anew so that `kubectl describe` shows each reason.
    let wp = WorkerPool::test()
        .named("scaled")
        .consumes("t")
        .autoscaled(1, 10)
        .build();
    let (client, verifier) = api_server(vec![
        expect(Method::POST, EVENTS, 201, json!({})),
        expect(Method::POST, EVENTS, 201, json!({})),
    ]);
    let ctx = context(client, MANAGEMENT);
    for note in ["1 → 3: backlog 250", "3 → 5: backlog 480"] {
        ctx.event_each(&wp, "Scaled", note.to_owned()).await;
    }
    let seen = verifier.await.unwrap();
    assert_eq!(seen[0].2["note"], "1 → 3: backlog 250");
    assert_eq!(seen[1].2["note"], "3 → 5: backlog 480");
    assert_eq!(seen[1].2["regarding"]["name"], "scaled");
    assert_eq!(seen[1].2["reason"], "Scaled");
}

/// An autoscaled pool `scaled` whose Deployment has `replicas`, reconciled while the
/// management API cannot be reached; returns what was asked of the API server.
async fn reconcile_without_statistics(wp: WorkerPool, replicas: i32) -> Vec<Seen> {
    let (client, verifier) = api_server(without_statistics_script(&wp, replicas));
    let ctx = context(client, "http://127.0.0.1:1");
    assert!(ctx.broker.refresh(&ctx.management).await.is_err());
    worker_pools::reconcile(Arc::new(wp), ctx).await.unwrap();
    verifier.await.unwrap()
}

/// A pool of `replicas` workers reconciled once, with the queue list read first from the
/// management API at `management` by the poller both controllers share.
async fn reconcile_with_counts(wp: WorkerPool, management: &str, replicas: i32) -> Vec<Seen> {
    let (client, verifier) = api_server(without_statistics_script(&wp, replicas));
    let ctx = context(client, management);
    ctx.broker
        .refresh(&ctx.management)
        .await
        .expect("the queue list itself was read");
    worker_pools::reconcile(Arc::new(wp), ctx).await.unwrap();
    verifier.await.unwrap()
}

/// What a reconcile of [`reconcile_without_statistics`] asks of the API server.
fn without_statistics_script(wp: &WorkerPool, replicas: i32) -> Vec<Expect> {
    let current = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "scaled-worker", "namespace": "video"},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"conveyor.dev/pool": "scaled"}}, "template": {}},
        "status": {"readyReplicas": replicas}
    });
    let shrinks = replicas > 4;
    let mut script = vec![
        expect(
            Method::GET,
            "/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes",
            200,
            task_type_list(&["t"]),
        ),
        expect(
            Method::GET,
            "/apis/apps/v1/namespaces/video/deployments/scaled-worker",
            200,
            current,
        ),
    ];
    if shrinks {
        // Pods 0-3 run (their workers do not answer: never chosen); the pods beyond 4 have
        // not started (no address) and were marked removable on an earlier round: the
        // Deployment shrinks by them at once.
        let pending: Vec<Value> = (0..replicas)
            .map(|i| {
                let mut pod = json!({"metadata": {
                    "name": format!("scaled-worker-{i}"),
                    "namespace": "video",
                    "uid": format!("pod-{i}"),
                }});
                if i < 4 {
                    pod["status"] = json!({"podIP": "127.0.0.2"});
                } else {
                    pod["metadata"]["annotations"] = json!({
                        "controller.kubernetes.io/pod-deletion-cost": i32::MIN.to_string()
                    });
                }
                pod
            })
            .collect();
        script.push(expect(
            Method::GET,
            "/api/v1/namespaces/video/pods",
            200,
            json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pending}),
        ));
    }
    script.extend(applies("scaled"));
    if shrinks {
        script.push(expect(Method::POST, EVENTS, 201, json!({})));
    }
    script.push(expect(
        Method::PATCH,
        "/apis/conveyor.dev/v1alpha1/namespaces/video/workerpools/scaled/status",
        200,
        serde_json::to_value(wp).unwrap(),
    ));
    script
}

#[tokio::test]
async fn a_pool_handed_over_before_its_status_write_keeps_its_last_scale() {
    // The Deployment's change can wake the next reconcile before the watch delivers the
    // status written with the change: that pool has no lastScale, and the status apply
    // would remove it (CI saw `status.lastScale` empty after a scale-up).
    let wp = WorkerPool::test()
        .named("scaled")
        .consumes("t")
        .autoscaled(0, 4)
        .build();
    let mut script = without_statistics_script(&wp, 7);
    script.extend(without_statistics_script(&wp, 4));
    let (client, verifier) = api_server(script);
    let ctx = context(client, "http://127.0.0.1:1");
    assert!(ctx.broker.refresh(&ctx.management).await.is_err());
    worker_pools::reconcile(Arc::new(wp.clone()), ctx.clone())
        .await
        .unwrap();
    worker_pools::reconcile(Arc::new(wp), ctx).await.unwrap();
    let seen = verifier.await.unwrap();
    let statuses: Vec<&Value> = seen
        .iter()
        .filter(|(_, uri, _)| uri.contains("/workerpools/scaled/status"))
        .map(|(_, _, body)| &body["status"]["lastScale"])
        .collect();
    assert_eq!(statuses.len(), 2);
    assert_eq!(statuses[0]["from"], 7, "{:?}", statuses[0]);
    assert_eq!(
        statuses[1], statuses[0],
        "the second write keeps the record"
    );
}

fn deployment_replicas(seen: &[Seen]) -> &Value {
    let apply = seen
        .iter()
        .find(|(_, uri, _)| uri.contains("/deployments/scaled-worker?"))
        .unwrap();
    &apply.2["spec"]["replicas"]
}

fn pool_status(seen: &[Seen]) -> &Value {
    &seen.last().unwrap().2["status"]
}

/// A management API that answers every request with `queues` as the one page of the queue
/// list (a stand-in for a broker that lists its queues without some counters); returns its
/// URL.
async fn management_answering(queues: Value) -> String {
    management_counting(queues).await.0
}

/// [`management_answering`], and how many requests it has been sent.
async fn management_counting(queues: Value) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let count = queues.as_array().map_or(0, Vec::len);
    let body = json!({"items": queues, "page": 1, "page_size": 500, "page_count": 1,
                      "item_count": count, "total_count": count, "filtered_count": count})
    .to_string();
    let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = requests.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                 connection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(answer.as_bytes()).await;
        }
    });
    (url, requests)
}

/// Every queue of type `t` in namespace video, with `ready` tasks counted in full.
fn counted_queues(ready: u64) -> Value {
    let queues: Vec<Value> = QueueNames::of(&in_video("t").name)
        .all(1)
        .into_iter()
        .map(|name| {
            json!({"name": name, "consumers": 3, "messages": ready, "messages_ready": ready,
                   "messages_unacknowledged": 0})
        })
        .collect();
    json!(queues)
}

/// A pool's reconcile reads the broker's counts from the one poller both controllers share
/// (issue 13, defect 4: it made four management requests per type it consumes).
#[tokio::test]
async fn a_pool_reconcile_asks_the_management_api_nothing_of_its_own() {
    let (management, requests) = management_counting(counted_queues(0)).await;
    let wp = WorkerPool::test()
        .named("scaled")
        .consumes("t")
        .autoscaled(3, 10)
        .build();
    let (client, verifier) = api_server(without_statistics_script(&wp, 3));
    let ctx = context(client, &management);
    ctx.broker
        .refresh(&ctx.management)
        .await
        .expect("the queues were read");
    let polled = requests.load(std::sync::atomic::Ordering::SeqCst);
    assert!(polled > 0, "the poller asked nothing");
    worker_pools::reconcile(Arc::new(wp), ctx).await.unwrap();
    let seen = verifier.await.unwrap();
    assert_eq!(*deployment_replicas(&seen), 3);
    assert_eq!(
        requests.load(std::sync::atomic::Ordering::SeqCst),
        polled,
        "the pool's reconcile asked the management API itself"
    );
}

#[tokio::test]
async fn an_autoscaled_pool_whose_queues_lack_counters_is_not_scaled_to_zero() {
    // The management API answers, but without the counters of the type's queues (not
    // collected yet, or statistics turned off). Read as 0 they would shrink a pool with
    // work waiting to its minimum of 0; unknown, the pool holds and says why.
    let queues: Vec<Value> = QueueNames::of(&in_video("t").name)
        .all(1)
        .into_iter()
        .map(|name| json!({"name": name, "consumers": 3}))
        .collect();
    let management = management_answering(json!(queues)).await;
    let mut wp = WorkerPool::test()
        .named("scaled")
        .consumes("t")
        .autoscaled(0, 4)
        .build();
    // Nothing else would hold it: no stabilization window, no bound on a step down.
    let autoscaling = wp.spec.autoscaling.as_mut().unwrap();
    autoscaling.scale_down_stabilization_seconds = 0;
    autoscaling.scale_down_max_percent = 100;
    let seen = reconcile_with_counts(wp, &management, 3).await;
    assert_eq!(*deployment_replicas(&seen), 3, "held, not scaled down");
    let metrics = &pool_status(&seen)["conditions"][2];
    assert_eq!(metrics["type"], "MetricsAvailable");
    assert_eq!(metrics["status"], "False");
    assert_eq!(metrics["reason"], "MetricsUnavailable");
    assert!(
        metrics["message"].as_str().unwrap().contains("statistic"),
        "{metrics}"
    );
}

#[tokio::test]
async fn an_autoscaled_pool_without_statistics_holds_within_its_bounds() {
    let wp = WorkerPool::test()
        .named("scaled")
        .consumes("t")
        .autoscaled(0, 4)
        .build();
    let seen = reconcile_without_statistics(wp, 7).await;
    assert_eq!(
        *deployment_replicas(&seen),
        4,
        "an edited maxReplicas applies even while the queues cannot be read"
    );
    let metrics = &pool_status(&seen)["conditions"][2];
    assert_eq!(metrics["type"], "MetricsAvailable");
    assert_eq!(metrics["status"], "False");
    assert_eq!(metrics["reason"], "RabbitMQUnavailable");
}

#[tokio::test]
async fn a_paused_pool_holds_its_count() {
    // A backlog of 1,000 ready tasks on every queue of the type, counted in full: unpaused,
    // the pool would grow (to 6, a scale-up at most doubling).
    let management = management_answering(counted_queues(1000)).await;
    let wp = WorkerPool::test()
        .named("scaled")
        .consumes("t")
        .autoscaled(0, 10)
        .annotated("conveyor.dev/autoscaling-paused", "true")
        .build();
    let seen = reconcile_with_counts(wp, &management, 3).await;
    assert_eq!(
        *deployment_replicas(&seen),
        3,
        "paused, held despite the backlog"
    );
    let ready = &pool_status(&seen)["conditions"][0];
    assert_eq!(ready["status"], "True", "serving while paused: {ready}");
    assert!(
        pool_status(&seen)["conditions"][1]["message"]
            .as_str()
            .unwrap()
            .contains("autoscaling-paused"),
        "{}",
        pool_status(&seen)
    );
}

/// Answers each request with the first unused step of `script` it matches, in any order
/// (for reconciles that run at once), then checks that nothing more is asked.
fn api_server_any_order(script: Vec<Expect>) -> (Client, JoinHandle<Vec<Seen>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let verifier = tokio::spawn(async move {
        let mut left = script;
        let mut seen = Vec::new();
        while !left.is_empty() {
            let next = tokio::time::timeout(Duration::from_secs(120), handle.next_request()).await;
            let (request, send) = next
                .unwrap_or_else(|_| panic!("no request; {} expected still", left.len()))
                .expect("client dropped");
            let method = request.method().clone();
            let uri = request.uri().to_string();
            let path = uri.split('?').next().unwrap().to_owned();
            let body = request.into_body().collect_bytes().await.unwrap();
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let at = left
                .iter()
                .position(|step| step.method == method && path.ends_with(&step.path))
                .unwrap_or_else(|| panic!("unexpected {method} {uri}"));
            let step = left.remove(at);
            let response = Response::builder()
                .status(step.status)
                .body(Body::from(serde_json::to_vec(&step.answer).unwrap()))
                .unwrap();
            send.send_response(response);
            seen.push((method, uri, body));
        }
        seen
    });
    (Client::new(service, "default"), verifier)
}

/// A broker that accepts connections and never answers; counts the connections.
async fn hung_broker() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(socket);
        }
    });
    (format!("amqp://conveyor:conveyor@{address}/%2f"), accepted)
}

#[tokio::test]
async fn a_hung_broker_makes_every_waiting_type_not_ready_without_each_waiting_it_out() {
    // Twelve types behind a broker that never answers: those declaring first time out;
    // the rest waiting for a turn must report the outage rather than each try again (six
    // rounds of timeouts would take the last past the controller's 60 s bound, which ends
    // a reconcile before it writes any status: the type stayed Ready).
    let names: Vec<String> = (0..12).map(|_| testing::unique_type("hung")).collect();
    let script = names
        .iter()
        .map(|name| {
            let path =
                format!("/apis/conveyor.dev/v1alpha1/namespaces/video/tasktypes/{name}/status");
            let tt = task_type(name, TaskTypeSpec::default());
            expect(Method::PATCH, &path, 200, status_answer(&tt))
        })
        .collect();
    let (client, verifier) = api_server_any_order(script);
    let (amqp_url, accepted) = hung_broker().await;
    let ctx = context_with(client, "http://127.0.0.1:1", &amqp_url);
    let reconciles = names.iter().map(|name| {
        let tt = Arc::new(task_type(name, TaskTypeSpec::default()));
        task_types::reconcile(tt, ctx.clone())
    });
    for result in futures_util::future::join_all(reconciles).await {
        assert_eq!(result.unwrap_err().category(), "RabbitMQUnavailable");
    }
    let seen = verifier.await.unwrap();
    for (_, uri, body) in &seen {
        let ready = &body["status"]["conditions"][0];
        assert_eq!(ready["status"], "False", "{uri} stays Ready");
        assert_eq!(ready["reason"], "RabbitMQUnavailable", "{uri}");
    }
    let connects = accepted.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        connects <= conveyor_operator::declarations::AT_ONCE,
        "{connects} connections to a broker known to be hung (one per declaration under way)"
    );
}

/// A worker's admin port at `ip` that answers `GET /drain` with `state`.
async fn worker_answering(ip: &str, state: Value) -> JoinHandle<()> {
    let port = conveyor_operator::build::METRICS_PORT;
    let listener = tokio::net::TcpListener::bind(format!("{ip}:{port}"))
        .await
        .unwrap_or_else(|err| panic!("cannot listen on {ip}:{port}: {err}"));
    let app = axum::Router::new().route(
        conveyor_core::drain::DRAIN_PATH,
        axum::routing::get(move || async move { axum::Json(state) }),
    );
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    })
}

fn pod(name: &str, ip: &str, ready: bool, annotations: Value) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "video", "uid": format!("uid-{name}"),
            "labels": {"conveyor.dev/pool": "shrinking"}, "annotations": annotations},
        "spec": {"nodeName": "kwok-node", "containers": []},
        "status": {"phase": "Running", "podIP": ip,
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    })
}

/// One scale-down round of a two-worker pool to one: `busy` has tasks in hand and is not
/// ready (its database breaker is open), `drained` is idle and was marked for removal on an
/// earlier round; `drained_ready` is whether it still shows ready. The Deployment's count.
async fn shrink_beside_a_busy_unready_worker(drained_ready: bool, at: u8) -> (i32, String) {
    let (busy_ip, drained_ip) = (format!("127.77.{at}.1"), format!("127.77.{at}.2"));
    let busy = worker_answering(
        &busy_ip,
        json!({"draining": false, "inFlight": 3, "idle": false}),
    )
    .await;
    let drained = worker_answering(
        &drained_ip,
        json!({"draining": true, "inFlight": 0, "idle": true}),
    )
    .await;
    let pods = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [
        pod("busy", &busy_ip, false, json!({})),
        pod("drained", &drained_ip, drained_ready, json!({
            "conveyor.dev/draining-since": "2026-12-01T00:00:00Z",
            "controller.kubernetes.io/pod-deletion-cost": i32::MIN.to_string(),
        })),
    ]});
    let (client, verifier) = api_server(vec![expect(
        Method::GET,
        "/api/v1/namespaces/video/pods",
        200,
        pods,
    )]);
    let ctx = context(client, MANAGEMENT);
    let pool = WorkerPool::test()
        .named("shrinking")
        .consumes("transcode")
        .replicas(1)
        .build();
    let settled = conveyor_operator::scale_down::settle(&pool, &ctx, 2, 1).await;
    verifier.await.unwrap();
    busy.abort();
    drained.abort();
    (settled.replicas, settled.note.unwrap_or_default())
}

#[tokio::test]
async fn a_scale_down_waits_while_the_replica_set_would_take_a_busy_unready_worker_first() {
    // The ReplicaSet deletes a pod that is not ready before a ready one, whatever their
    // deletion costs: shrinking now would remove the busy worker, not the drained one.
    let (replicas, note) = shrink_beside_a_busy_unready_worker(true, 1).await;
    assert_eq!(
        replicas, 2,
        "shrank with a busy worker first in line: {note}"
    );
    assert!(note.contains("busy comes first"), "{note}");
    // Once the drained worker shows not ready too, its cost puts it first.
    let (replicas, note) = shrink_beside_a_busy_unready_worker(false, 2).await;
    assert_eq!(replicas, 1, "{note}");
}

/// A pod template the CRD's rules let through but the apiserver refuses in the Deployment
/// (a volume with two sources): the pool says so in its status and an Event, in the
/// apiserver's words, and the error is not retried as an outage.
#[tokio::test]
async fn a_deployment_the_apiserver_refuses_degrades_the_pool_in_its_words() {
    let wp = WorkerPool::test()
        .named("media")
        .consumes("transcode")
        .replicas(1)
        .pod("volumes: [{name: two, emptyDir: {}, configMap: {name: x}}]")
        .build();
    let refusal = "Deployment.apps \"media-worker\" is invalid: spec.template.spec.volumes[4].configMap: Forbidden: may not specify more than 1 volume type";
    // The rounds of a new pool (its Event is the refusal's, not a scaling one), with the
    // Deployment's apply (the fourth) answered 422.
    let mut script = scaling_round(&wp, Some(&["transcode"]), no_deployment("media"));
    script[5].status = 422;
    script[5].answer = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "reason": "Invalid", "code": 422, "message": refusal});
    let (client, verifier) = api_server(script);
    let err = worker_pools::reconcile(Arc::new(wp), context(client, MANAGEMENT))
        .await
        .unwrap_err();
    assert_eq!(err.category(), "InvalidPodTemplate");
    let seen = verifier.await.unwrap();
    let event = &seen[6].2;
    assert_eq!(
        (event["type"].as_str(), event["reason"].as_str()),
        (Some("Warning"), Some("InvalidPodTemplate"))
    );
    assert!(event["note"]
        .as_str()
        .unwrap()
        .contains("may not specify more than 1 volume type"));
    let status = &seen[7].2["status"];
    assert_eq!(status["phase"], "Degraded");
    let ready = &status["conditions"][0];
    assert_eq!(ready["reason"], "InvalidPodTemplate");
    assert!(
        ready["message"]
            .as_str()
            .unwrap()
            .contains("spec.template.spec.volumes[4]"),
        "{ready}"
    );
}
