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
