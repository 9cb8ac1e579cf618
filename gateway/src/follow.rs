//! `GET /v1/tasks/{id}/stream`: a task followed as server-sent events, so that clients stop
//! polling. An `event: task` carries the task (as in a list) at once and again each time
//! it changes; the stream ends after the task settles, or after an hour (reconnect then).
//!
//! Streams read nothing themselves: the gateway's one change feed (`crate::feed`) reads every
//! followed row together a few times a second and wakes the streams whose task changed. Each
//! stream holds one of its client's in-flight requests and one of its namespace's streams
//! (`crate::admission`). A stream whose token is revoked (its ClientToken deleted) ends
//! with `event: error`, `unauthorized`, within a second.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Extension, Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;

use crate::admission::InFlight;
use crate::auth::{Client, Tokens};
use crate::error::{db_error, DbWork};
use crate::error::{ApiError, ErrorBody};
use crate::feed::{version, Seen, Subscription, Version};
use crate::request::own_task;
use crate::state::ApiState;
use crate::views::TaskSummary;

/// Longest a stream stays open; a client that still wants to follow reconnects.
const MAX_STREAM: Duration = Duration::from_secs(3600);
/// How often a stream whose task is quiet looks whether its token was revoked (in memory).
const REVOCATION_CHECK: Duration = Duration::from_secs(1);

/// What a stream remembers between events.
struct Follow {
    state: Arc<ApiState>,
    subscription: Subscription,
    /// The version of the task last sent.
    sent: Option<Version>,
    done: bool,
    until: Instant,
    /// The request's `Authorization`, looked up again whenever the tokens change.
    authorization: String,
    tenant: String,
    /// The token set the stream was last found in.
    tokens: Arc<Tokens>,
    _in_flight: InFlight,
    _stream: Option<tokio::sync::OwnedSemaphorePermit>,
}

#[utoipa::path(get, path = "/v1/tasks/{id}/stream", tag = "tasks",
    params(("id" = Uuid, Path, description = "The task's id")),
    responses(
        (status = 200, content_type = "text/event-stream",
         description = "`event: task` with a TaskSummary now and at each change, until it \
            settles; `event: error` with an ApiError if reading fails (the stream ends)",
         body = TaskSummary),
        (status = 404, description = "No such task in the client's namespaces", body = ErrorBody),
        (status = "4XX", description = "Refused", body = ErrorBody),
        (status = "5XX", description = "The database is unavailable, or the gateway failed: try again", body = ErrorBody),
    ))]
/// Follows a task as server-sent events until it settles.
pub(crate) async fn stream_task(
    State(state): State<Arc<ApiState>>,
    Extension(client): Extension<Client>,
    Extension(in_flight): Extension<InFlight>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    // Checked before the stream starts: another tenant's id answers 404, not a stream.
    let stream = state.admit_stream(&client)?;
    let task = own_task(&state, &client, &id).await?;
    let authorization = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let tenant = task.tenant.clone();
    let follow = Follow {
        tokens: state.tokens.current(),
        authorization,
        tenant,
        subscription: state.feed.follow(task),
        state,
        sent: None,
        done: false,
        until: Instant::now() + MAX_STREAM,
        _in_flight: in_flight,
        _stream: stream,
    };
    let events = stream::unfold(follow, |mut follow| async move {
        let event = follow.next().await?;
        Some((Ok::<Event, Infallible>(event), follow))
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

impl Follow {
    /// The next event to send, once there is one; `None` ends the stream.
    async fn next(&mut self) -> Option<Event> {
        while !self.done && Instant::now() < self.until {
            if let Some(revoked) = self.revoked() {
                self.done = true;
                return Event::default().event("error").json_data(&revoked).ok();
            }
            let seen = self.subscription.seen.borrow_and_update().clone();
            match seen {
                Seen::Task(task) => {
                    let version = version(&task);
                    if self.sent.as_ref() != Some(&version) {
                        self.sent = Some(version);
                        self.done = task.state.is_settled();
                        return Event::default()
                            .event("task")
                            .json_data(TaskSummary::from(task.as_ref()))
                            .ok();
                    }
                }
                Seen::Gone => return None,
                Seen::Failed(err) => {
                    self.done = true;
                    let error = db_error(&self.state.ingestor.metrics, &err, DbWork::Read);
                    return Event::default().event("error").json_data(&error).ok();
                }
            }
            let wait = REVOCATION_CHECK.min(self.until.saturating_duration_since(Instant::now()));
            tokio::select! {
                changed = self.subscription.seen.changed() => if changed.is_err() { return None },
                _ = tokio::time::sleep(wait) => {}
            }
        }
        None
    }

    /// An error when the tokens changed and the stream's token no longer reaches the task's
    /// tenant. Only a new token set is looked at: one pointer comparison per read.
    fn revoked(&mut self) -> Option<ApiError> {
        let now = self.state.tokens.current();
        if Arc::ptr_eq(&now, &self.tokens) {
            return None;
        }
        let allowed = now
            .client(Some(&self.authorization))
            .is_some_and(|client| client.may_use(&self.tenant));
        self.tokens = now;
        (!allowed).then(|| {
            ApiError::new(
                axum::http::StatusCode::UNAUTHORIZED,
                "unauthorized",
                "the token of this stream was revoked",
            )
        })
    }
}
