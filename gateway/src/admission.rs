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

use crate::api::ApiState;
use crate::auth::Client;
use crate::error::ApiError;

/// Limits on each client's requests besides its task rate.
#[derive(Debug, Clone)]
pub struct RequestLimits {
    /// Requests of one client being served at once; more answer 429.
    pub max_in_flight: usize,
    /// Request body bytes one client may send per second (token bucket, a request's own
    /// size as the least burst).
    pub bytes_per_second: f64,
    /// Longest a request is served; a submission still finishes behind the answer.
    pub timeout: Duration,
    /// Request body bytes the gateway reads and holds at once, over every client: its memory
    /// bound whatever the number of tokens. A body is charged its declared length (or the
    /// route's limit when it declares none) on admission; past this, 503 `gateway_busy`.
    pub max_bytes_in_flight: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_in_flight: 64,
            bytes_per_second: 64.0 * 1024.0 * 1024.0,
            timeout: Duration::from_secs(30),
            max_bytes_in_flight: 256 * 1024 * 1024,
        }
    }
}

/// The gateway-wide budget of request body bytes, in permits of one byte.
pub struct BodyBudget {
    bytes: Arc<Semaphore>,
    /// Charged to a body that does not say its length: the most its route reads.
    max_body_bytes: usize,
    max_batch_bytes: usize,
}

impl BodyBudget {
    /// A budget of `limits.max_bytes_in_flight`, never less than one largest batch (or no
    /// batch of that size could ever be admitted).
    pub fn new(limits: &RequestLimits, max_body_bytes: usize, max_batch_bytes: usize) -> Self {
        let bytes = limits
            .max_bytes_in_flight
            .max(max_batch_bytes)
            .max(max_body_bytes)
            .min(u32::MAX as usize);
        BodyBudget {
            bytes: Arc::new(Semaphore::new(bytes)),
            max_body_bytes,
            max_batch_bytes,
        }
    }

    /// What a request's body is charged: no more than its route will read.
    fn charge(&self, request: &Request, declared: Option<usize>) -> usize {
        let route_limit = if request.uri().path().ends_with(":batch") {
            self.max_batch_bytes
        } else {
            self.max_body_bytes
        };
        match declared {
            Some(length) => length.min(route_limit),
            None if request.method() == axum::http::Method::GET => 0,
            None => route_limit,
        }
    }

    fn take(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        // `new` keeps the budget within u32, and a charge within the budget.
        let bytes = u32::try_from(bytes).unwrap_or(u32::MAX);
        self.bytes.clone().try_acquire_many_owned(bytes).ok()
    }
}

/// Runs before any extractor reads the body: an unauthenticated request is refused with
/// its body unread, a client over its concurrent requests or byte rate gets 429, a body past
/// the gateway's budget gets 503, and no request is served for longer than the timeout.
pub(crate) async fn admit(
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
        _permit: Arc::new((permit, body)),
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
    /// The client's request permit and the body's bytes in the gateway-wide budget.
    _permit: Arc<(OwnedSemaphorePermit, OwnedSemaphorePermit)>,
}

impl ApiState {
    fn admit_one(&self, client: &Client) -> Option<OwnedSemaphorePermit> {
        let semaphore = {
            let mut all = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            all.entry(client.name.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(self.limits.max_in_flight)))
                .clone()
        };
        semaphore.try_acquire_owned().ok()
    }

    /// Charges `length` body bytes against the client's byte rate.
    pub(crate) fn charge_bytes(&self, client: &Client, length: usize) -> Result<(), ApiError> {
        let size = length as f64;
        let rate = self.limits.bytes_per_second;
        self.ingestor
            .limiter
            .try_take(
                &format!("bytes/{}", client.name),
                size,
                rate,
                rate.max(size),
            )
            .map_err(|wait| {
                ApiError::too_many(
                    "rate_limited",
                    format!("client {} is over its byte rate", client.name),
                    wait,
                )
            })
    }
}
