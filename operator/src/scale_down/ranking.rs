//! The order in which a ReplicaSet deletes pods when its count drops, as far as the pods'
//! own fields decide it (the ReplicaSet controller's `ActivePodsWithRanks`): unscheduled
//! first, then pending before running, then not ready before ready, then the lowest
//! `pod-deletion-cost`. The cost comes only fourth: a busy pod that is not ready (its
//! database breaker is open, say) goes before a ready idle one whatever their costs. The
//! operator therefore shrinks a Deployment only by as many pods as that order takes from
//! those it chose.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::DELETION_COST;

/// What the ReplicaSet sorts by, lowest deleted first.
pub(super) fn rank(pod: &Pod) -> (bool, u8, bool, i32) {
    let scheduled = pod
        .spec
        .as_ref()
        .is_some_and(|s| s.node_name.as_deref().is_some_and(|n| !n.is_empty()));
    let status = pod.status.as_ref();
    let phase = match status.and_then(|s| s.phase.as_deref()) {
        Some("Pending") | None => 0,
        Some("Unknown") => 1,
        Some("Running") => 2,
        Some(_) => 3,
    };
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let cost = pod
        .annotations()
        .get(DELETION_COST)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (scheduled, phase, ready, cost)
}

/// How many of `pods` a ReplicaSet shrinking now would delete before it reaches one that is
/// not `harmless`, and that one (among equals it may take either, so an equal counts as
/// ahead).
pub fn taken_first(pods: &[Pod], harmless: impl Fn(&Pod) -> bool) -> (usize, Option<&Pod>) {
    let mut order: Vec<(&Pod, bool)> = pods.iter().map(|pod| (pod, harmless(pod))).collect();
    order.sort_by_key(|&(pod, harmless)| (rank(pod), harmless));
    let taken = order.iter().take_while(|(_, harmless)| *harmless).count();
    (taken, order.get(taken).map(|(pod, _)| *pod))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(name: &str, ready: bool, cost: i32) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {DELETION_COST: cost.to_string()}},
            "spec": {"nodeName": "node-1", "containers": []},
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        }))
        .unwrap()
    }

    fn marked(pod: &Pod) -> bool {
        pod.annotations().get(DELETION_COST) == Some(&i32::MIN.to_string())
    }

    #[test]
    fn the_lowest_cost_goes_first_among_ready_pods() {
        let pods = [pod("busy", true, 0), pod("drained", true, i32::MIN)];
        assert_eq!(taken_first(&pods, marked).0, 1);
    }

    #[test]
    fn a_busy_pod_that_is_not_ready_goes_before_a_ready_marked_one() {
        // The breaker-open worker with tasks in hand: the ReplicaSet would take it first.
        let pods = [pod("busy", false, 0), pod("drained", true, i32::MIN)];
        let (taken, ahead) = taken_first(&pods, marked);
        assert_eq!(taken, 0);
        assert_eq!(ahead.and_then(|p| p.metadata.name.as_deref()), Some("busy"));
        // Drained, the marked one stops being ready too: then its cost decides.
        let pods = [pod("busy", false, 0), pod("drained", false, i32::MIN)];
        assert_eq!(taken_first(&pods, marked).0, 1);
    }

    #[test]
    fn an_unscheduled_pod_goes_first_and_an_equal_counts_as_ahead() {
        let mut pending = pod("pending", false, 0);
        pending.spec.as_mut().unwrap().node_name = None;
        pending.status.as_mut().unwrap().phase = Some("Pending".to_owned());
        let pods = [pod("drained", true, i32::MIN), pending];
        assert_eq!(
            taken_first(&pods, marked).0,
            0,
            "the pending one is not ours"
        );
        assert_eq!(taken_first(&pods, |_| true).0, 2);
        let twins = [pod("a", true, i32::MIN), pod("b", true, i32::MIN)];
        let only_b = |p: &Pod| p.metadata.name.as_deref() == Some("b");
        assert_eq!(taken_first(&twins, only_b).0, 0);
    }
}
