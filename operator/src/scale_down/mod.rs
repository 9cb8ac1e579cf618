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
//! [`plan`] is the pure decision, [`ranking`] the ReplicaSet's order of deletion, [`memory`]
//! what this process has seen; [`settle`] reads the pods and carries the plan out.

use std::collections::HashMap;
use std::time::Duration;

use conveyor_core::crd::WorkerPool;
use conveyor_core::drain::{DrainState, DRAIN_PATH};
use k8s_openapi::api::core::v1::{Pod, PodSpec, PodStatus};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;

use crate::build::{selector, METRICS_PORT, POOL_LABEL};
use crate::context::Context;
use crate::shared::synced;

pub mod memory;
mod plan;
mod ranking;

pub use plan::{plan, Plan, Worker};

/// When the operator asked a worker to drain (RFC 3339), on the pod.
pub const DRAINING_SINCE: &str = "conveyor.dev/draining-since";
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
/// The cost of a worker that may go now: below every other.
pub const REMOVABLE_COST: i32 = i32::MIN;
/// How long a worker's admin port may take to answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// The outcome of [`settle`]: the replica count to apply and why it differs from the one
/// wanted, if it does.
pub struct Settled {
    pub replicas: i32,
    pub note: Option<String>,
    /// Workers chosen to go and not removable yet (or whose drain could not be undone):
    /// look again soon.
    pub waiting: usize,
}

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
    let due = ctx.drains.look_due(&key);
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
    ctx.drains.looked_at(&key);
    // A terminating pod is on its way out already: neither a candidate nor counted.
    let live: Vec<Pod> = listed
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .collect();
    let http = reqwest::Client::builder()
        .timeout(ASK_TIMEOUT)
        .build()
        .unwrap_or_default();
    let mut workers = observe_all(&http, &live).await;
    ctx.drains.remember(&live, &mut workers);
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
    let token = ctx.admin_token(pool);
    let token = token.as_deref();
    for pod in &plan.drain {
        if ask(&http, &addresses, pod, reqwest::Method::POST, token).await {
            annotate(&pods, pod, json!({DRAINING_SINCE: now, DELETION_COST: "0"})).await;
        }
    }
    let mut not_undone = 0;
    for pod in &plan.resume {
        // An unstarted or unreachable worker cannot be asked: its stamp stays, and it is
        // asked again next round.
        if ask(&http, &addresses, pod, reqwest::Method::DELETE, token).await {
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
    let mut marking = 0;
    for pod in &plan.remove {
        let marked = workers.iter().any(|w| &w.pod == pod && w.marked);
        if !marked
            && annotate(
                &pods,
                pod,
                json!({DELETION_COST: REMOVABLE_COST.to_string()}),
            )
            .await
        {
            marking += 1;
        }
    }
    // The Deployment shrinks only by the pods the ReplicaSet will take first: those marked
    // before this round, and unstarted ones, until the first other pod in its order.
    let harmless = |pod: &Pod| {
        let name = pod.name_any();
        workers
            .iter()
            .any(|w| w.pod == name && (w.unstarted || (w.marked && plan.remove.contains(&name))))
    };
    let (taken, ahead) = ranking::taken_first(&live, harmless);
    let marked = plan
        .remove
        .iter()
        .filter(|pod| workers.iter().any(|w| &w.pod == *pod && w.marked))
        .count();
    // Marked pods held back by the ReplicaSet's order are looked at again soon as well.
    let waiting = plan.waiting + marking + not_undone + marked.saturating_sub(taken);
    let replicas = if wanted >= current {
        wanted
    } else {
        let after = i32::try_from(live.len() - taken).unwrap_or(i32::MAX);
        after.clamp(wanted, current)
    };
    let note = (replicas != wanted).then(|| {
        let blocked = ahead
            .filter(|_| taken < marked)
            .map(|pod| {
                format!(
                    "; {} comes first in the ReplicaSet's order of deletion (it is not ready \
                     or not running), so the workers chosen wait until it is ready or they \
                     no longer are",
                    pod.name_any()
                )
            })
            .unwrap_or_default();
        format!(
            "scale-down to {wanted} at {replicas} for now: {waiting} worker(s) draining, \
             removed as each is idle or after its {}s drain grace (busy workers are not \
             removed){blocked}",
            grace.as_secs()
        )
    });
    Settled {
        replicas,
        note,
        waiting,
    }
}

/// Asks every pod at once: hung workers cost a round one [`ASK_TIMEOUT`], not one each.
async fn observe_all(http: &reqwest::Client, pods: &[Pod]) -> Vec<Worker> {
    futures_util::future::join_all(pods.iter().map(|pod| observe(http, pod))).await
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

/// What the pod watch keeps of a pool's pod: only what a scale-down reads (its metadata
/// without managed fields, its node, phase, conditions and address). A whole pod is tens of
/// kilobytes, most of it the spec and managed fields: a thousand pools' workers would fill
/// the operator's memory.
pub fn slim(pod: &mut Pod) {
    crate::shared::without_managed_fields(pod);
    pod.spec = pod.spec.take().map(|spec| PodSpec {
        node_name: spec.node_name,
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|status| PodStatus {
        phase: status.phase,
        conditions: status.conditions,
        pod_ip: status.pod_ip,
        ..PodStatus::default()
    });
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

/// Asks a worker to drain (POST) or resume (DELETE), with the pool's admin token when there
/// is one; whether it answered.
async fn ask(
    http: &reqwest::Client,
    addresses: &HashMap<String, String>,
    pod: &str,
    method: reqwest::Method,
    token: Option<&str>,
) -> bool {
    let Some(ip) = addresses.get(pod) else {
        return false;
    };
    let url = format!("http://{ip}:{METRICS_PORT}{DRAIN_PATH}");
    let mut request = http.request(method.clone(), &url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    match request.send().await {
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

    #[test]
    fn a_slim_pod_keeps_what_a_scale_down_reads() {
        let mut pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "w1", "namespace": "video", "uid": "u1",
                "labels": {POOL_LABEL: "p"}, "annotations": {DELETION_COST: "5", DRAINING_SINCE: "t"},
                "managedFields": [{"manager": "kubelet", "operation": "Update"}]},
            "spec": {"nodeName": "node-1", "containers": [{"name": "worker", "image": "w:1",
                "env": [{"name": "A", "value": "x".repeat(2000)}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.7", "hostIP": "10.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "worker", "image": "w:1", "imageID": "", "ready": true, "restartCount": 0}]},
        }))
        .unwrap();
        let whole = serde_json::to_string(&pod).unwrap().len();
        let before = (
            ranking::rank(&pod),
            pod.annotations().clone(),
            pod.labels().clone(),
        );
        slim(&mut pod);
        assert_eq!(
            before,
            (
                ranking::rank(&pod),
                pod.annotations().clone(),
                pod.labels().clone()
            )
        );
        assert_eq!(
            pod.status.as_ref().unwrap().pod_ip.as_deref(),
            Some("10.0.0.7")
        );
        assert_eq!(pod.metadata.uid.as_deref(), Some("u1"));
        let kept = serde_json::to_string(&pod).unwrap().len();
        assert!(kept * 5 < whole, "{kept} of {whole} bytes kept");
    }

    #[tokio::test(start_paused = true)]
    async fn hung_workers_are_asked_at_once_not_one_after_another() {
        // Four workers that take the connection and never answer (nobody accepts).
        let mut listening = Vec::new();
        let mut pods = Vec::new();
        for i in 1..=4 {
            let ip = format!("127.78.0.{i}");
            listening.push(std::net::TcpListener::bind(format!("{ip}:{METRICS_PORT}")).unwrap());
            let pod = json!({"metadata": {"name": format!("w{i}")}, "status": {"podIP": ip}});
            pods.push(serde_json::from_value::<Pod>(pod).unwrap());
        }
        let http = reqwest::Client::builder()
            .timeout(ASK_TIMEOUT)
            .build()
            .unwrap();
        let started = tokio::time::Instant::now();
        let workers = observe_all(&http, &pods).await;
        assert!(workers.iter().all(|w| w.state.is_none()), "none answered");
        // On tokio's paused clock: one after another would take four timeouts.
        let took = started.elapsed();
        assert!(took < ASK_TIMEOUT * 2, "a round took {took:?}");
    }
}
