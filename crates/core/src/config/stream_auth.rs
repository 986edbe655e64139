//! `[data.stream.tls]` and `[data.stream.sasl]`: how a job reaches a
//! production Kafka (issue 55). The config names where the password is
//! (an environment variable or a file), never the password itself: a
//! config travels into checkpoints, exports and logs. The binary resolves
//! it at its edge ([`StreamSasl::resolve_password`]) and the value lives
//! in memory only, in a [`Secret`] that neither serializes nor prints.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Config, ConfigError};

/// TLS to the brokers. Present: every connection is TLS (rustls, TLS 1.2
/// and 1.3); absent: plain TCP.
#[derive(Clone, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct StreamTls {
    /// PEM file of the certificate authorities that sign the brokers'
    /// certificates (a private CA); absent: the system's trusted roots
    /// (`/etc/ssl/certs`), as a managed Kafka with a public CA needs.
    pub ca_file: Option<PathBuf>,
    /// PEM file of this client's certificate chain (mutual TLS); with
    /// `key_file`.
    pub cert_file: Option<PathBuf>,
    /// PEM file of the client certificate's private key (PKCS#8, PKCS#1 or
    /// SEC1); with `cert_file`.
    pub key_file: Option<PathBuf>,
    /// The name the brokers' certificates must carry, when it is not the
    /// host in `brokers` and the advertised listeners (a broker reached by
    /// IP address or through a tunnel).
    pub server_name: Option<String>,
}

/// SASL authentication, after TLS when both are set (SASL_SSL) or on
/// plain TCP (SASL_PLAINTEXT).
#[derive(Clone, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct StreamSasl {
    /// `"PLAIN"`, `"SCRAM-SHA-256"` or `"SCRAM-SHA-512"`.
    pub mechanism: SaslMechanism,
    /// The user the brokers know (required).
    pub username: String,
    /// The environment variable that holds the password (one of
    /// `password_env` and `password_file`).
    pub password_env: Option<String>,
    /// A file whose content is the password (a trailing newline is not
    /// part of it), e.g. a mounted Kubernetes secret.
    pub password_file: Option<PathBuf>,
    /// The password, read at start (never from the config text).
    #[serde(skip)]
    #[schemars(skip)]
    pub password: Option<Secret>,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
pub enum SaslMechanism {
    #[default]
    #[serde(rename = "PLAIN")]
    Plain,
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

impl SaslMechanism {
    pub fn name(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// A password in memory: it prints as `(secret)` and is never serialized.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("(secret)")
    }
}

/// The largest password file read: a password is short; past this the
/// key names something else.
const MAX_PASSWORD_BYTES: u64 = 64 << 10;

impl StreamTls {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: &str| {
            Err(ConfigError::Invalid { key: format!("data.stream.tls.{key}"), message: message.into() })
        };
        match (&self.cert_file, &self.key_file) {
            (Some(_), None) => return invalid("key_file", "a client certificate (cert_file) needs its key"),
            (None, Some(_)) => return invalid("cert_file", "a client key (key_file) needs its certificate"),
            _ => {}
        }
        if self.server_name.as_deref().is_some_and(|n| n.is_empty() || n.contains(char::is_whitespace)) {
            return invalid("server_name", "a DNS name or IP address, without spaces");
        }
        Ok(())
    }
}

impl StreamSasl {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: &str| {
            Err(ConfigError::Invalid { key: format!("data.stream.sasl.{key}"), message: message.into() })
        };
        if self.username.is_empty() {
            return invalid("username", "name the user the brokers know");
        }
        match (&self.password_env, &self.password_file) {
            (None, None) => invalid(
                "password_env",
                "say where the password is: password_env = \"VARIABLE\" or password_file = \"PATH\" \
                 (a config never holds the password itself)",
            ),
            (Some(_), Some(_)) => invalid("password_file", "one of password_env and password_file, not both"),
            (Some(v), None) if v.is_empty() || v.contains('=') || v.contains('\0') => {
                invalid("password_env", "an environment variable's name")
            }
            _ => Ok(()),
        }
    }

    /// Reads the password from where the config says: `env` looks a
    /// variable up (the binary passes the process's environment), a file
    /// is read here. Errors name the key and the variable or file, never
    /// the value.
    pub fn resolve_password(&mut self, env: impl Fn(&str) -> Option<OsString>) -> Result<(), ConfigError> {
        let text = match (&self.password_env, &self.password_file) {
            (Some(var), _) => {
                let invalid =
                    |m: String| ConfigError::Invalid { key: "data.stream.sasl.password_env".into(), message: m };
                let value = env(var).ok_or_else(|| invalid(format!("the environment variable {var} is not set")))?;
                value.into_string().map_err(|_| invalid(format!("the environment variable {var} is not UTF-8 text")))?
            }
            (None, Some(path)) => read_password_file(path)?,
            (None, None) => return Ok(()),
        };
        let text = text.strip_suffix('\n').map(|t| t.strip_suffix('\r').unwrap_or(t)).unwrap_or(&text);
        if text.is_empty() {
            let key = if self.password_env.is_some() { "password_env" } else { "password_file" };
            return Err(ConfigError::Invalid {
                key: format!("data.stream.sasl.{key}"),
                message: "the password is empty".into(),
            });
        }
        self.password = Some(Secret(text.to_string()));
        Ok(())
    }
}

impl Config {
    /// Reads the secrets the config points at (`data.stream.sasl`'s
    /// password). `env` looks up an environment variable: the binary passes
    /// the process's own, as libraries read none.
    pub fn resolve_secrets(&mut self, env: impl Fn(&str) -> Option<OsString>) -> Result<(), ConfigError> {
        match self.data.stream.as_mut().and_then(|s| s.sasl.as_mut()) {
            Some(sasl) => sasl.resolve_password(env),
            None => Ok(()),
        }
    }
}

fn read_password_file(path: &Path) -> Result<String, ConfigError> {
    use std::io::Read;
    let invalid = |m: String| ConfigError::Invalid { key: "data.stream.sasl.password_file".into(), message: m };
    let file = std::fs::File::open(path).map_err(|e| invalid(format!("{}: {e}", path.display())))?;
    let mut bytes = Vec::new();
    file.take(MAX_PASSWORD_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| invalid(format!("{}: {e}", path.display())))?;
    if bytes.len() as u64 > MAX_PASSWORD_BYTES {
        return Err(invalid(format!("{}: more than {MAX_PASSWORD_BYTES} bytes, which no password is", path.display())));
    }
    String::from_utf8(bytes).map_err(|_| invalid(format!("{}: not UTF-8 text", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<crate::Config, ConfigError> {
        crate::Config::from_toml(text, "test", &super::super::Overrides::default())
    }

    const STREAM: &str = "[data.stream]\ntopic = \"t\"\n";

    #[test]
    fn tls_and_sasl_parse_and_bad_values_name_their_key() {
        let c = parse(&format!(
            "{STREAM}[data.stream.tls]\nca_file = \"ca.pem\"\nserver_name = \"kafka.internal\"\n\
             [data.stream.sasl]\nmechanism = \"SCRAM-SHA-512\"\nusername = \"trainer\"\npassword_env = \"KAFKA_PASSWORD\"\n"
        ))
        .expect("parses");
        let s = c.data.stream.expect("stream");
        assert_eq!(s.tls.as_ref().and_then(|t| t.server_name.as_deref()), Some("kafka.internal"));
        assert_eq!(s.sasl.as_ref().map(|s| s.mechanism), Some(SaslMechanism::ScramSha512));
        for (text, key) in [
            ("[data.stream.tls]\ncert_file = \"c.pem\"", "data.stream.tls.key_file"),
            ("[data.stream.tls]\nkey_file = \"k.pem\"", "data.stream.tls.cert_file"),
            ("[data.stream.tls]\nserver_name = \"\"", "data.stream.tls.server_name"),
            ("[data.stream.tls]\nca = \"x\"", "ca"),
            ("[data.stream.sasl]\nusername = \"u\"", "data.stream.sasl.password_env"),
            ("[data.stream.sasl]\npassword_env = \"P\"", "data.stream.sasl.username"),
            ("[data.stream.sasl]\nusername = \"u\"\npassword_env = \"P\"\npassword_file = \"f\"", "password_file"),
            ("[data.stream.sasl]\nusername = \"u\"\npassword_env = \"P\"\nmechanism = \"GSSAPI\"", "mechanism"),
            // The password itself is not a key.
            ("[data.stream.sasl]\nusername = \"u\"\npassword = \"hunter2\"", "password"),
        ] {
            let e = parse(&format!("{STREAM}{text}\n")).expect_err(text).to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn the_password_is_read_at_the_edge_and_never_written_or_printed() {
        let text = format!("{STREAM}[data.stream.sasl]\nusername = \"u\"\npassword_env = \"KAFKA_PASSWORD\"\n");
        let mut c = parse(&text).expect("parses");
        let sasl = c.data.stream.as_mut().and_then(|s| s.sasl.as_mut()).expect("sasl");
        let unset = sasl.resolve_password(|_| None).expect_err("unset").to_string();
        assert!(unset.contains("KAFKA_PASSWORD") && unset.contains("not set"), "{unset}");
        sasl.resolve_password(|v| (v == "KAFKA_PASSWORD").then(|| "hunter2\n".into())).expect("resolves");
        assert_eq!(sasl.password.as_ref().map(Secret::expose), Some("hunter2"));
        assert!(!format!("{c:?}").contains("hunter2"));
        assert!(!c.to_toml().contains("hunter2"), "{}", c.to_toml());
        let empty =
            c.data.stream.as_mut().and_then(|s| s.sasl.as_mut()).expect("sasl").resolve_password(|_| Some("\n".into()));
        assert!(empty.expect_err("empty").to_string().contains("empty"));

        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("password");
        let mut sasl = StreamSasl { username: "u".into(), password_file: Some(file.clone()), ..Default::default() };
        let missing = sasl.resolve_password(|_| None).expect_err("missing").to_string();
        assert!(missing.contains("data.stream.sasl.password_file") && missing.contains("password"), "{missing}");
        std::fs::write(&file, "s3cret\r\n").expect("write");
        sasl.resolve_password(|_| None).expect("reads");
        assert_eq!(sasl.password.as_ref().map(Secret::expose), Some("s3cret"));
    }
}
