//! A topic's `cleanup.policy`, asked of a broker with Kafka's
//! DescribeConfigs (API key 32; version 4, the flexible encoding Kafka 2.6
//! on and tansu speak, then version 1 for older brokers): whether offsets missing inside a
//! partition are compaction's work or records lost. rskafka does not send
//! this request, so it is written here, on its own short connection to a
//! bootstrap broker. A broker that does not answer it leaves the policy
//! unknown (`None`), which the reader takes as "not compacted".

use std::time::Duration;

use crate::access::Access;
use crate::connection::{Connection, string};

const DESCRIBE_CONFIGS: i16 = 32;
const TOPIC: i8 = 2;

/// `topic`'s `cleanup.policy` as the first of the brokers that answers
/// says (over the job's TLS and SASL), or why none did.
pub fn cleanup_policy(access: &Access, topic: &str, timeout: Duration) -> Result<Option<String>, String> {
    let mut last = String::from("no broker");
    for broker in &access.brokers {
        for version in [4, 1] {
            match ask(broker, access, topic, version, timeout) {
                Ok(policy) => return Ok(policy),
                Err(e) => last = format!("{broker}: {e}"),
            }
        }
    }
    Err(last)
}

fn ask(broker: &str, access: &Access, topic: &str, version: i16, timeout: Duration) -> Result<Option<String>, String> {
    let mut conn = Connection::open(broker, access, timeout).map_err(|e| e.to_string())?;
    let flexible = version >= 4;
    let answer =
        conn.call_with(DESCRIBE_CONFIGS, version, flexible, &request(topic, version)).map_err(|e| e.to_string())?;
    policy_of(&answer, topic, flexible)
}

/// The request's body: one topic resource asking for all its configs
/// (naming the one key makes tansu 0.6.0 drop the connection), without
/// synonyms.
fn request(topic: &str, version: i16) -> Vec<u8> {
    let flexible = version >= 4;
    let mut b = Vec::new();
    let text = |b: &mut Vec<u8>, s: &str| {
        if flexible {
            varint(b, s.len() as u32 + 1);
            b.extend(s.as_bytes());
        } else {
            string(b, s)
        }
    };
    let count = |b: &mut Vec<u8>, n: u32| if flexible { varint(b, n + 1) } else { b.extend((n as i32).to_be_bytes()) };
    count(&mut b, 1);
    b.push(TOPIC as u8);
    text(&mut b, topic);
    // configuration_keys: null, every config.
    if flexible {
        b.push(0)
    } else {
        b.extend((-1i32).to_be_bytes())
    }
    if flexible {
        b.push(0); // the resource's tagged fields
    }
    b.push(0); // include_synonyms
    if flexible {
        b.extend([0, 0]); // include_documentation, the body's tagged fields
    }
    b
}

fn varint(b: &mut Vec<u8>, mut n: u32) {
    while n >= 0x80 {
        b.push((n as u8) | 0x80);
        n >>= 7;
    }
    b.push(n as u8);
}

/// Reads the answer (after its correlation id): `cleanup.policy` of
/// `topic`, or `None` when the broker lists no such config.
fn policy_of(answer: &[u8], topic: &str, flexible: bool) -> Result<Option<String>, String> {
    let mut r = Reader { rest: answer, flexible };
    r.tags()?;
    let _throttle = r.i32()?;
    for _ in 0..r.count()? {
        let error = r.i16()?;
        let message = r.text()?;
        let _kind = r.i8()?;
        let name = r.text()?.unwrap_or_default();
        if error != 0 {
            return Err(format!("error {error}: {}", message.unwrap_or_default()));
        }
        for _ in 0..r.count()? {
            let key = r.text()?.unwrap_or_default();
            let value = r.text()?;
            let (_read_only, _source, _sensitive) = (r.i8()?, r.i8()?, r.i8()?);
            for _ in 0..r.count()? {
                let (_name, _value, _source) = (r.text()?, r.text()?, r.i8()?);
                r.tags()?;
            }
            if flexible {
                let (_type, _documentation) = (r.i8()?, r.text()?);
            }
            r.tags()?;
            if name == topic && key == "cleanup.policy" {
                return Ok(value);
            }
        }
        r.tags()?;
    }
    Ok(None)
}

/// Kafka's encoding of an answer: fixed-width integers, and strings and
/// arrays with an i16/i32 length, or (flexible versions) a varint length
/// plus one, with tagged fields after each structure.
struct Reader<'a> {
    rest: &'a [u8],
    flexible: bool,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let (head, rest) = self.rest.split_at_checked(N).ok_or("a short answer")?;
        self.rest = rest;
        Ok(head.try_into().expect("N bytes"))
    }

    fn i8(&mut self) -> Result<i8, String> {
        Ok(i8::from_be_bytes(self.take()?))
    }

    fn i16(&mut self) -> Result<i16, String> {
        Ok(i16::from_be_bytes(self.take()?))
    }

    fn i32(&mut self) -> Result<i32, String> {
        Ok(i32::from_be_bytes(self.take()?))
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut n = 0u64;
        for shift in (0..64).step_by(7) {
            let [byte] = self.take::<1>()?;
            n |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Ok(n);
            }
        }
        Err("a varint past 64 bits".into())
    }

    /// A length: -1 (i16/i32) or 0 (varint) is null, as `None`.
    fn length(&mut self, wide: bool) -> Result<Option<usize>, String> {
        let n = match (self.flexible, wide) {
            (true, _) => self.varint()?.checked_sub(1).map(|n| n as i64).unwrap_or(-1),
            (false, true) => i64::from(self.i32()?),
            (false, false) => i64::from(self.i16()?),
        };
        Ok(usize::try_from(n).ok())
    }

    /// An array's length (null as none), bounded by what is left.
    fn count(&mut self) -> Result<usize, String> {
        Ok(self.length(true)?.unwrap_or(0).min(self.rest.len()))
    }

    fn text(&mut self) -> Result<Option<String>, String> {
        let Some(len) = self.length(false)? else { return Ok(None) };
        let (s, rest) = self.rest.split_at_checked(len).ok_or("a short answer")?;
        self.rest = rest;
        Ok(Some(String::from_utf8_lossy(s).into_owned()))
    }

    /// Skips a structure's tagged fields (flexible versions only).
    fn tags(&mut self) -> Result<(), String> {
        if !self.flexible {
            return Ok(());
        }
        for _ in 0..self.varint()? {
            let _tag = self.varint()?;
            let size = usize::try_from(self.varint()?).map_err(|e| e.to_string())?;
            self.rest = self.rest.get(size..).ok_or("a short answer")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes an answer in either encoding, for the reader to read back.
    struct W {
        b: Vec<u8>,
        flexible: bool,
    }

    impl W {
        fn text(&mut self, s: Option<&str>) {
            match (s, self.flexible) {
                (Some(s), true) => {
                    varint(&mut self.b, s.len() as u32 + 1);
                    self.b.extend(s.as_bytes());
                }
                (None, true) => self.b.push(0),
                (Some(s), false) => string(&mut self.b, s),
                (None, false) => self.b.extend((-1i16).to_be_bytes()),
            }
        }

        fn count(&mut self, n: u32) {
            if self.flexible { varint(&mut self.b, n + 1) } else { self.b.extend((n as i32).to_be_bytes()) }
        }

        /// Tagged fields: one unknown field of 3 bytes, to be skipped.
        fn tags(&mut self) {
            if self.flexible {
                self.b.extend([1, 9, 3, 0xaa, 0xbb, 0xcc]);
            }
        }
    }

    fn answer(flexible: bool, error: i16, value: Option<&str>) -> Vec<u8> {
        let mut w = W { b: Vec::new(), flexible };
        w.tags();
        w.b.extend(0i32.to_be_bytes());
        w.count(1);
        w.b.extend(error.to_be_bytes());
        w.text((error != 0).then_some("no such topic"));
        w.b.push(2);
        w.text(Some("t"));
        w.count(1);
        w.text(Some("cleanup.policy"));
        w.text(value);
        w.b.extend([0u8, 5, 0]);
        w.count(1);
        w.text(Some("log.cleanup.policy"));
        w.text(Some("delete"));
        w.b.push(5);
        w.tags();
        if flexible {
            w.b.push(2);
            w.text(None);
        }
        w.tags();
        w.tags();
        w.tags();
        w.b
    }

    /// Answers laid out as Kafka's DescribeConfigs v1 and v4 lay them out
    /// (one topic, one config with one synonym, tagged fields to skip) read
    /// back their value; an error code or a cut answer is an error.
    #[test]
    fn an_answer_reads_back_its_cleanup_policy_in_either_encoding() {
        for flexible in [false, true] {
            let policy = |error, value, topic| policy_of(&answer(flexible, error, value), topic, flexible);
            assert_eq!(policy(0, Some("compact,delete"), "t"), Ok(Some("compact,delete".into())));
            assert_eq!(policy(0, None, "t"), Ok(None));
            assert_eq!(policy(0, Some("compact"), "other"), Ok(None));
            assert!(policy(3, None, "t").is_err_and(|e| e.contains("error 3")));
            let whole = answer(flexible, 0, Some("compact"));
            assert!(policy_of(&whole[..30], "t", flexible).is_err(), "flexible {flexible}");
        }
    }

    /// The v4 request is byte for byte what tansu's own encoder writes for
    /// the same fields (its test `describe_configs_request_v4_000`, with
    /// our client id).
    #[test]
    fn the_requests_are_framed_as_kafka_frames_them() {
        let request = |topic, version: i16, correlation| {
            crate::connection::frame(DESCRIBE_CONFIGS, version, correlation, version >= 4, &request(topic, version))
        };
        for version in [1, 4] {
            let req = request("test", version, 5);
            assert_eq!(i32::from_be_bytes(req[..4].try_into().expect("4 bytes")) as usize, req.len() - 4);
            assert_eq!(&req[4..8], &[0, 32, 0, version as u8]);
        }
        let v4 = request("test", 4, 5);
        let mut expected = vec![0, 32, 0, 4, 0, 0, 0, 5, 0, 7];
        expected.extend(b"sparrow");
        expected.extend([0, 2, 2, 5]);
        expected.extend(b"test");
        expected.extend([0, 0, 0, 0, 0]);
        assert_eq!(&v4[4..], &expected[..]);
    }
}
