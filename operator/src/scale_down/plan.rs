//! Which of a pool's workers go in a scale-down, decided from what each answered: the pure
//! part of [`super::settle`].

use std::time::Duration;

use conveyor_core::drain::DrainState;

/// One pod of the pool as the operator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Worker {
    pub pod: String,
    /// The pod has no address: its worker has not started, so it holds nothing.
    pub unstarted: bool,
    /// `None`: the worker did not answer.
    pub state: Option<DrainState>,
    /// Carries the [`DRAINING_SINCE`] stamp (asked to drain by some operator).
    pub stamped: bool,
    /// How long this operator process has seen it draining, on its own monotonic clock:
    /// another operator's wall-clock stamp is not trusted for the grace (decision 0017).
    pub draining_for: Option<Duration>,
    /// How long this process has found the worker unreadable (`None`: it answered).
    pub unreadable_for: Option<Duration>,
    /// Carries [`REMOVABLE_COST`].
    pub marked: bool,
}

impl Worker {
    pub fn draining(&self) -> bool {
        self.state.map_or(self.stamped, |s| s.draining)
    }

    /// Holds nothing: not started, or no delivery in hand (and, draining, none to come).
    fn idle(&self) -> bool {
        self.unstarted
            || self
                .state
                .is_some_and(|s| if s.draining { s.idle } else { s.in_flight == 0 })
    }

    fn removable(&self, grace: Duration) -> bool {
        // Unreadable for a whole grace: its node is likely gone; it goes last, but it goes.
        self.unstarted
            || (self.draining() && (self.idle() || self.draining_for.is_some_and(|d| d >= grace)))
            || self.unreadable_for.is_some_and(|d| d >= grace)
    }

    fn busy(&self) -> u64 {
        self.state.map_or(u64::MAX, |s| s.in_flight)
    }
}

/// What to do with a pool's workers this round.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Plan {
    /// Workers to ask to drain.
    pub drain: Vec<String>,
    /// Draining workers no longer to be removed.
    pub resume: Vec<String>,
    /// Workers that may go now, to carry [`REMOVABLE_COST`].
    pub remove: Vec<String>,
    /// Workers carrying [`REMOVABLE_COST`] that are not to go (a pod marked before it
    /// started, a worker taken back): their cost goes back to 0.
    pub unmark: Vec<String>,
    /// Workers chosen to go that are not removable yet.
    pub waiting: usize,
}

/// Decides, for a pool whose live pods are `surplus` too many (0 when none), which workers
/// go: unstarted ones first, then idle ones (draining or not), then the least busy, with
/// those already draining before the others among equally busy ones; unreadable workers
/// (they may be busy) last. The chosen go once removable (idle, or draining for the grace,
/// or unreadable for the grace: a dead node's pods must not block a scale-down); the rest
/// are asked to drain; workers draining that were not chosen are taken back.
pub fn plan(workers: &[Worker], surplus: usize, grace: Duration) -> Plan {
    let mut plan = Plan::default();
    let mut candidates: Vec<&Worker> = workers.iter().collect();
    candidates.sort_by_key(|w| (!w.unstarted, !w.idle(), !w.draining(), w.busy()));
    let chosen: Vec<&str> = candidates
        .iter()
        .take(surplus)
        .map(|w| w.pod.as_str())
        .collect();
    for worker in workers {
        let going = chosen.contains(&worker.pod.as_str());
        if going && worker.removable(grace) {
            plan.remove.push(worker.pod.clone());
            continue;
        }
        if going {
            if !worker.draining() && worker.state.is_some() {
                plan.drain.push(worker.pod.clone());
            }
            plan.waiting += 1;
        } else if worker.draining() {
            plan.resume.push(worker.pod.clone());
        }
        if worker.marked {
            plan.unmark.push(worker.pod.clone());
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(30);

    fn worker(pod: &str, in_flight: u64) -> Worker {
        Worker {
            pod: pod.to_owned(),
            unstarted: false,
            state: Some(DrainState {
                draining: false,
                in_flight,
                idle: false,
            }),
            stamped: false,
            draining_for: None,
            unreadable_for: None,
            marked: false,
        }
    }

    fn draining(pod: &str, in_flight: u64, seconds: u64) -> Worker {
        Worker {
            state: Some(DrainState {
                draining: true,
                in_flight,
                idle: in_flight == 0,
            }),
            stamped: true,
            draining_for: Some(Duration::from_secs(seconds)),
            ..worker(pod, in_flight)
        }
    }

    #[test]
    fn the_least_busy_workers_are_asked_to_drain_and_nobody_goes_yet() {
        let workers = [worker("a", 3), worker("b", 1), worker("c", 2)];
        let plan = plan(&workers, 2, GRACE);
        assert_eq!(plan.drain, ["b", "c"]);
        assert!(plan.remove.is_empty(), "busy workers are not removed");
        assert_eq!(plan.waiting, 2);
    }

    #[test]
    fn a_drained_idle_worker_goes_and_a_busy_one_waits_for_its_grace() {
        let workers = [worker("a", 3), draining("b", 0, 5), draining("c", 2, 5)];
        let now = plan(&workers, 2, GRACE);
        assert_eq!(now.remove, ["b"]);
        assert_eq!(now.waiting, 1);
        assert!(now.drain.is_empty() && now.resume.is_empty());
        let later = [worker("a", 3), draining("b", 0, 31), draining("c", 2, 31)];
        assert_eq!(
            plan(&later, 2, GRACE).remove,
            ["b", "c"],
            "grace over: it goes anyway"
        );
    }

    #[test]
    fn an_idle_worker_goes_before_a_busy_draining_one() {
        let workers = [draining("busy", 3, 1), worker("idle", 0)];
        let plan = plan(&workers, 1, GRACE);
        assert_eq!(plan.drain, ["idle"]);
        assert_eq!(
            plan.resume,
            ["busy"],
            "taken back: an idle worker can go instead"
        );
    }

    #[test]
    fn unreadable_workers_go_last_and_only_after_a_grace_unstarted_ones_first() {
        let unknown = |seconds| Worker {
            state: None,
            unreadable_for: Some(Duration::from_secs(seconds)),
            ..worker("u", 0)
        };
        let unstarted = Worker {
            unstarted: true,
            state: None,
            ..worker("new", 0)
        };
        let plan_now = plan(&[unknown(1), unstarted.clone(), worker("a", 4)], 2, GRACE);
        assert_eq!(plan_now.remove, ["new"]);
        assert_eq!(plan_now.drain, ["a"], "the unreadable one may be busy");
        let all_three = plan(&[unknown(1), unstarted.clone(), worker("a", 4)], 3, GRACE);
        assert!(
            !all_three.remove.contains(&"u".to_owned()),
            "not before its grace"
        );
        assert!(
            !all_three.drain.contains(&"u".to_owned()),
            "it cannot be asked"
        );
        let dead_node = plan(&[unknown(31), unstarted, worker("a", 4)], 3, GRACE);
        assert!(
            dead_node.remove.contains(&"u".to_owned()),
            "unreadable for a whole grace: it goes"
        );
    }

    #[test]
    fn workers_draining_beyond_the_surplus_are_taken_back_and_stale_marks_cleared() {
        let marked_and_started = Worker {
            marked: true,
            ..worker("c", 2)
        };
        let workers = [draining("a", 0, 1), draining("b", 4, 1), marked_and_started];
        let plan = plan(&workers, 1, GRACE);
        assert_eq!(plan.remove, ["a"]);
        assert_eq!(plan.resume, ["b"]);
        assert_eq!(
            plan.unmark,
            ["c"],
            "a pod marked before it started keeps no low cost"
        );
        let none = super::plan(&workers, 0, GRACE);
        assert_eq!(
            none.resume,
            ["a", "b"],
            "no scale-down: every drain is undone"
        );
        assert!(none.remove.is_empty());
    }

    #[test]
    fn a_drain_stamped_by_another_operator_is_judged_on_this_ones_clock() {
        // Stamped, unreadable, first seen just now: its grace starts now, not at the
        // stamp another operator's (perhaps skewed) clock wrote.
        let stamped = Worker {
            state: None,
            stamped: true,
            draining_for: Some(Duration::ZERO),
            ..worker("s", 0)
        };
        let plan = plan(&[stamped], 1, GRACE);
        assert!(plan.remove.is_empty());
        assert_eq!(plan.waiting, 1);
    }
}
