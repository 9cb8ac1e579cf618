//! The Helm chart (charts/conveyor): it lints, its values schema refuses what it does not
//! know, it renders what the apiserver accepts (the Prometheus operator's CRDs applied, so
//! the monitors are checked against their schemas), and the kustomize manifests rendered
//! from it have not drifted. Installed and upgraded: `tests/chart_upgrade.rs`.

use conveyor_e2e_tests::helm::{repo, run, script_folder, tempdir};
use conveyor_e2e_tests::{kubectl, kubectl_with};

/// Values that satisfy every required setting (connections, tokens, the test's token).
const REQUIRED: &[&str] = &[
    "--set=operator.connections.existingSecret=ops",
    "--set=gateway.connections.existingSecret=gw",
    "--set=gateway.tokens.existingSecret=tokens",
    "--set=test.tokenSecret=token",
];

#[test]
fn the_chart_lints_and_renders_what_the_apiserver_accepts_and_the_manifests_do_not_drift() {
    let mut lint = vec!["lint", "--strict", "charts/conveyor"];
    lint.extend(REQUIRED);
    run("helm", &lint).unwrap();
    // Missing settings are refused with the value to set, not rendered half-way.
    let err = run("helm", &["template", "x", "charts/conveyor"]).unwrap_err();
    assert!(
        err.contains("operator.connections: set existingSecret"),
        "{err}"
    );
    // values.schema.json: a mistyped name or a wrong type fails with its path.
    for (setting, said) in [
        (
            "--set=gatway.replicas=3",
            "additional properties 'gatway' not allowed",
        ),
        ("--set=gateway.replicas=two", "/gateway/replicas"),
        ("--set=watchNamespaces={Video}", "/watchNamespaces/0"),
    ] {
        let mut args = vec!["template", "x", "charts/conveyor", setting];
        args.extend(REQUIRED);
        let err = run("helm", &args).unwrap_err();
        assert!(err.contains(said), "{setting}: {err}");
    }

    // The directory is the script's standard output; a cold cache also says on standard
    // error what Go downloads while it generates them (seen on a fresh machine).
    let crds = script_folder("cluster/monitoring-crds.sh");
    for kind in ["servicemonitors", "podmonitors", "prometheusrules"] {
        let file = crds.join(format!("monitoring.coreos.com_{kind}.yaml"));
        kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            file.to_str().unwrap(),
        ]);
    }
    // A namespace of its own: on kind, conveyor-system holds a live install, and a dry run
    // there merges the render with it (another manager's `valueFrom` beside a `value`).
    let _ = kubectl_with(&["create", "namespace", "e2e-chart-render"], None);
    let mut template = vec![
        "template",
        "conveyor",
        "charts/conveyor",
        "--namespace=e2e-chart-render",
        "--set=monitoring.serviceMonitors=true",
        "--set=monitoring.podMonitor=true",
        "--set=monitoring.prometheusRule=true",
        "--set=monitoring.dashboards=true",
        "--set=tenants[0].namespace=e2e-chart-render",
        "--set=tenants[0].databaseUrl=postgres://x",
        "--set=tenants[0].amqpUrl=amqps://x",
        r#"--set-json=networkPolicies.workerMetricsFrom=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]"#,
    ];
    template.extend(REQUIRED);
    let rendered = run("helm", &template).unwrap();
    // The other ways in: a RabbitmqCluster's default-user Secret, a private CA from a Secret,
    // HTTPS at the gateway, a tenant with its CA, no NetworkPolicies, scoped to a namespace.
    let other = vec![
        "template",
        "conveyor",
        "charts/conveyor",
        "--namespace=e2e-chart-render",
        "--set=operator.connections.rabbitmqDefaultUserSecret=rabbitmq-default-user",
        "--set=operator.connections.amqpHost=rabbitmq.e2e-chart-render.svc",
        "--set=operator.connections.managementUrl=https://rabbitmq.e2e-chart-render.svc:15671",
        "--set=ca.secretName=conveyor-ca",
        "--set=gateway.tlsSecretName=conveyor-gateway-tls",
        "--set=gateway.connections.databaseUrl=postgres://x",
        "--set=gateway.connections.amqpUrl=amqps://x",
        "--set=gateway.tokens.list[0]=ci@video=sha256:00",
        "--set=test.tokenSecret=token",
        "--set=tenants[0].namespace=e2e-chart-render",
        "--set=tenants[0].databaseUrl=postgres://x",
        "--set=tenants[0].amqpUrl=amqps://x",
        "--set=tenants[0].caCrt=PEM",
        "--set=networkPolicies.enabled=false",
        "--set=gateway.retention.archiveClaimName=conveyor-archive",
        "--set=gateway.retention.taskDays=7",
        "--set=watchNamespaces={e2e-chart-render}",
    ];
    let other_rendered = run("helm", &other).unwrap();
    for line in [
        "--task-retention-days=7",
        "--task-archive-dir=/var/lib/conveyor/archive",
        "persistentVolumeClaim: {claimName: \"conveyor-archive\"}",
    ] {
        assert!(
            other_rendered.contains(line),
            "the gateway's task archive goes to the claim named: no {line:?} in\n{other_rendered}"
        );
    }
    // Scoped: both components are told their namespaces (the Roles are rendered for them).
    assert_eq!(
        other_rendered
            .matches("- name: CONVEYOR_WATCH_NAMESPACES\n              value: \"e2e-chart-render\"")
            .count(),
        2,
        "the scoped render tells the operator and the gateway their scope:\n{other_rendered}"
    );
    assert!(
        other_rendered.contains("https://conveyor-gateway.e2e-chart-render.svc:80"),
        "helm test must speak HTTPS to a gateway that serves it:\n{other_rendered}"
    );
    for (what, manifests) in [
        ("chart", &rendered),
        ("chart's other settings", &other_rendered),
    ] {
        kubectl_with(
            &[
                "apply",
                "--dry-run=server",
                "--server-side",
                "--force-conflicts",
                "--field-manager=e2e-chart",
                "-f",
                "-",
            ],
            Some(manifests),
        )
        .unwrap_or_else(|err| panic!("the apiserver refused the rendered {what}: {err}"));
    }

    let fresh = tempdir("render");
    run("scripts/render-manifests.sh", &[fresh.to_str().unwrap()]).unwrap();
    for file in [
        "base/rbac.yaml",
        "base/conveyor.yaml",
        "observability/monitors.yaml",
        "observability/prometheusrule.yaml",
        "observability/dashboards.yaml",
    ] {
        let committed = std::fs::read_to_string(repo().join("manifests").join(file)).unwrap();
        let now = std::fs::read_to_string(fresh.join(file)).unwrap();
        assert!(
            committed == now,
            "manifests/{file} drifted from the chart: run scripts/render-manifests.sh"
        );
    }
    let _ = std::fs::remove_dir_all(fresh);
}
