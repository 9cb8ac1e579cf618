//! The shipped example task types parse and validate.

#[test]
fn example_task_types_load() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/task-types.yaml");
    let types = conveyor_core::task_type::load_task_types(&path).expect("examples are valid");
    let names: Vec<&str> = types.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        ["metadata", "quality-analysis", "thumbnail", "transcode"]
    );
}
