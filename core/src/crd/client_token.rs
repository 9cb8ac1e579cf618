//! `ClientToken`: a client of the gateway, in the namespace whose task types and tasks it
//! may use (`docs/security.md`). Only the token's digest is stored, so the resource is not a
//! secret and the gateway needs no access to Secrets: a team creates its own in its own
//! namespace, and the gateway lists them across the cluster.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A bearer token the gateway accepts for this namespace. The same digest in several
/// namespaces makes one client of all of them.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "conveyor.dev",
    version = "v1alpha1",
    kind = "ClientToken",
    plural = "clienttokens",
    namespaced,
    doc = "A client of the gateway in this namespace: the SHA-256 digest of a bearer token the gateway accepts for this namespace's task types and tasks (never the token itself).",
    printcolumn = r#"{"name":"Age", "type":"date", "jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClientTokenSpec {
    /// SHA-256 of the bearer token, in lowercase hex (`printf %s "$TOKEN" | sha256sum`).
    /// The token itself is never stored.
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub token_sha256: String,
}
