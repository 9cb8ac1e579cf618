//! TLS on every link: the local services speak it only and refuse a client that trusts
//! another CA; the gateway serves HTTPS, swaps in a renewed certificate without a restart,
//! and keeps its admin routes off the API's port.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use conveyor_core::amqp;
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::testing::{self, binary, wait_until};
use conveyor_core::tls::TrustedRoots;
use conveyor_core::with_causes as chain;
use conveyor_gateway::tls::TlsFiles;
use reqwest::StatusCode;
use uuid::Uuid;

use crate::support::{test_type, Harness, TOKEN};

/// A scratch directory with CAs and certificates made by the `openssl` CLI.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new() -> Pki {
        let dir = std::env::temp_dir().join(format!("conveyor-pki-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        Pki { dir }
    }

    fn openssl(&self, args: &[&str]) {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .output()
            .expect("openssl (scripts/services.sh installs it)");
        assert!(
            output.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// A CA of its own, trusted by nobody else; returns its certificate's path.
    fn ca(&self, name: &str) -> PathBuf {
        self.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        self.dir.join(format!("{name}.crt"))
    }

    /// A loopback server certificate signed by CA `ca`: (certificate, key).
    fn server(&self, ca: &str, name: &str) -> (PathBuf, PathBuf) {
        std::fs::write(
            self.dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             extendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "server.ext",
            "-out",
            &format!("{name}.crt"),
        ]);
        (
            self.dir.join(format!("{name}.crt")),
            self.dir.join(format!("{name}.key")),
        )
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn client_trusting(ca: &Path) -> reqwest::Client {
    TrustedRoots::from_file(ca)
        .unwrap()
        .client_builder()
        .build()
        .unwrap()
}

fn mentions_the_certificate(message: &str) -> bool {
    let lower = message.to_lowercase();
    lower.contains("certificate") || lower.contains("unknownissuer")
}

#[tokio::test]
async fn the_services_speak_tls_only_and_refuse_a_client_that_trusts_another_ca() {
    let pki = Pki::new();
    let wrong_ca = pki.ca("wrong-ca");
    let wrong = wrong_ca.display().to_string();

    // PostgreSQL: the test's own connection is TLS, as the server sees it.
    let db = Db::connect(&DbOptions::new(testing::admin_database_url())).unwrap();
    let (ssl,): (bool,) =
        sqlx::query_as("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(db.pool())
            .await
            .unwrap();
    assert!(ssl, "the server sees a plaintext connection");
    let url = testing::admin_database_url().replace(testing::DEV_CA, &wrong);
    assert!(url.contains(&wrong), "the test URL names its CA: {url}");
    let err = Db::connect(&DbOptions::new(&url))
        .unwrap()
        .ping()
        .await
        .expect_err("a server signed by another CA is refused");
    assert!(mentions_the_certificate(&chain(&err)), "{}", chain(&err));
    let plain = testing::admin_database_url().replace("sslmode=verify-full", "sslmode=disable");
    let err = Db::connect(&DbOptions::new(&plain))
        .unwrap()
        .ping()
        .await
        .expect_err("plaintext is refused");
    assert!(chain(&err).contains("no encryption"), "{}", chain(&err));

    // RabbitMQ: AMQPS verified against the dev CA; the broker lists the link as TLS.
    let name = format!("tls-test-{}", Uuid::new_v4());
    let conn = amqp::connect(&testing::amqp_url(), &name).await.unwrap();
    let management = testing::http_client();
    wait_until(
        "the broker lists the connection as TLS",
        Duration::from_secs(30),
        || async {
            let Ok(answer) = management
                .get(format!("{}/api/connections", testing::management_url()))
                .send()
                .await
            else {
                return false;
            };
            let connections: serde_json::Value = answer.json().await.unwrap_or_default();
            connections.as_array().into_iter().flatten().any(|c| {
                c["client_properties"]["connection_name"] == name.as_str() && c["ssl"] == true
            })
        },
    )
    .await;
    let _ = conn.close(200, "done").await;
    let url = testing::amqp_url().replace(testing::DEV_CA, &wrong);
    let err = amqp::connect(&url, "tls-test-wrong-ca")
        .await
        .expect_err("a broker signed by another CA is refused");
    assert!(mentions_the_certificate(&chain(&err)), "{}", chain(&err));
    let err = amqp::connect(
        "amqp://conveyor:conveyor@127.0.0.1:5672/%2f",
        "tls-test-plain",
    )
    .await
    .expect_err("no plaintext listener");
    assert!(matches!(err, amqp::AmqpError::Unavailable(_)), "{err}");

    // The management API: HTTPS only, refused when trusting another CA.
    let err = client_trusting(&wrong_ca)
        .get(format!("{}/api/overview", testing::MANAGEMENT_API))
        .send()
        .await
        .expect_err("a management API signed by another CA is refused");
    assert!(mentions_the_certificate(&chain(&err)), "{}", chain(&err));
    assert!(reqwest::get("http://127.0.0.1:15672/api/overview")
        .await
        .is_err());
}

fn gateway_tls(cert: &Path, key: &Path) -> TlsFiles {
    TlsFiles {
        cert: cert.to_owned(),
        key: key.to_owned(),
        reload_every: Duration::from_millis(200),
    }
}

#[tokio::test]
async fn the_gateway_serves_https_with_its_admin_routes_on_another_port() {
    let spec = test_type("https");
    let name = spec.name.clone();
    let cert = PathBuf::from(testing::DEV_SERVER_CERT);
    let key = PathBuf::from(testing::DEV_SERVER_KEY);
    let harness = Harness::start_with(vec![spec], |config| {
        config.tls = Some(gateway_tls(&cert, &key));
    })
    .await;
    assert!(harness.gateway_url.starts_with("https://"));
    harness.submit_ok(&name, serde_json::json!({})).await;

    // Plain HTTP to the TLS port gets no answer.
    let plain = harness.gateway_url.replace("https://", "http://");
    assert!(reqwest::get(format!("{plain}/v1/tasks/{}", Uuid::new_v4()))
        .await
        .is_err());
    // /metrics and the probes are on the admin port only.
    let on_api = harness
        .http
        .get(format!("{}/metrics", harness.gateway_url))
        .send()
        .await
        .unwrap();
    assert_eq!(on_api.status(), StatusCode::NOT_FOUND);
    let on_admin = harness
        .http
        .get(format!("{}/metrics", harness.admin_url))
        .send()
        .await
        .unwrap();
    assert_eq!(on_admin.status(), StatusCode::OK);
    assert!(on_admin.text().await.unwrap().contains("conveyor_"));

    // conveyorctl trusts the CA it is given, and refuses the gateway without it. (Run
    // without blocking: the gateway answers on this test's thread.)
    let conveyorctl = |ca: Option<&str>| {
        let mut command = tokio::process::Command::new(binary("conveyorctl"));
        command
            .args(["--gateway", &harness.gateway_url, "--token", TOKEN])
            .args(["submit", "--type", &name, "--payload", "{}"])
            .env_remove("CONVEYOR_CA_FILE");
        if let Some(ca) = ca {
            command.args(["--ca-file", ca]);
        }
        command.output()
    };
    let trusted = conveyorctl(Some(testing::DEV_CA)).await.unwrap();
    assert!(
        trusted.status.success(),
        "{}",
        String::from_utf8_lossy(&trusted.stderr)
    );
    let answer: serde_json::Value = serde_json::from_slice(&trusted.stdout).unwrap();
    assert_eq!(answer["state"], "QUEUED", "{answer}");
    let untrusted = conveyorctl(None).await.unwrap();
    assert!(!untrusted.status.success());
    let stderr = String::from_utf8_lossy(&untrusted.stderr);
    assert!(mentions_the_certificate(&stderr), "{stderr}");
    harness.shutdown().await;
}

#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart() {
    let pki = Pki::new();
    let old_ca = pki.ca("old-ca");
    let new_ca = pki.ca("new-ca");
    let (old_cert, old_key) = pki.server("old-ca", "old");
    let (new_cert, new_key) = pki.server("new-ca", "new");
    let cert = pki.dir.join("serving.crt");
    let key = pki.dir.join("serving.key");
    std::fs::copy(&old_cert, &cert).unwrap();
    std::fs::copy(&old_key, &key).unwrap();

    let spec = test_type("renew");
    let harness = Harness::start_with(vec![spec], |config| {
        config.tls = Some(gateway_tls(&cert, &key));
    })
    .await;
    let url = format!("{}/v1/tasks/{}", harness.gateway_url, Uuid::new_v4());
    let answers = |client: reqwest::Client| {
        let url = url.clone();
        async move {
            client
                .get(&url)
                .bearer_auth(TOKEN)
                .send()
                .await
                .map(|r| r.status())
        }
    };
    assert_eq!(
        answers(client_trusting(&old_ca)).await.unwrap(),
        StatusCode::NOT_FOUND
    );
    assert!(answers(client_trusting(&new_ca)).await.is_err());

    // A half-done renewal (the new certificate beside the old key) is not served; the old
    // pair keeps serving until the key follows.
    std::fs::copy(&new_cert, &cert).unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        answers(client_trusting(&old_ca)).await.unwrap(),
        StatusCode::NOT_FOUND
    );
    std::fs::copy(&new_key, &key).unwrap();
    wait_until(
        "the renewed certificate is served",
        Duration::from_secs(30),
        || async { answers(client_trusting(&new_ca)).await.is_ok() },
    )
    .await;
    assert!(answers(client_trusting(&old_ca)).await.is_err());
    harness.shutdown().await;
}

#[test]
fn with_require_tls_no_component_starts_over_a_plaintext_link() {
    // Issue 33, item 7: a production switch, so that a wrong URL cannot quietly fall back
    // to plaintext. Each component refuses at start, naming the link and not its password.
    let plaintext = [
        (
            "CONVEYOR_DATABASE_URL",
            "postgres://conveyor:hunter2@127.0.0.1:5432/conveyor",
        ),
        (
            "CONVEYOR_AMQP_URL",
            "amqp://conveyor:hunter2@127.0.0.1:5672/%2f",
        ),
        ("CONVEYOR_RABBITMQ_MANAGEMENT_URL", "http://127.0.0.1:15672"),
    ];
    for (component, args, expected) in [
        ("conveyor-gateway", vec![], "served without TLS"),
        ("conveyor-worker", vec!["--consume", "t"], "amqps"),
        ("conveyor-operator", vec!["run"], "management URL"),
    ] {
        let output = Command::new(binary(component))
            .args(&args)
            .arg("--require-tls")
            .envs(plaintext)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{component} started");
        assert!(
            stderr.contains("--require-tls refuses"),
            "{component}: {stderr}"
        );
        assert!(stderr.contains(expected), "{component}: {stderr}");
        assert!(
            !stderr.contains("hunter2"),
            "{component} showed a password: {stderr}"
        );
    }
}
