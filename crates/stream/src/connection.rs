//! One blocking connection to a broker, TLS and SASL included, for the
//! requests the Kafka client does not send (DescribeConfigs) and for the
//! first contact, which tells a broker that refuses us (a certificate not
//! trusted, a wrong password, TLS spoken to a plain port or the reverse)
//! from one not reachable yet. The Kafka client retries every failed
//! connection for `max_unavailable_secs`; a refusal is reported at once,
//! naming the broker.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;

use crate::access::{Access, Sasl, probe_config};

const API_VERSIONS: i16 = 18;
const METADATA: i16 = 3;
const SASL_HANDSHAKE: i16 = 17;
const SASL_AUTHENTICATE: i16 = 36;
/// How long a TLS server may take to answer a ClientHello.
const HANDSHAKE: Duration = Duration::from_secs(3);
/// The longest answer read here (DescribeConfigs of one topic, ApiVersions).
const MAX_ANSWER: usize = 1 << 20;

/// Why a connection failed.
#[derive(Debug)]
pub enum ConnectError {
    /// Nothing answered, or the connection broke: it may pass (a broker
    /// restarting), so the caller retries.
    Unreachable(String),
    /// The broker answered and refused (TLS, SASL, or the protocol spoken
    /// on its port): retrying cannot help.
    Refused(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Unreachable(m) | ConnectError::Refused(m) => f.write_str(m),
        }
    }
}

trait Io: Read + Write + Send {}
impl<T: Read + Write + Send> Io for T {}

pub struct Connection {
    io: Box<dyn Io>,
    correlation: i32,
    tls: bool,
}

impl Connection {
    /// Connects to `broker` (`host:port`) as `access` says: TCP, TLS, then
    /// ApiVersions (a first answer), then the SASL login.
    pub fn open(broker: &str, access: &Access, timeout: Duration) -> Result<Connection, ConnectError> {
        let unreachable = |e: String| ConnectError::Unreachable(e);
        let addr = broker
            .to_socket_addrs()
            .map_err(|e| unreachable(e.to_string()))?
            .next()
            .ok_or_else(|| unreachable("no address".into()))?;
        let tcp = connect(&addr, timeout)?;
        let io: Box<dyn Io> = match &access.tls {
            None => Box::new(tcp),
            Some(config) => Box::new(handshake(tcp, broker, config, timeout).map_err(|e| match e {
                // A plain Kafka port waits for the rest of what it took for
                // a huge request (or closes): ask it in plain Kafka.
                ConnectError::Unreachable(_) if speaks_plain_kafka(&addr, timeout) => ConnectError::Refused(
                    "TLS: this port speaks plain Kafka, not TLS (data.stream.tls is set for a plain listener)".into(),
                ),
                e => e,
            })?),
        };
        let mut conn = Connection { io, correlation: 0, tls: access.tls.is_some() };
        match conn.call(API_VERSIONS, 0, &[]) {
            Err(ConnectError::Unreachable(_))
                if access.tls.is_none()
                    && handshake(connect(&addr, timeout)?, broker, &probe_config(), timeout)
                        .is_err_and(|e| matches!(e, ConnectError::Refused(ref m) if m.starts_with(TLS_SPOKEN))) =>
            {
                return Err(ConnectError::Refused(
                    "this port is a TLS listener: it closed a plain Kafka request and answers a TLS handshake \
                     (set [data.stream.tls])"
                        .into(),
                ));
            }
            Err(e) => return Err(e),
            Ok(_) => {}
        }
        if let Some(sasl) = &access.sasl {
            conn.login(sasl)?;
        }
        Ok(conn)
    }

    /// Sends one request (`body` after a request header: v1, or v2 for a
    /// flexible version) and returns its answer after the correlation id.
    pub fn call(&mut self, key: i16, version: i16, body: &[u8]) -> Result<Vec<u8>, ConnectError> {
        self.call_with(key, version, false, body)
    }

    pub fn call_with(&mut self, key: i16, version: i16, flexible: bool, body: &[u8]) -> Result<Vec<u8>, ConnectError> {
        self.correlation += 1;
        let framed = frame(key, version, self.correlation, flexible, body);
        self.io.write_all(&framed).and_then(|()| self.io.flush()).map_err(|e| self.io_error(e))?;
        let mut size = [0u8; 4];
        self.io.read_exact(&mut size).map_err(|e| self.io_error(e))?;
        if !self.tls && matches!(size, [0x15 | 0x16, 3, _, _]) {
            return Err(ConnectError::Refused(
                "the broker answers in TLS: this port is a TLS listener (set [data.stream.tls])".into(),
            ));
        }
        let size = i32::from_be_bytes(size);
        let size = usize::try_from(size)
            .ok()
            .filter(|&s| (4..=MAX_ANSWER).contains(&s))
            .ok_or_else(|| ConnectError::Refused(format!("an answer of {size} bytes is not Kafka's")))?;
        let mut answer = vec![0u8; size];
        self.io.read_exact(&mut answer).map_err(|e| self.io_error(e))?;
        Ok(answer.split_off(4))
    }

    fn io_error(&self, e: std::io::Error) -> ConnectError {
        if let Some(refused) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
            return describe_tls(refused);
        }
        let hint = match (e.kind(), self.tls, self.correlation) {
            (std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset, false, 1) => {
                " (a broker that closes the connection at once may be a TLS listener: [data.stream.tls])"
            }
            _ => "",
        };
        ConnectError::Unreachable(format!("{e}{hint}"))
    }

    /// SaslHandshake v1, then SaslAuthenticate v1 until the mechanism is
    /// done; a refusal carries the broker's message.
    fn login(&mut self, sasl: &Sasl) -> Result<(), ConnectError> {
        use rsasl::prelude::{Mechname, SASLClient, SASLConfig};
        let mechanism = sasl.mechanism.name();
        let mut body = Vec::new();
        string(&mut body, mechanism);
        let answer = self.call(SASL_HANDSHAKE, 1, &body).map_err(|e| match e {
            ConnectError::Unreachable(m) => ConnectError::Refused(format!(
                "SASL: the broker closed the connection at the handshake for {mechanism} ({m}): it does not take \
                 this mechanism"
            )),
            refused => refused,
        })?;
        let mut r = Fields(&answer);
        let error = r.i16()?;
        if error != 0 {
            let offered = (0..r.i32()?.max(0)).map(|_| r.string()).collect::<Result<Vec<_>, _>>()?;
            return Err(ConnectError::Refused(format!(
                "SASL: the broker does not offer {mechanism} (it offers {}; error {error})",
                if offered.is_empty() { "none".to_string() } else { offered.join(", ") }
            )));
        }
        let refused = |e: &dyn std::fmt::Display| ConnectError::Refused(format!("SASL {mechanism}: {e}"));
        let config = SASLConfig::with_credentials(None, sasl.username.clone(), sasl.password.expose().to_string())
            .map_err(|e| refused(&e))?;
        let name = Mechname::parse(mechanism.as_bytes()).map_err(|e| refused(&e))?;
        let mut session = SASLClient::new(config).start_suggested(&[name]).map_err(|e| refused(&e))?;
        let mut received: Option<Vec<u8>> = None;
        loop {
            let mut out = Vec::new();
            // A SCRAM broker says "invalid proof" (a wrong password) in
            // its last message, which the mechanism reads as an error.
            let state = session.step(received.as_deref(), &mut out).map_err(|e| {
                refused(&format!(
                    "authentication as user {:?} failed ({e}): a wrong user or password (data.stream.sasl)",
                    sasl.username
                ))
            })?;
            if state.has_sent_message() {
                let mut body = Vec::new();
                body.extend((out.len() as i32).to_be_bytes());
                body.extend(&out);
                let answer = self.call(SASL_AUTHENTICATE, 1, &body).map_err(|e| match e {
                    ConnectError::Unreachable(m) => refused(&format!(
                        "the broker closed the connection during the login ({m}): it refuses this user, password \
                         or mechanism"
                    )),
                    refused => refused,
                })?;
                let mut r = Fields(&answer);
                let error = r.i16()?;
                let message = r.nullable_string()?;
                if error != 0 {
                    return Err(ConnectError::Refused(format!(
                        "SASL {mechanism} as user {:?}: authentication failed (error {error}{}): a wrong user or \
                         password (data.stream.sasl)",
                        sasl.username,
                        message.map(|m| format!(": {m}")).unwrap_or_default()
                    )));
                }
                received = Some(r.bytes()?);
            }
            if state.is_finished() {
                return Ok(());
            }
        }
    }
}

/// Connects to the first of `access`'s brokers that answers, and asks for
/// metadata (no topic): a broker that wants a login we do not send closes
/// the connection there. A refusal from any broker is returned at once;
/// if none answered, the last reason.
pub fn first_contact(access: &Access, timeout: Duration) -> Result<(), ConnectError> {
    let mut last = ConnectError::Unreachable("no broker named".into());
    for broker in &access.brokers {
        let named = |e: ConnectError| match e {
            ConnectError::Refused(m) => ConnectError::Refused(format!("{broker}: {m}")),
            ConnectError::Unreachable(m) => ConnectError::Unreachable(format!("{broker}: {m}")),
        };
        let mut conn = match Connection::open(broker, access, timeout) {
            Ok(c) => c,
            Err(e @ ConnectError::Refused(_)) => return Err(named(e)),
            Err(e) => {
                last = named(e);
                continue;
            }
        };
        return match conn.call(METADATA, 1, &0i32.to_be_bytes()) {
            Ok(_) => Ok(()),
            Err(ConnectError::Unreachable(m)) if access.sasl.is_none() => Err(named(ConnectError::Refused(format!(
                "the broker closed the connection at a metadata request ({m}): it wants a SASL login \
                 ([data.stream.sasl])"
            )))),
            Err(e) => Err(named(e)),
        };
    }
    Err(last)
}

fn connect(addr: &SocketAddr, timeout: Duration) -> Result<TcpStream, ConnectError> {
    let unreachable = |e: std::io::Error| ConnectError::Unreachable(e.to_string());
    let tcp = TcpStream::connect_timeout(addr, timeout).map_err(unreachable)?;
    tcp.set_read_timeout(Some(timeout)).map_err(unreachable)?;
    tcp.set_write_timeout(Some(timeout)).map_err(unreachable)?;
    let _ = tcp.set_nodelay(true);
    Ok(tcp)
}

/// The TLS handshake on `tcp`, now, so that its failure is named as one.
/// A TLS server answers a ClientHello at once: a short wait.
fn handshake(
    tcp: TcpStream,
    broker: &str,
    config: &Arc<rustls::ClientConfig>,
    timeout: Duration,
) -> Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>, ConnectError> {
    let host = broker.rsplit_once(':').map_or(broker, |(h, _)| h).trim_matches(['[', ']']);
    let name = ServerName::try_from(host.to_string())
        .map_err(|e| ConnectError::Refused(format!("{host:?} is not a DNS name or IP address: {e}")))?;
    let session = rustls::ClientConnection::new(Arc::clone(config), name)
        .map_err(|e| ConnectError::Refused(format!("TLS: {e}")))?;
    let mut stream = rustls::StreamOwned::new(session, tcp);
    let unreachable = |e: std::io::Error| ConnectError::Unreachable(e.to_string());
    stream.sock.set_read_timeout(Some(timeout.min(HANDSHAKE))).map_err(unreachable)?;
    while stream.conn.is_handshaking() {
        stream.conn.complete_io(&mut stream.sock).map_err(tls_error)?;
    }
    stream.sock.set_read_timeout(Some(timeout)).map_err(unreachable)?;
    Ok(stream)
}

/// Whether `addr` answers ApiVersions in plain Kafka.
fn speaks_plain_kafka(addr: &SocketAddr, timeout: Duration) -> bool {
    let Ok(tcp) = connect(addr, timeout) else { return false };
    let mut conn = Connection { io: Box::new(tcp), correlation: 0, tls: false };
    conn.call(API_VERSIONS, 0, &[]).is_ok()
}

fn tls_error(e: std::io::Error) -> ConnectError {
    match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(refused) => describe_tls(refused),
        None => ConnectError::Unreachable(format!("TLS: no handshake ({e})")),
    }
}

/// How a refusal from a server that does speak TLS begins (a probe's).
const TLS_SPOKEN: &str = "TLS: ";

fn describe_tls(e: &rustls::Error) -> ConnectError {
    use rustls::{CertificateError, Error};
    if matches!(e, Error::InvalidMessage(_)) {
        return ConnectError::Unreachable("TLS: the answer to a ClientHello is not TLS".into());
    }
    let why = match e {
        Error::InvalidCertificate(CertificateError::UnknownIssuer | CertificateError::BadSignature) => {
            "its certificate is not signed by a CA this job trusts (data.stream.tls.ca_file)".to_string()
        }
        Error::InvalidCertificate(CertificateError::NotValidForName)
        | Error::InvalidCertificate(CertificateError::NotValidForNameContext { .. }) => {
            "its certificate is not for the name connected to (data.stream.tls.server_name)".to_string()
        }
        Error::InvalidCertificate(c) => format!("its certificate is refused: {c:?}"),
        Error::AlertReceived(alert) => format!(
            "it ended the TLS handshake ({alert:?}): a client certificate it does not accept (data.stream.tls.cert_file)?"
        ),
        other => other.to_string(),
    };
    ConnectError::Refused(format!("{TLS_SPOKEN}{why}"))
}

/// A request as sent: its length, the header (key, version, correlation,
/// client id; tagged fields when flexible), the body.
pub fn frame(key: i16, version: i16, correlation: i32, flexible: bool, body: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(body.len() + 32);
    b.extend(key.to_be_bytes());
    b.extend(version.to_be_bytes());
    b.extend(correlation.to_be_bytes());
    string(&mut b, "sparrow");
    if flexible {
        b.push(0);
    }
    b.extend(body);
    let mut framed = (b.len() as i32).to_be_bytes().to_vec();
    framed.extend(b);
    framed
}

pub(crate) fn string(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as i16).to_be_bytes());
    b.extend(s.as_bytes());
}

/// An answer's fields, read in order.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], ConnectError> {
        let (head, rest) = self.0.split_at_checked(n).ok_or_else(|| ConnectError::Refused("a short answer".into()))?;
        self.0 = rest;
        Ok(head)
    }

    fn i16(&mut self) -> Result<i16, ConnectError> {
        Ok(i16::from_be_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }

    fn i32(&mut self) -> Result<i32, ConnectError> {
        Ok(i32::from_be_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn nullable_string(&mut self) -> Result<Option<String>, ConnectError> {
        let len = self.i16()?;
        let Ok(len) = usize::try_from(len) else { return Ok(None) };
        Ok(Some(String::from_utf8_lossy(self.take(len)?).into_owned()))
    }

    fn string(&mut self) -> Result<String, ConnectError> {
        Ok(self.nullable_string()?.unwrap_or_default())
    }

    fn bytes(&mut self) -> Result<Vec<u8>, ConnectError> {
        let len = self.i32()?;
        let Ok(len) = usize::try_from(len) else { return Ok(Vec::new()) };
        Ok(self.take(len)?.to_vec())
    }
}
