//! The report: one Markdown table (for people and for docs/) and one JSON line per scenario
//! (for comparing runs). Columns and field names are stable; add new ones at the end.

use std::fmt::Write as _;

use crate::scenarios::{Row, Scenario};

/// What each column measures, and from which source (client answers, side effects seen by
/// the sidecar, the database, the product's own audit log): decision 0009.
const COLUMNS: [&str; 20] = [
    "scenario",
    "accepted (client told 2xx)",
    "completed (db)",
    "dead-lettered (db)",
    "lost (accepted, not settled in db)",
    "stranded (any task not settled in db)",
    "completed without effect (db vs sidecar)",
    "effects of refused tasks (sidecar vs client)",
    "same attempt twice (sidecar)",
    "COMPLETED twice (audit log)",
    "re-runs (sidecar)",
    "re-run bound",
    "invalid chains (audit log)",
    "recovery (s)",
    "verdict",
    "buffered (max)",
    "replayed",
    "breaker opens",
    "worker RSS max (MiB)",
    "notes",
];

pub fn markdown(rows: &[Row], header: &str) -> String {
    let mut out = format!(
        "{header}\n\n| {} |\n|{}\n",
        COLUMNS.join(" | "),
        "---|".repeat(COLUMNS.len())
    );
    let mut totals = [0usize; 9];
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
            v.stranded,
            v.completed_without_effect,
            v.effects_of_refused,
            v.duplicate_side_effects,
            v.duplicate_completions,
        ];
        for (total, n) in totals.iter_mut().zip(counts) {
            *total += n;
        }
        let counts: Vec<String> = counts.iter().map(ToString::to_string).collect();
        let t = &row.telemetry;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {:.0} | {} |",
            row.scenario,
            counts.join(" | "),
            v.reruns,
            v.rerun_bound.map_or("—".to_owned(), |b| b.to_string()),
            v.invalid_chains,
            v.recovery_seconds,
            verdict,
            t.buffered_max,
            t.replayed,
            t.breaker_opens,
            t.worker_rss_max_mib,
            row.notes.join("; "),
        );
    }
    let reruns: usize = rows.iter().map(|r| r.verdict.reruns).sum();
    let totals: Vec<String> = totals.iter().map(ToString::to_string).collect();
    let _ = writeln!(
        out,
        "| **total** | {} | {reruns} | | | | | | | | | |",
        totals.join(" | ")
    );
    out
}

pub fn json_lines(rows: &[Row]) -> String {
    rows.iter()
        .filter_map(|row| serde_json::to_string(row).ok())
        .map(|line| line + "\n")
        .collect()
}

/// The heading of the report's cluster-scale part (`--replicated`). One file holds both
/// parts: a run rewrites its own and keeps the other's last run.
pub const REPLICATED_HEADING: &str = "## Cluster scale";

/// `existing` (the report file, maybe empty) with one part replaced by `part`: the
/// cluster-scale part when `replicated` (`part` starts with [`REPLICATED_HEADING`]), else
/// the single-services part before it.
pub fn merged(existing: &str, part: &str, replicated: bool) -> String {
    let (single, cluster) = existing
        .find(REPLICATED_HEADING)
        .map_or((existing, ""), |at| existing.split_at(at));
    match (replicated, single.trim().is_empty(), cluster.is_empty()) {
        (true, true, _) => part.to_owned(),
        (true, false, _) => format!("{}\n\n{part}", single.trim_end()),
        (false, _, true) => part.to_owned(),
        (false, _, false) => format!("{}\n\n{cluster}", part.trim_end()),
    }
}

/// The JSON lines of `existing` from the other kind of run (as [`merged`] keeps its part),
/// then this run's.
pub fn merged_lines(existing: &str, rows: &[Row], replicated: bool) -> String {
    let kept = existing.lines().filter(|line| {
        serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| Scenario::parse(v["scenario"].as_str()?))
            .is_some_and(|scenario| scenario.replicated() != replicated)
    });
    kept.map(|line| format!("{line}\n"))
        .chain(std::iter::once(json_lines(rows)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_run_replaces_its_own_part_and_keeps_the_other() {
        let single = "# Chaos report\n\n| a |\n";
        let cluster = format!("{REPLICATED_HEADING}\n\n| b |\n");
        let both = merged(single, &cluster, true);
        assert_eq!(both, format!("# Chaos report\n\n| a |\n\n{cluster}"));
        let again = merged(&both, "# Chaos report\n\n| c |\n", false);
        assert_eq!(again, format!("# Chaos report\n\n| c |\n\n{cluster}"));
        let newer = format!("{REPLICATED_HEADING}\n\n| d |\n");
        assert_eq!(
            merged(&again, &newer, true),
            format!("# Chaos report\n\n| c |\n\n{newer}")
        );
        assert_eq!(merged("", &newer, true), newer);
    }
}
