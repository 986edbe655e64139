//! Each role's Prometheus metrics (RPC latency histograms, bytes in/out per
//! peer kind, batches in flight), served as text on a small HTTP endpoint.
//! One registry per role instance: no global registry, so several roles can
//! live in one test process.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

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
        RoleMetrics { registry, rpc_seconds, bytes, batches_in_flight }
    }

    pub fn observe(&self, side: &str, method: &str, secs: f64) {
        self.rpc_seconds.with_label_values(&[side, method]).observe(secs);
    }

    pub fn count_bytes(&self, direction: &str, peer: &str, bytes: usize) {
        self.bytes.with_label_values(&[direction, peer]).inc_by(bytes as u64);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }

    /// Serves `GET /metrics` (any path) on `addr` from a background thread;
    /// returns the bound address (`addr` may use port 0).
    pub fn serve(&self, addr: SocketAddr) -> Result<SocketAddr, ClusterError> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| ClusterError::Io { what: format!("metrics: binding {addr}"), source: e })?;
        let bound = listener.local_addr().map_err(|e| ClusterError::Io { what: "metrics".into(), source: e })?;
        let metrics = self.clone();
        std::thread::Builder::new()
            .name("sparrow-metrics".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
                    let mut reader = BufReader::new(&stream);
                    // Read the request head; the answer is the same for every path.
                    let mut line = String::new();
                    while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                        line.clear();
                    }
                    let body = metrics.render();
                    let mut stream = &stream;
                    let _ = write!(
                        stream,
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                }
            })
            .map_err(|e| ClusterError::Io { what: "starting the metrics thread".into(), source: e })?;
        Ok(bound)
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;

    #[test]
    fn the_endpoint_serves_prometheus_text() {
        let metrics = RoleMetrics::new("shard");
        metrics.observe("server", "pull", 0.002);
        metrics.count_bytes("out", "worker", 4096);
        metrics.batches_in_flight.set(3);
        let addr = metrics.serve("127.0.0.1:0".parse().expect("addr")).expect("serve");
        let mut stream = std::net::TcpStream::connect(addr).expect("connect");
        stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").expect("request");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("response");
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
}
