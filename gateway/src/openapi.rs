//! The API's OpenAPI 3.1 document, generated from the routes' own types and annotations
//! (utoipa), served at `/openapi.json` and kept in `docs/openapi.json`, which a test holds
//! to what this builds.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::OpenApi as Document;
use utoipa::{Modify, OpenApi};

use crate::error::CODES;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Conveyor gateway API",
        description = "Submit tasks, follow them, and fix them. Every `/v1` route takes a \
            bearer token, which belongs to one or more namespaces (tenants): a client sees and \
            changes its own namespaces' tasks only, and another tenant's task answers 404 like \
            one that does not exist.",
    ),
    paths(
        crate::tasks::submit_one,
        crate::tasks::submit_batch,
        crate::find::list_tasks,
        crate::tasks::get_task,
        crate::tasks::get_events,
        crate::follow::stream_task,
        crate::remedy::cancel_task,
        crate::remedy::retry_task,
        crate::remedy::redrive,
        crate::overview::task_types,
    ),
    components(schemas(crate::error::ApiError)),
    modifiers(&Conventions),
    tags(
        (name = "tasks", description = "Submit, list and read tasks"),
        (name = "remedies", description = "Cancel, retry and redrive, audited with the client's name"),
    ),
    security(("bearer" = [])),
)]
struct ApiDoc;

/// The bearer scheme, the version, and the table of error codes (from [`CODES`]).
struct Conventions;

impl Modify for Conventions {
    fn modify(&self, doc: &mut Document) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
        let mut table = String::from(
            "\n\n## Errors\n\nEvery error answers `{\"error\": {\"code\", \"message\"}}`; \
             429 and 503 carry `Retry-After`.\n\n| code | status | when |\n|---|---|---|\n",
        );
        for (code, status, when) in CODES {
            table.push_str(&format!("| `{code}` | {status} | {when} |\n"));
        }
        let description = doc.info.description.get_or_insert_with(String::new);
        description.push_str(&table);
    }
}

/// The document as pretty JSON, with a final newline (as committed).
pub fn json() -> String {
    let mut text = ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    /// `docs/openapi.json` is what the code describes. `UPDATE_OPENAPI=1 cargo test -p
    /// conveyor-gateway openapi` rewrites it after a change to the API.
    #[test]
    fn the_committed_document_matches_the_code() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json");
        let built = super::json();
        if std::env::var_os("UPDATE_OPENAPI").is_some() {
            std::fs::write(&path, &built).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == built,
            "docs/openapi.json differs from the code: run UPDATE_OPENAPI=1 cargo test -p \
             conveyor-gateway openapi, and review the diff"
        );
    }

    #[test]
    fn every_route_and_error_code_is_described() {
        let doc: serde_json::Value = serde_json::from_str(&super::json()).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        for path in [
            "/v1/tasks",
            "/v1/tasks:batch",
            "/v1/tasks/{id}",
            "/v1/tasks/{id}/events",
            "/v1/tasks/{id}:cancel",
            "/v1/tasks/{id}:retry",
            "/v1/tasks:redrive",
            "/v1/task-types",
            "/v1/tasks/{id}/stream",
        ] {
            assert!(paths.contains_key(path), "{path} is not described");
        }
        let codes = &doc["components"]["schemas"]["ApiError"]["properties"]["code"]["enum"];
        assert_eq!(codes.as_array().unwrap().len(), super::CODES.len());
        let description = doc["info"]["description"].as_str().unwrap();
        for (code, _, _) in super::CODES {
            assert!(description.contains(&format!("`{code}`")));
        }
    }
}
