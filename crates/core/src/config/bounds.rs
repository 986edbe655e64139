//! The accepted range of every integer key that has one, in one table:
//! validation refuses a value outside it naming the key, and the generated
//! JSON Schema (so the book's reference, and editors) states the same
//! `minimum` and `maximum`, so the two cannot drift. Upper bounds stop a
//! value from allocating or waiting past what breaks
//! (`cluster.loader_queue_batches = 1000000000` grew the loader until it
//! was killed; `i64::MAX` milliseconds hung a job or overflowed a
//! deadline); each is far above any real setting.

use super::stream::MAX_FETCH_BYTES;
use super::tasks::{MAX_CLASSES, MAX_SEQUENCE_LEN};
use super::{Config, ConfigError, MAX_EMBEDDING_DIM, MAX_MERGE_BUFFER_ROWS};

const SECOND_MS: u128 = 1000;
const MINUTE_MS: u128 = 60 * SECOND_MS;
const HOUR_MS: u128 = 60 * MINUTE_MS;
const DAY_MS: u128 = 24 * HOUR_MS;
const YEAR_SECS: u128 = 366 * 24 * 3600;
/// No upper bound (the type's own).
const ANY: u128 = u64::MAX as u128;

/// One key's accepted values, both ends included. `key` is the key's path
/// in the schema (a list's items and an array of tables' keys included).
pub struct Range {
    pub key: &'static str,
    pub min: u128,
    pub max: u128,
    /// What the value counts (in the message past the upper bound).
    pub what: &'static str,
}

const fn range(key: &'static str, min: u128, max: u128, what: &'static str) -> Range {
    Range { key, min, max, what }
}

pub const RANGES: &[Range] = &[
    range("data.num_fields", 1, 1 << 16, "fields a row has"),
    range("data.prefetch_batches", 1, 1024, "batches held in memory"),
    range("data.report_bad_rows", 0, 1 << 20, "rows reported"),
    range("data.group_window_rows", 1, ANY, "rows"),
    range("data.shuffle_window_rows", 1, ANY, "rows"),
    range("data.schema.sequence.max_len", 1, MAX_SEQUENCE_LEN as u128, "IDs a history keeps"),
    range("data.stream.fetch_max_bytes", 1024, MAX_FETCH_BYTES as u128, "bytes a fetch asks for"),
    range("data.stream.max_unavailable_secs", 1, YEAR_SECS, "seconds"),
    range("data.stream.stop_when_idle_secs", 0, YEAR_SECS, "seconds"),
    range("data.stream.linger_ms", 0, HOUR_MS, "milliseconds"),
    range("data.stream.max_future_secs", 0, 10 * YEAR_SECS, "seconds"),
    range("data.weighting.merge_window_secs", 1, 1 << 32, "seconds"),
    range("data.weighting.merge_buffer_rows", 0, MAX_MERGE_BUFFER_ROWS as u128, "rows held in memory"),
    range("model.embedding_dim", 1, MAX_EMBEDDING_DIM as u128, "floats a row"),
    range("model.hidden", 1, 1 << 20, "units a layer"),
    range("model.bottom_hidden", 1, 1 << 20, "units a layer"),
    range("model.expert_hidden", 1, 1 << 20, "units a layer"),
    range("model.tower_hidden", 1, 1 << 20, "units a layer"),
    range("model.attention_hidden", 1, 1 << 20, "units a layer"),
    range("model.cross_layers", 0, 64, "layers"),
    range("model.tasks.classes", 2, MAX_CLASSES as u128, "classes"),
    range("model.experts", 1, 1 << 10, "experts"),
    range("model.task_experts", 1, 1 << 10, "experts a task"),
    range("model.levels", 1, 64, "levels"),
    range("eval.top_k", 1, ANY, "rows"),
    range("train.online_window_samples", 0, 10_000_000, "samples held in memory and sorted at every log line"),
    range("train.batch_size", 1, 1 << 22, "rows a batch holds in memory"),
    range("train.epochs", 1, ANY, "passes"),
    range("train.threads", 1, 1024, "threads"),
    range("train.log_interval_steps", 1, ANY, "steps"),
    range("train.pipeline_depth", 0, 16, "batches in flight (each keeps its rows)"),
    range("embedding.table_shards", 1, 1 << 16, "lock shards"),
    range("embedding.admit_min_count", 0, 255, "sightings (the sketch counts in bytes)"),
    range("embedding.admit_sketch_counters", 0, 1 << 32, "counters in memory"),
    range("checkpoint.keep", 1, 1 << 20, "versions kept"),
    range("checkpoint.full_every", 1, ANY, "checkpoints"),
    range("cluster.heartbeat_interval_ms", 1, MINUTE_MS, "milliseconds"),
    range("cluster.heartbeat_timeout_ms", 1, HOUR_MS, "milliseconds"),
    range("cluster.connect_timeout_ms", 0, HOUR_MS, "milliseconds"),
    range("cluster.progress_timeout_ms", 0, DAY_MS, "milliseconds"),
    range("cluster.max_message_bytes", 1024, 1 << 31, "bytes (gRPC's limit)"),
    range("cluster.loader_queue_batches", 1, 1024, "batches held in memory"),
    range("cluster.max_restarts", 0, 10_000, "restarts"),
    range("cluster.restart_window_secs", 0, 366 * 86_400, "seconds (a year)"),
    range("cluster.round_iterations", 1, 1 << 16, "batches a round holds"),
    range("cluster.pass_batches", 1, 1 << 20, "batches a pass stages"),
    range("cluster.lazy.max_local_iterations", 1, 1 << 30, "iterations"),
    range("cluster.lazy.probe_interval_ms", 1, MINUTE_MS, "milliseconds"),
    range("cluster.lazy.probe_timeout_ms", 1, MINUTE_MS, "milliseconds"),
];

/// Each ranged key's value in `c`: (the range's key, the key as the error
/// names it, the value). A list gives each item; a table the config leaves
/// out gives none.
fn values(c: &Config) -> Vec<(&'static str, String, u128)> {
    let (d, m, t, e, k, cl, lazy) =
        (&c.data, &c.model, &c.train, &c.embedding, &c.checkpoint, &c.cluster, &c.cluster.lazy);
    let mut out: Vec<(&'static str, u128)> = vec![
        ("data.prefetch_batches", d.prefetch_batches as u128),
        ("data.report_bad_rows", u128::from(d.report_bad_rows)),
        ("data.group_window_rows", d.group_window_rows as u128),
        ("data.shuffle_window_rows", d.shuffle_window_rows as u128),
        ("model.embedding_dim", m.embedding_dim as u128),
        ("model.cross_layers", m.cross_layers as u128),
        ("model.experts", m.experts as u128),
        ("model.task_experts", m.task_experts as u128),
        ("model.levels", m.levels as u128),
        ("eval.top_k", c.eval.top_k as u128),
        ("train.batch_size", t.batch_size as u128),
        ("train.epochs", u128::from(t.epochs)),
        ("train.threads", t.threads as u128),
        ("train.log_interval_steps", u128::from(t.log_interval_steps)),
        ("train.pipeline_depth", t.pipeline_depth as u128),
        ("embedding.table_shards", e.table_shards as u128),
        ("embedding.admit_min_count", u128::from(e.admit_min_count)),
        ("embedding.admit_sketch_counters", e.admit_sketch_counters as u128),
        ("checkpoint.keep", k.keep as u128),
        ("checkpoint.full_every", u128::from(k.full_every)),
        ("cluster.heartbeat_interval_ms", u128::from(cl.heartbeat_interval_ms)),
        ("cluster.heartbeat_timeout_ms", u128::from(cl.heartbeat_timeout_ms)),
        ("cluster.connect_timeout_ms", u128::from(cl.connect_timeout_ms)),
        ("cluster.progress_timeout_ms", u128::from(cl.progress_timeout_ms)),
        ("cluster.max_message_bytes", cl.max_message_bytes as u128),
        ("cluster.loader_queue_batches", cl.loader_queue_batches as u128),
        ("cluster.max_restarts", u128::from(cl.max_restarts)),
        ("cluster.restart_window_secs", u128::from(cl.restart_window_secs)),
        ("cluster.round_iterations", u128::from(cl.round_iterations)),
        ("cluster.pass_batches", u128::from(cl.pass_batches)),
        ("cluster.lazy.max_local_iterations", u128::from(lazy.max_local_iterations)),
        ("cluster.lazy.probe_interval_ms", u128::from(lazy.probe_interval_ms)),
        ("cluster.lazy.probe_timeout_ms", u128::from(lazy.probe_timeout_ms)),
    ];
    if let Some(n) = d.num_fields {
        out.push(("data.num_fields", n as u128));
    }
    if let Some(n) = t.online_window_samples {
        out.push(("train.online_window_samples", u128::from(n)));
    }
    out.extend(m.hidden.iter().map(|&u| ("model.hidden", u as u128)));
    out.extend(m.bottom_hidden.iter().map(|&u| ("model.bottom_hidden", u as u128)));
    out.extend(m.expert_hidden.iter().map(|&u| ("model.expert_hidden", u as u128)));
    out.extend(m.tower_hidden.iter().map(|&u| ("model.tower_hidden", u as u128)));
    out.extend(m.attention_hidden.iter().map(|&u| ("model.attention_hidden", u as u128)));
    if let Some(s) = &d.stream {
        out.extend([
            ("data.stream.fetch_max_bytes", u128::from(s.fetch_max_bytes)),
            ("data.stream.max_unavailable_secs", u128::from(s.max_unavailable_secs)),
            ("data.stream.stop_when_idle_secs", u128::from(s.stop_when_idle_secs)),
            ("data.stream.linger_ms", u128::from(s.linger_ms)),
            ("data.stream.max_future_secs", u128::from(s.max_future_secs)),
        ]);
    }
    if let Some(w) = &d.weighting {
        out.push(("data.weighting.merge_window_secs", u128::from(w.merge_window_secs)));
        out.push(("data.weighting.merge_buffer_rows", w.merge_buffer_rows as u128));
    }
    let mut named: Vec<(&'static str, String, u128)> = out.into_iter().map(|(k, v)| (k, k.to_string(), v)).collect();
    if let Some(schema) = &d.schema {
        for (i, q) in schema.sequence.iter().enumerate() {
            named.push((
                "data.schema.sequence.max_len",
                format!("data.schema.sequence[{i}].max_len"),
                q.max_len as u128,
            ));
        }
    }
    for (i, task) in m.tasks.iter().enumerate() {
        if let Some(classes) = task.classes {
            named.push(("model.tasks.classes", format!("model.tasks[{i}].classes"), classes as u128));
        }
    }
    named
}

/// The range of `key` (a key of [`RANGES`]).
pub fn range_of(key: &str) -> Option<&'static Range> {
    RANGES.iter().find(|r| r.key == key)
}

/// The first key outside its range, named with its value and the range.
pub(super) fn check(config: &Config) -> Result<(), ConfigError> {
    for (key, shown, value) in values(config) {
        let Some(r) = range_of(key) else { continue };
        let message = if value < r.min && r.max == ANY {
            format!("{value}: must be at least {}", r.min)
        } else if value < r.min {
            format!("{value}: must be between {} and {} ({})", r.min, r.max, r.what)
        } else if value > r.max {
            format!("{value} is past the largest accepted, {} ({})", r.max, r.what)
        } else {
            continue;
        };
        return Err(ConfigError::Invalid { key: shown, message });
    }
    Ok(())
}

/// Writes each range into `schema` (the config's, as schemars made it):
/// `minimum` and `maximum` on the key's property (on a list's items).
pub(super) fn annotate(schema: &mut serde_json::Value) {
    for r in RANGES {
        let Some(property) = property_mut(schema, r.key) else { continue };
        let is_list = property.get("type").and_then(serde_json::Value::as_str) == Some("array");
        let target = if is_list { property.get_mut("items") } else { Some(property) };
        if let Some(map) = target.and_then(serde_json::Value::as_object_mut) {
            map.insert("minimum".into(), (r.min as u64).into());
            if r.max < ANY {
                map.insert("maximum".into(), (r.max as u64).into());
            } else {
                map.remove("maximum");
            }
        }
    }
}

/// The schema of key `path` (dotted), through `$ref`s into the
/// definitions, `allOf` wrappers, and an array of tables' items.
pub(super) fn property_mut<'s>(schema: &'s mut serde_json::Value, path: &str) -> Option<&'s mut serde_json::Value> {
    let mut location: Vec<String> = Vec::new();
    let mut node = &*schema;
    for key in path.split('.') {
        let table = resolve(schema, node, &mut location)?;
        node = table.get("properties")?.get(key)?;
        location.extend(["properties".to_string(), key.to_string()]);
    }
    let mut target = schema;
    for step in &location {
        target = target.get_mut(step.as_str())?;
    }
    Some(target)
}

/// The table `node` stands for (itself, or what its `$ref`, `allOf[0]` or
/// `items` points to), with `location` moved to it.
fn resolve<'s>(
    root: &'s serde_json::Value,
    node: &'s serde_json::Value,
    location: &mut Vec<String>,
) -> Option<&'s serde_json::Value> {
    let inner = node.get("allOf").and_then(|a| a.get(0)).or(node.get("items")).unwrap_or(node);
    match inner.get("$ref").and_then(serde_json::Value::as_str).and_then(|r| r.rsplit('/').next()) {
        Some(name) => {
            *location = vec!["definitions".to_string(), name.to_string()];
            root.get("definitions")?.get(name)
        }
        None => Some(node),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Overrides;

    fn set(key: &str, value: u128) -> Result<Config, ConfigError> {
        let text = format!("{key}={value}");
        Overrides::parse(&[text]).and_then(|o| Config::from_toml("", "test", &o))
    }

    /// Every plain key of the table (present in a default config): its
    /// ends pass, one past either end is refused naming the key (u64::MAX
    /// and i64::MAX included).
    #[test]
    fn every_range_holds_at_its_ends() {
        let defaults = Config::default();
        check(&defaults).expect("the defaults are within range");
        for (key, _, _) in values(&defaults) {
            let r = range_of(key).expect("a range");
            if key.ends_with("_hidden") || key == "model.hidden" {
                continue;
            }
            for at in [r.min, r.max.min(i64::MAX as u128)] {
                if let Err(e) = set(key, at) {
                    // Another rule may refuse an end (table shards a power of two, timeouts in order).
                    let e = e.to_string();
                    assert!(
                        !e.contains("past the largest") && !e.contains(&format!("{at}: must be")),
                        "{key}={at}: {e}"
                    );
                }
            }
            let mut outside = vec![r.max + 1, i64::MAX as u128];
            if r.min > 0 {
                outside.push(r.min - 1);
            }
            for past in outside.into_iter().filter(|&v| v <= i64::MAX as u128 && (v < r.min || v > r.max)) {
                let e = set(key, past).err().unwrap_or_else(|| panic!("{key}={past} accepted"));
                assert!(e.to_string().contains(key), "{key}={past}: {e}");
            }
        }
        let e = Overrides::parse(&["model.hidden=[8, 2000000]"])
            .and_then(|o| Config::from_toml("", "test", &o))
            .expect_err("hidden");
        assert!(e.to_string().contains("model.hidden"), "{e}");
        let e =
            Overrides::parse(&["model.hidden=[8, 0]"]).and_then(|o| Config::from_toml("", "test", &o)).expect_err("0");
        assert!(e.to_string().contains("model.hidden") && e.to_string().contains("between 1 and"), "{e}");
    }

    /// The schema states each range as validation does: every key of the
    /// table is found in it with exactly its `minimum` and `maximum`.
    #[test]
    fn the_schema_states_each_range_validation_enforces() {
        let mut schema = crate::config::json_schema();
        for r in RANGES {
            let property = property_mut(&mut schema, r.key).unwrap_or_else(|| panic!("{} is not in the schema", r.key));
            let target = if property["type"] == "array" { &property["items"] } else { &*property };
            assert_eq!(target["minimum"], serde_json::json!(r.min as u64), "{}", r.key);
            let max = if r.max < ANY { serde_json::json!(r.max as u64) } else { serde_json::Value::Null };
            assert_eq!(target["maximum"], max, "{}", r.key);
        }
        let fetch = property_mut(&mut schema, "data.stream.fetch_max_bytes").expect("fetch_max_bytes").clone();
        assert_eq!((fetch["minimum"].as_u64(), fetch["maximum"].as_u64()), (Some(1024), Some(MAX_FETCH_BYTES as u64)));
    }
}
