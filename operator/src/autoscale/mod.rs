//! The autoscaling decision, as a pure function of what the operator observed.
//!
//! Desired workers come from the work waiting and running (ready + in-flight) divided by the
//! pool's `targetBacklogPerReplica`, raised if the measured processing rate says the ready
//! backlog would take longer than [`DRAIN_TARGET`] to clear. Scale-up applies at once, at
//! most doubling (or +[`SCALE_UP_STEP`]) per decision, since every worker opens database
//! connections; scale-down only once every recommendation over the stabilization window was
//! lower (as the HPA does, whose window starts with the current count, so a restarted
//! operator does not shrink a busy pool), and never to zero while anything is in flight or
//! waiting. Without queue statistics the pool holds within its bounds ([`hold`]). Each
//! decision carries the sentence that explains it, for the Event and the condition message.

use std::collections::VecDeque;
use std::time::Duration;

use conveyor_core::crd::worker_pool::Autoscaling;

/// How long a ready backlog may take to drain at the measured rate before we add workers.
pub const DRAIN_TARGET: Duration = Duration::from_secs(60);
/// How much faster than the pool finishes tasks must arrive before the arrival term adds
/// workers (rates measured over a few seconds jitter).
pub const ARRIVAL_MARGIN: f64 = 1.1;
/// Workers one decision may add beyond doubling the pool (the HPA's default policy).
pub const SCALE_UP_STEP: i32 = 4;
/// The shortest time between two scale-up steps (the HPA's default period): a pool's own
/// Deployment change wakes its reconcile at once, and must not double it again.
pub const SCALE_UP_PERIOD: Duration = Duration::from_secs(15);
/// The shortest time between two scale-down steps, for the same reason: without it
/// `scaleDownMaxPercent` would cap a step but not the steps a minute.
pub const SCALE_DOWN_PERIOD: Duration = Duration::from_secs(15);

/// What the operator saw of a pool and its queues.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// Ready messages in the pool's work queues.
    pub ready: u64,
    /// Tasks delivered to the pool's workers and not yet acknowledged.
    pub in_flight: u64,
    /// Failed attempts waiting out their backoff in the retry queues: not work yet, but it
    /// will be, so it keeps a worker.
    pub retrying: u64,
    /// Tasks per second the pool completed recently; `None` when not measured yet.
    pub processing_rate: Option<f64>,
    /// Tasks per second arriving in the pool's work queues; `None` when not measured yet.
    pub arrival_rate: Option<f64>,
    /// Workers the pool has now.
    pub current_replicas: i32,
    /// Tasks each worker runs at once.
    pub concurrency: u32,
}

/// A scaling decision and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub replicas: i32,
    pub reason: String,
}

/// Recent recommendations of one pool, for scale-down stabilization. Times are seconds on
/// any monotonic clock the caller keeps.
#[derive(Debug, Clone, Default)]
pub struct History {
    recommendations: VecDeque<(f64, i32)>,
    /// Since when the queue statistics have been unreadable, if they are.
    unavailable_since: Option<f64>,
    /// When the last scale-up step was decided.
    last_up: Option<f64>,
    /// When the last scale-down step was decided, and to what count.
    last_down: Option<(f64, i32)>,
}

impl History {
    /// The recommendations start with the current count (as the HPA seeds its window): a
    /// restarted or newly elected operator has no memory of why the pool is this big.
    fn seed(&mut self, now: f64, current: i32) {
        if self.recommendations.is_empty() {
            self.recommendations.push_back((now, current));
        }
    }

    /// Records a count held without a recommendation (paused, or no statistics), so the
    /// window afterwards starts from it rather than empty.
    pub fn held(&mut self, now: f64, replicas: i32, window: f64) {
        self.record(now, replicas, window);
    }

    fn record(&mut self, now: f64, replicas: i32, window: f64) {
        self.recommendations.push_back((now, replicas));
        while self
            .recommendations
            .front()
            .is_some_and(|&(t, _)| now - t > window)
        {
            self.recommendations.pop_front();
        }
    }

    fn highest(&self) -> Option<i32> {
        self.recommendations.iter().map(|&(_, r)| r).max()
    }
}

/// Decides the replica count for an autoscaled pool at time `now` (seconds).
pub fn desired_replicas(
    seen: &Observation,
    policy: &Autoscaling,
    history: &mut History,
    now: f64,
) -> Decision {
    let work = seen.ready + seen.in_flight;
    let per_replica = u64::from(policy.target_backlog_per_replica.max(1));
    let by_backlog = work.div_ceil(per_replica) as i64;
    let mut reasons = vec![format!(
        "backlog {work} (ready {} + in-flight {}) at {per_replica} per worker needs {by_backlog}",
        seen.ready, seen.in_flight
    )];
    let mut wanted = by_backlog;

    if let (Some(rate), true) = (seen.processing_rate, seen.current_replicas > 0) {
        if rate > 0.0 && seen.ready > 0 {
            let per_worker = rate / f64::from(seen.current_replicas);
            let by_rate =
                (seen.ready as f64 / (per_worker * DRAIN_TARGET.as_secs_f64())).ceil() as i64;
            if by_rate > wanted {
                reasons.push(format!(
                    "at {rate:.1} tasks/s ({per_worker:.2} per worker) draining the ready backlog within {}s needs {by_rate}",
                    DRAIN_TARGET.as_secs()
                ));
                wanted = by_rate;
            }
        }
    }
    // Arrivals outpacing what the workers finish: grow before the queue builds up. A pool
    // that keeps up finishes what arrives, so this term then asks for the current count.
    if let (Some(arrival), Some(rate), true) = (
        seen.arrival_rate,
        seen.processing_rate,
        seen.current_replicas > 0,
    ) {
        if rate > 0.0 && arrival > rate * ARRIVAL_MARGIN {
            let per_worker = rate / f64::from(seen.current_replicas);
            let by_arrival = (arrival / per_worker).ceil() as i64;
            if by_arrival > wanted {
                reasons.push(format!(
                    "{arrival:.1} tasks/s arriving, {rate:.1} finished ({per_worker:.2} per worker), needs {by_arrival}"
                ));
                wanted = by_arrival;
            }
        }
    }
    // Slots busy beyond the target utilisation: more workers, whatever the queue says.
    if let (Some(percent), true) = (policy.target_utilization_percent, seen.concurrency > 0) {
        let slots = u64::from(seen.concurrency) * u64::from(percent.clamp(1, 100));
        let by_utilization = (seen.in_flight * 100).div_ceil(slots) as i64;
        if by_utilization > wanted {
            reasons.push(format!(
                "{} in flight at {percent}% of {} slots per worker needs {by_utilization}",
                seen.in_flight, seen.concurrency
            ));
            wanted = by_utilization;
        }
    }
    // Work in flight, waiting or coming back from a retry keeps at least one worker,
    // whatever minReplicas says; an idle pool at zero waits for the activation backlog.
    let dormant = seen.current_replicas == 0
        && seen.in_flight == 0
        && seen.ready <= u64::from(policy.activation_backlog)
        && (seen.ready > 0 || seen.retrying > 0);
    if dormant {
        reasons.push(format!(
            "{} ready, not above the activation backlog of {}: staying at zero",
            seen.ready, policy.activation_backlog
        ));
        wanted = 0;
    }
    let keeps_one = !dormant && (work > 0 || seen.retrying > 0);
    if seen.retrying > 0 {
        reasons.push(format!(
            "{} retries waiting out their backoff",
            seen.retrying
        ));
    }
    if keeps_one && wanted < 1 {
        wanted = 1;
    }
    let bounded = wanted.clamp(
        i64::from(policy.min_replicas),
        i64::from(policy.max_replicas),
    ) as i32;
    if i64::from(bounded) != wanted {
        reasons.push(format!(
            "bounded to [{}, {}]",
            policy.min_replicas, policy.max_replicas
        ));
    }
    let recommendation = if keeps_one { bounded.max(1) } else { bounded };

    let window = f64::from(policy.scale_down_stabilization_seconds);
    let current = seen.current_replicas;
    if window > 0.0 {
        history.seed(now, current);
    }
    history.record(now, recommendation, window);
    let replicas = if recommendation > current {
        let period = SCALE_UP_PERIOD.as_secs_f64();
        match history.last_up {
            Some(at) if now - at < period => {
                reasons.push(format!(
                    "scale-up to {recommendation} waits: the last step was {:.0}s ago (one per {period:.0}s)",
                    now - at
                ));
                current
            }
            _ => {
                let limit = current
                    .saturating_mul(2)
                    .max(current.saturating_add(SCALE_UP_STEP));
                if recommendation > limit {
                    reasons.push(format!(
                        "scale-up to {recommendation} limited to {limit} this step (at most double or +{SCALE_UP_STEP})"
                    ));
                }
                history.last_up = Some(now);
                recommendation.min(limit)
            }
        }
    } else if recommendation == current {
        current
    } else {
        // Shrink only to the highest recommendation within the window, and by at most
        // scaleDownMaxPercent of the pool a step.
        let stable = history.highest().unwrap_or(recommendation).min(current);
        if stable > recommendation {
            reasons.push(format!(
                "scale-down to {recommendation} held at {stable} for the {window:.0}s stabilization window"
            ));
        }
        let percent = i64::from(policy.scale_down_max_percent.clamp(1, 100));
        let step = (i64::from(current) * percent / 100).max(1) as i32;
        let floor = current - step;
        if stable < floor {
            reasons.push(format!(
                "scale-down to {stable} limited to {floor} this step (at most {percent}% of the pool)"
            ));
        }
        let step_to = stable.max(floor);
        let period = SCALE_DOWN_PERIOD.as_secs_f64();
        match history.last_down {
            _ if stable >= current => current,
            // Within the period the last step's count holds: the drain it started goes on
            // (holding at `current` would take the drain back every round).
            Some((at, target)) if now - at < period => {
                if step_to < target {
                    reasons.push(format!(
                        "scale-down to {step_to} waits: the last step was {:.0}s ago (one per {period:.0}s)",
                        now - at
                    ));
                }
                step_to.max(target).min(current)
            }
            _ => {
                history.last_down = Some((now, step_to));
                step_to
            }
        }
    };
    Decision {
        replicas,
        reason: reasons.join("; "),
    }
}

/// The decision when the queues' statistics cannot be read: the pool's fallback once they
/// have been unreadable for its `afterSeconds`, else the current count, both within the
/// pool's bounds (an edited minReplicas or maxReplicas still applies); never a guess from
/// missing numbers. The count decided enters the stabilization window.
pub fn without_statistics(
    current: i32,
    policy: &Autoscaling,
    history: &mut History,
    now: f64,
    why: &str,
) -> Decision {
    let since = *history.unavailable_since.get_or_insert(now);
    let decision = match &policy.fallback {
        Some(fallback) if now - since >= f64::from(fallback.after_seconds) => {
            let replicas = fallback
                .replicas
                .clamp(policy.min_replicas, policy.max_replicas);
            Decision {
                replicas,
                reason: format!(
                    "fallback to {replicas}: no statistics for {:.0}s ({why})",
                    now - since
                ),
            }
        }
        _ => hold(current, policy, why),
    };
    history.held(
        now,
        decision.replicas,
        f64::from(policy.scale_down_stabilization_seconds),
    );
    decision
}

/// Statistics were read again: a later outage counts its fallback delay afresh.
pub fn statistics_read(history: &mut History) {
    history.unavailable_since = None;
}

/// The current count within the pool's bounds.
pub fn hold(current: i32, policy: &Autoscaling, why: &str) -> Decision {
    let replicas = current.clamp(policy.min_replicas, policy.max_replicas);
    let reason = if replicas == current {
        format!("holding at {current}: {why}")
    } else {
        format!(
            "holding within [{}, {}] at {replicas}: {why}",
            policy.min_replicas, policy.max_replicas
        )
    };
    Decision { replicas, reason }
}

#[cfg(test)]
mod tests;
