//! `crds/` and the chart's `charts/conveyor/files/crds/` are generated from the Rust types
//! (`conveyor-operator crdgen --out <dir>`); this fails when either drifts from them.

use conveyor_core::crd::crd_documents;

#[test]
fn crds_folders_match_the_types() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for folder in ["crds", "charts/conveyor/files/crds"] {
        for (file, generated) in crd_documents() {
            let committed =
                std::fs::read_to_string(root.join(folder).join(file)).unwrap_or_default();
            assert!(
                committed == generated,
                "{folder}/{file} is out of date: run `cargo run -p conveyor-operator -- crdgen --out {folder}`"
            );
        }
    }
}

#[test]
fn worker_pool_crd_has_short_names_scale_and_columns() {
    let docs = crd_documents();
    let crd: serde_json::Value = serde_yaml::from_str(&docs[1].1).unwrap();
    assert_eq!(crd["metadata"]["name"], "workerpools.conveyor.dev");
    assert_eq!(
        crd["spec"]["names"]["shortNames"],
        serde_json::json!(["wp", "taskpool", "taskpools"])
    );
    let version = &crd["spec"]["versions"][0];
    assert_eq!(version["name"], "v1alpha1");
    assert_eq!(
        version["subresources"]["scale"]["specReplicasPath"],
        ".spec.replicas"
    );
    assert_eq!(
        version["subresources"]["scale"]["labelSelectorPath"],
        ".status.selector"
    );
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        columns,
        [
            "Task-Types",
            "Ready",
            "Desired",
            "Queued",
            "In-Flight",
            "Dead-Lettered",
            "Status",
            "Age"
        ]
    );
    let spec = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert!(spec["properties"]["concurrency"]["description"]
        .as_str()
        .unwrap()
        .contains("prefetch"));
    let autoscaling = &spec["properties"]["autoscaling"];
    assert_eq!(
        autoscaling["x-kubernetes-validations"][0]["rule"],
        "self.minReplicas <= self.maxReplicas"
    );
}

#[test]
fn task_type_crd_keeps_payload_schemas_and_has_a_short_name() {
    let docs = crd_documents();
    let crd: serde_json::Value = serde_yaml::from_str(&docs[0].1).unwrap();
    assert_eq!(
        crd["spec"]["names"]["shortNames"],
        serde_json::json!(["tt"])
    );
    let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(
        spec["properties"]["schema"]["x-kubernetes-preserve-unknown-fields"],
        true
    );
    assert_eq!(spec["properties"]["maxRetries"]["maximum"], 100.0);
}

#[test]
fn every_crd_explains_itself_at_the_root() {
    // `kubectl explain <kind>` shows the root description: kube-derive's placeholder
    // ("Auto-generated derived type for ...") tells a user nothing.
    for (file, document) in crd_documents() {
        let crd: serde_json::Value = serde_yaml::from_str(&document).unwrap();
        let root = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"];
        let text = root.as_str().unwrap_or_default();
        assert!(
            text.len() > 40 && !text.contains("Auto-generated"),
            "{file}: root description {root}"
        );
    }
}

#[test]
fn task_type_ready_column_is_its_ready_condition() {
    // A column named "Ready" must say whether the type is ready, not count messages.
    let docs = crd_documents();
    let crd: serde_json::Value = serde_yaml::from_str(&docs[0].1).unwrap();
    assert_eq!(crd["metadata"]["name"], "tasktypes.conveyor.dev");
    let columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
        .as_array()
        .unwrap();
    let ready = columns.iter().find(|c| c["name"] == "Ready").unwrap();
    assert_eq!(ready["type"], "string");
    assert_eq!(
        ready["jsonPath"],
        ".status.conditions[?(@.type==\"Ready\")].status"
    );
    assert_eq!(columns[0]["name"], "Ready", "first, as for Deployments");
}

#[test]
fn pod_template_rules_name_every_reserved_value_and_bound_their_lists() {
    use conveyor_core::crd::worker_pool::{RESERVED_ENV, RESERVED_MOUNT_PATHS, RESERVED_VOLUMES};
    let docs = crd_documents();
    let crd: serde_json::Value = serde_yaml::from_str(&docs[1].1).unwrap();
    let pod = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]["pod"];
    let rules: Vec<(&str, &str)> = pod["x-kubernetes-validations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["rule"].as_str().unwrap(), r["message"].as_str().unwrap()))
        .collect();
    let named = |value: &str| {
        rules
            .iter()
            .any(|(rule, message)| rule.contains(&format!("'{value}'")) && message.contains(value))
    };
    for value in RESERVED_ENV
        .iter()
        .chain(&RESERVED_VOLUMES)
        .chain(&RESERVED_MOUNT_PATHS)
    {
        assert!(
            named(value),
            "no rule refuses {value} with a message naming it"
        );
    }
    // CEL's cost estimate needs bounded lists and names.
    for list in [
        "env",
        "envFrom",
        "volumes",
        "volumeMounts",
        "initContainers",
        "sidecars",
        "imagePullSecrets",
        "topologySpreadConstraints",
    ] {
        assert!(pod["properties"][list]["maxItems"].is_u64(), "{list}");
    }
    for list in ["volumes", "initContainers", "sidecars"] {
        let name = &pod["properties"][list]["items"]["properties"]["name"];
        assert_eq!(name["maxLength"], 63, "{list}");
    }
    let sidecar = &pod["properties"]["sidecars"]["items"];
    assert!(sidecar["required"]
        .as_array()
        .unwrap()
        .contains(&"image".into()));
}

#[test]
fn every_crd_fits_a_client_side_apply() {
    // `kubectl apply` without --server-side keeps the whole object in an annotation of at
    // most 256 KiB (262,144 bytes): a larger CRD cannot be applied that way, and README's
    // `kubectl apply -k manifests/base` would fail. Half of it leaves room to grow.
    for (file, document) in crd_documents() {
        let crd: serde_json::Value = serde_yaml::from_str(&document).unwrap();
        let size = serde_json::to_string(&crd).unwrap().len();
        assert!(size < 131_072, "{file}: {size} bytes of JSON");
    }
}
