//! Safe scale-down (decision 0018): the operator chooses the workers to remove, asks each
//! to stop taking tasks (the worker's `POST /drain`), and shrinks the Deployment only by
//! the workers that then answer idle (`GET /drain`), or whose drain grace has passed. The
//! ReplicaSet removes the lowest `pod-deletion-cost` first, so those workers get the
//! lowest cost one round before the Deployment shrinks by them (the ReplicaSet controller
//! must have seen the cost when it picks). A busy worker is never removed while an
//! idle one could be, and none is removed with a task in flight unless its grace ran out.
//!
//! The state lives on the pods (the worker's drain state and the `draining-since`
//! annotation), so a restarted or newly elected operator carries on where the last one was.
//! [`plan`] is the pure decision; [`settle`] reads the pods and carries it out.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use conveyor_core::crd::WorkerPool;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::ResourceExt;
use serde::Deserialize;
use serde_json::json;

use crate::build::{selector, METRICS_PORT};
use crate::context::Context;

/// When the operator asked a worker to drain (RFC 3339), on the pod.
pub const DRAINING_SINCE: &str = "conveyor.dev/draining-since";
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
/// The cost of a worker that may go now: below every other.
pub const REMOVABLE_COST: i32 = i32::MIN;
/// The cost of a worker whose state could not be read: it may be busy, so it goes last.
pub const UNKNOWN_COST: i32 = i32::MAX;
/// How long a worker's admin port may take to answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// A worker's answer on `/drain`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainState {
    pub draining: bool,
    pub in_flight: u64,
    pub idle: bool,
}

/// One pod of the pool as the operator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Worker {
    pub pod: String,
    /// The pod has no address: its worker has not started, so it holds nothing.
    pub unstarted: bool,
    /// `None`: the worker did not answer.
    pub state: Option<DrainState>,
    pub draining_since: Option<DateTime<Utc>>,
    /// Already carries [`REMOVABLE_COST`] (set on an earlier round).
    pub marked: bool,
}

impl Worker {
    fn draining(&self) -> bool {
        self.state
            .map_or(self.draining_since.is_some(), |s| s.draining)
    }

    fn removable(&self, grace: Duration, now: DateTime<Utc>) -> bool {
        let grace_over = self.draining_since.is_some_and(|since| {
            now.signed_duration_since(since)
                .to_std()
                .unwrap_or_default()
                >= grace
        });
        self.unstarted || (self.draining() && (self.state.is_some_and(|s| s.idle) || grace_over))
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
    /// Workers that may go now, to be given [`REMOVABLE_COST`].
    pub remove: Vec<String>,
    /// Workers draining (asked before or now), not removable yet.
    pub waiting: usize,
}

/// Decides, for a pool with `surplus` workers too many (0 when none), which to drain, which
/// to resume and which may go.
pub fn plan(workers: &[Worker], surplus: usize, grace: Duration, now: DateTime<Utc>) -> Plan {
    let mut plan = Plan::default();
    let (out, staying): (Vec<&Worker>, Vec<&Worker>) =
        workers.iter().partition(|w| w.unstarted || w.draining());
    // Unstarted workers go before draining ones, idle draining ones before busy ones; the
    // rest of those on their way out are taken back.
    let mut out = out;
    out.sort_by_key(|w| (!w.unstarted, !w.removable(grace, now), w.busy()));
    for (i, worker) in out.iter().enumerate() {
        if i >= surplus {
            if !worker.unstarted {
                plan.resume.push(worker.pod.clone());
            }
        } else if worker.removable(grace, now) {
            plan.remove.push(worker.pod.clone());
        } else {
            plan.waiting += 1;
        }
    }
    // Too few on their way out: drain the least busy of those known (an unreadable worker
    // may be busy, and could not be asked anyway).
    let mut candidates: Vec<&Worker> = staying.into_iter().filter(|w| w.state.is_some()).collect();
    candidates.sort_by_key(|w| w.busy());
    for worker in candidates
        .into_iter()
        .take(surplus.saturating_sub(out.len()))
    {
        plan.drain.push(worker.pod.clone());
        plan.waiting += 1;
    }
    plan
}

/// The outcome of [`settle`]: the replica count to apply and why it differs from the one
/// wanted, if it does.
pub struct Settled {
    pub replicas: i32,
    pub note: Option<String>,
    /// Workers draining and not yet removable: look again soon.
    pub waiting: usize,
}

/// Brings the pool from `current` workers towards `wanted`: a scale-up applies at once (and
/// takes back workers that were draining); a scale-down removes only the workers that
/// [`plan`] allows, and asks the others to drain.
pub async fn settle(pool: &WorkerPool, ctx: &Context, current: i32, wanted: i32) -> Settled {
    let surplus = usize::try_from(current - wanted).unwrap_or(0);
    let was_draining = pool.status.as_ref().is_some_and(|s| s.draining > 0);
    if surplus == 0 && !was_draining {
        return Settled {
            replicas: wanted,
            note: None,
            waiting: 0,
        };
    }
    let namespace = pool.namespace().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let listed = match pods
        .list(&ListParams::default().labels(&selector(&pool.name_any())))
        .await
    {
        Ok(list) => list.items,
        Err(err) => {
            tracing::warn!(error = %err, "cannot list the pool's pods; not shrinking");
            return Settled {
                replicas: current.max(wanted),
                note: Some(format!(
                    "scale-down to {wanted} waits: cannot list pods ({err})"
                )),
                waiting: 0,
            };
        }
    };
    // A terminating pod is on its way out already: neither a candidate nor counted.
    let live: Vec<Pod> = listed
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .collect();
    let http = reqwest::Client::builder()
        .timeout(ASK_TIMEOUT)
        .build()
        .unwrap_or_default();
    let workers = futures_util::future::join_all(live.iter().map(|pod| observe(&http, pod))).await;
    let grace = Duration::from_secs(u64::from(pool.spec.drain_grace_seconds));
    let now = Utc::now();
    let plan = plan(&workers, surplus, grace, now);

    let addresses: HashMap<String, String> = live
        .iter()
        .filter_map(|pod| Some((pod.name_any(), pod.status.as_ref()?.pod_ip.clone()?)))
        .collect();
    for pod in &plan.drain {
        if ask(&http, &addresses, pod, reqwest::Method::POST).await {
            annotate(&pods, pod, Some(&now.to_rfc3339()), 0).await;
        }
    }
    for pod in &plan.resume {
        ask(&http, &addresses, pod, reqwest::Method::DELETE).await;
        annotate(&pods, pod, None, 0).await;
    }
    // Marked on an earlier round: the ReplicaSet controller has seen the cost by now.
    // Marked this round: removed on the next one.
    let mut removing: i32 = 0;
    let mut marking = 0;
    for pod in &plan.remove {
        if workers.iter().any(|w| &w.pod == pod && w.marked) {
            removing += 1;
        } else if annotate(&pods, pod, None, REMOVABLE_COST).await {
            marking += 1;
        }
    }
    let waiting = plan.waiting + marking;
    let replicas = if surplus == 0 {
        wanted
    } else {
        current - removing
    };
    let note = (replicas != wanted).then(|| {
        format!(
            "scale-down to {wanted} at {replicas} for now: {} worker(s) draining, removed as each \
             is idle or after its {}s drain grace (busy workers are not removed)",
            waiting,
            grace.as_secs()
        )
    });
    Settled {
        replicas,
        note,
        waiting,
    }
}

async fn observe(http: &reqwest::Client, pod: &Pod) -> Worker {
    let draining_since = pod
        .annotations()
        .get(DRAINING_SINCE)
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc));
    let marked = pod.annotations().get(DELETION_COST).map(String::as_str)
        == Some(REMOVABLE_COST.to_string().as_str());
    let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
        return Worker {
            pod: pod.name_any(),
            unstarted: true,
            state: None,
            draining_since,
            marked,
        };
    };
    let url = format!("http://{ip}:{METRICS_PORT}/drain");
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
        draining_since,
        marked,
    }
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
    let url = format!("http://{ip}:{METRICS_PORT}/drain");
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

/// Sets (or, with `None`, removes) a pod's draining-since annotation and its deletion cost.
async fn annotate(pods: &Api<Pod>, pod: &str, since: Option<&str>, cost: i32) -> bool {
    let patch = json!({"metadata": {"annotations": {
        DRAINING_SINCE: since,
        DELETION_COST: cost.to_string(),
    }}});
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

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-12-02T10:00:00Z")
            .unwrap()
            .with_timezone(&Utc)
    }

    fn worker(pod: &str, in_flight: u64) -> Worker {
        Worker {
            pod: pod.to_owned(),
            unstarted: false,
            state: Some(DrainState {
                draining: false,
                in_flight,
                idle: false,
            }),
            draining_since: None,
            marked: false,
        }
    }

    fn draining(pod: &str, in_flight: u64, seconds_ago: i64) -> Worker {
        Worker {
            state: Some(DrainState {
                draining: true,
                in_flight,
                idle: in_flight == 0,
            }),
            draining_since: Some(now() - chrono::Duration::seconds(seconds_ago)),
            ..worker(pod, in_flight)
        }
    }

    #[test]
    fn the_least_busy_workers_are_asked_to_drain_and_nobody_goes_yet() {
        let workers = [worker("a", 3), worker("b", 1), worker("c", 2)];
        let plan = plan(&workers, 2, GRACE, now());
        assert_eq!(plan.drain, ["b", "c"]);
        assert!(plan.remove.is_empty(), "busy workers are not removed");
        assert_eq!(plan.waiting, 2);
    }

    #[test]
    fn a_drained_idle_worker_goes_and_a_busy_one_waits_for_its_grace() {
        let workers = [worker("a", 3), draining("b", 0, 5), draining("c", 2, 5)];
        let plan = plan(&workers, 2, GRACE, now());
        assert_eq!(plan.remove, ["b"]);
        assert_eq!(plan.waiting, 1);
        assert!(plan.drain.is_empty());
        let later = plan_after(&workers, 31);
        assert_eq!(later.remove, ["b", "c"], "grace over: it goes anyway");
    }

    fn plan_after(workers: &[Worker], seconds: i64) -> Plan {
        plan(
            workers,
            2,
            GRACE,
            now() + chrono::Duration::seconds(seconds - 5),
        )
    }

    #[test]
    fn unreadable_workers_are_never_chosen_and_unstarted_ones_go_first() {
        let unknown = Worker {
            state: None,
            ..worker("u", 0)
        };
        let unstarted = Worker {
            unstarted: true,
            state: None,
            ..worker("new", 0)
        };
        let plan = plan(&[unknown, unstarted, worker("a", 4)], 2, GRACE, now());
        assert_eq!(plan.remove, ["new"]);
        assert_eq!(plan.drain, ["a"], "the unreadable one may be busy");
    }

    #[test]
    fn workers_draining_beyond_the_surplus_are_taken_back_busiest_first() {
        let workers = [draining("a", 0, 1), draining("b", 4, 1), worker("c", 0)];
        let plan = plan(&workers, 1, GRACE, now());
        assert_eq!(plan.remove, ["a"]);
        assert_eq!(plan.resume, ["b"]);
        let none = super::plan(&workers, 0, GRACE, now());
        assert_eq!(
            none.resume,
            ["a", "b"],
            "no scale-down: every drain is undone"
        );
        assert!(none.remove.is_empty());
    }
}
