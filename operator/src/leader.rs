//! Leader election on a `coordination.k8s.io` Lease, so that one operator replica acts
//! while others stand by. Acquire with [`Leader::acquire`]; [`Leader::hold`] renews until
//! shutdown and cancels `lost` if the lease cannot be renewed in time — the process then
//! exits and Kubernetes restarts it as a follower.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::Client;
use tokio_util::sync::CancellationToken;

pub struct Leader {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

impl Leader {
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
        }
    }

    /// Waits until this process holds the lease (or `shutdown`); `false` on shutdown.
    pub async fn acquire(&self, shutdown: &CancellationToken) -> Result<bool, kube::Error> {
        loop {
            if self.try_hold().await? {
                tracing::info!(identity = self.identity, lease = self.name, "became leader");
                return Ok(true);
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(false),
                _ = tokio::time::sleep(self.duration / 3) => {}
            }
        }
    }

    /// Renews every third of the lease duration until `shutdown`; cancels `lost` when the
    /// lease could not be renewed for a whole duration or another holder took it.
    pub async fn hold(self, shutdown: CancellationToken, lost: CancellationToken) {
        let mut last_renewed = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.duration / 3) => {}
            }
            match self.try_hold().await {
                Ok(true) => last_renewed = tokio::time::Instant::now(),
                Ok(false) => {
                    tracing::error!("another operator took the lease");
                    lost.cancel();
                    return;
                }
                Err(err) => tracing::warn!(error = %err, "cannot renew the lease"),
            }
            if last_renewed.elapsed() >= self.duration {
                tracing::error!("lease not renewed in time; stepping down");
                lost.cancel();
                return;
            }
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
        let expired = spec.renew_time.as_ref().is_none_or(|renewed| {
            let ttl = SignedDuration::from_secs(i64::from(
                spec.lease_duration_seconds.unwrap_or(seconds),
            ));
            renewed
                .0
                .checked_add(ttl)
                .map(|end| end < now)
                .unwrap_or(true)
        });
        if !ours && !expired {
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
}

fn conflict_is_false(result: Result<Lease, kube::Error>) -> Result<bool, kube::Error> {
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(err) => Err(err),
    }
}
