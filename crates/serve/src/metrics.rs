//! The server's Prometheus metrics: one registry per server (no global
//! registry, so several servers can live in one test process).

use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

pub(crate) struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub rows: IntCounter,
    pub seconds: Histogram,
    pub model_step: IntGauge,
    pub swaps: IntCounterVec,
    pub swap_locked: Gauge,
    pub staleness: Gauge,
    pub watch_errors: IntCounter,
    pub watch_failing: IntGauge,
    pub connections_open: IntGauge,
    pub connections_refused: IntCounter,
    pub connections_evicted: IntCounter,
    pub connections_timed_out: IntCounterVec,
    pub unauthorized: IntCounter,
}

fn counter(name: &str, help: &str) -> IntCounter {
    IntCounter::new(name, help).expect("valid metric")
}

fn counter_vec(name: &str, help: &str, label: &str) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric")
}

fn int_gauge(name: &str, help: &str) -> IntGauge {
    IntGauge::new(name, help).expect("valid metric")
}

fn gauge(name: &str, help: &str) -> Gauge {
    Gauge::new(name, help).expect("valid metric")
}

impl Metrics {
    pub fn new() -> Metrics {
        let m = Metrics {
            registry: Registry::new(),
            requests: counter_vec("sparrow_serve_requests_total", "inference requests by HTTP status", "code"),
            rows: counter("sparrow_serve_rows_total", "rows scored"),
            seconds: Histogram::with_opts(HistogramOpts::new(
                "sparrow_serve_infer_seconds",
                "time to answer an inference request",
            ))
            .expect("valid metric"),
            model_step: int_gauge("sparrow_serve_model_step", "training step of the model served"),
            swaps: counter_vec("sparrow_serve_swaps_total", "--watch: exports applied, by kind (delta, full)", "kind"),
            swap_locked: gauge(
                "sparrow_serve_swap_lock_seconds",
                "--watch: how long the last swap held the model (requests waited, none failed)",
            ),
            staleness: gauge(
                "sparrow_serve_staleness_seconds",
                "--watch: at the last swap, the longest a row's update had waited to be served",
            ),
            watch_errors: counter(
                "sparrow_serve_watch_errors_total",
                "--watch: checks of LATEST that failed (an export that cannot be read or applied)",
            ),
            watch_failing: int_gauge(
                "sparrow_serve_watch_failing",
                "--watch: 1 while the newest export cannot be served (the model stays as it was)",
            ),
            connections_open: int_gauge("sparrow_serve_connections_open", "connections open now"),
            connections_refused: counter(
                "sparrow_serve_connections_refused_total",
                "connections refused at --max-connections with every open one busy",
            ),
            connections_evicted: counter(
                "sparrow_serve_connections_evicted_total",
                "idle connections closed at --max-connections to admit a new one",
            ),
            connections_timed_out: counter_vec(
                "sparrow_serve_connections_timed_out_total",
                "connections closed for time, by phase: header (--header-read-timeout-ms), idle \
                 (--idle-timeout-ms), request (--request-timeout-ms)",
                "phase",
            ),
            unauthorized: counter(
                "sparrow_serve_unauthorized_total",
                "requests refused for a missing or wrong bearer token",
            ),
        };
        for metric in [
            Box::new(m.requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.rows.clone()),
            Box::new(m.seconds.clone()),
            Box::new(m.model_step.clone()),
            Box::new(m.swaps.clone()),
            Box::new(m.swap_locked.clone()),
            Box::new(m.staleness.clone()),
            Box::new(m.watch_errors.clone()),
            Box::new(m.watch_failing.clone()),
            Box::new(m.connections_open.clone()),
            Box::new(m.connections_refused.clone()),
            Box::new(m.connections_evicted.clone()),
            Box::new(m.connections_timed_out.clone()),
            Box::new(m.unauthorized.clone()),
        ] {
            m.registry.register(metric).expect("registered once");
        }
        // Present from the start, so a scrape sees zeros rather than nothing.
        for phase in ["header", "idle", "request"] {
            m.connections_timed_out.with_label_values(&[phase]);
        }
        m
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = prometheus::TextEncoder::new().encode_utf8(&self.registry.gather(), &mut out);
        out
    }
}
