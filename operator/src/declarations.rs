//! Turns at declaring queues over the operator's AMQP connection, and the memory of an
//! outage. Quorum queues are slow to create on a busy node, so only a few declarations run at
//! once; when one finds the broker unreachable or hung, the types waiting for a turn report
//! that at once instead of each waiting out its own timeout: a thousand types behind a hung
//! broker would otherwise hit the reconcile bound, write no status, and stay `Ready=True`.
//! Without a recent queue list, one type at a time declares to find out whether the broker
//! is out ([`Declarations::probe_due`]): had every type declared, a list that is slow because
//! the fleet is large would bring a storm of declarations that slows the broker further.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, SemaphorePermit};

use crate::error::{Error, Result};
use crate::shared::lock;

/// Declarations under way at once.
pub const AT_ONCE: usize = 4;
/// After an outage, declarations wait this long before one tries the broker again.
pub const RETRY_AFTER: Duration = Duration::from_secs(10);

pub struct Declarations {
    turns: Semaphore,
    /// When the last declaration found the broker out, and why.
    outage: Mutex<Option<(Instant, String)>>,
    /// When a type last declared to find out whether the broker is out.
    last_probe: Mutex<Option<Instant>>,
}

impl Default for Declarations {
    fn default() -> Self {
        Declarations {
            turns: Semaphore::new(AT_ONCE),
            outage: Mutex::default(),
            last_probe: Mutex::default(),
        }
    }
}

impl Declarations {
    /// A turn to declare, or [`Error::BrokerDown`] while an outage seen less than
    /// [`RETRY_AFTER`] ago holds (checked again once the turn comes: the declarations ahead
    /// may have just found the broker out).
    pub async fn turn(&self) -> Result<SemaphorePermit<'_>> {
        self.not_out()?;
        let turn =
            self.turns.acquire().await.map_err(|_| {
                Error::Timeout("waiting to declare (shutting down)", Duration::ZERO)
            })?;
        self.not_out()?;
        Ok(turn)
    }

    /// Whether the caller should declare to find out if the broker is out (no queue list for
    /// a while): yes for one caller per [`RETRY_AFTER`], whatever the number of types.
    pub fn probe_due(&self) -> bool {
        let mut last = lock(&self.last_probe);
        if last.is_some_and(|at| at.elapsed() < RETRY_AFTER) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }

    /// [`Error::BrokerDown`] while an outage seen less than [`RETRY_AFTER`] ago holds.
    pub fn not_out(&self) -> Result<()> {
        match lock(&self.outage).as_ref() {
            Some((at, cause)) if at.elapsed() < RETRY_AFTER => Err(Error::BrokerDown {
                ago: at.elapsed(),
                cause: cause.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Records what a declaration found: an outage (the broker unreachable, or silent past
    /// the timeout) starts the wait; anything else ends it (a refused argument or login is
    /// the type's or the settings' fault, not an outage).
    pub fn found(&self, outage: Option<String>) {
        *lock(&self.outage) = outage.map(|cause| (Instant::now(), cause));
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    #[tokio::test]
    async fn an_outage_answers_at_once_until_its_wait_has_passed() {
        let declarations = Declarations::default();
        drop(declarations.turn().await.unwrap());
        declarations.found(Some("connection refused".to_owned()));
        let err = declarations.turn().await.unwrap_err();
        assert_eq!(err.category(), "RabbitMQUnavailable");
        assert!(err.to_string().contains("connection refused"), "{err}");
        declarations.found(None);
        assert!(declarations.turn().await.is_ok());
    }

    #[test]
    fn one_probe_per_wait_however_many_types_ask() {
        let declarations = Declarations::default();
        let due = (0..1000).filter(|_| declarations.probe_due()).count();
        assert_eq!(due, 1, "a thousand types without a list probe once");
        *lock(&declarations.last_probe) = Instant::now().checked_sub(RETRY_AFTER);
        assert!(declarations.probe_due(), "the wait has passed: one more");
        assert!(!declarations.probe_due());
    }

    #[tokio::test]
    async fn a_type_waiting_for_its_turn_learns_of_an_outage_found_meanwhile() {
        let declarations = Declarations::default();
        let held: Vec<_> =
            futures_util::future::join_all((0..AT_ONCE).map(|_| declarations.turn()))
                .await
                .into_iter()
                .map(Result::unwrap)
                .collect();
        let waiting = declarations.turn();
        tokio::pin!(waiting);
        assert!(waiting.as_mut().now_or_never().is_none(), "no turn free");
        declarations.found(Some("timed out".to_owned()));
        drop(held);
        assert!(matches!(waiting.await, Err(Error::BrokerDown { .. })));
    }
}
