//! The web console: three static files compiled into the binary and served at `/console/`.
//! They hold no secret and need no token to load; the page asks for the client's token and
//! calls the same `/v1` API with it, so it sees exactly what that client may see.

use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::HeaderName;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

const INDEX: &str = include_str!("../console/index.html");
const SCRIPT: &str = include_str!("../console/app.js");
const STYLE: &str = include_str!("../console/app.css");

/// Only this origin's own script, style and API: an injected `<script>` or a task's
/// payload shown on the page cannot run or call elsewhere.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/console",
            get(|| async { Redirect::permanent("/console/") }),
        )
        .route(
            "/console/",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/console/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/console/app.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (CONTENT_TYPE, content_type),
            (CACHE_CONTROL, "no-cache"),
            (HeaderName::from_static("content-security-policy"), POLICY),
            (HeaderName::from_static("x-content-type-options"), "nosniff"),
        ],
        body,
    )
        .into_response()
}
