//! The outermost layer of the API: every request gets a request id (the client's
//! `x-request-id` when it sent a usable one), which the answer carries back and every log
//! line of the request names; its duration goes into
//! `conveyor_http_request_duration_seconds`; its server span opens (or continues) the trace
//! its tasks carry (`conveyor_core::trace`); and one access-log line says what was asked and
//! answered.

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use conveyor_core::metrics::Metrics;
use conveyor_core::trace::{SpanKind, TraceContext, Tracer};
use tracing::Instrument;

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// A client's id longer than this, or with characters outside visible ASCII, is replaced.
const MAX_CLIENT_ID: usize = 128;

/// The client's request id if usable, else a new time-ordered one.
pub fn request_id(request: &Request) -> HeaderValue {
    request
        .headers()
        .get(&REQUEST_ID)
        .filter(|v| {
            let bytes = v.as_bytes();
            !bytes.is_empty()
                && bytes.len() <= MAX_CLIENT_ID
                && bytes.iter().all(|b| b.is_ascii_graphic())
        })
        .cloned()
        .unwrap_or_else(|| {
            HeaderValue::from_str(&uuid::Uuid::now_v7().to_string()).expect("a uuid is ASCII")
        })
}

/// What the layer records into.
#[derive(Clone)]
pub struct Observe {
    pub metrics: Metrics,
    pub tracer: Tracer,
}

/// Times, logs and tags one request (`axum::middleware::from_fn_with_state`); its server
/// span continues the client's `traceparent`, and handlers find the span's context in the
/// request's extensions.
pub async fn observe(
    axum::extract::State(observe): axum::extract::State<Observe>,
    mut request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let id = request_id(&request);
    let parent = request
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceContext::parse);
    let method = request.method().clone();
    // The route's pattern (`/v1/tasks/{id}`), not the path: one series per route, and no
    // task ids in the metric's labels.
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_owned();
    let path = request.uri().path().to_owned();
    let mut server = observe.tracer.start(
        format!("{method} {route}"),
        SpanKind::Server,
        parent.as_ref(),
    );
    server.set("http.request.method", &method);
    server.set("http.route", &route);
    server.set("conveyor.request_id", id.to_str().unwrap_or_default());
    request.extensions_mut().insert(server.context);
    let span = tracing::info_span!(
        "request",
        request_id = id.to_str().unwrap_or_default(),
        trace_id = server.context.trace_id()
    );
    let mut response = next.run(request).instrument(span.clone()).await;
    let elapsed = started.elapsed();
    let status = response.status();
    server.set("http.response.status_code", status.as_u16());
    server.end(status.is_server_error().then_some(status.as_str()));
    observe
        .metrics
        .http_request_seconds
        .with_label_values(&[route.as_str(), method.as_str(), status.as_str()])
        .observe(elapsed.as_secs_f64());
    span.in_scope(|| {
        tracing::info!(target: "conveyor_gateway::access", method = %method, path,
            status = status.as_u16(), millis = elapsed.as_secs_f64() * 1000.0, "request")
    });
    response.headers_mut().insert(REQUEST_ID, id);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_header(value: &[u8]) -> Request {
        Request::builder()
            .header(REQUEST_ID, HeaderValue::from_bytes(value).unwrap())
            .body(axum::body::Body::empty())
            .unwrap()
    }

    #[test]
    fn a_usable_client_id_is_kept_and_any_other_replaced() {
        assert_eq!(request_id(&with_header(b"job-42/7")), "job-42/7");
        for bad in [&b"has space"[..], &[b'x'; 129][..]] {
            let id = request_id(&with_header(bad));
            assert_ne!(id.as_bytes(), bad);
            assert!(
                uuid::Uuid::parse_str(id.to_str().unwrap()).is_ok(),
                "{id:?}"
            );
        }
        let none = Request::new(axum::body::Body::empty());
        assert!(uuid::Uuid::parse_str(request_id(&none).to_str().unwrap()).is_ok());
    }
}
