//! One task's trace, as an OTLP collector receives it: the client's span, the gateway's
//! request and publish spans, the worker's span and its exec handler's span, one trace with
//! each span's parent the one before; the handler saw its own span as TRACEPARENT, and the
//! audit log's INGESTED row names the trace.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::Json;
use conveyor_core::trace::{TraceContext, Tracer};
use conveyor_core::TaskState;
use conveyor_worker::handler::Handler;
use reqwest::StatusCode;
use serde_json::Value;

use crate::support::*;

/// A local OTLP/HTTP collector: every span it was sent, with its service's name.
async fn collector() -> (String, Arc<Mutex<Vec<(String, Value)>>>) {
    let spans: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
    let kept = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        post(move |Json(body): Json<Value>| {
            let kept = kept.clone();
            async move {
                for resource in body["resourceSpans"].as_array().into_iter().flatten() {
                    let service = resource["resource"]["attributes"][0]["value"]["stringValue"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                        for span in scope["spans"].as_array().into_iter().flatten() {
                            kept.lock().unwrap().push((service.clone(), span.clone()));
                        }
                    }
                }
                Json(serde_json::json!({}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, spans)
}

#[tokio::test]
async fn a_task_is_one_trace_from_the_client_through_the_gateway_worker_and_exec_handler() {
    let (endpoint, spans) = collector().await;
    let spec = test_type("traced");
    let name = spec.name.clone();
    let gateway_tracer = Tracer::otlp(&endpoint, "conveyor-gateway");
    let worker_tracer = Tracer::otlp(&endpoint, "conveyor-worker");
    let tracer = gateway_tracer.clone();
    let mut harness = Harness::start_with(vec![spec], move |c| c.tracer = tracer).await;
    // The handler answers with the trace context it was handed.
    let handler = Handler::Exec {
        command: "sh".into(),
        args: vec![
            "-c".into(),
            r#"printf '{"traceparent": "%s"}' "$TRACEPARENT""#.into(),
        ],
    };
    let config = conveyor_worker::WorkerConfig {
        tracer: worker_tracer.clone(),
        ..harness.worker_config(&[&name], handler, 2)
    };
    harness.start_configured(config);

    // The client's own span: the task's trace continues it.
    let client = TraceContext::root();
    let answer = harness
        .http
        .post(format!("{}/v1/tasks", harness.gateway_url))
        .bearer_auth(TOKEN)
        .header("traceparent", client.header())
        .json(&serde_json::json!({"taskType": name, "payload": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::CREATED);
    let task: Value = answer.json().await.unwrap();
    let id: uuid::Uuid = task["id"].as_str().unwrap().parse().unwrap();
    harness
        .wait_for_state(&name, TaskState::Completed, 1, Duration::from_secs(20))
        .await;
    let finished = harness.db.task(id).await.unwrap().unwrap();

    let trace_id = client.trace_id();
    let mut found: Vec<(String, Value)> = Vec::new();
    for _ in 0..100 {
        gateway_tracer.flush().await;
        worker_tracer.flush().await;
        found = spans
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, s)| s["traceId"] == trace_id.as_str())
            .cloned()
            .collect();
        if found.len() >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let by_name = |prefix: &str| {
        found
            .iter()
            .find(|(_, s)| s["name"].as_str().unwrap_or_default().starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} span in trace {trace_id}: {found:#?}"))
    };
    let (gateway_service, request) = by_name("POST /v1/tasks");
    let (_, publish) = by_name("conveyor.publish");
    let (worker_service, process) = by_name("conveyor.process");
    let (_, handler) = by_name("conveyor.handler");
    println!("trace {trace_id}:");
    for (service, span) in [
        (gateway_service, request),
        (gateway_service, publish),
        (worker_service, process),
        (worker_service, handler),
    ] {
        println!(
            "  {service:<17} {:<40} span {} parent {}",
            span["name"].as_str().unwrap(),
            span["spanId"].as_str().unwrap(),
            span["parentSpanId"].as_str().unwrap_or("-")
        );
    }
    assert_eq!(
        (gateway_service.as_str(), worker_service.as_str()),
        ("conveyor-gateway", "conveyor-worker")
    );
    let span_id = |s: &Value| s["spanId"].as_str().unwrap().to_owned();
    assert_eq!(request["parentSpanId"], hex(&client.span_id));
    assert_eq!(publish["parentSpanId"], span_id(request));
    assert_eq!(process["parentSpanId"], span_id(publish));
    assert_eq!(handler["parentSpanId"], span_id(process));
    // The handler was handed its own span's context.
    let seen = finished.result.unwrap()["traceparent"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(seen, format!("00-{trace_id}-{}-01", span_id(handler)));
    // The audit log ties the task to its trace.
    let events = harness.db.events(id).await.unwrap();
    assert_eq!(events[0].to_state, TaskState::Ingested);
    assert_eq!(
        events[0].detail.as_deref(),
        Some(format!("trace {trace_id}").as_str())
    );
    harness.shutdown().await;
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
