//! Sparrow's stream layer: training data from a Kafka topic
//! (`[data.stream]`), cut into the same batches the file readers make, with
//! the read positions every checkpoint keeps; and a producer for demos and
//! tests (`sparrow produce`).
//!
//! This is the only crate that talks to Kafka.

pub mod access;
pub mod broker;
pub mod connection;
pub mod continuity;
pub mod describe;
pub mod produce;
pub mod reader;

pub use access::Access;
pub use broker::Broker;
pub use reader::spawn;
