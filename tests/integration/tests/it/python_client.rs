//! The Python client's own tests (`clients/python/tests`, stdlib unittest), run against a
//! real gateway, RabbitMQ and PostgreSQL with real workers: this test starts them and
//! hands the Python side their addresses through the environment.

use std::process::Command;

use conveyor_worker::handler::Handler;

use crate::support::{test_type, Harness, TOKEN};

const OTHER_TOKEN: &str = "another-tenants-token-1";

#[tokio::test]
async fn the_python_clients_tests_pass_against_the_real_gateway() {
    let ok = test_type("py-ok");
    let mut failing = test_type("py-failing");
    failing.max_retries = 0;
    let mut full = test_type("py-full");
    full.max_queue_depth = 1;
    let mut strict = test_type("py-strict");
    strict.schema = Some(serde_json::json!({
        "type": "object",
        "required": ["video"],
        "properties": {"video": {"type": "string"}},
    }));
    let names = [&ok, &failing, &full, &strict].map(|t| t.name.clone());
    // A second client, of namespace `elsewhere`, with a type of the same name as `ok` (no
    // worker: its tasks wait): the suite checks each client sees only its own.
    let theirs = conveyor_core::task_type::NamedTaskType::in_namespace(
        "elsewhere",
        &names[0],
        conveyor_core::task_type::TaskTypeSpec::default(),
    );
    let mut harness = Harness::start_with(vec![ok, failing, full, strict, theirs], |config| {
        config.tokens = conveyor_gateway::auth::Tokens::parse_pairs(&format!(
            "tests={TOKEN},other@elsewhere={OTHER_TOKEN}"
        ))
        .unwrap();
    })
    .await;
    harness.start_worker(&[&names[0], &names[3]], Handler::Noop, 8);
    harness.start_worker(&[&names[1]], Handler::Fail, 4);
    // `full` has no worker: its queue stays over its depth once it holds a task.

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../clients/python");
    let url = harness.gateway_url.clone();
    let (ok, failing, full, strict) = (
        names[0].clone(),
        names[1].clone(),
        names[2].clone(),
        names[3].clone(),
    );
    // The Python process blocks: run it off the runtime that serves the gateway.
    let output = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args(["-m", "unittest", "discover", "-v", "-s", "tests", "-t", "."])
            .current_dir(&root)
            .env("PYTHONPATH", root.join("src"))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("CONVEYOR_URL", url)
            .env("CONVEYOR_TOKEN", TOKEN)
            .env("CONVEYOR_OTHER_TOKEN", OTHER_TOKEN)
            .env("CONVEYOR_TYPE_OK", ok)
            .env("CONVEYOR_TYPE_FAILING", failing)
            .env("CONVEYOR_TYPE_FULL", full)
            .env("CONVEYOR_TYPE_STRICT", strict)
            .output()
            .expect("python3 runs")
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stderr}");
    assert!(
        output.status.success(),
        "the Python client's tests failed:\n{stderr}"
    );
    // A run that found no tests would pass too: make sure the suite ran.
    assert!(stderr.contains("Ran "), "{stderr}");
    assert!(!stderr.contains("Ran 0 tests"), "{stderr}");
    assert!(
        !stderr.contains("skipped="),
        "no test may skip here: {stderr}"
    );
    harness.shutdown().await;
}
