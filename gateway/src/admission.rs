//! Admission of every `/v1` request, before any extractor reads its body: the token checked
//! (an unauthenticated body is never read), the client's concurrent requests and byte rate
//! capped, the gateway's request body bytes over all clients bounded, and the request's time
//! bounded.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::auth::Client;
use crate::error::ApiError;
use crate::state::ApiState;

/// How long a refused request (4xx but 404 and 409, which answer a question) waits before
/// its answer: a client retrying in a tight loop, or sending what is refused again and
/// again, then sends a few requests a second per connection instead of taking the
/// gateway's CPU from every other tenant (make chaos, `tenant-floods-streams-and-lists`:
/// 12,000 refusals a second raised a calm tenant's p99 7.6 times). A client waits only when
/// it is refused: when it errs, or it or its namespace is over a limit. It paces each
/// connection, not each client: a client that opens more connections meets the in-flight
/// limits instead.
pub const REFUSAL_PAUSE: Duration = Duration::from_millis(250);

/// Admits the request ([`admit_or_refuse`]); a refusal is answered after [`REFUSAL_PAUSE`].
pub(crate) async fn admit(state: State<Arc<ApiState>>, request: Request, next: Next) -> Response {
    let response = admit_or_refuse(state, request, next).await;
    let status = response.status();
    if status.is_client_error() && status != StatusCode::NOT_FOUND && status != StatusCode::CONFLICT
    {
        tokio::time::sleep(REFUSAL_PAUSE).await;
    }
    response
}

/// Runs before any extractor reads the body: an unauthenticated request is refused with
/// its body unread, a client over its concurrent requests or byte rate gets 429, a body past
/// the gateway's budget gets 503, and no request is served for longer than the timeout.
async fn admit_or_refuse(
    State(state): State<Arc<ApiState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let header = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let Some(client) = state.tokens.current().client(header).cloned() else {
        return ApiError::unauthorized().into_response();
    };
    let presented = header
        .and_then(|h| h.strip_prefix("Bearer "))
        .unwrap_or_default();
    if client.self_service() && !crate::auth::strong_enough(presented.trim()) {
        tracing::warn!(
            client = client.name,
            "a ClientToken's token is too weak; refused"
        );
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "this ClientToken's token is too weak to be accepted: make one from a random \
             source (`openssl rand -hex 32`) and put its digest in the ClientToken",
        )
        .into_response();
    }
    let Some(permit) = state.admit_one(&client) else {
        let message = format!(
            "client {} has {} requests in flight already",
            client.name, state.limits.max_in_flight
        );
        return ApiError::too_many("too_many_requests", message, Duration::from_secs(1))
            .into_response();
    };
    let namespace_permit = match client.namespace() {
        None => None,
        Some(namespace) => {
            let limit = state.limits.namespace.max_in_flight;
            match state.permit(&format!("namespace/{namespace}"), limit) {
                Some(permit) => Some(permit),
                None => {
                    let message = format!(
                        "namespace {namespace} has {limit} requests in flight already \
                         (over all its clients, on this gateway replica)"
                    );
                    return ApiError::too_many(
                        "too_many_requests",
                        message,
                        Duration::from_secs(1),
                    )
                    .into_response();
                }
            }
        }
    };
    if let Some(namespace) = client.namespace() {
        let rate = state.limits.namespace.requests_per_second;
        let taken = state.ingestor.limiter.take_or_refuse(
            &format!("namespace-requests/{namespace}"),
            1.0,
            rate,
            rate,
            || format!("namespace {namespace} is over its request rate (over all its clients)"),
        );
        if let Err(refused) = taken {
            return refused.into_response();
        }
    }
    // A body that says its length is charged against the client's byte rate before a byte
    // of it is read; one that does not is charged once read.
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let Some(body) = state.bodies.take(state.bodies.charge(&request, declared)) else {
        return ApiError::unavailable(
            "gateway_busy",
            "the gateway holds as many request body bytes as it may (--max-bytes-in-flight); \
             retry with the same Idempotency-Key",
        )
        .into_response();
    };
    if let Some(length) = declared {
        if let Err(refused) = state.charge_bytes(&client, length) {
            return refused.into_response();
        }
        request.extensions_mut().insert(BodyCharged);
    }
    request.extensions_mut().insert(client);
    // A submission outlives a timed-out request (`submit_detached`), and so does its permit,
    // and the parsed body it holds.
    request.extensions_mut().insert(InFlight {
        _permit: Arc::new((permit, namespace_permit, body)),
    });
    match tokio::time::timeout(state.limits.timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::unavailable(
            "request_timeout",
            format!(
                "the request took longer than {:?}; submitted tasks may still be recorded: \
                 retry with the same Idempotency-Key",
                state.limits.timeout
            ),
        )
        .into_response(),
    }
}

/// The request's body was charged against its client's byte rate on admission.
#[derive(Clone, Copy)]
pub(crate) struct BodyCharged;

/// The client's in-flight permit for this request, released when the request and any
/// submission it started are both done.
#[derive(Clone)]
pub(crate) struct InFlight {
    /// The client's request permit, its namespace's, and the body's bytes in the
    /// gateway-wide budget.
    _permit: Arc<(
        OwnedSemaphorePermit,
        Option<OwnedSemaphorePermit>,
        OwnedSemaphorePermit,
    )>,
}

impl ApiState {
    fn admit_one(&self, client: &Client) -> Option<OwnedSemaphorePermit> {
        self.permit(
            &format!("client/{}", client.name),
            self.limits.max_in_flight,
        )
    }

    /// One of the `limit` permits counted under `key`, if one is free.
    fn permit(&self, key: &str, limit: usize) -> Option<OwnedSemaphorePermit> {
        let semaphore = {
            let mut all = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            all.entry(key.to_owned())
                .or_insert_with(|| Arc::new(Semaphore::new(limit)))
                .clone()
        };
        semaphore.try_acquire_owned().ok()
    }

    pub(crate) fn admit_stream(
        &self,
        client: &Client,
    ) -> Result<Option<OwnedSemaphorePermit>, ApiError> {
        let Some(namespace) = client.namespace() else {
            return Ok(None);
        };
        let limit = self.limits.namespace.max_streams;
        self.permit(&format!("streams/{namespace}"), limit)
            .map(Some)
            .ok_or_else(|| {
                ApiError::too_many(
                    "too_many_requests",
                    format!(
                        "namespace {namespace} has {limit} task streams open already (over all \
                         its clients, on this gateway replica)"
                    ),
                    Duration::from_secs(5),
                )
            })
    }

    /// Charges `length` body bytes against the client's byte rate, and its namespace's.
    pub(crate) fn charge_bytes(&self, client: &Client, length: usize) -> Result<(), ApiError> {
        let size = length as f64;
        let rate = self.limits.bytes_per_second;
        let limiter = &self.ingestor.limiter;
        limiter.take_or_refuse(&format!("bytes/{}", client.name), size, rate, rate, || {
            format!("client {} is over its byte rate", client.name)
        })?;
        let Some(namespace) = client.namespace() else {
            return Ok(());
        };
        let rate = self.limits.namespace.bytes_per_second;
        limiter.take_or_refuse(
            &format!("namespace-bytes/{namespace}"),
            size,
            rate,
            rate,
            || format!("namespace {namespace} is over its byte rate (over all its clients)"),
        )
    }

    /// Charges a list costing `cost` (its limit, and its scan's share) against the client's
    /// namespace's listing rate.
    pub(crate) fn charge_listing(&self, client: &Client, cost: u64) -> Result<(), ApiError> {
        let Some(namespace) = client.namespace() else {
            return Ok(());
        };
        let rate = self.limits.namespace.listed_per_second;
        self.ingestor.limiter.take_or_refuse(
            &format!("namespace-listed/{namespace}"),
            cost as f64,
            rate,
            rate,
            || {
                format!(
                    "namespace {namespace} is over its listing rate ({rate} tasks a second over \
                     all its clients, each list counting its limit and a hundredth of what its \
                     filter may scan)"
                )
            },
        )
    }
}
