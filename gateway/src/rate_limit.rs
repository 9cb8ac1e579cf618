//! Token buckets, keyed by client or task type.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    updated: Instant,
}

/// Buckets refilled at `rate` per second up to `burst`, one per key.
#[derive(Debug)]
pub struct RateLimiter {
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl RateLimiter {
    /// Takes `n` tokens from `key`'s bucket (refilled at `rate` a second up to `burst`, and
    /// never shallower than `n`, so that one large request can pass at all); otherwise 429
    /// `rate_limited` with `over` as its message and the wait as its Retry-After.
    pub fn take_or_refuse(
        &self,
        key: &str,
        n: f64,
        rate: f64,
        burst: f64,
        over: impl FnOnce() -> String,
    ) -> Result<(), crate::error::ApiError> {
        self.try_take(key, n, rate, burst.max(n))
            .map_err(|wait| crate::error::ApiError::too_many("rate_limited", over(), wait))
    }

    pub fn new() -> Self {
        RateLimiter {
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes `n` tokens from `key`'s bucket, or says how long until they would be there.
    pub fn try_take(&self, key: &str, n: f64, rate: f64, burst: f64) -> Result<(), Duration> {
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let bucket = buckets.entry(key.to_owned()).or_insert(Bucket {
            tokens: burst,
            updated: now,
        });
        let elapsed = now.duration_since(bucket.updated).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * rate).min(burst);
        bucket.updated = now;
        if bucket.tokens >= n {
            bucket.tokens -= n;
            Ok(())
        } else {
            // Capped: a tiny configured rate must not overflow the conversion.
            Err(Duration::from_secs_f64(
                ((n - bucket.tokens) / rate).min(3600.0),
            ))
        }
    }
}

impl Default for RateLimiter {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_refusal_with_wait() {
        let limiter = RateLimiter::new();
        // One token per 1000 s: no refill between these calls, however slow the machine.
        for _ in 0..3 {
            assert!(limiter.try_take("a", 1.0, 0.001, 3.0).is_ok());
        }
        let wait = limiter.try_take("a", 1.0, 0.001, 3.0).unwrap_err();
        assert!(wait > Duration::from_secs(900) && wait <= Duration::from_secs(1000));
        // Other keys have their own bucket.
        assert!(limiter.try_take("b", 1.0, 0.001, 3.0).is_ok());
    }
}
