//! What the chart's tests share: the repository, a command run in it, a scratch folder, and
//! the smallest TaskType and WorkerPool manifests a story applies.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs a command in the repository; Err holds its output when it fails.
pub fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("{program} runs (make test puts helm on PATH): {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{program} {}: {text}", args.join(" ")))
    }
}

/// Runs a script of the repository that prints a folder as its last line of standard output
/// (and says what it does on standard error); that folder. Panics with what it said when it
/// fails.
pub fn script_folder(script: &str) -> PathBuf {
    let out = Command::new(repo().join(script))
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("{script} runs: {e}"));
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .last()
        .unwrap_or_else(|| panic!("{script} printed no folder"));
    PathBuf::from(last.trim())
}

/// A new, empty folder under the system's temporary one.
pub fn tempdir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("conveyor-{what}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    dir
}

/// A TaskType `name` retried twice, with `extra` lines of its spec.
pub fn task_type_yaml(name: &str, extra: &str) -> String {
    format!("apiVersion: conveyor.dev/v1alpha1\nkind: TaskType\nmetadata: {{name: {name}}}\nspec:\n  maxRetries: 2\n{extra}")
}

/// A pool running the built-in sleep handler (it sleeps `sleepMs` of the payload).
pub fn pool_yaml(name: &str, task_type: &str, extra: &str) -> String {
    format!(
        "apiVersion: conveyor.dev/v1alpha1\nkind: WorkerPool\nmetadata: {{name: {name}}}\nspec:\n  \
         taskTypes: [{task_type}]\n  image: conveyor:dev\n  handler: {{type: sleep}}\n{extra}"
    )
}
