//! The report: one Markdown table (for people and for docs/) and one JSON line per scenario
//! (for comparing runs). Columns and field names are stable; add new ones at the end.

use std::fmt::Write as _;

use crate::scenarios::Row;

const COLUMNS: [&str; 15] = [
    "scenario",
    "accepted",
    "completed",
    "dead-lettered",
    "lost",
    "duplicate completions",
    "duplicate side effects",
    "re-runs",
    "invalid chains",
    "recovery (s)",
    "verdict",
    "buffered (max)",
    "replayed",
    "breaker opens",
    "worker RSS max (MiB)",
];

pub fn markdown(rows: &[Row], header: &str) -> String {
    let mut out = format!(
        "{header}\n\n| {} |\n|{}\n",
        COLUMNS.join(" | "),
        "---|".repeat(COLUMNS.len())
    );
    let mut totals = [0usize; 6];
    for row in rows {
        let v = &row.verdict;
        let verdict = if row.failures.is_empty() {
            "pass".to_owned()
        } else {
            format!("FAIL: {}", row.failures.join("; "))
        };
        // The columns that add up across scenarios, in table order.
        let counts = [
            v.accepted,
            v.completed,
            v.dead_lettered,
            v.lost,
            v.duplicate_completions,
            v.duplicate_side_effects,
        ];
        for (total, n) in totals.iter_mut().zip(counts) {
            *total += n;
        }
        let counts: Vec<String> = counts.iter().map(ToString::to_string).collect();
        let t = &row.telemetry;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {:.0} |",
            row.scenario,
            counts.join(" | "),
            v.reruns,
            v.invalid_chains,
            v.recovery_seconds,
            verdict,
            t.buffered_max,
            t.replayed,
            t.breaker_opens,
            t.worker_rss_max_mib,
        );
    }
    let _ = writeln!(
        out,
        "| **total** | {} | {} | {} | {} | {} | {} | | | | | | | | |",
        totals[0], totals[1], totals[2], totals[3], totals[4], totals[5]
    );
    out
}

pub fn json_lines(rows: &[Row]) -> String {
    rows.iter()
        .filter_map(|row| serde_json::to_string(row).ok())
        .map(|line| line + "\n")
        .collect()
}
