//! Whether a pool's objects need applying: only when what would be applied changed, when
//! someone else edited the Deployment, or every [`REAPPLY_EVERY`] (plus the pool's share of
//! half of it) to repair hand edits of the ConfigMap, Service and PodDisruptionBudget. The
//! fingerprint of what was applied is written on the Deployment ([`APPLIED_ANNOTATION`]), so
//! that a restarted or newly elected operator applies again only what changed, not every
//! pool of the cluster.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;

use crate::build::{fnv1a, PoolObjects};
use crate::context::Applied;

/// Unchanged objects are applied again at least this often.
pub const REAPPLY_EVERY: Duration = Duration::from_secs(300);
/// The Deployment's annotation naming the fingerprint of the objects last applied.
pub const APPLIED_ANNOTATION: &str = "conveyor.dev/applied";

/// A stable hash of the four objects, written on the Deployment as [`APPLIED_ANNOTATION`].
pub fn stamp(objects: &mut PoolObjects) -> u64 {
    let texts = [
        serde_json::to_string(&objects.config_map),
        serde_json::to_string(&objects.service),
        serde_json::to_string(&objects.pod_disruption_budget),
        serde_json::to_string(&objects.deployment),
    ];
    let print = fnv1a(
        texts
            .iter()
            .flat_map(|t| t.as_deref().unwrap_or_default().bytes().chain([0])),
    );
    objects
        .deployment
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(APPLIED_ANNOTATION.to_owned(), format!("{print:016x}"));
    print
}

/// The fingerprint a Deployment carries, if any.
pub fn carried(deployment: &Deployment) -> Option<u64> {
    let text = deployment
        .metadata
        .annotations
        .as_ref()?
        .get(APPLIED_ANNOTATION)?;
    u64::from_str_radix(text, 16).ok()
}

/// What the Deployment looks like now.
#[derive(Debug, Clone, Copy, Default)]
pub struct Live {
    pub generation: Option<i64>,
    /// Its [`APPLIED_ANNOTATION`].
    pub carried: Option<u64>,
}

/// Whether `fingerprint` needs no apply for the pool `key`. With no memory of the pool (a
/// restarted operator), a Deployment carrying the same fingerprint counts as applied now,
/// and is remembered in `memory` as such. A Deployment someone else edited meanwhile keeps
/// the edit until the next periodic apply.
pub fn unchanged(memory: &mut Option<Applied>, key: &str, live: Live, fingerprint: u64) -> bool {
    match memory {
        Some(last) => {
            last.fingerprint == fingerprint
                && last.generation.is_some()
                && last.generation == live.generation
                && last.at.elapsed() < reapply_after(key)
        }
        None if live.carried == Some(fingerprint) && live.generation.is_some() => {
            *memory = Some(Applied {
                fingerprint,
                generation: live.generation,
                at: Instant::now(),
            });
            true
        }
        None => false,
    }
}

/// [`REAPPLY_EVERY`] plus the pool's own share of half of it: pools remembered together (at
/// a restart) are applied again spread out.
fn reapply_after(key: &str) -> Duration {
    crate::shared::spread(key, REAPPLY_EVERY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(generation: i64, carried: u64) -> Live {
        Live {
            generation: Some(generation),
            carried: Some(carried),
        }
    }

    #[test]
    fn a_restarted_operator_trusts_the_fingerprint_the_deployment_carries() {
        let mut memory = None;
        assert!(unchanged(&mut memory, "uid", live(4, 7), 7));
        let remembered = memory.as_ref().expect("remembered");
        assert_eq!(
            (remembered.fingerprint, remembered.generation),
            (7, Some(4))
        );
        assert!(
            unchanged(&mut memory, "uid", live(4, 7), 7),
            "still unchanged"
        );
        assert!(
            !unchanged(&mut memory, "uid", live(5, 7), 7),
            "edited by someone else since"
        );
        let mut memory = None;
        assert!(
            !unchanged(&mut memory, "uid", live(4, 6), 7),
            "the spec changed"
        );
        assert!(memory.is_none());
        assert!(
            !unchanged(&mut memory, "uid", Live::default(), 7),
            "no Deployment"
        );
    }

    #[test]
    fn unchanged_pools_are_applied_again_spread_out() {
        let due: Vec<Duration> = (0..100)
            .map(|i| reapply_after(&format!("uid-{i}")))
            .collect();
        assert!(due
            .iter()
            .all(|d| *d >= REAPPLY_EVERY && *d < REAPPLY_EVERY * 3 / 2));
        let (earliest, latest) = (due.iter().min().unwrap(), due.iter().max().unwrap());
        assert!(*latest - *earliest > REAPPLY_EVERY / 4);
        let mut memory = Some(Applied {
            fingerprint: 7,
            generation: Some(4),
            at: Instant::now()
                .checked_sub(REAPPLY_EVERY * 2)
                .unwrap_or_else(Instant::now),
        });
        if memory
            .as_ref()
            .is_some_and(|m| m.at.elapsed() >= REAPPLY_EVERY * 2)
        {
            assert!(!unchanged(&mut memory, "uid", live(4, 7), 7), "due again");
        }
    }
}
