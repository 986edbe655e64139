//! Upper bounds of every size, count and duration key: a value past its
//! bound is refused naming the key, before anything is allocated or waited
//! on (`cluster.loader_queue_batches = 1000000000` grew the loader until it
//! was killed; `i64::MAX` milliseconds hung a job or overflowed a deadline).
//! Each bound is far above any real setting and below what breaks.

use super::{Config, ConfigError};

const SECOND_MS: u128 = 1000;
const MINUTE_MS: u128 = 60 * SECOND_MS;
const HOUR_MS: u128 = 60 * MINUTE_MS;
const DAY_MS: u128 = 24 * HOUR_MS;

/// (key, value, largest accepted, what the value holds).
type Bound = (&'static str, u128, u128, &'static str);

fn bounds(c: &Config) -> Vec<Bound> {
    let (d, m, t, e, k, cl, lazy) =
        (&c.data, &c.model, &c.train, &c.embedding, &c.checkpoint, &c.cluster, &c.cluster.lazy);
    let mut out: Vec<Bound> = vec![
        ("data.num_fields", d.num_fields.unwrap_or(0) as u128, 1 << 16, "fields a row has"),
        ("data.prefetch_batches", d.prefetch_batches as u128, 1024, "batches held in memory"),
        ("data.report_bad_rows", u128::from(d.report_bad_rows), 1 << 20, "rows reported"),
        ("model.cross_layers", m.cross_layers as u128, 64, "layers"),
        ("train.batch_size", t.batch_size as u128, 1 << 22, "rows a batch holds in memory"),
        ("train.threads", t.threads as u128, 1024, "threads"),
        ("embedding.table_shards", e.table_shards as u128, 1 << 16, "lock shards"),
        ("embedding.admit_sketch_counters", e.admit_sketch_counters as u128, 1 << 32, "counters in memory"),
        ("checkpoint.keep", k.keep as u128, 1 << 20, "versions kept"),
        ("cluster.heartbeat_interval_ms", u128::from(cl.heartbeat_interval_ms), MINUTE_MS, "milliseconds"),
        ("cluster.heartbeat_timeout_ms", u128::from(cl.heartbeat_timeout_ms), HOUR_MS, "milliseconds"),
        ("cluster.connect_timeout_ms", u128::from(cl.connect_timeout_ms), HOUR_MS, "milliseconds"),
        ("cluster.progress_timeout_ms", u128::from(cl.progress_timeout_ms), DAY_MS, "milliseconds"),
        ("cluster.max_message_bytes", cl.max_message_bytes as u128, 1 << 31, "bytes (gRPC's limit)"),
        ("cluster.loader_queue_batches", cl.loader_queue_batches as u128, 1024, "batches held in memory"),
        ("cluster.max_restarts", u128::from(cl.max_restarts), 10_000, "restarts"),
        ("cluster.round_iterations", u128::from(cl.round_iterations), 1 << 16, "batches a round holds"),
        ("cluster.pass_batches", u128::from(cl.pass_batches), 1 << 20, "batches a pass stages"),
        ("cluster.lazy.max_local_iterations", u128::from(lazy.max_local_iterations), 1 << 30, "iterations"),
        ("cluster.lazy.probe_interval_ms", u128::from(lazy.probe_interval_ms), MINUTE_MS, "milliseconds"),
        ("cluster.lazy.probe_timeout_ms", u128::from(lazy.probe_timeout_ms), MINUTE_MS, "milliseconds"),
    ];
    for &units in &m.hidden {
        out.push(("model.hidden", units as u128, 1 << 20, "units a layer"));
    }
    for &units in &m.bottom_hidden {
        out.push(("model.bottom_hidden", units as u128, 1 << 20, "units a layer"));
    }
    if let Some(s) = &d.stream {
        out.push(("data.stream.max_future_secs", u128::from(s.max_future_secs), 10 * 366 * 24 * 3600, "seconds"));
    }
    if let Some(w) = &d.weighting {
        out.push(("data.weighting.merge_window_secs", u128::from(w.merge_window_secs), 1 << 32, "seconds"));
    }
    out
}

/// The first key past its bound, named with its value and the bound.
pub(super) fn check(config: &Config) -> Result<(), ConfigError> {
    for (key, value, max, what) in bounds(config) {
        if value > max {
            return Err(ConfigError::Invalid {
                key: key.to_string(),
                message: format!("{value} is past the largest accepted, {max} ({what})"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Overrides;

    /// Every bounded key: the default passes, its bound passes, one past it
    /// is refused naming the key (u64::MAX and i64::MAX included).
    #[test]
    fn every_bound_holds_at_its_edge() {
        let defaults = Config::default();
        check(&defaults).expect("the defaults are within bounds");
        for (key, _, max, _) in bounds(&defaults) {
            let set = |value: u128| {
                let text = format!("{key}={value}");
                Overrides::parse(&[text]).and_then(|o| Config::from_toml("", "test", &o))
            };
            if key == "model.hidden" || key == "model.bottom_hidden" || key.starts_with("data.weighting") {
                continue;
            }
            if let Err(e) = set(max) {
                // Another rule of the key may refuse its bound (e.g. table shards a power of two).
                assert!(!e.to_string().contains("past the largest"), "{key} at its bound: {e}");
            }
            for past in [max + 1, u128::from(u64::MAX), i64::MAX as u128] {
                let e = set(past).err().unwrap_or_else(|| panic!("{key}={past} accepted"));
                assert!(e.to_string().contains(key), "{key}={past}: {e}");
            }
        }
        let e = Overrides::parse(&["model.hidden=[8, 2000000]"])
            .and_then(|o| Config::from_toml("", "test", &o))
            .expect_err("hidden");
        assert!(e.to_string().contains("model.hidden"), "{e}");
    }
}
