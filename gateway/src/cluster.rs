//! The gateway in a cluster: the TaskType and ClientToken resources of every namespace
//! (ClientTokens hold digests only, so the gateway needs no access to Secrets), listed at
//! start and again every refresh.

use std::sync::Arc;
use std::time::Duration;

use conveyor_core::crd::ClientToken;
use kube::api::{Api, ListParams};
use kube::ResourceExt;
use tokio_util::sync::CancellationToken;

use crate::auth::{TokenSet, Tokens};
use crate::registry::{list_cluster_types, Registry};

/// `fixed` (file and environment) and every ClientToken, each for its namespace. A
/// malformed one is left out and logged; the rest serve.
pub async fn list(client: &kube::Client, fixed: &Tokens) -> Result<Tokens, kube::Error> {
    let listed = Api::<ClientToken>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let mut tokens = fixed.clone();
    for resource in &listed.items {
        let namespace = resource.namespace().unwrap_or_default();
        let name = format!("{namespace}/{}", resource.name_any());
        if let Err(err) = tokens.add_listed(&name, &resource.spec.token_sha256, &namespace) {
            tracing::warn!(client = name, error = err, "ClientToken refused");
        }
    }
    Ok(tokens)
}

/// Lists the TaskTypes and ClientTokens every `interval` until `shutdown`; a failed list
/// keeps the last set of its kind. `fixed` are the tokens of the file and environment.
pub async fn follow(
    registry: Arc<Registry>,
    tokens: Arc<TokenSet>,
    fixed: Tokens,
    client: kube::Client,
    interval: Duration,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        match list_cluster_types(&client).await {
            Ok(types) => registry.replace(types),
            Err(err) => tracing::warn!(error = %err, "cannot list TaskTypes; keeping the last set"),
        }
        match list(&client, &fixed).await {
            Ok(listed) => tokens.replace(listed),
            Err(err) => {
                tracing::warn!(error = %err, "cannot list ClientTokens; keeping the last set")
            }
        }
    }
}
