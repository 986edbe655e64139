//! The Kafka client behind a small blocking API, for a reader thread.
//!
//! The client is `rskafka` (InfluxData's): pure Rust, so nothing like
//! librdkafka has to be built, and it fetches by offset, which is all a
//! trainer needs whose checkpoints hold the offsets (no consumer group).
//! Every call runs on the broker's own single-threaded runtime; one that
//! cannot reach the broker retries with backoff for `max_unavailable` and
//! then fails naming the brokers, the topic and the partition.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use rskafka::BackoffConfig;
use rskafka::client::error::{Error as KafkaError, ProtocolError};
use rskafka::client::partition::{Compression, OffsetAt, PartitionClient, UnknownTopicHandling};
use rskafka::client::{Client, ClientBuilder};
use rskafka::record::{Record, RecordAndOffset};
use sparrow_data::DataError;

use crate::access::Access;
use crate::connection::{ConnectError, first_contact};

/// How long the first contact waits for a broker's answer.
const FIRST_CONTACT: Duration = Duration::from_secs(10);

/// What a fetch found: records from the offset asked for, and the
/// partition's end (the offset the next appended record will get).
pub struct Fetched {
    pub records: Vec<RecordAndOffset>,
    pub high_watermark: i64,
}

/// Why a fetch found nothing to return.
pub enum FetchError {
    /// The offset is no longer (or not yet) in the partition.
    OutOfRange,
    Failed(DataError),
}

pub struct Broker {
    runtime: tokio::runtime::Runtime,
    client: Client,
    topic: String,
    /// For messages: the bootstrap list.
    brokers: String,
    partitions: BTreeMap<i32, PartitionClient>,
    max_unavailable: Duration,
}

impl Broker {
    /// Connects to the brokers for `topic`; an unreachable broker is
    /// retried for `max_unavailable`, one that refuses us (TLS, SASL) fails
    /// at once.
    pub fn connect(access: &Access, topic: &str, max_unavailable: Duration) -> Result<Broker, DataError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| DataError::Stream(format!("kafka: cannot start the client's runtime: {e}")))?;
        let backoff = BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            base: 2.0,
            deadline: Some(max_unavailable),
        };
        let names = access.brokers.join(",");
        let protocol = access.protocol();
        // A first contact of our own: the Kafka client retries a broker
        // that refuses us as one that is down, for max_unavailable.
        let first = match first_contact(access, max_unavailable.min(FIRST_CONTACT)) {
            Ok(()) => None,
            Err(ConnectError::Refused(why)) => {
                return Err(DataError::Stream(format!("kafka {names} ({protocol}): cannot connect: {why}")));
            }
            Err(ConnectError::Unreachable(why)) => {
                tracing::debug!("kafka {names}: no answer yet ({why}): retrying for data.stream.max_unavailable_secs");
                Some(why)
            }
        };
        let mut builder = ClientBuilder::new(access.brokers.clone()).client_id("sparrow").backoff_config(backoff);
        if let Some(tls) = &access.tls {
            builder = builder.tls_config(tls.clone());
        }
        if let Some(sasl) = access.rskafka_sasl() {
            builder = builder.sasl_config(sasl);
        }
        let client = block(&runtime, max_unavailable, builder.build()).map_err(|e| {
            let first = first.as_ref().map(|w| format!(" (the first attempt: {w})")).unwrap_or_default();
            DataError::Stream(format!("kafka {names} ({protocol}): cannot connect: {e}{first}"))
        })?;
        Ok(Broker {
            runtime,
            client,
            topic: topic.to_string(),
            brokers: names,
            partitions: BTreeMap::new(),
            max_unavailable,
        })
    }

    fn error(&self, partition: Option<i32>, what: &str, e: impl std::fmt::Display) -> DataError {
        let at = partition.map(|p| format!(" partition {p}")).unwrap_or_default();
        DataError::Stream(format!("kafka {}: topic {}{at}: {what}: {e}", self.brokers, self.topic))
    }

    /// The topic's partitions, sorted; a missing topic is an error naming it.
    pub fn partitions(&self) -> Result<Vec<i32>, DataError> {
        let topics = block(&self.runtime, self.max_unavailable, self.client.list_topics())
            .map_err(|e| self.error(None, "cannot list topics", e))?;
        match topics.into_iter().find(|t| t.name == self.topic) {
            Some(t) => Ok(t.partitions.into_iter().collect()),
            None => Err(DataError::Stream(format!("kafka {}: topic {:?} does not exist", self.brokers, self.topic))),
        }
    }

    /// Creates the topic with `partitions` partitions (single replica).
    pub fn create_topic(&self, partitions: i32) -> Result<(), DataError> {
        let controller = self.client.controller_client().map_err(|e| self.error(None, "no controller", e))?;
        block(&self.runtime, self.max_unavailable, controller.create_topic(&self.topic, partitions, 1, 30_000))
            .map_err(|e| self.error(None, "cannot create the topic", e))
    }

    /// Opens the clients of `partitions` (each talks to its leader).
    pub fn open(&mut self, partitions: &[i32]) -> Result<(), DataError> {
        for &p in partitions {
            if self.partitions.contains_key(&p) {
                continue;
            }
            let open = self.client.partition_client(self.topic.clone(), p, UnknownTopicHandling::Retry);
            let client = block(&self.runtime, self.max_unavailable, open)
                .map_err(|e| self.error(Some(p), "cannot reach its leader", e))?;
            self.partitions.insert(p, client);
        }
        Ok(())
    }

    fn client(&self, p: i32) -> &PartitionClient {
        &self.partitions[&p]
    }

    /// The partition's earliest kept, latest, or first at-or-after-a-time offset.
    pub fn offset(&self, p: i32, at: OffsetAt) -> Result<i64, DataError> {
        block(&self.runtime, self.max_unavailable, self.client(p).get_offset(at))
            .map_err(|e| self.error(Some(p), "cannot list its offsets", e))
    }

    /// Fetches from each `(partition, offset)` at once, each up to
    /// `max_bytes`, waiting up to `wait_ms` for a record to arrive.
    pub fn fetch(&self, asks: &[(i32, i64)], max_bytes: i32, wait_ms: i32) -> Vec<Result<Fetched, FetchError>> {
        let fetches = asks.iter().map(|&(p, offset)| self.client(p).fetch_records(offset, 1..max_bytes, wait_ms));
        let limit = self.max_unavailable + Duration::from_millis(wait_ms.max(0) as u64);
        let results =
            self.runtime.block_on(async { tokio::time::timeout(limit, futures::future::join_all(fetches)).await });
        let Ok(results) = results else {
            let e = format!("no answer within data.stream.max_unavailable_secs = {}", self.max_unavailable.as_secs());
            return asks.iter().map(|&(p, _)| Err(FetchError::Failed(self.error(Some(p), "fetch", &e)))).collect();
        };
        results
            .into_iter()
            .zip(asks)
            .map(|(r, &(p, _))| match r {
                Ok((records, high_watermark)) => Ok(Fetched { records, high_watermark }),
                Err(KafkaError::ServerError { protocol_error: ProtocolError::OffsetOutOfRange, .. }) => {
                    Err(FetchError::OutOfRange)
                }
                Err(e) => Err(FetchError::Failed(self.error(Some(p), "fetch", e))),
            })
            .collect()
    }

    /// Appends `records` to partition `p`; their offsets.
    pub fn produce(&self, p: i32, records: Vec<Record>) -> Result<Vec<i64>, DataError> {
        block(&self.runtime, self.max_unavailable, self.client(p).produce(records, Compression::NoCompression))
            .map_err(|e| self.error(Some(p), "produce", e))
    }
}

/// Runs `f` to completion on `runtime`, failing after `limit`.
fn block<T>(
    runtime: &tokio::runtime::Runtime,
    limit: Duration,
    f: impl Future<Output = Result<T, KafkaError>>,
) -> Result<T, String> {
    match runtime.block_on(async { tokio::time::timeout(limit, f).await }) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {} s (data.stream.max_unavailable_secs)", limit.as_secs())),
    }
}
