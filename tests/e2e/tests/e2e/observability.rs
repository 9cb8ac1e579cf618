//! The alerting rules and the dashboards, proven against the real Prometheus that
//! `scripts/prometheus.sh` runs beside the stack: promtool checks and unit-tests every alert,
//! Prometheus loads the rules, and every dashboard panel's query returns data while a pool
//! works, so no dashboard ships with a typo or a metric that does not exist.

use std::path::{Path, PathBuf};
use std::time::Duration;

use conveyor_core::TaskState;
use serde_json::{json, Value};

use crate::{pool_stack, MINUTE};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn prometheus() -> String {
    std::env::var("CONVEYOR_PROMETHEUS_URL").unwrap_or_else(|_| "http://127.0.0.1:9099".into())
}

const RULES: &str = "charts/conveyor/files/prometheus/rules.yaml";
const RULE_TESTS: &str = "tests/observability/rules.test.yaml";
const DASHBOARDS: &str = "charts/conveyor/files/dashboards";

fn promtool(args: &[&str]) -> String {
    let out = std::process::Command::new("promtool")
        .args(args)
        .current_dir(repo())
        .output()
        .expect("promtool on PATH (scripts/prometheus.sh installs Debian's prometheus)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {}: {text}", args.join(" "));
    text
}

fn alert_names() -> Vec<String> {
    let rules: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(repo().join(RULES)).unwrap()).unwrap();
    rules["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap().iter())
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn every_alert_is_unit_tested_and_has_a_runbook() {
    promtool(&["check", "rules", RULES]);
    let tested = promtool(&["test", "rules", RULE_TESTS]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    let tests = std::fs::read_to_string(repo().join(RULE_TESTS)).unwrap();
    let rules = std::fs::read_to_string(repo().join(RULES)).unwrap();
    for alert in alert_names() {
        assert!(
            tests.contains(&format!("alertname: {alert}\n")),
            "{alert} has no promtool test in {RULE_TESTS}"
        );
        // Every alert's runbook_url names a runbook that exists.
        let section = &rules[rules.find(&format!("alert: {alert}\n")).unwrap()..];
        let url = section
            .lines()
            .find_map(|l| l.trim().strip_prefix("runbook_url: "))
            .unwrap_or_else(|| panic!("{alert} has no runbook_url"));
        assert!(
            repo().join(url).is_file(),
            "{alert}'s runbook {url} does not exist"
        );
    }
}

async fn query(http: &reqwest::Client, promql: &str) -> Result<Vec<Value>, String> {
    let answer: Value = http
        .get(format!("{}/api/v1/query", prometheus()))
        .query(&[("query", promql)])
        .send()
        .await
        .map_err(|e| format!("Prometheus unreachable: {e}"))?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    if answer["status"] != "success" {
        return Err(format!("refused: {}", answer["error"]));
    }
    Ok(answer["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// Every (dashboard, panel title, query) of the chart's dashboards, rows' panels included.
fn panel_queries() -> Vec<(String, String, String)> {
    let mut found = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(repo().join(DASHBOARDS))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for file in files {
        let dashboard: Value =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let mut panels: Vec<Value> = dashboard["panels"].as_array().cloned().unwrap_or_default();
        while let Some(panel) = panels.pop() {
            panels.extend(panel["panels"].as_array().cloned().unwrap_or_default());
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    found.push((
                        name.clone(),
                        panel["title"].as_str().unwrap_or_default().to_owned(),
                        expr.to_owned(),
                    ));
                }
            }
        }
    }
    found
}

/// A dashboard query with Grafana's variables set to this test's namespace, type and pool.
fn resolve(expr: &str, namespace: &str, task_type: &str, pool: &str) -> String {
    [
        ("$__rate_interval", "1m"),
        ("$__interval", "15s"),
        ("$__range", "1h"),
        ("${namespace}", namespace),
        ("$namespace", namespace),
        ("${task_type}", task_type),
        ("$task_type", task_type),
        ("${pool}", pool),
        ("$pool", pool),
    ]
    .iter()
    .fold(expr.to_owned(), |e, (var, value)| e.replace(var, value))
}

#[tokio::test]
async fn every_dashboard_panel_returns_data_from_the_running_stack() {
    let http = reqwest::Client::new();
    // Prometheus has the chart's rules loaded and healthy.
    let rules: Value = http
        .get(format!("{}/api/v1/rules", prometheus()))
        .send()
        .await
        .expect("Prometheus runs beside the stack (scripts/prometheus.sh up)")
        .json()
        .await
        .unwrap();
    let loaded: Vec<&str> = rules["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .filter(|r| r["health"] == "ok" || r["health"] == "unknown")
        .filter_map(|r| r["name"].as_str())
        .collect();
    for alert in alert_names() {
        assert!(
            loaded.contains(&alert.as_str()),
            "{alert} not loaded: {rules}"
        );
    }

    let (stack, task_type) = pool_stack("observe", "watched", "  concurrency: 4\n", 1).await;
    let key = stack.key(&task_type);
    let queries = panel_queries();
    assert!(
        queries.len() >= 15,
        "the dashboards have {} queries",
        queries.len()
    );
    // A steady trickle of work, so that rates and latency quantiles have samples.
    let deadline = tokio::time::Instant::now() + 4 * MINUTE;
    let mut submitted = 0;
    let mut missing: Vec<String> = Vec::new();
    while tokio::time::Instant::now() < deadline {
        stack
            .submit_all(&task_type, vec![json!({"sleepMs": 50}); 20])
            .await;
        submitted += 20;
        missing.clear();
        for (dashboard, title, expr) in &queries {
            let promql = resolve(expr, &stack.namespace, &key, "watched");
            match query(&http, &promql).await {
                Ok(result) if !result.is_empty() => {}
                Ok(_) => missing.push(format!("{dashboard} / {title}: no data for {promql}")),
                Err(err) => missing.push(format!("{dashboard} / {title}: {err} for {promql}")),
            }
        }
        if missing.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    assert!(
        missing.is_empty(),
        "panels without data after 4 minutes of work:\n{}",
        missing.join("\n")
    );
    stack
        .wait_for_state(&task_type, TaskState::Completed, submitted, 2 * MINUTE)
        .await;
    stack.finish().await;
}
