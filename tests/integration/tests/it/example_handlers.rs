//! The example handlers (`examples/video-pipeline/handlers/`) accept only files under their
//! media root: a payload cannot make ffmpeg read a URL, an absolute path or a path out of
//! the root, nor pass it an option (issue 11). Refusals exit 2 before ffmpeg runs, so this
//! needs only `sh`, `jq` and `realpath`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn handlers() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/video-pipeline/handlers")
}

/// Runs `script` with media root `root` on `payload` as task type `task_type`.
fn run(script: &str, root: &Path, task_type: &str, payload: &str) -> (i32, String) {
    let out = Command::new(handlers().join(script))
        .arg(root)
        .env("CONVEYOR_PAYLOAD", payload)
        .env("CONVEYOR_TASK_TYPE", task_type)
        .env("CONVEYOR_NAMESPACE", "video")
        .env(
            "CONVEYOR_IDEMPOTENCY_KEY",
            "5f0c2a4e-0000-4000-8000-000000000001",
        )
        .output()
        .expect("run the handler");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn payloads_cannot_point_the_example_handlers_outside_their_media_root() {
    let base = std::env::temp_dir().join(format!("conveyor-media-{}", uuid::Uuid::new_v4()));
    let root = base.join("media");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(base.join("secret.mp4"), b"not yours").unwrap();
    std::os::unix::fs::symlink(base.join("secret.mp4"), root.join("link.mp4")).unwrap();
    // Another namespace's output (the handlers run in namespace video).
    let theirs = root.join("out/audio/key");
    std::fs::create_dir_all(&theirs).unwrap();
    std::fs::write(theirs.join("a.mp4"), b"audio's").unwrap();
    let refused = [
        (
            "transcode.sh",
            "transcode",
            r#"{"source": "http://example.com/a.mp4", "renditions": [240]}"#,
        ),
        (
            "transcode.sh",
            "transcode",
            r#"{"source": "/etc/passwd", "renditions": [240]}"#,
        ),
        (
            "transcode.sh",
            "transcode",
            r#"{"source": "../secret.mp4", "renditions": [240]}"#,
        ),
        (
            "transcode.sh",
            "transcode",
            r#"{"source": "link.mp4", "renditions": [240]}"#,
        ),
        ("light.sh", "thumbnail", r#"{"source": "-i"}"#),
        (
            "light.sh",
            "metadata",
            r#"{"source": "concat:a.mp4|b.mp4"}"#,
        ),
        ("light.sh", "metadata", r#"{"source": "missing.mp4"}"#),
        ("light.sh", "thumbnail", r#"{"source": ["a.mp4"]}"#),
        (
            "light.sh",
            "metadata",
            r#"{"source": "out/audio/key/a.mp4"}"#,
        ),
        (
            "quality.sh",
            "quality-analysis",
            r#"{"source": "a.mp4", "reference": "/etc/shadow"}"#,
        ),
    ];
    std::fs::write(root.join("a.mp4"), b"a clip").unwrap();
    for (script, task_type, payload) in refused {
        let (code, stderr) = run(script, &root, task_type, payload);
        assert_eq!(code, 2, "{script} {payload}: exit {code}, {stderr}");
        assert!(!stderr.is_empty(), "{script} {payload} says why");
    }
    // Nothing was written anywhere, least of all beside the secret.
    let outputs: Vec<_> = std::fs::read_dir(root.join("out")).unwrap().collect();
    assert_eq!(outputs.len(), 1, "only audio's output is there");
    assert_eq!(std::fs::read_dir(&base).unwrap().count(), 2);
    std::fs::remove_dir_all(&base).unwrap();
}
