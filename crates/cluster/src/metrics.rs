//! Each role's Prometheus metrics (RPC latency histograms, bytes in/out per
//! peer kind, batches in flight), served as text on a small HTTP endpoint.
//! One registry per role instance: no global registry, so several roles can
//! live in one test process.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
pub use prometheus::Gauge;
use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

use crate::net::NetSettings;
use crate::transport::ClusterError;

#[derive(Clone)]
pub struct RoleMetrics {
    registry: Registry,
    /// Seconds per RPC, by side (`client` | `server`) and method.
    pub rpc_seconds: HistogramVec,
    /// Payload bytes by direction (`in` | `out`) and peer kind.
    pub bytes: IntCounterVec,
    /// Batches queued or being worked on by this role.
    pub batches_in_flight: IntGauge,
    /// Payload bytes in and out, all peers (the scheduler's utilisation).
    total_bytes: Arc<std::sync::atomic::AtomicU64>,
}

impl RoleMetrics {
    pub fn new(role: &str) -> RoleMetrics {
        let registry =
            Registry::new_custom(Some("sparrow".into()), Some([("role".to_string(), role.to_string())].into()))
                .unwrap_or_default();
        let buckets = prometheus::exponential_buckets(50e-6, 2.0, 18).unwrap_or_default();
        let rpc_seconds = HistogramVec::new(
            HistogramOpts::new("rpc_seconds", "RPC latency in seconds").buckets(buckets),
            &["side", "method"],
        )
        .expect("static histogram options are valid");
        let bytes = IntCounterVec::new(Opts::new("bytes_total", "Message payload bytes"), &["direction", "peer"])
            .expect("static counter options are valid");
        let batches_in_flight = IntGauge::new("batches_in_flight", "Batches queued or in progress")
            .expect("static gauge options are valid");
        for collector in [
            Box::new(rpc_seconds.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(bytes.clone()),
            Box::new(batches_in_flight.clone()),
        ] {
            // Registering distinct names in a fresh registry cannot collide.
            let _ = registry.register(collector);
        }
        RoleMetrics { registry, rpc_seconds, bytes, batches_in_flight, total_bytes: Arc::default() }
    }

    /// A gauge of this role's registry (`sparrow train`'s progressive
    /// validation and stream lag, set as the run goes).
    pub fn gauge(&self, name: &str, help: &str) -> Gauge {
        let gauge = Gauge::new(name, help).expect("a gauge name is a Prometheus name");
        // A name registered twice keeps the first: callers register each once.
        let _ = self.registry.register(Box::new(gauge.clone()));
        gauge
    }

    pub fn observe(&self, side: &str, method: &str, secs: f64) {
        self.rpc_seconds.with_label_values(&[side, method]).observe(secs);
    }

    pub fn count_bytes(&self, direction: &str, peer: &str, bytes: usize) {
        self.bytes.with_label_values(&[direction, peer]).inc_by(bytes as u64);
        self.total_bytes.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Payload bytes this role sent and received so far.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }

    /// Serves `GET /metrics` (any path) on `addr` from the role's runtime;
    /// returns the bound address (`addr` may use port 0). The listen rule is
    /// the RPCs': off loopback only with a token, and with a token every
    /// scrape must carry it (`Authorization: Bearer TOKEN`). A scrape is
    /// HTTP/1.1 served by hyper with small limits, so a client cannot grow
    /// the role's memory or hold the endpoint: request heads up to
    /// [`MAX_HEAD_BYTES`], [`HEAD_TIMEOUT`] to send one, [`MAX_CONNECTIONS`] at
    /// once (more are closed at once), [`CONNECTION_TIMEOUT`] per connection.
    pub fn serve(
        &self,
        addr: SocketAddr,
        settings: &NetSettings,
        rt: &tokio::runtime::Handle,
    ) -> Result<SocketAddr, ClusterError> {
        settings.check_listen(addr)?;
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(addr))
            .map_err(|e| ClusterError::Io { what: format!("metrics: binding {addr}"), source: e })?;
        let bound = listener.local_addr().map_err(|e| ClusterError::Io { what: "metrics".into(), source: e })?;
        let metrics = self.clone();
        let token = settings.token.clone();
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        rt.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                // Over the limit: closed at once, nothing read.
                let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
                let (metrics, token) = (metrics.clone(), token.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let reply = metrics.answer(&request, token.as_deref());
                        async move { Ok::<_, std::convert::Infallible>(reply) }
                    });
                    let connection = http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(HEAD_TIMEOUT)
                        .max_buf_size(MAX_HEAD_BYTES)
                        .keep_alive(false)
                        .serve_connection(TokioIo::new(stream), service);
                    let _ = tokio::time::timeout(CONNECTION_TIMEOUT, connection).await;
                    drop(slot);
                });
            }
        });
        Ok(bound)
    }

    /// The reply to one scrape: the metrics, or 401 without the token.
    fn answer(
        &self,
        request: &hyper::Request<hyper::body::Incoming>,
        token: Option<&str>,
    ) -> hyper::Response<Full<Bytes>> {
        // Constant time, as the RPCs' check.
        let authorized = token.is_none_or(|t| {
            sparrow_core::token::bearer_matches(
                request.headers().get(hyper::header::AUTHORIZATION).map(|v| v.as_bytes()),
                t,
            )
        });
        let (status, content_type, body) = if authorized {
            (hyper::StatusCode::OK, "text/plain; version=0.0.4", self.render())
        } else {
            let body = "missing or wrong token: send `Authorization: Bearer TOKEN` (cluster.auth_token)\n";
            (hyper::StatusCode::UNAUTHORIZED, "text/plain", body.to_string())
        };
        let mut reply = hyper::Response::new(Full::new(Bytes::from(body)));
        *reply.status_mut() = status;
        if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
            reply.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        reply
    }
}

/// The largest request head a scrape may send (hyper's smallest buffer).
pub const MAX_HEAD_BYTES: usize = 8192;
/// Time a client has to send its request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a connection may stay open, whatever it does.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// Scrapes served at once.
pub const MAX_CONNECTIONS: usize = 16;

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Instant;

    use super::*;

    fn settings(token: Option<&str>) -> NetSettings {
        NetSettings {
            token: token.map(Arc::from),
            max_message_bytes: 1 << 20,
            connect_timeout: Duration::from_secs(1),
            rpc_timeout: Duration::from_secs(1),
        }
    }

    fn serve(token: Option<&str>) -> (tokio::runtime::Runtime, RoleMetrics, SocketAddr) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
        let metrics = RoleMetrics::new("shard");
        let addr = metrics.serve("127.0.0.1:0".parse().expect("addr"), &settings(token), rt.handle()).expect("serve");
        (rt, metrics, addr)
    }

    /// One request; the whole response (the server closes the connection).
    fn scrape(addr: SocketAddr, head: &str) -> String {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        stream.write_all(head.as_bytes()).expect("request");
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        response
    }

    const GET: &str = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";

    #[test]
    fn the_endpoint_serves_prometheus_text() {
        let (_rt, metrics, addr) = serve(None);
        metrics.observe("server", "pull", 0.002);
        metrics.count_bytes("out", "worker", 4096);
        metrics.batches_in_flight.set(3);
        let response = scrape(addr, GET);
        assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
        for line in [
            r#"sparrow_rpc_seconds_bucket{method="pull",side="server",role="shard",le="0.0032"} 1"#,
            r#"sparrow_rpc_seconds_bucket{method="pull",side="server",role="shard",le="0.0016"} 0"#,
            r#"sparrow_bytes_total{direction="out",peer="worker",role="shard"} 4096"#,
            r#"sparrow_batches_in_flight{role="shard"} 3"#,
        ] {
            assert!(response.contains(line), "missing `{line}` in\n{response}");
        }
    }

    /// 600 MB without a newline grew a shard to 1.4 GB: the head is capped.
    #[test]
    fn a_request_head_past_the_cap_is_refused_without_being_read() {
        let (_rt, _metrics, addr) = serve(None);
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let junk = vec![b'A'; 64 * 1024];
        let mut sent = 0;
        for _ in 0..64 {
            match stream.write(&junk) {
                Ok(n) => sent += n,
                Err(_) => break,
            }
        }
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        assert!(
            response.is_empty() || response.starts_with("HTTP/1.1 431") || response.starts_with("HTTP/1.1 400"),
            "after {sent} bytes: {response}"
        );
        assert!(!response.contains("sparrow_"), "served a 4 MB request line");
        assert!(scrape(addr, GET).starts_with("HTTP/1.1 200 OK"), "the endpoint still serves");
    }

    /// A client sending a byte at a time used to block every scrape (the
    /// old endpoint read one connection at a time, 2 s per silent read).
    #[test]
    fn a_slow_client_neither_blocks_scrapes_nor_stays_connected() {
        let (_rt, _metrics, addr) = serve(None);
        let mut slow = TcpStream::connect(addr).expect("connect");
        slow.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: ").expect("a few bytes");
        let start = Instant::now();
        let trickle = {
            let mut slow = slow.try_clone().expect("clone");
            std::thread::spawn(move || {
                // A byte every 300 ms: never silent long enough for a read timeout.
                while start.elapsed() < HEAD_TIMEOUT + Duration::from_secs(5) {
                    if slow.write_all(b"a").is_err() {
                        return Some(start.elapsed());
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
                None
            })
        };
        std::thread::sleep(Duration::from_millis(500));
        let asked = Instant::now();
        assert!(scrape(addr, GET).starts_with("HTTP/1.1 200 OK"));
        assert!(asked.elapsed() < Duration::from_secs(1), "a scrape waited {:?}", asked.elapsed());
        // The trickling head is cut off after HEAD_TIMEOUT, however it trickles.
        let cut = trickle.join().expect("trickle");
        let cut = cut.expect("the server never closed the slow connection");
        assert!(cut < HEAD_TIMEOUT + Duration::from_secs(3), "closed after {cut:?}");
        drop(slow);
    }

    #[test]
    fn the_endpoint_keeps_the_rpcs_listen_rule_and_token() {
        let rt = tokio::runtime::Runtime::new().expect("rt");
        let metrics = RoleMetrics::new("loader");
        let open = "0.0.0.0:0".parse().expect("addr");
        let err = metrics.serve(open, &settings(None), rt.handle()).expect_err("off loopback without a token");
        assert!(err.to_string().contains("without a shared token"), "{err}");
        drop(rt);
        let (_rt, _metrics, addr) = serve(Some("t0ken"));
        assert!(scrape(addr, GET).starts_with("HTTP/1.1 401"), "no token");
        let wrong = "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n\r\n";
        assert!(scrape(addr, wrong).starts_with("HTTP/1.1 401"), "wrong token");
        let right = "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0ken\r\n\r\n";
        let response = scrape(addr, right);
        assert!(response.starts_with("HTTP/1.1 200 OK") && response.contains("# TYPE sparrow_"), "{response}");
    }
}
