//! How read commands print: `-o table` (the default, for people), `wide` (every column,
//! nothing shortened), `json` and `yaml` (the API's own objects, for scripts).

use chrono::{DateTime, Utc};
use clap::ValueEnum;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Table,
    Wide,
    Json,
    Yaml,
}

impl Format {
    pub fn is_table(self) -> bool {
        matches!(self, Format::Table | Format::Wide)
    }
}

/// Prints `value` as JSON or YAML; tables are the caller's (`Table`).
pub fn print_data(format: Format, value: &Value) -> anyhow::Result<()> {
    match format {
        Format::Yaml => print!("{}", serde_yaml::to_string(value)?),
        _ => println!("{}", serde_json::to_string_pretty(value)?),
    }
    Ok(())
}

/// Columns padded to their widest cell, two spaces apart; the last column is not padded.
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Table {
        Table {
            rows: vec![headers.iter().map(|h| (*h).to_owned()).collect()],
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|cell| cell.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c + 1 == row.len() {
                    line.push_str(cell);
                } else {
                    let pad = widths[c] - cell.chars().count();
                    line.push_str(cell);
                    line.push_str(&" ".repeat(pad + 2));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// At most `max` characters, the middle replaced by `…`: worker ids keep both their pod
/// name's start and its unique end.
pub fn shorten(text: &str, max: usize) -> String {
    let count = text.chars().count();
    if count <= max || max < 5 {
        return text.to_owned();
    }
    let head = (max - 1) / 2;
    let tail = max - 1 - head;
    let start: String = text.chars().take(head).collect();
    let end: String = text.chars().skip(count - tail).collect();
    format!("{start}…{end}")
}

/// `3s`, `5m`, `2h`, `4d`: how long ago, as kubectl prints ages.
pub fn age(at: &str, now: DateTime<Utc>) -> String {
    let Ok(at) = DateTime::parse_from_rfc3339(at) else {
        return "?".into();
    };
    let secs = (now - at.with_timezone(&Utc)).num_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 2 * 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

/// A JSON string field, or `-`.
pub fn text(value: &Value, field: &str) -> String {
    match &value[field] {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// Labels as `k=v,k=v`.
pub fn labels(value: &Value) -> String {
    match value["labels"].as_object() {
        Some(map) if !map.is_empty() => map
            .iter()
            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
            .collect::<Vec<_>>()
            .join(","),
        _ => "-".into(),
    }
}

/// A progress line on stderr, only when stderr is a terminal (scripts and CI see nothing).
pub struct Progress {
    on: bool,
}

impl Progress {
    pub fn new() -> Progress {
        use std::io::IsTerminal;
        Progress {
            on: std::io::stderr().is_terminal(),
        }
    }

    /// Replaces the line with `done` of `total` and a bar, and `what`.
    pub fn show(&self, done: usize, total: Option<usize>, what: &str) {
        if !self.on {
            return;
        }
        let bar = match total {
            Some(total) if total > 0 => {
                let filled = (done * 24 / total).min(24);
                format!(
                    "[{}{}] {done}/{total}",
                    "#".repeat(filled),
                    "-".repeat(24 - filled)
                )
            }
            _ => format!("{done}"),
        };
        eprint!("\r\x1b[2K{bar} {what}");
    }

    pub fn finish(&self) {
        if self.on {
            eprint!("\r\x1b[2K");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_worker_ids_keep_their_ends_and_tables_line_up() {
        let id = "transcode-pool-7f9c6d5b8-x2k4q-0123456789abcdef";
        let short = shorten(id, 24);
        assert_eq!(short.chars().count(), 24);
        assert!(
            short.starts_with("transcode-") && short.ends_with("89abcdef"),
            "{short}"
        );
        assert_eq!(shorten("short", 24), "short");
        let mut table = Table::new(&["ID", "STATE", "OWNER"]);
        table.row(vec!["a".into(), "COMPLETED".into(), short.clone()]);
        table.row(vec!["bbbb".into(), "QUEUED".into(), "-".into()]);
        let text = table.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "ID    STATE      OWNER");
        assert_eq!(lines[1], format!("a     COMPLETED  {short}"));
        assert_eq!(lines[2], "bbbb  QUEUED     -");
    }

    #[test]
    fn ages_read_like_kubectls() {
        let now = Utc::now();
        let ago = |secs: i64| (now - chrono::Duration::seconds(secs)).to_rfc3339();
        assert_eq!(age(&ago(5), now), "5s");
        assert_eq!(age(&ago(600), now), "10m");
        assert_eq!(age(&ago(3 * 3600), now), "3h");
        assert_eq!(age(&ago(5 * 86400), now), "5d");
        assert_eq!(age("nonsense", now), "?");
    }
}
