//! A topic behind TLS and SASL (`[data.stream.tls]`, `[data.stream.sasl]`,
//! issue 55), against real servers on 127.0.0.1: tansu (SCRAM users kept
//! in its SQLite storage) behind stunnel (TLS, with a CA and a broker
//! certificate the test makes with openssl). `scripts/test` installs all
//! three (`scripts/ensure-tansu`, `scripts/ensure-stunnel`).

mod common;

use common::kafka::{
    BROKER_NAME, Certificates, Server, certificates, create_user, free_port, spawn_stunnel, spawn_tansu,
};
use common::{last_json, sparrow};
use std::path::Path;
use std::process::Output;

/// tansu on a private port, advertising stunnel's; stunnel in front with
/// the broker certificate. `auth`: tansu in SQLite storage with SCRAM users
/// `trainer` (SHA-256 and SHA-512) made before it is restarted with
/// `--authentication`.
struct SecureBroker {
    /// The TLS port (stunnel).
    tls: String,
    /// tansu's own, plain port.
    plain: String,
    certs: Certificates,
    _servers: Vec<Server>,
}

const PASSWORD: &str = "correct-horse-battery";

fn secure_broker(dir: &Path, auth: bool) -> SecureBroker {
    let certs = certificates(dir);
    let (plain, tls) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let tansu = if auth {
        let storage = format!("sqlite://{}", dir.join("tansu.db").display());
        let open = Server(spawn_tansu(&plain, &plain, &storage, &[]));
        for mechanism in ["scram256", "scram512"] {
            create_user(&plain, "trainer", PASSWORD, mechanism);
        }
        drop(open);
        spawn_tansu(&plain, &tls, &storage, &["--authentication"])
    } else {
        spawn_tansu(&plain, &tls, "memory://tansu/", &[])
    };
    let tansu = Server(tansu);
    // The TLS test's broker wants a client certificate too (mutual TLS).
    let stunnel = Server(spawn_stunnel(dir, &certs, &tls, &plain, !auth));
    SecureBroker { tls, plain, certs, _servers: vec![tansu, stunnel] }
}

/// The small job on `dir/data` reading `topic` at `broker`, with the
/// `[data.stream]` lines `stream` and the tables `tables` after it.
fn job(dir: &Path, name: &str, broker: &str, stream: &str, tables: &str) -> String {
    let base = std::fs::read_to_string(common::write_config(dir, "")).expect("config");
    let text = base.replace("batch_size = 256", "batch_size = 256\npipeline_depth = 0")
        + &format!(
            "[checkpoint]\ndir = {:?}\n[data.stream]\nbrokers = [\"{broker}\"]\ntopic = \"rows\"\n\
             stop_when_idle_secs = 1\nmax_unavailable_secs = 30\n{stream}\n{tables}\n",
            dir.join(format!("ckpt-{name}")).display().to_string()
        );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).expect("config");
    path.display().to_string()
}

/// The same job on the file `dir/data/train.tsv`.
fn file_job(dir: &Path) -> String {
    let text = std::fs::read_to_string(job(dir, "file", "unused:1", "", "")).expect("config");
    let path = dir.join("file.toml");
    std::fs::write(&path, &text[..text.find("[data.stream]").expect("stream table")]).expect("config");
    path.display().to_string()
}

fn tls_table(ca: &Path, client: Option<&Certificates>) -> String {
    let mut text =
        format!("[data.stream.tls]\nca_file = {:?}\nserver_name = \"{BROKER_NAME}\"\n", ca.display().to_string());
    if let Some(c) = client {
        let (cert, key) = (c.client_cert.display().to_string(), c.client_key.display().to_string());
        text += &format!("cert_file = {cert:?}\nkey_file = {key:?}\n");
    }
    text
}

fn run(args: &[&str], config: &str, env: &[(&str, &str)]) -> Output {
    let mut command = sparrow();
    command.args(args).args(["--config", config]);
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("sparrow")
}

fn ok(out: Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    last_json(&out)
}

/// It fails (never hangs until max_unavailable_secs: the test's is 30 s,
/// and a retried connection would show in the error) with an error naming
/// the broker and each of `words`.
fn fails_naming(out: Output, broker: &str, words: &[&str]) {
    let e = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "succeeded: {e}");
    assert!(e.contains(broker) && words.iter().all(|w| e.contains(w)), "want {broker} and {words:?} in: {e}");
    assert!(!e.contains("retries failed"), "retried: {e}");
}

/// Records produced and trained over mutual TLS with a private CA are the
/// file's model bit for bit; a CA that did not sign the broker's
/// certificate, a name the certificate is not for, no client certificate,
/// plain Kafka to the TLS port and TLS to the plain port each fail at once,
/// naming the broker and the key to fix.
#[test]
fn tls_with_a_private_ca_trains_the_files_model_and_each_mismatch_is_named() {
    let tmp = tempfile::tempdir().expect("tmp");
    common::generate(tmp.path(), "4000");
    let b = secure_broker(tmp.path(), false);
    let train_rows = tmp.path().join("data/train.tsv").display().to_string();
    let tls = tls_table(&b.certs.ca, Some(&b.certs));
    let config = job(tmp.path(), "tls", &b.tls, "", &tls);
    let produced = ok(run(&["produce", "--from", &train_rows], &config, &[]));
    assert_eq!(produced["end_offsets"], serde_json::json!({"0": 4000}), "{produced}");
    let stream = ok(run(&["train", "--quiet"], &config, &[]));
    let file = common::train_json(&file_job(tmp.path()));
    assert_eq!(stream["stream_records"], 4000, "{stream}");
    assert_eq!((&stream["test_auc"], &stream["steps"]), (&file["test_auc"], &file["steps"]), "{stream}\n{file}");

    let wrong_ca = job(tmp.path(), "ca", &b.tls, "", &tls_table(&b.certs.other_ca, Some(&b.certs)));
    fails_naming(
        run(&["train", "--quiet"], &wrong_ca, &[]),
        &b.tls,
        &["not signed by a CA", "data.stream.tls.ca_file"],
    );
    let wrong_name = job(tmp.path(), "name", &b.tls, "", &tls.replace(BROKER_NAME, "kafka.example.com"));
    fails_naming(run(&["train", "--quiet"], &wrong_name, &[]), &b.tls, &["data.stream.tls.server_name"]);
    let no_client_cert = job(tmp.path(), "anonymous", &b.tls, "", &tls_table(&b.certs.ca, None));
    fails_naming(run(&["train", "--quiet"], &no_client_cert, &[]), &b.tls, &["data.stream.tls.cert_file"]);
    let plain_to_tls = job(tmp.path(), "plain", &b.tls, "", "");
    fails_naming(run(&["train", "--quiet"], &plain_to_tls, &[]), &b.tls, &["TLS listener", "[data.stream.tls]"]);
    let tls_to_plain = job(tmp.path(), "tlsplain", &b.plain, "", &tls);
    fails_naming(run(&["produce", "--from", &train_rows], &tls_to_plain, &[]), &b.plain, &["plain Kafka, not TLS"]);
}

/// SCRAM over TLS (SASL_SSL): `produce` logs in with SHA-512 and a password
/// file, `train` and a 1×1 `launch` (whose loader reads the password from
/// its own environment) with SHA-256 and an environment variable; both
/// train every record (the topic's cleanup.policy read over the same login),
/// and the password is in no checkpoint file and no output. A wrong password, an unknown user, an unset variable and no
/// login at all each fail at once, naming the broker or the key.
#[test]
fn scram_over_tls_trains_and_a_wrong_login_is_named() {
    let tmp = tempfile::tempdir().expect("tmp");
    common::generate(tmp.path(), "3000");
    let b = secure_broker(tmp.path(), true);
    let train_rows = tmp.path().join("data/train.tsv").display().to_string();
    let tls = tls_table(&b.certs.ca, None);
    let secret = tmp.path().join("kafka-password");
    std::fs::write(&secret, format!("{PASSWORD}\n")).expect("password file");
    let sasl = |mechanism: &str, password: &str| {
        format!("[data.stream.sasl]\nmechanism = \"{mechanism}\"\nusername = \"trainer\"\n{password}\n")
    };
    let file_login = sasl("SCRAM-SHA-512", &format!("password_file = {:?}", secret.display().to_string()));
    let producer = job(tmp.path(), "producer", &b.tls, "", &format!("{tls}{file_login}"));
    let produced = ok(run(&["produce", "--from", &train_rows], &producer, &[]));
    assert_eq!(produced["end_offsets"], serde_json::json!({"0": 3000}), "{produced}");

    let env_login = sasl("SCRAM-SHA-256", "password_env = \"KAFKA_PASSWORD\"");
    let config = job(tmp.path(), "trainer", &b.tls, "", &format!("{tls}{env_login}"));
    let env = [("KAFKA_PASSWORD", PASSWORD)];
    // The topic's cleanup.policy is asked on a connection of our own
    // (DescribeConfigs), logged in as the client's are.
    let trained = run(&["train", "--quiet"], &config, &[env[0], ("RUST_LOG", "info,sparrow_stream=debug")]);
    let output = format!("{}{}", String::from_utf8_lossy(&trained.stdout), String::from_utf8_lossy(&trained.stderr));
    let trained = ok(trained);
    assert!(output.contains("kafka topic rows: ") && !output.contains("did not say its cleanup.policy"), "{output}");
    assert_eq!(trained["stream_offsets"], serde_json::json!({"0": 3000}), "{trained}");
    let launched = run(&["launch", "--shards", "1", "--workers", "1", "--quiet"], &config, &env);
    let output = output + &String::from_utf8_lossy(&launched.stderr);
    let launched = ok(launched);
    assert_eq!(launched["stream_offsets"], serde_json::json!({"0": 3000}), "{launched}");
    // The checkpoints hold the config (and where the password is), never it.
    assert!(!output.contains(PASSWORD), "{output}");
    let mut files = Vec::new();
    let mut dirs = vec![tmp.path().join("ckpt-trainer")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("checkpoint dir").map(|e| e.expect("entry").path()) {
            if entry.is_dir() { dirs.push(entry) } else { files.push(entry) }
        }
    }
    assert!(files.iter().any(|f| f.ends_with("manifest.json")), "{files:?}");
    for f in &files {
        let bytes = std::fs::read(f).expect("read");
        assert!(!bytes.windows(PASSWORD.len()).any(|w| w == PASSWORD.as_bytes()), "the password is in {}", f.display());
    }

    let train = ["train", "--quiet"];
    fails_naming(run(&train, &config, &[("KAFKA_PASSWORD", "wrong")]), &b.tls, &["authentication", "\"trainer\""]);
    let stranger = config.replace("trainer.toml", "stranger.toml");
    std::fs::write(&stranger, std::fs::read_to_string(&config).expect("config").replace("\"trainer\"", "\"nobody\""))
        .expect("config");
    fails_naming(run(&train, &stranger, &env), &b.tls, &["authentication", "\"nobody\""]);
    fails_naming(run(&train, &config, &[]), "data.stream.sasl.password_env", &["KAFKA_PASSWORD", "not set"]);
    let no_login = job(tmp.path(), "anonymous", &b.tls, "", &tls);
    fails_naming(run(&train, &no_login, &[]), &b.tls, &["SASL login", "[data.stream.sasl]"]);
}
