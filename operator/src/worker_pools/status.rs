//! A pool's status: counts, load, conditions, and the last change with its inputs. The
//! last change is remembered per pool, since the pool a reconcile is handed may not show
//! this operator's last write yet.

use conveyor_core::crd::status::conditions::{METRICS_AVAILABLE, READY, SCALING};
use conveyor_core::crd::status::{phases, reasons};
use conveyor_core::crd::worker_pool::{ScaleRecord, WorkerPoolStatus};
use conveyor_core::crd::WorkerPool;
use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde_json::json;

use super::{Load, Seen};
use crate::build::{selector, FIELD_MANAGER};
use crate::context::{condition, Context};
use crate::error::Result;
use crate::scale_down;
use crate::shared::lock;

/// Status: counts, load, conditions, and the last change with its inputs.
pub(super) async fn report(
    pool: &WorkerPool,
    ctx: &Context,
    seen: Seen,
    wanted: i32,
    settled: &scale_down::Settled,
    reason: String,
) -> Result<()> {
    let (current, replicas) = (seen.current, settled.replicas);
    let metrics = seen
        .load
        .as_ref()
        .err()
        .map(|err| (err.category(), err.to_string()));
    let load = seen.load.ok();
    let last_scale = if replicas != current {
        let record = ScaleRecord {
            time: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            from: current,
            to: replicas,
            reason: reason.clone(),
            ready: load.map(|l| l.ready),
            in_flight: load.map(|l| l.in_flight),
            retrying: load.map(|l| l.retrying),
            processing_rate: load.and_then(|l| l.rate),
            arrival_rate: load.and_then(|l| l.arrival),
        };
        remember_scale(pool, ctx, &record);
        Some(record)
    } else {
        last_scale(pool, ctx)
    };
    let settling = wanted != current || settled.waiting > 0;
    let status = Status {
        metrics,
        phase: if seen.ready_replicas == wanted && !settling {
            phases::READY
        } else {
            phases::SCALING
        },
        reason: if settling {
            reasons::SCALING
        } else {
            reasons::STABLE
        },
        message: reason,
        wanted,
        current,
        ready_replicas: seen.ready_replicas,
        draining: settled.waiting,
        load,
        last_scale,
    };
    write_status(pool, ctx, status).await
}

/// The pool's last change: the one this operator wrote, which the pool it was handed may
/// not show yet, or else the one in its status (written before this operator started).
pub(super) fn last_scale(pool: &WorkerPool, ctx: &Context) -> Option<ScaleRecord> {
    let written = lock(&ctx.last_scales);
    pool.uid()
        .and_then(|uid| written.get(&uid).cloned())
        .or_else(|| pool.status.as_ref().and_then(|s| s.last_scale.clone()))
}

fn remember_scale(pool: &WorkerPool, ctx: &Context, record: &ScaleRecord) {
    if let Some(uid) = pool.uid() {
        let mut written = lock(&ctx.last_scales);
        written.insert(uid, record.clone());
    }
}

pub(super) struct Status {
    /// Why the queues' statistics could not be read; `None` when they were.
    pub(super) metrics: Option<(&'static str, String)>,
    pub(super) phase: &'static str,
    pub(super) reason: &'static str,
    pub(super) message: String,
    /// Workers wanted (the Deployment follows as draining workers become idle).
    pub(super) wanted: i32,
    pub(super) current: i32,
    pub(super) ready_replicas: i32,
    /// Workers draining before their removal.
    pub(super) draining: usize,
    /// `None`: the broker could not be read.
    pub(super) load: Option<Load>,
    pub(super) last_scale: Option<ScaleRecord>,
}

impl Status {
    /// Nothing was applied: the Deployment keeps its count, and `/scale` reports it.
    pub(super) fn degraded(
        reason: &'static str,
        message: String,
        current: i32,
        ready: i32,
    ) -> Status {
        Status {
            metrics: None,
            phase: phases::DEGRADED,
            reason,
            message,
            wanted: current,
            current,
            ready_replicas: ready,
            draining: 0,
            load: None,
            last_scale: None,
        }
    }
}

/// How long a pool that may rest at zero stays Ready with no worker up after a scale-up:
/// time for a pod to start, short enough that workers that never start (a bad image, a
/// crash loop) show as not Ready.
const STARTING_GRACE: chrono::TimeDelta = chrono::TimeDelta::minutes(5);

/// Ready means serving, not settled: a scaling step is the Scaling condition's business, so
/// GitOps health checks do not flap on every decision. A pool that may rest at zero
/// (autoscaled from `minReplicas: 0`) scales up from zero each time work arrives; it stays
/// Ready while its first worker starts, for [`STARTING_GRACE`] after the step.
fn serving(
    pool: &WorkerPool,
    status: &Status,
    healthy: bool,
    now: chrono::DateTime<chrono::Utc>,
) -> bool {
    if !healthy {
        return false;
    }
    if status.ready_replicas > 0 || status.wanted == 0 {
        return true;
    }
    let may_rest_at_zero = pool
        .spec
        .autoscaling
        .as_ref()
        .is_some_and(|a| a.min_replicas == 0);
    let starting = status.last_scale.as_ref().is_some_and(|step| {
        step.to > step.from
            && chrono::DateTime::parse_from_rfc3339(&step.time)
                .is_ok_and(|at| now.signed_duration_since(at) < STARTING_GRACE)
    });
    may_rest_at_zero && starting
}

pub(super) async fn write_status(pool: &WorkerPool, ctx: &Context, status: Status) -> Result<()> {
    let previous = pool
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let generation = pool.meta().generation;
    let healthy = status.phase != phases::DEGRADED;
    let ready = serving(pool, &status, healthy, chrono::Utc::now());
    let body = WorkerPoolStatus {
        observed_generation: generation,
        replicas: status.current,
        ready_replicas: status.ready_replicas,
        desired_replicas: status.wanted,
        draining: i32::try_from(status.draining).unwrap_or(i32::MAX),
        last_scale: status.last_scale,
        selector: Some(selector(&pool.name_any())),
        queued: status.load.map(|l| l.ready),
        in_flight: status.load.map(|l| l.in_flight),
        dead_lettered: status.load.map(|l| l.dead_lettered),
        phase: Some(status.phase.to_owned()),
        conditions: vec![
            condition(
                &previous,
                READY,
                ready,
                status.reason,
                status.message.clone(),
                generation,
            ),
            condition(
                &previous,
                SCALING,
                status.wanted != status.current || status.draining > 0,
                status.reason,
                status.message,
                generation,
            ),
            match status.metrics {
                None => condition(
                    &previous,
                    METRICS_AVAILABLE,
                    true,
                    reasons::QUEUES_READ,
                    "queue depths and rates read from RabbitMQ".to_owned(),
                    generation,
                ),
                Some((reason, message)) => condition(
                    &previous,
                    METRICS_AVAILABLE,
                    false,
                    reason,
                    message,
                    generation,
                ),
            },
        ],
    };
    // Unchanged (a steady pool's periodic look): no write.
    if pool.status.as_ref() == Some(&body) {
        return Ok(());
    }
    let patch = json!({
        "apiVersion": WorkerPool::api_version(&()),
        "kind": WorkerPool::kind(&()),
        "status": body,
    });
    let api: Api<WorkerPool> =
        Api::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default());
    api.patch_status(
        &pool.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(wanted: i32, ready_replicas: i32, scaled: Option<(i32, i32, i64)>) -> Status {
        let now = chrono::Utc::now();
        Status {
            metrics: None,
            phase: phases::SCALING,
            reason: "R",
            message: String::new(),
            wanted,
            current: wanted,
            ready_replicas,
            draining: 0,
            load: None,
            last_scale: scaled.map(|(from, to, minutes_ago)| ScaleRecord {
                time: (now - chrono::TimeDelta::minutes(minutes_ago)).to_rfc3339(),
                from,
                to,
                reason: String::new(),
                ready: None,
                in_flight: None,
                retrying: None,
                processing_rate: None,
                arrival_rate: None,
            }),
        }
    }

    #[test]
    fn a_pool_that_may_rest_at_zero_stays_ready_while_its_first_worker_starts() {
        let now = chrono::Utc::now();
        let from_zero = WorkerPool::test().consumes("t").autoscaled(0, 4).build();
        let just_scaled = with(2, 0, Some((0, 2, 1)));
        assert!(
            serving(&from_zero, &just_scaled, true, now),
            "its first worker starting"
        );
        let long_ago = with(2, 0, Some((0, 2, 10)));
        assert!(
            !serving(&from_zero, &long_ago, true, now),
            "workers that never start show"
        );
        assert!(!serving(&from_zero, &with(2, 0, None), true, now));
        assert!(serving(&from_zero, &with(0, 0, None), true, now), "at rest");
        assert!(!serving(&from_zero, &just_scaled, false, now), "degraded");
        let from_one = WorkerPool::test().consumes("t").autoscaled(1, 4).build();
        assert!(!serving(&from_one, &with(2, 0, Some((1, 2, 1))), true, now));
        assert!(serving(&from_one, &with(2, 1, Some((1, 2, 1))), true, now));
        let fixed = WorkerPool::test().consumes("t").replicas(3).build();
        assert!(!serving(&fixed, &with(3, 0, Some((0, 3, 1))), true, now));
    }
}
