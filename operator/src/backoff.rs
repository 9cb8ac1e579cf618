//! Per-object retry delays after a failed reconcile: exponential with jitter, so a broker
//! outage does not make every TaskType and pool retry in lockstep every 5 s, and an object
//! that keeps failing is retried less and less often. A success forgets the object's
//! failures.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// The first retry's delay, and the longest one.
pub const FIRST: Duration = Duration::from_secs(5);
pub const LONGEST: Duration = Duration::from_secs(300);

/// Consecutive failures per object (`kind/namespace/name`).
#[derive(Default)]
pub struct Backoff {
    failures: Mutex<HashMap<String, u32>>,
}

impl Backoff {
    /// Counts a failure of `key` and returns how long to wait before its next try.
    pub fn failed(&self, key: &str) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let count = failures.entry(key.to_owned()).or_insert(0);
        *count = count.saturating_add(1);
        delay(*count, rand::random::<f64>())
    }

    /// Forgets `key`'s failures after a successful reconcile.
    pub fn succeeded(&self, key: &str) {
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        failures.remove(key);
    }
}

/// The delay after the `failures`-th consecutive failure: `FIRST × 2^(failures-1)`, scaled
/// by a factor in [0.5, 1.5) drawn from `unit` in [0, 1). The base stops doubling at two
/// thirds of [`LONGEST`], so no delay passes it and objects at the cap still spread evenly
/// (over [LONGEST/3, LONGEST)) instead of retrying together.
pub fn delay(failures: u32, unit: f64) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    let base = (FIRST * 2u32.pow(doublings)).min(LONGEST * 2 / 3);
    base.mul_f64(0.5 + unit.clamp(0.0, 0.999_999))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_with_jitter_around_them() {
        assert_eq!(delay(1, 0.5), FIRST);
        assert_eq!(delay(2, 0.5), FIRST * 2);
        assert_eq!(delay(4, 0.5), FIRST * 8);
        assert_eq!(delay(30, 0.5), LONGEST * 2 / 3);
        assert_eq!(delay(1, 0.0), FIRST / 2);
        assert!(delay(1, 0.999) < FIRST * 3 / 2);
    }

    #[test]
    fn no_delay_is_longer_than_the_longest_one_and_those_at_the_cap_spread() {
        for failures in 1..40 {
            assert!(delay(failures, 1.0) < LONGEST, "after {failures} failures");
        }
        let at_cap: Vec<Duration> = (0..10).map(|i| delay(30, f64::from(i) / 10.0)).collect();
        assert_eq!(at_cap[0], LONGEST / 3);
        assert!(
            at_cap.windows(2).all(|w| w[0] < w[1]),
            "objects failing together retry apart: {at_cap:?}"
        );
    }

    #[test]
    fn a_success_starts_an_object_over() {
        let backoff = Backoff::default();
        for _ in 0..5 {
            backoff.failed("tasktype/video/t");
        }
        assert!(backoff.failed("tasktype/video/t") >= FIRST * 16);
        assert!(
            backoff.failed("workerpool/video/p") < FIRST * 2,
            "per object"
        );
        backoff.succeeded("tasktype/video/t");
        assert!(backoff.failed("tasktype/video/t") < FIRST * 2);
    }
}
