//! Safe scale-down (decision 0018): the operator chooses the workers to remove, asks each
//! to stop taking tasks (the worker's `POST /drain`), and shrinks the Deployment only by
//! the workers that then answer idle (`GET /drain`), or whose drain grace has passed. The
//! ReplicaSet removes the lowest `pod-deletion-cost` first, so those workers get the
//! lowest cost one round before the Deployment shrinks by them (the ReplicaSet controller
//! must have seen the cost when it picks). A busy worker is never removed while an
//! idle one could be, and none is removed with a task in flight unless its grace ran out.
//!
//! The state lives on the pods (the worker's drain state and the `draining-since`
//! annotation), so a restarted or newly elected operator carries on where the last one was;
//! the grace is timed on the operator's own monotonic clock from when it first saw the drain.
//! [`plan`] is the pure decision; [`settle`] reads the pods and carries it out.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use conveyor_core::crd::WorkerPool;
use conveyor_core::drain::{DrainState, DRAIN_PATH};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;

use crate::build::{selector, METRICS_PORT, POOL_LABEL};
use crate::context::{lock, synced, Context};

/// When the operator asked a worker to drain (RFC 3339), on the pod.
pub const DRAINING_SINCE: &str = "conveyor.dev/draining-since";
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
/// The cost of a worker that may go now: below every other.
pub const REMOVABLE_COST: i32 = i32::MIN;
/// How long a worker's admin port may take to answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

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
    fn draining(&self) -> bool {
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

/// The outcome of [`settle`]: the replica count to apply and why it differs from the one
/// wanted, if it does.
pub struct Settled {
    pub replicas: i32,
    pub note: Option<String>,
    /// Workers chosen to go and not removable yet (or whose drain could not be undone):
    /// look again soon.
    pub waiting: usize,
}

/// What the operator process remembers between rounds: since when it has seen each pod
/// draining (by uid), and when it last looked at each pool's pods (`namespace/name`).
pub struct Memory {
    draining_since: Mutex<HashMap<String, Instant>>,
    unreadable_since: Mutex<HashMap<String, Instant>>,
    looked: Mutex<HashMap<String, Instant>>,
    started: Instant,
}

impl Default for Memory {
    fn default() -> Self {
        Memory {
            draining_since: Mutex::default(),
            unreadable_since: Mutex::default(),
            looked: Mutex::default(),
            started: Instant::now(),
        }
    }
}

/// A pool with nothing to shrink and no drain known is still looked at this often, so that
/// a drain left by a crashed operator (or a status write that failed) is undone.
const LOOK_EVERY: Duration = Duration::from_secs(60);

/// Drains of pods this process has not seen for this long are forgotten (the pod is gone).
const FORGET_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Brings the pool from `current` workers towards `wanted`: a scale-up applies at once (and
/// takes back workers that were draining); a scale-down removes only the workers that
/// [`plan`] allows, and asks the others to drain.
pub async fn settle(pool: &WorkerPool, ctx: &Context, current: i32, wanted: i32) -> Settled {
    let key = format!(
        "{}/{}",
        pool.namespace().unwrap_or_default(),
        pool.name_any()
    );
    let previous = pool
        .status
        .as_ref()
        .map_or(0, |s| usize::try_from(s.draining).unwrap_or(0));
    // A pool not looked at yet counts as looked at when the process started.
    let due = lock(&ctx.drains.looked)
        .get(&key)
        .map_or(ctx.drains.started.elapsed(), Instant::elapsed)
        >= LOOK_EVERY;
    if wanted >= current && previous == 0 && !due {
        return Settled {
            replicas: wanted,
            note: None,
            waiting: 0,
        };
    }
    let namespace = pool.namespace().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    // The periodic look at a pool with nothing to shrink reads the pod watch; a scale-down
    // or a drain under way lists the pods. A watch that lags a deletion can still make the
    // periodic look ask one worker too many to drain; the next round lists, and takes it
    // back.
    let cached = wanted >= current && previous == 0;
    let listed = match pool_pods(pool, ctx, &pods, cached).await {
        Ok(listed) => listed,
        Err(err) => {
            tracing::warn!(error = %err, "cannot list the pool's pods; not shrinking");
            return Settled {
                replicas: current.max(wanted),
                note: (wanted < current)
                    .then(|| format!("scale-down to {wanted} waits: cannot list pods ({err})")),
                // Drains known before stay known: the next round looks again.
                waiting: previous,
            };
        }
    };
    lock(&ctx.drains.looked).insert(key, Instant::now());
    // A terminating pod is on its way out already: neither a candidate nor counted.
    let live: Vec<Pod> = listed
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .collect();
    let http = reqwest::Client::builder()
        .timeout(ASK_TIMEOUT)
        .build()
        .unwrap_or_default();
    let mut workers =
        futures_util::future::join_all(live.iter().map(|pod| observe(&http, pod))).await;
    remember_drains(ctx, &live, &mut workers);
    let grace = Duration::from_secs(u64::from(pool.spec.drain_grace_seconds));
    // From the live pods, not the Deployment's count: pods the ReplicaSet still owes a
    // deletion (marked on an earlier round, not terminating yet) are counted once.
    let surplus = live
        .len()
        .saturating_sub(usize::try_from(wanted).unwrap_or(0));
    let plan = plan(&workers, surplus, grace);

    let addresses: HashMap<String, String> = live
        .iter()
        .filter_map(|pod| Some((pod.name_any(), pod.status.as_ref()?.pod_ip.clone()?)))
        .collect();
    let now = chrono::Utc::now().to_rfc3339();
    for pod in &plan.drain {
        if ask(&http, &addresses, pod, reqwest::Method::POST).await {
            annotate(&pods, pod, json!({DRAINING_SINCE: now, DELETION_COST: "0"})).await;
        }
    }
    let mut not_undone = 0;
    for pod in &plan.resume {
        // An unstarted or unreachable worker cannot be asked: its stamp stays, and it is
        // asked again next round.
        if ask(&http, &addresses, pod, reqwest::Method::DELETE).await {
            annotate(
                &pods,
                pod,
                json!({DRAINING_SINCE: null, DELETION_COST: "0"}),
            )
            .await;
        } else {
            not_undone += 1;
        }
    }
    for pod in &plan.unmark {
        annotate(&pods, pod, json!({DELETION_COST: "0"})).await;
    }
    // Marked on an earlier round: the ReplicaSet controller has seen the cost by now.
    // Marked this round: counted on the next one.
    let mut marked = 0;
    let mut marking = 0;
    for pod in &plan.remove {
        if workers.iter().any(|w| &w.pod == pod && w.marked) {
            marked += 1;
        } else if annotate(
            &pods,
            pod,
            json!({DELETION_COST: REMOVABLE_COST.to_string()}),
        )
        .await
        {
            marking += 1;
        }
    }
    let waiting = plan.waiting + marking + not_undone;
    let replicas = if wanted >= current {
        wanted
    } else {
        let after = i32::try_from(live.len() - marked).unwrap_or(i32::MAX);
        after.clamp(wanted, current)
    };
    let note = (replicas != wanted).then(|| {
        format!(
            "scale-down to {wanted} at {replicas} for now: {waiting} worker(s) draining, \
             removed as each is idle or after its {}s drain grace (busy workers are not removed)",
            grace.as_secs()
        )
    });
    Settled {
        replicas,
        note,
        waiting,
    }
}

/// Keeps, per pod uid, when this process first saw it draining and first found it
/// unreadable, and sets each worker's `draining_for` and `unreadable_for` from them.
fn remember_drains(ctx: &Context, live: &[Pod], workers: &mut [Worker]) {
    let uids: Vec<String> = live
        .iter()
        .zip(workers.iter())
        .map(|(pod, w)| pod.metadata.uid.clone().unwrap_or_else(|| w.pod.clone()))
        .collect();
    let draining: Vec<bool> = workers.iter().map(Worker::draining).collect();
    let unreadable: Vec<bool> = workers
        .iter()
        .map(|w| !w.unstarted && w.state.is_none())
        .collect();
    let draining_for = since(&ctx.drains.draining_since, &uids, &draining);
    let unreadable_for = since(&ctx.drains.unreadable_since, &uids, &unreadable);
    for (i, worker) in workers.iter_mut().enumerate() {
        worker.draining_for = draining_for[i];
        worker.unreadable_for = unreadable_for[i];
    }
}

/// For each of `uids`, how long `flags[i]` has held as this process saw it; those of
/// `uids` no longer flagged are forgotten, and so is anything not seen for a day.
fn since(
    memory: &Mutex<HashMap<String, Instant>>,
    uids: &[String],
    flags: &[bool],
) -> Vec<Option<Duration>> {
    let mut seen = lock(memory);
    let mut kept = Vec::new();
    let out = uids
        .iter()
        .zip(flags)
        .map(|(uid, &flag)| {
            flag.then(|| {
                let at = seen.get(uid).copied().unwrap_or_else(Instant::now);
                kept.push((uid.clone(), at));
                at.elapsed()
            })
        })
        .collect();
    seen.retain(|uid, at| at.elapsed() < FORGET_AFTER && !uids.contains(uid));
    seen.extend(kept);
    out
}

async fn observe(http: &reqwest::Client, pod: &Pod) -> Worker {
    let stamped = pod.annotations().contains_key(DRAINING_SINCE);
    let marked = pod.annotations().get(DELETION_COST).map(String::as_str)
        == Some(REMOVABLE_COST.to_string().as_str());
    let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
        return Worker {
            pod: pod.name_any(),
            unstarted: true,
            state: None,
            stamped,
            draining_for: None,
            unreadable_for: None,
            marked,
        };
    };
    let url = format!("http://{ip}:{METRICS_PORT}{DRAIN_PATH}");
    let state = async {
        http.get(&url)
            .send()
            .await?
            .error_for_status()?
            .json::<DrainState>()
            .await
    }
    .await
    .ok();
    Worker {
        pod: pod.name_any(),
        unstarted: false,
        state,
        stamped,
        draining_for: None,
        unreadable_for: None,
        marked,
    }
}

/// The pool's pods: from the pod watch when `cached` and it has synced, else listed.
async fn pool_pods(
    pool: &WorkerPool,
    ctx: &Context,
    pods: &Api<Pod>,
    cached: bool,
) -> kube::Result<Vec<Pod>> {
    let name = pool.name_any();
    let namespace = pool.namespace();
    if cached {
        if let Some(store) = synced(&ctx.pods).await {
            return Ok(store
                .state()
                .iter()
                .filter(|pod| {
                    pod.namespace() == namespace && pod.labels().get(POOL_LABEL) == Some(&name)
                })
                .map(|pod| Pod::clone(pod))
                .collect());
        }
    }
    let listed = pods
        .list(&ListParams::default().labels(&selector(&name)))
        .await?;
    Ok(listed.items)
}

/// Asks a worker to drain (POST) or resume (DELETE); whether it answered.
async fn ask(
    http: &reqwest::Client,
    addresses: &HashMap<String, String>,
    pod: &str,
    method: reqwest::Method,
) -> bool {
    let Some(ip) = addresses.get(pod) else {
        return false;
    };
    let url = format!("http://{ip}:{METRICS_PORT}{DRAIN_PATH}");
    match http.request(method.clone(), &url).send().await {
        Ok(answer) if answer.status().is_success() => true,
        Ok(answer) => {
            tracing::warn!(pod, %method, status = %answer.status(), "worker refused the drain request");
            false
        }
        Err(err) => {
            tracing::warn!(pod, %method, error = %err, "cannot reach worker for the drain request");
            false
        }
    }
}

/// Merges `annotations` (a null removes one) into a pod's; whether it worked.
async fn annotate(pods: &Api<Pod>, pod: &str, annotations: serde_json::Value) -> bool {
    let patch = json!({"metadata": {"annotations": annotations}});
    match pods
        .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => true,
        Err(err) => {
            tracing::warn!(pod, error = %err, "cannot annotate pod");
            false
        }
    }
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
