//! The drain handshake between the operator and a worker (decision 0018), as both sides
//! read it: the worker serves it on its admin port, the operator asks before a scale-down.

use serde::{Deserialize, Serialize};

/// The worker's admin route: `GET` the state, `POST` to stop taking tasks, `DELETE` to take
/// them again.
pub const DRAIN_PATH: &str = "/drain";

/// What `GET /drain` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainState {
    /// Asked to take no new tasks.
    pub draining: bool,
    /// Deliveries being handled (claimed or about to be).
    pub in_flight: u64,
    /// Draining, its consumers ended and nothing in flight: it can go without a task being
    /// released.
    pub idle: bool,
}

/// The environment variable that gives a worker its admin token: with one, `POST` and
/// `DELETE` on [`DRAIN_PATH`] need it as a bearer token (any pod may reach the admin port;
/// issue 33, item 2). Handlers never see it: they run with a scrubbed environment.
pub const ADMIN_TOKEN_ENV: &str = "CONVEYOR_ADMIN_TOKEN";

/// The admin token of a pool's workers: HMAC-SHA256 of `namespace/pool` under the
/// operator's key, in hex. Derived, so the operator stores nothing per pool and a restart
/// changes nothing; another pool's token says nothing about this one's.
pub fn pool_token(key: &[u8], namespace: &str, pool: &str) -> String {
    crate::secrets::keyed_hex(key, &[namespace.as_bytes(), b"/", pool.as_bytes()])
}

/// Whether an `Authorization` header carries `Bearer <token>`, compared in constant time.
pub fn bearer_matches(header: Option<&str>, token: &str) -> bool {
    let given = header
        .and_then(|h| h.strip_prefix("Bearer "))
        .unwrap_or_default();
    crate::secrets::same(given.as_bytes(), token.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pools_token_is_its_own_and_only_a_bearer_of_it_matches() {
        let token = pool_token(b"key", "video", "transcode");
        assert_eq!(token.len(), 64);
        assert_ne!(token, pool_token(b"key", "video", "thumbs"));
        assert_ne!(token, pool_token(b"other", "video", "transcode"));
        assert!(bearer_matches(Some(&format!("Bearer {token}")), &token));
        assert!(!bearer_matches(Some(&token), &token));
        assert!(!bearer_matches(None, &token));
        assert!(!bearer_matches(Some("Bearer "), &token));
    }
}
