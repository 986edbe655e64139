//! `[data.stream]`: training data read from a Kafka topic instead of
//! `data.train`. The read positions (partition → next offset) are part of
//! every checkpoint, so a resumed or recovered job continues exactly where
//! the model stopped (issue 40).

use serde::{Deserialize, Serialize};

use super::stream_auth::{StreamSasl, StreamTls};
use super::{ConfigError, DataFormat};

#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StreamConfig {
    /// The broker protocol: `kafka` (any Kafka-protocol broker).
    pub kind: StreamKind,
    /// Bootstrap brokers, `host:port`.
    pub brokers: Vec<String>,
    /// The topic read (required).
    pub topic: String,
    /// `"all"` or a list of partition numbers.
    pub partitions: Partitions,
    /// Where a run that has no checkpointed offset for a partition starts:
    /// `"earliest"`, `"latest"`, `{ timestamp = UNIX_SECS }` (the first
    /// record at or after it), or `"checkpoint"` (a checkpoint must hold the
    /// partition's offset). A checkpointed offset always wins.
    pub start: StreamStart,
    /// Each record's value is one row in this format (criteo, csv with the
    /// schema, libsvm, libffm); default: `data.format`.
    pub format: Option<DataFormat>,
    /// CSV records carry no header line: the columns' names in order, as a
    /// header line would give them (needed when `data.schema.header = true`).
    pub header: Option<String>,
    /// 0: run until stopped; N: stop (checkpoint, exit 0) after N s without
    /// a new record.
    pub stop_when_idle_secs: u64,
    /// The broker unreachable this long: the job fails, with a checkpoint.
    pub max_unavailable_secs: u64,
    /// A checkpointed offset the broker no longer holds (retention deleted
    /// it): `"fail"` names the partition and both offsets; `"skip"` goes on
    /// at the oldest record kept and counts the records lost.
    pub on_retention_gap: RetentionGap,
    /// The partition's log went backwards: its end is before the next
    /// offset to read, or the record last read there is no longer the one
    /// read (a broker restarted empty, a topic deleted and created again, a
    /// checkpoint from another topic's log). `"fail"` stops the job naming
    /// the partition, both offsets and the likely cause; `"earliest"` goes
    /// on from the log's first record, `"latest"` from its end. Either is
    /// logged and counted (`stream_offset_resets`).
    pub on_offset_reset: OffsetReset,
    /// Offsets the broker skipped inside a partition (a fetch answered from
    /// past the offset asked, or records missing between two read): counted
    /// as `stream_gap_records` and named in the log. `"fail"` stops the job
    /// unless the topic's `cleanup.policy` (read from the broker) is
    /// `compact`, where gaps are compaction's work; `"skip"` goes on.
    pub on_gap: GapPolicy,
    /// A batch short of `train.batch_size` (every partition read to its end)
    /// waits this long for more records before it is trained.
    pub linger_ms: u64,
    /// Bytes asked of the broker per fetch and partition.
    pub fetch_max_bytes: u32,
    /// A record stamped more than this many seconds ahead of the reader's
    /// clock is trained, but its time moves no clock (`embedding.ttl_secs`'
    /// event time, `[data.weighting]`'s ages): one record stamped a century
    /// ahead would otherwise stop expiry for good. Counted as
    /// `future_records` (the final JSON, `/metrics`), with a warning.
    pub max_future_secs: u64,
    /// TLS to the brokers (`[data.stream.tls]`); absent: plain TCP.
    pub tls: Option<StreamTls>,
    /// SASL authentication (`[data.stream.sasl]`); absent: none.
    pub sasl: Option<StreamSasl>,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            kind: StreamKind::Kafka,
            brokers: vec!["127.0.0.1:9092".into()],
            topic: String::new(),
            partitions: Partitions::All,
            start: StreamStart::Earliest,
            format: None,
            header: None,
            stop_when_idle_secs: 0,
            max_unavailable_secs: 300,
            on_retention_gap: RetentionGap::Fail,
            on_offset_reset: OffsetReset::Fail,
            on_gap: GapPolicy::Fail,
            linger_ms: 100,
            fetch_max_bytes: 4 << 20,
            // Kafka's own bound on a record's time ahead of the broker's
            // (`log.message.timestamp.after.max.ms`, Kafka 3.6 on): an hour.
            max_future_secs: 3600,
            tls: None,
            sasl: None,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StreamKind {
    #[default]
    Kafka,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Partitions {
    #[default]
    All,
    Some(Vec<i32>),
}

impl Serialize for Partitions {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Partitions::All => s.serialize_str("all"),
            Partitions::Some(list) => list.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Partitions {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Word(String),
            List(Vec<i32>),
        }
        match Raw::deserialize(d)? {
            Raw::Word(w) if w == "all" => Ok(Partitions::All),
            Raw::Word(w) => {
                Err(serde::de::Error::custom(format!("expected \"all\" or a list of partitions, not {w:?}")))
            }
            Raw::List(list) => Ok(Partitions::Some(list)),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamStart {
    #[default]
    Earliest,
    Latest,
    /// Unix seconds.
    Timestamp(i64),
    Checkpoint,
}

impl Serialize for StreamStart {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self {
            StreamStart::Earliest => s.serialize_str("earliest"),
            StreamStart::Latest => s.serialize_str("latest"),
            StreamStart::Checkpoint => s.serialize_str("checkpoint"),
            StreamStart::Timestamp(t) => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("timestamp", t)?;
                m.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for StreamStart {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct At {
            timestamp: i64,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Word(String),
            At(At),
        }
        let expected = "expected \"earliest\", \"latest\", \"checkpoint\" or { timestamp = UNIX_SECS }";
        match Raw::deserialize(d).map_err(|_| serde::de::Error::custom(expected))? {
            Raw::Word(w) => match w.as_str() {
                "earliest" => Ok(StreamStart::Earliest),
                "latest" => Ok(StreamStart::Latest),
                "checkpoint" => Ok(StreamStart::Checkpoint),
                _ => Err(serde::de::Error::custom(format!("{expected}, not {w:?}"))),
            },
            Raw::At(At { timestamp }) => Ok(StreamStart::Timestamp(timestamp)),
        }
    }
}

// Hand-written schemas for the two keys whose serde is hand-written: the
// schema must accept exactly what `Deserialize` accepts.
impl schemars::JsonSchema for Partitions {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Partitions".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "`\"all\"`, or a list of partition numbers (at least one, none twice).",
            "oneOf": [
                { "const": "all", "description": "Every partition of the topic." },
                { "type": "array", "items": { "type": "integer", "minimum": 0 }, "minItems": 1, "uniqueItems": true }
            ]
        })
    }
}

impl schemars::JsonSchema for StreamStart {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "StreamStart".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Where a partition without a checkpointed offset starts.",
            "oneOf": [
                { "const": "earliest", "description": "Its oldest record kept." },
                { "const": "latest", "description": "Records appended from now on." },
                { "const": "checkpoint", "description": "Nowhere: a checkpoint must hold its offset." },
                {
                    "type": "object",
                    "description": "The first record at or after a time.",
                    "properties": { "timestamp": {
                        "type": "integer", "minimum": 0, "maximum": MAX_START_SECS,
                        "description": "Unix seconds (a time after now starts at the partition's end)."
                    } },
                    "required": ["timestamp"],
                    "additionalProperties": false
                }
            ]
        })
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RetentionGap {
    #[default]
    Fail,
    Skip,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OffsetReset {
    #[default]
    Fail,
    Earliest,
    Latest,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GapPolicy {
    #[default]
    Fail,
    Skip,
}

/// The latest `start = { timestamp }`: the end of the year 9999.
pub const MAX_START_SECS: i64 = 253_402_300_799;

/// The largest fetch asked of a broker per partition (Kafka's own default
/// `max.partition.fetch.bytes` is 1 MiB; a record must fit in one fetch).
pub const MAX_FETCH_BYTES: u32 = 256 << 20;

impl StreamConfig {
    /// The format of each record's value.
    pub fn value_format(&self, data_format: DataFormat) -> DataFormat {
        self.format.unwrap_or(data_format)
    }

    pub(super) fn validate(&self, data: &super::DataConfig) -> Result<(), ConfigError> {
        let invalid =
            |key: &str, message: String| Err(ConfigError::Invalid { key: format!("data.stream.{key}"), message });
        if self.brokers.is_empty() {
            return invalid("brokers", "name at least one broker, e.g. [\"127.0.0.1:9092\"]".into());
        }
        if let Some(b) = self.brokers.iter().find(|b| b.rsplit_once(':').is_none_or(|(_, p)| p.parse::<u16>().is_err()))
        {
            return invalid("brokers", format!("{b:?} is not host:port"));
        }
        if self.topic.is_empty() {
            return invalid("topic", "name the topic to read".into());
        }
        if let Partitions::Some(list) = &self.partitions {
            if list.is_empty() {
                return invalid("partitions", "an empty list reads nothing: \"all\" or partition numbers".into());
            }
            if let Some(p) = list.iter().find(|&&p| p < 0) {
                return invalid("partitions", format!("{p} is not a partition number"));
            }
            let mut sorted = list.clone();
            sorted.sort_unstable();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return invalid("partitions", "a partition is listed twice".into());
            }
        }
        let format = self.value_format(data.format);
        if format == DataFormat::Parquet {
            return invalid("format", "a record's value is one text row: criteo, csv, libsvm or libffm".into());
        }
        if format == DataFormat::Csv
            && data.schema.as_ref().is_none_or(|s| s.header)
            && self.header.as_deref().is_none_or(str::is_empty)
        {
            return invalid(
                "header",
                "CSV records have no header line: give the columns' names in order (\"label,price,item\"), or set data.schema.header = false and name columns by number".into(),
            );
        }
        if let StreamStart::Timestamp(secs) = self.start
            && !(0..=MAX_START_SECS).contains(&secs)
        {
            return invalid(
                "start",
                format!(
                    "{{ timestamp = {secs} }}: Unix seconds between 0 and {MAX_START_SECS} (the year 9999); \
                     \"earliest\" and \"latest\" name the partition's ends"
                ),
            );
        }
        if let Some(tls) = &self.tls {
            tls.validate()?;
        }
        if let Some(sasl) = &self.sasl {
            sasl.validate()?;
        }
        if let Some(w) = &data.weighting {
            // Age is counted from the stream's event clock, and merging stays
            // within a batch so that checkpoints stay at record offsets.
            if w.reference_time.is_some() {
                return Err(ConfigError::Invalid {
                    key: "data.weighting.reference_time".into(),
                    message: "is not used with [data.stream]: a stream's samples age from its event clock \
                              (the newest record time read so far)"
                        .into(),
                });
            }
            if w.merge_buffer_rows > 0 {
                return Err(ConfigError::Invalid {
                    key: "data.weighting.merge_buffer_rows".into(),
                    message: "is not used with [data.stream]: a stream merges identical samples within each \
                              batch as it is cut (train.batch_size records), so checkpoints stay at record offsets"
                        .into(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<crate::Config, ConfigError> {
        crate::Config::from_toml(text, "test", &super::super::Overrides::default())
    }

    #[test]
    fn the_contract_keys_parse_and_bad_values_name_their_key() {
        let c = parse(
            "[data.stream]\nkind = \"kafka\"\nbrokers = [\"127.0.0.1:9092\"]\ntopic = \"impressions\"\npartitions = [0, 3]\nstart = { timestamp = 1700000000 }\nformat = \"criteo\"\nstop_when_idle_secs = 5\nmax_unavailable_secs = 30\n",
        )
        .expect("parses");
        let s = c.data.stream.expect("stream");
        assert_eq!(s.partitions, Partitions::Some(vec![0, 3]));
        assert_eq!(s.start, StreamStart::Timestamp(1_700_000_000));
        assert_eq!((s.stop_when_idle_secs, s.max_unavailable_secs), (5, 30));
        for (start, want) in [
            ("earliest", StreamStart::Earliest),
            ("latest", StreamStart::Latest),
            ("checkpoint", StreamStart::Checkpoint),
        ] {
            let c = parse(&format!("[data.stream]\ntopic = \"t\"\npartitions = \"all\"\nstart = \"{start}\"\n"))
                .expect("parses");
            assert_eq!(c.data.stream.as_ref().map(|s| s.start), Some(want));
            // It writes back as it was read (the config travels as TOML).
            let again = parse(&toml::to_string(&c).expect("toml")).expect("round trip");
            assert_eq!(again.data.stream, c.data.stream);
        }
        for (text, key) in [
            ("topic = \"t\"\nstart = \"newest\"", "start"),
            ("topic = \"t\"\npartitions = \"some\"", "partitions"),
            ("topic = \"t\"\nbrokers = [\"localhost\"]", "data.stream.brokers"),
            ("topic = \"\"", "data.stream.topic"),
            ("topic = \"t\"\npartitions = [1, 1]", "data.stream.partitions"),
            ("topic = \"t\"\nformat = \"parquet\"", "data.stream.format"),
            ("topic = \"t\"\nformat = \"csv\"", "data.stream.header"),
            ("topic = \"t\"\ngroup = \"g\"", "group"),
        ] {
            let e = parse(&format!("[data.stream]\n{text}\n")).expect_err(text).to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn age_weighting_on_a_stream_dates_samples_by_their_records() {
        // No timestamp column needed, any text format: the record is the time.
        let c = parse("[data.stream]\ntopic = \"t\"\n[data.weighting]\ndecay_base = 2.0\n").expect("parses");
        assert!(c.data.weighting.is_some());
        for (text, key) in [
            ("reference_time = 1700000000", "data.weighting.reference_time"),
            ("merge_buffer_rows = 4096", "data.weighting.merge_buffer_rows"),
        ] {
            let e = parse(&format!("[data.stream]\ntopic = \"t\"\n[data.weighting]\n{text}\n"))
                .expect_err(text)
                .to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
        // A file still needs its timestamp column.
        let e = parse("[data]\ntrain = \"x.csv\"\n[data.weighting]\n").expect_err("no column").to_string();
        assert!(e.contains("data.schema.timestamp"), "{e}");
    }
}
