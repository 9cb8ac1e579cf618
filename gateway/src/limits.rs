//! The limits every `/v1` request is admitted under (`crate::admission`): each client's,
//! each namespace's, and the gateway's budget of request body bytes.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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
    /// What all the clients of one namespace share, however many ClientTokens it mints.
    pub namespace: NamespaceLimits,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_in_flight: 64,
            bytes_per_second: 64.0 * 1024.0 * 1024.0,
            timeout: Duration::from_secs(30),
            max_bytes_in_flight: 256 * 1024 * 1024,
            namespace: NamespaceLimits::default(),
        }
    }
}

/// Limits on the sum over one namespace's clients (`Client::namespace`), so that minting
/// tokens buys a namespace nothing (issue 33, item 3). Each gateway replica counts its own:
/// with N replicas behind a Service, a namespace gets up to N times these.
#[derive(Debug, Clone)]
pub struct NamespaceLimits {
    /// Requests of the namespace's clients being served at once; more answer 429.
    pub max_in_flight: usize,
    /// Requests the namespace's clients may make per second together (a second's worth
    /// at once); more answer 429.
    pub requests_per_second: f64,
    /// Request body bytes the namespace's clients may send per second together.
    pub bytes_per_second: f64,
    /// Task streams (`GET /v1/tasks/{id}/stream`) open at once; more answer 429.
    pub max_streams: usize,
    /// Tasks the namespace's lists may ask for per second (each list is charged its
    /// `limit`): listing is the API's costliest read, paid in the gateway's CPU.
    pub listed_per_second: f64,
}

impl Default for NamespaceLimits {
    fn default() -> Self {
        NamespaceLimits {
            max_in_flight: 256,
            requests_per_second: 10_000.0,
            bytes_per_second: 128.0 * 1024.0 * 1024.0,
            max_streams: 256,
            listed_per_second: 5_000.0,
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
    pub(crate) fn charge(&self, request: &Request, declared: Option<usize>) -> usize {
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

    pub(crate) fn take(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        // `new` keeps the budget within u32, and a charge within the budget.
        let bytes = u32::try_from(bytes).unwrap_or(u32::MAX);
        self.bytes.clone().try_acquire_many_owned(bytes).ok()
    }
}
