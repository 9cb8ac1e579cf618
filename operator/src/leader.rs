//! Leader election on a `coordination.k8s.io` Lease, so that one operator replica acts
//! while others stand by (decision 0006). [`Leader::acquire`] waits for the lease;
//! [`Leader::hold`] renews it and cancels `lost` when it could not be renewed within the
//! renew deadline, which ends before any standby may take over; [`Leader::release`] hands it
//! on at shutdown.
//!
//! Expiry is judged on this process's monotonic clock, never by comparing the holder's
//! `renewTime` with ours: a standby takes over only once it has watched the lease record
//! stay unchanged for a whole lease duration (as client-go does), so a skewed clock on
//! either side cannot make a live lease look expired.

use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::Client;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::shared::lock;

pub struct Leader {
    api: Api<Lease>,
    name: String,
    identity: String,
    /// How long a lease record must stay unchanged before a standby takes it.
    duration: Duration,
    /// How long the leader keeps acting without a successful renewal: shorter than
    /// `duration`, so it has stopped before anyone else may start.
    renew_deadline: Duration,
    /// Pause between attempts, and the bound on each API call while standing by.
    retry: Duration,
    /// The other holder's record as last seen, and when (on our clock).
    observed: Mutex<Option<(Record, Instant)>>,
    /// When the last successful acquire or renewal was sent.
    renewed_at: Mutex<Option<Instant>>,
}

/// What identifies one renewal of a lease: a new renewal changes it.
#[derive(Debug, Clone, PartialEq)]
struct Record {
    holder: Option<String>,
    renew_time: Option<Timestamp>,
    transitions: Option<i32>,
}

impl Leader {
    /// Renew deadline two thirds of `duration`, a retry every sixth (15 s → 10 s, 2.5 s,
    /// close to client-go's 15/10/2).
    pub fn new(
        client: Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> Self {
        Leader {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            duration,
            renew_deadline: duration * 2 / 3,
            retry: duration / 6,
            observed: Mutex::new(None),
            renewed_at: Mutex::new(None),
        }
    }

    /// Waits until this process holds the lease (`true`) or `shutdown` (`false`). API errors
    /// and timeouts while standing by are logged and retried: a follower must outlive an
    /// apiserver outage.
    pub async fn acquire(&self, shutdown: &CancellationToken) -> bool {
        loop {
            let sent = Instant::now();
            match tokio::time::timeout(self.retry, self.try_hold()).await {
                Ok(Ok(true)) => {
                    *lock(&self.renewed_at) = Some(sent);
                    tracing::info!(identity = self.identity, lease = self.name, "became leader");
                    return true;
                }
                Ok(Ok(false)) => {}
                Ok(Err(err)) => tracing::warn!(error = %err, "cannot read the lease; retrying"),
                Err(_) => tracing::warn!(after = ?self.retry, "lease call timed out; retrying"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return false,
                _ = tokio::time::sleep(self.retry) => {}
            }
        }
    }

    /// Renews until `shutdown`; cancels `lost` when another holder took the lease or no
    /// renewal succeeded within the renew deadline (each call is bounded by what is left of
    /// it, since kube's client has no read timeout of its own).
    pub async fn hold(&self, shutdown: CancellationToken, lost: CancellationToken) {
        let mut renewed = (*lock(&self.renewed_at)).unwrap_or_else(Instant::now);
        loop {
            // Never past the deadline: failed renewals that return at once must not push the
            // step-down a retry period later (the controllers then get STOP_WITHIN to stop,
            // and the whole must end before a standby may take the lease).
            let until_deadline = self.renew_deadline.saturating_sub(renewed.elapsed());
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.retry.min(until_deadline)) => {}
            }
            let sent = Instant::now();
            let left = self.renew_deadline.saturating_sub(renewed.elapsed());
            match tokio::time::timeout(left, self.try_hold()).await {
                Ok(Ok(true)) => renewed = sent,
                Ok(Ok(false)) => {
                    tracing::error!("another operator took the lease");
                    lost.cancel();
                    return;
                }
                Ok(Err(err)) => tracing::warn!(error = %err, "cannot renew the lease"),
                Err(_) => tracing::warn!("lease renewal timed out"),
            }
            if renewed.elapsed() >= self.renew_deadline {
                tracing::error!(deadline = ?self.renew_deadline, "lease not renewed in time; stepping down");
                lost.cancel();
                return;
            }
        }
    }

    /// Gives the lease up (at shutdown, once the controllers stopped), so a standby takes
    /// over at its next attempt instead of after a whole duration. Best effort, bounded.
    pub async fn release(&self) {
        let release = async {
            let Some(mut lease) = self.api.get_opt(&self.name).await? else {
                return Ok(());
            };
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
                return Ok(());
            }
            spec.holder_identity = None;
            spec.renew_time = Some(MicroTime(Timestamp::now()));
            spec.lease_duration_seconds = Some(1);
            self.api
                .replace(&self.name, &PostParams::default(), &lease)
                .await
                .map(drop)
        };
        match tokio::time::timeout(self.retry, release).await {
            Ok(Ok(())) => tracing::info!(lease = self.name, "released the lease"),
            Ok(Err(err)) => tracing::warn!(error = %err, "cannot release the lease"),
            Err(_) => tracing::warn!("releasing the lease timed out"),
        }
    }

    /// Takes or renews the lease if it is free, expired or ours. Optimistic: a concurrent
    /// writer makes the replace fail with 409, which counts as not holding it.
    async fn try_hold(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let seconds = self.duration.as_secs().max(1) as i32;
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return conflict_is_false(self.api.create(&PostParams::default(), &lease).await);
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let ours = spec.holder_identity.as_deref() == Some(self.identity.as_str());
        if !ours && !self.free_or_expired(spec) {
            return Ok(false);
        }
        if !ours {
            spec.holder_identity = Some(self.identity.clone());
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.renew_time = Some(MicroTime(now));
        spec.lease_duration_seconds = Some(seconds);
        conflict_is_false(
            self.api
                .replace(&self.name, &PostParams::default(), &lease)
                .await,
        )
    }

    /// Free when released (no holder); expired when the record has not changed for the
    /// holder's lease duration as this process's clock measures it.
    fn free_or_expired(&self, spec: &LeaseSpec) -> bool {
        if spec.holder_identity.as_deref().is_none_or(str::is_empty) {
            return true;
        }
        let record = Record {
            holder: spec.holder_identity.clone(),
            renew_time: spec.renew_time.as_ref().map(|t| t.0),
            transitions: spec.lease_transitions,
        };
        let ttl = spec
            .lease_duration_seconds
            .map_or(self.duration, |s| Duration::from_secs(s.max(1) as u64));
        let mut observed = lock(&self.observed);
        match observed.as_ref() {
            Some((seen, since)) if *seen == record => since.elapsed() >= ttl,
            _ => {
                *observed = Some((record, Instant::now()));
                false
            }
        }
    }
}

fn conflict_is_false(result: Result<Lease, kube::Error>) -> Result<bool, kube::Error> {
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(err) => Err(err),
    }
}
