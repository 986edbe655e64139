//! How the brokers are reached: the bootstrap list, TLS (rustls, with the
//! CA, client certificate and server name of `[data.stream.tls]`) and SASL
//! (`[data.stream.sasl]`, its password resolved by the binary). Built once
//! per connection from the config; both the Kafka client and the blocking
//! connections of `connection.rs` use the same TLS setup.

use std::path::Path;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use sparrow_core::config::{SaslMechanism, Secret, StreamConfig, StreamSasl, StreamTls};
use sparrow_data::DataError;

/// What a connection to the brokers needs.
#[derive(Clone)]
pub struct Access {
    pub brokers: Vec<String>,
    pub tls: Option<Arc<rustls::ClientConfig>>,
    pub sasl: Option<Sasl>,
}

/// A SASL login: the mechanism, the user and the password (never printed).
#[derive(Clone, Debug)]
pub struct Sasl {
    pub mechanism: SaslMechanism,
    pub username: String,
    pub password: Secret,
}

impl Access {
    /// Plain TCP to `brokers`, no authentication.
    pub fn plain(brokers: &[String]) -> Access {
        Access { brokers: brokers.to_vec(), tls: None, sasl: None }
    }

    /// What `[data.stream]` says; a file that cannot be read or holds no
    /// certificate or key is an error naming its key and path.
    pub fn of(config: &StreamConfig) -> Result<Access, DataError> {
        Access::new(&config.brokers, config.tls.as_ref(), config.sasl.as_ref())
    }

    pub fn new(brokers: &[String], tls: Option<&StreamTls>, sasl: Option<&StreamSasl>) -> Result<Access, DataError> {
        let tls = tls.map(client_config).transpose()?.map(Arc::new);
        let sasl = match sasl {
            None => None,
            Some(s) => {
                let password = s.password.clone().ok_or_else(|| {
                    DataError::Stream(
                        "data.stream.sasl: the password was not read (password_env or password_file): \
                         this front end does not resolve it"
                            .into(),
                    )
                })?;
                Some(Sasl { mechanism: s.mechanism, username: s.username.clone(), password })
            }
        };
        Ok(Access { brokers: brokers.to_vec(), tls, sasl })
    }

    /// `tls` / `sasl` / `plaintext`, for messages (Kafka's names).
    pub fn protocol(&self) -> &'static str {
        match (&self.tls, &self.sasl) {
            (Some(_), Some(_)) => "SASL_SSL",
            (Some(_), None) => "SSL",
            (None, Some(_)) => "SASL_PLAINTEXT",
            (None, None) => "PLAINTEXT",
        }
    }

    /// The Kafka client's form of the login.
    pub fn rskafka_sasl(&self) -> Option<rskafka::client::SaslConfig> {
        use rskafka::client::{Credentials, SaslConfig};
        let s = self.sasl.as_ref()?;
        let credentials = Credentials::new(s.username.clone(), s.password.expose().to_string());
        Some(match s.mechanism {
            SaslMechanism::Plain => SaslConfig::Plain(credentials),
            SaslMechanism::ScramSha256 => SaslConfig::ScramSha256(credentials),
            SaslMechanism::ScramSha512 => SaslConfig::ScramSha512(credentials),
        })
    }
}

fn bad(key: &str, path: &Path, what: impl std::fmt::Display) -> DataError {
    DataError::Stream(format!("data.stream.tls.{key} = {:?}: {what}", path.display().to_string()))
}

fn certificates(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, DataError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(key, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(key, path, e))?;
    if certs.is_empty() {
        return Err(bad(key, path, "holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
    }
    Ok(certs)
}

/// rustls' client setup: the roots (the CA file, else the system's), the
/// client certificate if any, and a verifier that checks the brokers'
/// certificates against `server_name` when it is set.
fn client_config(tls: &StreamTls) -> Result<rustls::ClientConfig, DataError> {
    let mut roots = RootCertStore::empty();
    match &tls.ca_file {
        Some(path) => {
            for cert in certificates("ca_file", path)? {
                roots.add(cert).map_err(|e| bad("ca_file", path, e))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(DataError::Stream(format!(
                    "data.stream.tls: no ca_file, and no trusted root certificate found on this system{}: \
                     name the brokers' CA in data.stream.tls.ca_file",
                    found.errors.first().map(|e| format!(" ({e})")).unwrap_or_default()
                )));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| DataError::Stream(format!("data.stream.tls: {e}")))?;
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| DataError::Stream(format!("data.stream.tls: {e}")))?;
    let builder = match &tls.server_name {
        None => builder.with_webpki_verifier(webpki),
        Some(name) => {
            let name = ServerName::try_from(name.clone()).map_err(|e| {
                DataError::Stream(format!("data.stream.tls.server_name = {name:?}: not a DNS name or IP address ({e})"))
            })?;
            builder.dangerous().with_custom_certificate_verifier(Arc::new(NamedVerifier { inner: webpki, name }))
        }
    };
    match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => {
            let chain = certificates("cert_file", cert)?;
            let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad("key_file", key, e))?;
            builder.with_client_auth_cert(chain, key_der).map_err(|e| bad("key_file", key, e))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// The standard verification (chain to the roots, validity, signatures),
/// of the name the config gives instead of the host connected to.
#[derive(Debug)]
struct NamedVerifier {
    inner: Arc<WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for NamedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _host: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner.verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A TLS setup that trusts nothing: a handshake with it fails at the
/// server's certificate, which tells a TLS listener from a plain one.
pub fn probe_config() -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = Arc::new(TrustNothing(provider.clone()));
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring's defaults have protocol versions");
    Arc::new(builder.dangerous().with_custom_certificate_verifier(verifier).with_no_client_auth())
}

fn distrust<T>() -> Result<T, rustls::Error> {
    Err(rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer))
}

#[derive(Debug)]
struct TrustNothing(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for TrustNothing {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        distrust()
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        distrust()
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        distrust()
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
