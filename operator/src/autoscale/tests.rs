//! The scaling decisions, case by case.
use super::*;

fn policy(min: i32, max: i32) -> Autoscaling {
    Autoscaling {
        min_replicas: min,
        max_replicas: max,
        target_backlog_per_replica: 100,
        scale_down_stabilization_seconds: 60,
        activation_backlog: 0,
        target_utilization_percent: None,
        scale_down_max_percent: 100,
        fallback: None,
    }
}

fn seen(ready: u64, in_flight: u64, current: i32) -> Observation {
    Observation {
        ready,
        in_flight,
        retrying: 0,
        processing_rate: None,
        arrival_rate: None,
        current_replicas: current,
        concurrency: 16,
    }
}

#[test]
fn backlog_sets_the_count_within_bounds() {
    let mut history = History::default();
    let d = desired_replicas(&seen(950, 50, 6), &policy(0, 20), &mut history, 0.0);
    assert_eq!(d.replicas, 10);
    assert!(d.reason.contains("backlog 1000"), "{}", d.reason);
    let d = desired_replicas(&seen(100_000, 0, 10), &policy(0, 20), &mut history, 20.0);
    assert_eq!(d.replicas, 20);
    assert!(d.reason.contains("bounded to [0, 20]"), "{}", d.reason);
    let d = desired_replicas(&seen(0, 0, 0), &policy(2, 20), &mut History::default(), 0.0);
    assert_eq!(d.replicas, 2, "minReplicas holds when idle");
}

#[test]
fn a_slow_processing_rate_adds_workers() {
    let mut observed = seen(600, 0, 2);
    observed.processing_rate = Some(2.0); // 1 task/s per worker: 600 s to drain
    let d = desired_replicas(&observed, &policy(0, 50), &mut History::default(), 0.0);
    assert_eq!(
        d.replicas, 6,
        "wants 600 ready / (1 per worker * 60 s) = 10, +4 a step"
    );
    observed.current_replicas = 6;
    observed.processing_rate = Some(6.0);
    let d = desired_replicas(&observed, &policy(0, 50), &mut History::default(), 10.0);
    assert_eq!(d.replicas, 10, "600 ready / (1 per worker * 60 s)");
    assert!(d.reason.contains("tasks/s"), "{}", d.reason);
}

#[test]
fn scale_up_is_immediate_and_scale_down_waits_for_the_window() {
    let mut history = History::default();
    let p = policy(0, 20);
    assert_eq!(
        desired_replicas(&seen(800, 0, 4), &p, &mut history, 0.0).replicas,
        8
    );
    // The backlog drains: recommendations drop, the pool holds for the window...
    let held = desired_replicas(&seen(100, 0, 8), &p, &mut history, 10.0);
    assert_eq!(held.replicas, 8);
    assert!(held.reason.contains("stabilization"), "{}", held.reason);
    assert_eq!(
        desired_replicas(&seen(100, 0, 8), &p, &mut history, 59.0).replicas,
        8
    );
    // ...and shrinks once the high recommendation is older than the window.
    assert_eq!(
        desired_replicas(&seen(100, 0, 8), &p, &mut history, 61.0).replicas,
        1
    );
}

#[test]
fn a_restarted_operator_does_not_shrink_a_busy_pool_at_once() {
    let p = policy(0, 20);
    // A fresh history (the operator just started or was elected) sees 8 workers and a
    // momentarily short queue: the window starts with the 8 it found.
    let mut history = History::default();
    let first = desired_replicas(&seen(100, 0, 8), &p, &mut history, 0.0);
    assert_eq!(first.replicas, 8, "{}", first.reason);
    assert!(first.reason.contains("stabilization"), "{}", first.reason);
    assert_eq!(
        desired_replicas(&seen(100, 0, 8), &p, &mut history, 61.0).replicas,
        1,
        "once the window has passed, the lower recommendation applies"
    );
}

#[test]
fn a_pool_held_through_an_outage_does_not_shrink_at_once_afterwards() {
    let p = policy(0, 20);
    let mut history = History::default();
    assert_eq!(
        desired_replicas(&seen(800, 0, 8), &p, &mut history, 0.0).replicas,
        8
    );
    // Statistics unavailable for longer than the window: the count is held...
    for t in [30.0, 60.0, 90.0] {
        history.held(t, 8, 60.0);
    }
    // ...and the first reading after it, lower, waits for the window again.
    let d = desired_replicas(&seen(100, 0, 8), &p, &mut history, 100.0);
    assert_eq!(d.replicas, 8, "{}", d.reason);
}

#[test]
fn scale_up_at_most_doubles_or_adds_four_per_step() {
    let p = policy(0, 100);
    let mut history = History::default();
    let d = desired_replicas(&seen(10_000, 0, 1), &p, &mut history, 0.0);
    assert_eq!(d.replicas, 5, "{}", d.reason);
    assert!(d.reason.contains("limited to 5"), "{}", d.reason);
    // Its own Deployment change wakes the pool at once: no second step yet.
    let d = desired_replicas(&seen(10_000, 0, 5), &p, &mut history, 0.5);
    assert_eq!(d.replicas, 5, "{}", d.reason);
    assert!(d.reason.contains("waits"), "{}", d.reason);
    let d = desired_replicas(&seen(10_000, 0, 10), &p, &mut history, 16.0);
    assert_eq!(d.replicas, 20, "{}", d.reason);
    assert_eq!(
        desired_replicas(&seen(0, 0, 0), &p, &mut history, 40.0).replicas,
        0
    );
}

#[test]
fn holding_without_statistics_still_applies_the_bounds() {
    let d = hold(7, &policy(0, 4), "queue statistics unavailable");
    assert_eq!(d.replicas, 4);
    assert!(d.reason.contains("within [0, 4]"), "{}", d.reason);
    assert_eq!(hold(0, &policy(2, 4), "x").replicas, 2);
    assert_eq!(hold(3, &policy(2, 4), "x").replicas, 3);
}

#[test]
fn arrivals_outpacing_the_pool_add_workers_before_the_queue_builds_up() {
    let p = policy(0, 20);
    // 2 workers finish 20 tasks/s; 50 arrive each second; almost nothing waits yet.
    let mut observed = seen(10, 40, 2);
    observed.processing_rate = Some(20.0);
    observed.arrival_rate = Some(50.0);
    let d = desired_replicas(&observed, &p, &mut History::default(), 0.0);
    assert_eq!(d.replicas, 5, "50 / 10 per worker: {}", d.reason);
    assert!(d.reason.contains("arriving"), "{}", d.reason);
    // A pool that keeps up is left alone.
    observed.arrival_rate = Some(21.0);
    let d = desired_replicas(&observed, &p, &mut History::default(), 0.0);
    assert_eq!(d.replicas, 2, "{}", d.reason);
}

#[test]
fn never_to_zero_while_work_is_in_flight() {
    let mut history = History::default();
    let p = Autoscaling {
        scale_down_stabilization_seconds: 0,
        ..policy(0, 5)
    };
    // Nothing ready (KEDA would scale to zero here), but one task is still running.
    let d = desired_replicas(&seen(0, 1, 3), &p, &mut history, 0.0);
    assert_eq!(d.replicas, 1);
    let d = desired_replicas(&seen(0, 0, 1), &p, &mut history, 15.0);
    assert_eq!(d.replicas, 0, "idle: zero is allowed");
}

#[test]
fn retries_waiting_out_their_backoff_keep_a_worker() {
    let policy = policy(0, 5);
    let mut history = History::default();
    let waiting = Observation {
        retrying: 3,
        ..seen(0, 0, 1)
    };
    let decision = desired_replicas(&waiting, &policy, &mut history, 0.0);
    assert_eq!(decision.replicas, 1, "{}", decision.reason);
    assert!(decision.reason.contains("3 retries"), "{}", decision.reason);
}

#[test]
fn a_dormant_pool_waits_for_the_activation_backlog() {
    let p = Autoscaling {
        activation_backlog: 5,
        ..policy(0, 10)
    };
    let d = desired_replicas(&seen(5, 0, 0), &p, &mut History::default(), 0.0);
    assert_eq!(d.replicas, 0, "{}", d.reason);
    assert!(d.reason.contains("activation"), "{}", d.reason);
    let d = desired_replicas(&seen(6, 0, 0), &p, &mut History::default(), 0.0);
    assert_eq!(d.replicas, 1, "above it: one worker");
    // A running pool is never stopped by the threshold: its work keeps a worker.
    let d = desired_replicas(&seen(3, 0, 1), &p, &mut History::default(), 0.0);
    assert_eq!(d.replicas, 1, "{}", d.reason);
}

#[test]
fn busy_slots_beyond_the_target_utilization_add_workers() {
    let p = Autoscaling {
        target_utilization_percent: Some(80),
        ..policy(0, 20)
    };
    // Long tasks: 4 workers of 2 slots all busy, nothing ready. Backlog says 1.
    let mut observed = seen(0, 8, 4);
    observed.concurrency = 2;
    let d = desired_replicas(&observed, &p, &mut History::default(), 0.0);
    assert_eq!(d.replicas, 5, "8 / (2 * 0.8) = 5: {}", d.reason);
    assert!(d.reason.contains("80%"), "{}", d.reason);
}

#[test]
fn a_scale_down_step_removes_at_most_its_percent_of_the_pool() {
    let p = Autoscaling {
        scale_down_max_percent: 25,
        scale_down_stabilization_seconds: 0,
        ..policy(0, 20)
    };
    let d = desired_replicas(&seen(0, 0, 12), &p, &mut History::default(), 0.0);
    assert_eq!(d.replicas, 9, "{}", d.reason);
    assert!(d.reason.contains("25%"), "{}", d.reason);
    let d = desired_replicas(&seen(0, 0, 2), &p, &mut History::default(), 0.0);
    assert_eq!(d.replicas, 1, "at least one worker a step");
}

#[test]
fn scale_down_steps_come_one_per_period() {
    // The shrink itself wakes the pool's reconcile at once: without a period, 25% a step
    // would take 12 workers to 1 in a few seconds.
    let p = Autoscaling {
        scale_down_max_percent: 25,
        scale_down_stabilization_seconds: 0,
        ..policy(0, 20)
    };
    let mut history = History::default();
    assert_eq!(
        desired_replicas(&seen(0, 0, 12), &p, &mut history, 0.0).replicas,
        9
    );
    // Still draining toward 9: the step holds, it is not taken back.
    let draining = desired_replicas(&seen(0, 0, 12), &p, &mut history, 0.5);
    assert_eq!(draining.replicas, 9, "{}", draining.reason);
    let woken = desired_replicas(&seen(0, 0, 9), &p, &mut history, 1.0);
    assert_eq!(woken.replicas, 9, "{}", woken.reason);
    assert!(woken.reason.contains("one per 15s"), "{}", woken.reason);
    assert_eq!(
        desired_replicas(&seen(0, 0, 9), &p, &mut history, 15.0).replicas,
        7
    );
}

#[test]
fn without_statistics_the_pool_holds_then_takes_its_fallback() {
    let p = Autoscaling {
        fallback: Some(conveyor_core::crd::worker_pool::Fallback {
            replicas: 6,
            after_seconds: 30,
        }),
        ..policy(0, 10)
    };
    let mut history = History::default();
    assert_eq!(
        without_statistics(2, &p, &mut history, 0.0, "down").replicas,
        2
    );
    assert_eq!(
        without_statistics(2, &p, &mut history, 29.0, "down").replicas,
        2
    );
    let d = without_statistics(2, &p, &mut history, 30.0, "down");
    assert_eq!(d.replicas, 6, "{}", d.reason);
    assert!(d.reason.contains("fallback"), "{}", d.reason);
    // Read again, then lost again: the delay starts over.
    statistics_read(&mut history);
    assert_eq!(
        without_statistics(6, &p, &mut history, 40.0, "down").replicas,
        6
    );
    assert_eq!(
        without_statistics(3, &p, &mut history, 41.0, "down").replicas,
        3
    );
}
