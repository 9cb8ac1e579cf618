//! What every route shares: the ingestor, the tokens, the limits and what is counted
//! against them. Its admission methods are in `crate::admission`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;

use crate::auth::TokenSet;
use crate::ingest::Ingestor;
use crate::limits::{BodyBudget, RequestLimits};

pub struct ApiState {
    pub ingestor: Ingestor,
    pub tokens: Arc<TokenSet>,
    /// The one reader of every followed task's row (`crate::follow`).
    pub feed: Arc<crate::feed::Feed>,
    /// For walks of a remediation queue after a retry or redrive (`crate::remedy`).
    pub amqp_url: String,
    pub max_batch_tasks: usize,
    pub limits: RequestLimits,
    /// Semaphores by client and by namespace: requests in flight and streams open.
    pub in_flight: Mutex<HashMap<String, Arc<Semaphore>>>,
    /// Body bytes being read or held, for [`RequestLimits::max_bytes_in_flight`].
    pub bodies: BodyBudget,
}
