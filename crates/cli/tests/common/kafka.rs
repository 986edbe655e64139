//! Real servers for the stream tests: tansu (a Kafka-protocol broker, from
//! crates.io, installed by `scripts/ensure-tansu`) and stunnel (a TLS
//! terminator, from Debian, installed by `scripts/ensure-stunnel`), on
//! 127.0.0.1.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::Log;

/// A child process killed when dropped.
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn tool(variable: &str, installed: &str, script: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(variable) {
        return PathBuf::from(path);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    let path = home.join(installed);
    assert!(path.exists(), "the stream tests need {installed}: run ./scripts/{script} (./scripts/test does)");
    path
}

/// tansu, built with its in-memory and SQLite storage.
pub fn tansu() -> PathBuf {
    tool("SPARROW_TANSU", ".cache/sparrow-tools/tansu-0.6.0/bin/tansu", "ensure-tansu")
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port()
}

/// tansu listening on `listen`, telling clients to connect to `advertised`,
/// with `storage` (`memory://tansu/`, `sqlite://PATH`) and `extra` flags,
/// once it says it is ready.
pub fn spawn_tansu(listen: &str, advertised: &str, storage: &str, extra: &[&str]) -> Child {
    let mut command = Command::new(tansu());
    // tansu 0.6.0 reads an SQLite URL's path as relative: it runs in the
    // database's directory, given its name.
    let storage = match storage.strip_prefix("sqlite://").map(Path::new) {
        Some(db) => {
            command.current_dir(db.parent().expect("a database path"));
            format!("sqlite://{}", db.file_name().expect("a database file").to_string_lossy())
        }
        None => storage.to_string(),
    };
    let mut child = command
        .args(["broker", "--listener-url", &format!("tcp://{listen}")])
        .args(["--advertised-listener-url", &format!("tcp://{advertised}")])
        .args(["--storage-engine", &storage])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start tansu");
    let log = Log::default();
    log.collect(child.stdout.take().expect("stdout"));
    log.wait_for_line(&["ready in"], Duration::from_secs(60));
    child
}

/// `tansu user create NAME PASSWORD` on the broker at `addr`, for SCRAM
/// `mechanism` (`scram256`, `scram512`).
pub fn create_user(addr: &str, name: &str, password: &str, mechanism: &str) {
    let out = Command::new(tansu())
        .args(["user", "create", name, password, "--broker", &format!("tcp://{addr}"), "--mechanism", mechanism])
        .output()
        .expect("tansu user create");
    assert!(out.status.success(), "tansu user create: {}", String::from_utf8_lossy(&out.stderr));
}

/// A certificate authority, a broker certificate it signs for the DNS
/// name `broker.sparrow.test` only, and a client certificate it signs
/// (mutual TLS); and a second CA that signs nothing.
pub struct Certificates {
    pub ca: PathBuf,
    pub other_ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

pub const BROKER_NAME: &str = "broker.sparrow.test";

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().expect("openssl (scripts/ensure-stunnel)");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

pub fn certificates(dir: &Path) -> Certificates {
    for (key, cert, subject) in
        [("ca.key", "ca.pem", "/CN=Sparrow test CA"), ("other.key", "other.pem", "/CN=Another CA")]
    {
        let req = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", subject];
        openssl(dir, &[&req[..], &["-keyout", key, "-out", cert]].concat());
    }
    for (name, subject, usage) in [
        (
            "broker",
            format!("/CN={BROKER_NAME}"),
            format!("subjectAltName=DNS:{BROKER_NAME}\nextendedKeyUsage=serverAuth"),
        ),
        ("client", "/CN=trainer".to_string(), "extendedKeyUsage=clientAuth".to_string()),
    ] {
        let (key, csr, ext, cert) =
            (format!("{name}.key"), format!("{name}.csr"), format!("{name}.ext"), format!("{name}.pem"));
        openssl(dir, &["req", "-newkey", "rsa:2048", "-nodes", "-subj", &subject, "-keyout", &key, "-out", &csr]);
        let text = format!("{usage}\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n");
        std::fs::write(dir.join(&ext), text).expect("extensions");
        let sign = ["x509", "-req", "-in", &csr, "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial"];
        openssl(dir, &[&sign[..], &["-days", "2", "-extfile", &ext, "-out", &cert]].concat());
    }
    Certificates {
        ca: dir.join("ca.pem"),
        other_ca: dir.join("other.pem"),
        cert: dir.join("broker.pem"),
        key: dir.join("broker.key"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client.key"),
    }
}

/// stunnel on `accept`, terminating TLS with `certs`' broker certificate
/// and passing the bytes to `connect`; `mutual`: clients must show a
/// certificate the CA signed.
pub fn spawn_stunnel(dir: &Path, certs: &Certificates, accept: &str, connect: &str, mutual: bool) -> Child {
    let conf = dir.join(format!("stunnel-{}.conf", accept.replace(':', "-")));
    let mut text = format!(
        "foreground = yes\npid =\n[kafka]\naccept = {accept}\nconnect = {connect}\ncert = {}\nkey = {}\n",
        certs.cert.display(),
        certs.key.display()
    );
    if mutual {
        text += &format!("verifyChain = yes\nCAfile = {}\n", certs.ca.display());
    }
    std::fs::write(&conf, text).expect("stunnel config");
    let mut child = Command::new(tool("SPARROW_STUNNEL", "/usr/bin/stunnel4", "ensure-stunnel"))
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start stunnel");
    let log = Log::default();
    log.collect(child.stderr.take().expect("stderr"));
    log.wait_for_line(&["Configuration successful"], Duration::from_secs(30));
    child
}
