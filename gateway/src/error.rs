//! The gateway's error answers: a status, a stable code and a human message, as JSON.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use conveyor_core::amqp::AmqpError;
use conveyor_core::db::DbError;
use conveyor_core::metrics::Metrics;
use serde::Serialize;

/// Every error code the gateway answers with: its status and when. The OpenAPI document
/// lists them; a test checks that no code is used that is not here.
pub const CODES: &[(&str, u16, &str)] = &[
    (
        "unauthorized",
        401,
        "no bearer token, or one the gateway does not know",
    ),
    (
        "invalid_json",
        400,
        "the body is not the JSON the route takes (the message says where)",
    ),
    ("invalid_body", 400, "the body could not be read"),
    ("invalid_id", 400, "a task id that is not a UUID"),
    (
        "invalid_idempotency_key",
        400,
        "an Idempotency-Key header that is not a UUID",
    ),
    (
        "invalid_payload",
        400,
        "the payload does not match the task type's schema (`path` says where)",
    ),
    (
        "invalid_labels",
        400,
        "labels that are not Kubernetes-style names and values, or more than 16",
    ),
    (
        "invalid_batch",
        400,
        "a batch with no tasks or more than the gateway takes",
    ),
    (
        "invalid_query",
        400,
        "a list query with an unknown parameter, state, time or limit",
    ),
    (
        "invalid_label_selector",
        400,
        "a label selector that does not parse",
    ),
    (
        "invalid_cursor",
        400,
        "a cursor that is not a page's nextCursor",
    ),
    ("invalid_redrive", 400, "a redrive limit outside 1 to 1000"),
    (
        "namespace_required",
        400,
        "a client of several namespaces named none",
    ),
    (
        "unknown_task_type",
        404,
        "no such task type in the client's namespaces",
    ),
    (
        "task_not_found",
        404,
        "no such task in the client's namespaces (another tenant's ids answer this too)",
    ),
    (
        "unknown_action",
        404,
        "a task action other than `:cancel` and `:retry`",
    ),
    (
        "method_not_allowed",
        405,
        "POST to a task without an action",
    ),
    (
        "idempotency_key_reused",
        409,
        "an Idempotency-Key used before for a different task type",
    ),
    (
        "not_cancellable",
        409,
        "cancel of a task that is no longer waiting",
    ),
    (
        "not_dead_lettered",
        409,
        "retry of a task that is not DEAD_LETTER",
    ),
    ("payload_too_large", 413, "a body or payload over its limit"),
    (
        "rate_limited",
        429,
        "the client, or its namespace over all its clients, is over its task, type or byte rate; see Retry-After",
    ),
    (
        "too_many_requests",
        429,
        "the client or its namespace has too many requests in flight, or the namespace too many task streams open",
    ),
    (
        "queue_full",
        429,
        "the type's queue is over its maxQueueDepth; see Retry-After",
    ),
    (
        "internal",
        500,
        "the gateway failed; retry with the same Idempotency-Key",
    ),
    (
        "broker_unavailable",
        503,
        "RabbitMQ did not confirm; nothing is lost, retry with the same key",
    ),
    (
        "task_type_not_ready",
        503,
        "the type's queues are not declared (its TaskType is not Ready yet, or its queues \
         were deleted); other types are unaffected; retry with the same key",
    ),
    (
        "database_unavailable",
        503,
        "PostgreSQL cannot be reached; retry later",
    ),
    (
        "gateway_busy",
        503,
        "the gateway holds its most request body bytes already; retry with the same key",
    ),
    (
        "request_timeout",
        503,
        "the request took too long; retry with the same Idempotency-Key",
    ),
];

fn code_schema() -> impl Into<utoipa::openapi::RefOr<utoipa::openapi::Schema>> {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::Type::String)
        .enum_values(Some(CODES.iter().map(|(code, _, _)| *code)))
        .description(Some(
            "Stable, for programs; the API description's table says when each is given.",
        ))
}

/// `Retry-After` of `task_type_not_ready`: about the operator's time to see a missing
/// queue or exchange (one broker poll) and declare it again.
const TYPE_NOT_READY_WAIT: Duration = Duration::from_secs(5);

/// An error: `code` is stable and meant for programs (see [`CODES`]), `message` for people.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ApiError {
    #[serde(skip)]
    pub status: StatusCode,
    #[schema(schema_with = code_schema)]
    pub code: &'static str,
    pub message: String,
    /// For schema errors: the JSON pointer of the first offending value in the payload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(skip)]
    pub retry_after: Option<Duration>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            path: None,
            retry_after: None,
        }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid bearer token is required",
        )
    }

    /// A fault of the gateway's own: 500 `internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }

    pub fn too_many(code: &'static str, message: impl Into<String>, wait: Duration) -> Self {
        ApiError {
            retry_after: Some(wait),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, code, message)
        }
    }

    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            retry_after: Some(Duration::from_secs(1)),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
        }
    }

    /// The broker did not take a task: a missing queue is its type's state alone
    /// (`task_type_not_ready`, with time for the operator to declare it again), anything
    /// else the broker's (`broker_unavailable`). `outcome` says what the client may do.
    pub fn not_published(task_type: &str, err: &AmqpError, outcome: &str) -> Self {
        match err {
            AmqpError::NoQueue { queue } => ApiError {
                retry_after: Some(TYPE_NOT_READY_WAIT),
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "task_type_not_ready",
                    format!(
                        "task type {task_type} has no queue {queue} now (its TaskType is not \
                         Ready yet, or its queues were deleted and are being declared again); \
                         {outcome}"
                    ),
                )
            },
            err => Self::unavailable(
                "broker_unavailable",
                format!("the broker did not take the task ({err}); {outcome}"),
            ),
        }
    }

    /// Whole seconds for `Retry-After`, at least 1.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after
            .map(|d| d.as_secs() + u64::from(d.subsec_nanos() > 0))
            .map(|s| s.max(1))
    }
}

/// Every error answer's body.
#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody<'a> {
    pub error: &'a ApiError,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(ErrorBody { error: &self })).into_response();
        if let Some(secs) = self.retry_after_secs() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// What a route was doing with the task database when it failed, so that its answer says
/// so (a read that failed recorded nothing, and must not say "could not be recorded").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbWork {
    /// Recording new tasks (a submission).
    Record,
    /// Reading tasks or their history.
    Read,
    /// Changing a task a client named (cancel, retry, redrive).
    Change,
}

/// The one answer to a failed use of the task database: 503 when it is unavailable, else
/// 500 with a second's `Retry-After`; counted, and logged with its cause.
pub fn db_error(metrics: &Metrics, err: &DbError, work: DbWork) -> ApiError {
    metrics
        .errors
        .with_label_values(&["database", err.category()])
        .inc();
    tracing::warn!(error = %err, source = ?std::error::Error::source(err), "database error");
    if err.is_unavailable() {
        return ApiError::unavailable("database_unavailable", "the task database is unavailable");
    }
    let message = match work {
        DbWork::Record => "the task could not be recorded",
        DbWork::Read => "the task database could not be read",
        DbWork::Change => "the change could not be recorded",
    };
    ApiError {
        retry_after: Some(Duration::from_secs(1)),
        ..ApiError::internal(message)
    }
}

#[cfg(test)]
mod tests {
    use super::CODES;
    use super::{db_error, DbWork};
    use axum::http::StatusCode;
    use conveyor_core::db::DbError;
    use conveyor_core::metrics::Metrics;

    /// A failed read or change says what failed: only a submission's says the task could
    /// not be recorded. An unavailable database is a 503 whatever the route was doing.
    #[test]
    fn a_database_error_says_what_failed() {
        let metrics = Metrics::new();
        let failed = |work| db_error(&metrics, &DbError::Corrupt("row".into()), work);
        assert_eq!(
            failed(DbWork::Record).message,
            "the task could not be recorded"
        );
        assert_eq!(
            failed(DbWork::Read).message,
            "the task database could not be read"
        );
        assert_eq!(
            failed(DbWork::Change).message,
            "the change could not be recorded"
        );
        for work in [DbWork::Record, DbWork::Read, DbWork::Change] {
            assert_eq!(failed(work).status, StatusCode::INTERNAL_SERVER_ERROR);
            assert!(failed(work).retry_after.is_some());
            let down = db_error(&metrics, &DbError::Stopped, work);
            assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(down.code, "database_unavailable");
        }
    }

    /// Every `"code"` the gateway's sources pass to an error constructor is in [`CODES`].
    #[test]
    fn every_code_used_is_documented() {
        let mut folders = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
        let mut files = Vec::new();
        while let Some(folder) = folders.pop() {
            for entry in std::fs::read_dir(&folder).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    folders.push(path);
                } else {
                    files.push(path);
                }
            }
        }
        let mut used = Vec::new();
        for file in files {
            let text = std::fs::read_to_string(file).unwrap();
            for call in ["bad_request(", "too_many(", "unavailable(", "::new("] {
                for (at, _) in text.match_indices(call) {
                    let rest = text[at + call.len()..].trim_start();
                    // `new(StatusCode::X, "code", ...)`: the code is the second argument.
                    let rest = match rest.strip_prefix("StatusCode::") {
                        Some(after) => after.split_once(',').map_or("", |(_, r)| r).trim_start(),
                        None => rest,
                    };
                    if let Some(quoted) = rest.strip_prefix('"') {
                        let code = quoted.split('"').next().unwrap_or("");
                        // (This test's own list of calls is not a code.)
                        if !code.is_empty()
                            && code.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                        {
                            used.push(code.to_owned());
                        }
                    }
                }
            }
        }
        assert!(used.len() > 20, "the scan found {} codes", used.len());
        for code in &used {
            assert!(
                CODES.iter().any(|(known, _, _)| known == code),
                "{code:?} is answered but not in CODES"
            );
        }
    }
}
