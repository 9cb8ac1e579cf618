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

/// Every (dashboard, what, query) of the chart's dashboards: each panel's targets (rows'
/// panels included), each template variable's `label_values` (as the series it lists), and
/// each annotation's query.
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
        for variable in dashboard["templating"]["list"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let query = variable["query"]["query"]
                .as_str()
                .or_else(|| variable["query"].as_str());
            if let Some(listed) = query.and_then(label_values_as_series) {
                let what = format!("variable {}", variable["name"].as_str().unwrap_or_default());
                found.push((name.clone(), what, listed));
            }
        }
        for annotation in dashboard["annotations"]["list"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(expr) = annotation["expr"].as_str() {
                // An annotation marks changes, which need not have happened: its series must
                // exist, not the change.
                let series = expr.split(" > ").next().unwrap_or(expr);
                let what = format!(
                    "annotation {}",
                    annotation["name"].as_str().unwrap_or_default()
                );
                found.push((name.clone(), what, series.to_owned()));
            }
        }
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

/// `label_values(<selector>, <label>)` as a query of the series it lists values from.
fn label_values_as_series(query: &str) -> Option<String> {
    let inner = query
        .trim()
        .strip_prefix("label_values(")?
        .strip_suffix(')')?;
    let (selector, label) = inner.rsplit_once(',')?;
    Some(format!("count by ({}) ({})", label.trim(), selector.trim()))
}

/// The metric names a query reads (identifiers starting `conveyor_` or `process_`).
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_') {
        rest = &rest[at..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let word = &rest[..end];
        if word.starts_with("conveyor_") || word.starts_with("process_") {
            names.push(word.to_owned());
        }
        rest = &rest[end..];
    }
    names
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
    // The operator's series vanish while a test swaps or restarts it: not during this one.
    let _operators = conveyor_e2e_tests::operators_to_myself().await;
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

    let (mut stack, task_type) = pool_stack("observe", "watched", "  concurrency: 4\n", 1).await;
    let key = stack.key(&task_type);
    // A type whose every attempt fails, so that retries and dead letters have series too.
    let failing = stack.task_type("e2e-observe-failing");
    stack.apply(&crate::task_type_yaml(
        &failing,
        "  backoff: {initialSeconds: 0.1, maxSeconds: 0.2, multiplier: 2}\n",
    ));
    stack.apply(
        &crate::pool_yaml("failing", &failing, "")
            .replace("handler: {type: sleep}", "handler: {type: fail}"),
    );
    stack.wait_for_workers(&failing, 1).await;
    stack.submit_all(&failing, vec![json!({}); 3]).await;
    // Grafana's multi-value variable: both types.
    let types = format!("{key}|{}", stack.key(&failing));
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
            let promql = resolve(expr, &stack.namespace, &types, "watched|failing");
            match query(&http, &promql).await {
                Ok(result) if !result.is_empty() => {}
                Ok(_) => missing.push(format!("{dashboard} / {title}: no data for {promql}")),
                Err(err) => missing.push(format!("{dashboard} / {title}: {err} for {promql}")),
            }
        }
        // Every metric a query names exists, also behind an `or on() vector(0)`.
        for (dashboard, title, expr) in &queries {
            for metric in metric_names(expr) {
                match query(&http, &format!("count({metric})")).await {
                    Ok(result) if !result.is_empty() => {}
                    _ => missing.push(format!("{dashboard} / {title}: no series of {metric}")),
                }
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
