//! A KServe v2 `infer` request body, decoded into typed columns with its
//! memory bounded before any of it is kept ([`Limits`]): no input may hold
//! more than `max_rows` values (the count is checked while the JSON is
//! read, so a body declaring 10⁷ rows is refused at row `max_rows + 1`), a
//! request names no more inputs than the model has columns, its lists hold
//! at most `max_ids` IDs together, no string is longer than a data file's
//! line, `shape`s and `outputs` are short, and keys the server does not
//! read are skipped without being stored. Cells are kept compactly (a tag
//! and a number, or a span of one text buffer per input), not as
//! `serde_json::Value`s; the body is not copied (a bare `NaN` is rewritten
//! in place).
//!
//! The body is plain JSON (any content type: Triton's client sends none),
//! or KServe's binary tensor extension: a JSON header of
//! `Inference-Header-Content-Length` bytes, then each input with
//! `parameters.binary_data_size` as raw little-endian values (`BYTES`
//! elements each a 4-byte length and the bytes).

use std::cell::Cell as Flag;
use std::fmt;

use bytes::Bytes;
use serde::de::{DeserializeSeed, Deserializer, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor};

pub use crate::cells::{Cell, Cells, MAX_CELL_BYTES, MAX_LIST_ITEMS};

/// The header of KServe's binary tensor extension: the JSON part's length.
pub const BINARY_HEADER: &str = "inference-header-content-length";

/// Shapes have at most this many dimensions (ours have one, or two for a
/// behaviour sequence given as a flat [N, L] tensor).
const MAX_SHAPE_DIMS: usize = 8;
/// A request names at most this many outputs.
const MAX_OUTPUTS: usize = 64;

/// What one request may hold.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Values an input may hold (`--max-batch-rows`).
    pub max_rows: usize,
    /// Inputs a request may name: the model's columns (each once).
    pub max_inputs: usize,
    /// IDs a request's lists, joined strings and multi-hot cells hold
    /// together (`--max-request-ids`; lists are counted here, the rest
    /// where they are split).
    pub max_ids: usize,
}

/// Why a body was refused: over one of the [`Limits`] (413, naming the
/// flag) or malformed (400).
#[derive(Debug, PartialEq)]
pub enum DecodeError {
    OverLimit(String),
    Bad(String),
}

/// One decoded request, its strings spans of the body.
#[derive(Debug, Default)]
pub struct Request<'s> {
    /// The request's `id`, echoed in the reply.
    pub id: Option<String>,
    pub inputs: Vec<Input<'s>>,
    /// Whether the reply's output is to be binary data.
    pub binary_output: bool,
    /// The outputs asked for by name (`outputs`); empty: every output.
    pub outputs: Vec<String>,
    /// The IDs its list cells hold together.
    pub list_ids: usize,
}

#[derive(Debug, Default)]
pub struct Input<'s> {
    pub name: String,
    pub datatype: String,
    /// As given (a `-1` is kept, to be reported as such).
    pub shape: Vec<i64>,
    pub cells: Cells<'s>,
    /// `parameters.binary_data_size`: the values follow the JSON header.
    binary_size: Option<u64>,
}

/// A request's body as read: the JSON part (its bare `NaN`s rewritten),
/// then any binary part.
pub struct Body {
    bytes: Bytes,
    json_len: usize,
}

impl Body {
    /// `body` (`binary_header`: the value of [`BINARY_HEADER`], if sent).
    pub fn new(binary_header: Option<&[u8]>, body: Bytes) -> Result<Body, DecodeError> {
        let json_len = match binary_header {
            None => body.len(),
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|&n| n <= body.len())
                .ok_or_else(|| {
                    DecodeError::Bad(format!("{BINARY_HEADER}: not a length within the body ({} bytes)", body.len()))
                })?,
        };
        if u32::try_from(body.len()).is_err() {
            return Err(DecodeError::OverLimit(format!("a body of {} bytes: at most 4 GiB", body.len())));
        }
        // numpy clients write a missing float as a bare `NaN`, which JSON lacks.
        let bytes = if bare_nans(&body[..json_len]).next().is_some() {
            Bytes::from(nan_as_empty_list(Vec::from(body), json_len))
        } else {
            body
        };
        Ok(Body { bytes, json_len })
    }

    /// The request, its strings spans of this body.
    pub fn decode(&self, limits: &Limits) -> Result<Request<'_>, DecodeError> {
        decode(&self.bytes, self.json_len, limits)
    }
}

fn decode<'s>(body: &'s [u8], json_len: usize, limits: &Limits) -> Result<Request<'s>, DecodeError> {
    let bad = |m: String| DecodeError::Bad(m);
    let (over, ids) = (Flag::new(false), Flag::new(0));
    let mut de = serde_json::Deserializer::from_slice(&body[..json_len]);
    let context = Context { limits, over: &over, ids: &ids, source: body };
    let seed = RequestSeed(&context);
    let decoded = seed.deserialize(&mut de).and_then(|r| de.end().map(|()| r));
    let mut request = match decoded {
        Ok(r) => r,
        Err(e) if over.get() => return Err(DecodeError::OverLimit(e.to_string())),
        Err(e) => return Err(bad(format!("the body is not a JSON request: {e}"))),
    };
    request.list_ids = ids.get();
    let mut binary = &body[json_len..];
    for input in &mut request.inputs {
        let Some(size) = input.binary_size else { continue };
        let name = &input.name;
        if !input.cells.is_empty() {
            return Err(bad(format!("input `{name}`: both `data` and binary_data_size")));
        }
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        if size > binary.len() {
            return Err(bad(format!(
                "input `{name}`: binary_data_size {size}, but {} bytes of binary data are left",
                binary.len()
            )));
        }
        let (raw, rest) = binary.split_at(size);
        binary = rest;
        input.cells = binary_cells(name, &input.datatype, body, raw, limits.max_rows)?;
    }
    if !binary.is_empty() {
        return Err(bad(format!("{} bytes of binary data belong to no input", binary.len())));
    }
    Ok(request)
}

/// The message of a request over the row limit.
pub fn too_many_rows(input: &str, max_rows: usize) -> String {
    format!(
        "input `{input}` holds more than {max_rows} rows, this server's --max-batch-rows: send fewer rows a request"
    )
}

/// An input's values from the binary part.
fn binary_cells<'s>(
    name: &str,
    datatype: &str,
    body: &'s [u8],
    raw: &'s [u8],
    max_rows: usize,
) -> Result<Cells<'s>, DecodeError> {
    let bad = |m: String| DecodeError::Bad(format!("input `{name}`: {m}"));
    let mut cells = Cells::new(body);
    match datatype {
        "FP32" if raw.len().is_multiple_of(4) => {
            if raw.len() / 4 > max_rows {
                return Err(DecodeError::OverLimit(too_many_rows(name, max_rows)));
            }
            cells.values.reserve_exact(raw.len() / 4);
            for (row, b) in raw.chunks_exact(4).enumerate() {
                let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                // NaN: a missing value, as `null` is in JSON; an infinity is
                // refused, as JSON's `1e999` is.
                if x.is_infinite() {
                    return Err(bad(format!("row {row}: {x} is not a finite number")));
                }
                cells.values.push(if x.is_nan() { Cell::Null } else { Cell::Number(f64::from(x)) });
            }
        }
        "BYTES" => {
            let mut at = raw;
            while !at.is_empty() {
                if cells.len() == max_rows {
                    return Err(DecodeError::OverLimit(too_many_rows(name, max_rows)));
                }
                let len = at.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
                let Some(value) = len.and_then(|n| at.get(4..4usize.saturating_add(n))) else {
                    return Err(bad("a BYTES element runs past its binary data".into()));
                };
                let text = std::str::from_utf8(value).map_err(|_| bad("a BYTES element is not UTF-8".into()))?;
                cells.push_text(text).map_err(bad)?;
                at = &at[4 + value.len()..];
            }
        }
        other => {
            let other = if other.is_empty() { "(none)" } else { other };
            return Err(bad(format!("binary data of {} bytes for datatype {other}", raw.len())));
        }
    }
    Ok(cells)
}

/// Where a bare `NaN` (outside strings) starts in `json`: numpy-based
/// clients (Triton's) write a float column's NaN so, though JSON has no NaN.
fn bare_nans(json: &[u8]) -> impl Iterator<Item = usize> + '_ {
    let (mut in_string, mut escaped) = (false, false);
    json.iter().enumerate().filter_map(move |(i, &b)| {
        if in_string {
            (escaped, in_string) = (!escaped && b == b'\\', escaped || b != b'"');
        } else if b == b'"' {
            in_string = true;
        } else if json[i..].starts_with(b"NaN") {
            return Some(i);
        }
        None
    })
}

/// `body` with each bare `NaN` of its first `json_len` bytes rewritten in
/// place as `[] `, an empty list, which reads as a missing value as `null`
/// does (`null` is a byte longer: rewriting to it would copy the body).
fn nan_as_empty_list(mut body: Vec<u8>, json_len: usize) -> Vec<u8> {
    let at: Vec<usize> = bare_nans(&body[..json_len]).collect();
    let mut free = 0;
    for i in at {
        if i >= free {
            body[i..i + 3].copy_from_slice(b"[] ");
            free = i + 3;
        }
    }
    body
}

/// What every part of a request's reading sees.
struct Context<'c, 's> {
    limits: &'c Limits,
    /// Set when a limit is passed (the error is a 413).
    over: &'c Flag<bool>,
    /// The request's list IDs so far.
    ids: &'c Flag<usize>,
    /// The body: strings inside it are kept as spans.
    source: &'s [u8],
}

/// The whole request object.
struct RequestSeed<'c, 's>(&'c Context<'c, 's>);

impl<'de, 's> DeserializeSeed<'de> for RequestSeed<'_, 's> {
    type Value = Request<'s>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Request<'s>, D::Error> {
        d.deserialize_map(self)
    }
}

/// Refuses a key seen twice in one object (JSON allows it; which one wins
/// would be a guess).
fn once<E: serde::de::Error>(seen: &mut Vec<&'static str>, key: &'static str) -> Result<(), E> {
    if seen.contains(&key) {
        return Err(E::custom(format!("`{key}` is given twice")));
    }
    seen.push(key);
    Ok(())
}

impl<'de, 's> Visitor<'de> for RequestSeed<'_, 's> {
    type Value = Request<'s>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an inference request object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Request<'s>, A::Error> {
        let (mut request, mut seen, mut has_inputs) = (Request::default(), Vec::new(), false);
        let mut binary_output = None;
        while let Some(key) = map.next_key::<Key>()? {
            match key.0.as_str() {
                "id" => {
                    once(&mut seen, "id")?;
                    request.id = Some(map.next_value_seed(Id)?);
                }
                "inputs" => {
                    once(&mut seen, "inputs")?;
                    has_inputs = true;
                    request.inputs = map.next_value_seed(InputsSeed(self.0))?;
                }
                "outputs" => {
                    once(&mut seen, "outputs")?;
                    let (names, binary) = map.next_value_seed(OutputsSeed)?;
                    request.outputs = names;
                    if let Some(b) = binary {
                        request.binary_output = b;
                        binary_output = Some(b);
                    }
                }
                "parameters" => {
                    once(&mut seen, "parameters")?;
                    let p = map.next_value_seed(Parameters)?;
                    if binary_output.is_none() {
                        request.binary_output = p.binary_data_output.unwrap_or(false);
                    }
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if !has_inputs {
            return Err(A::Error::custom("the request has no `inputs` array"));
        }
        Ok(request)
    }
}

/// An object key (short strings; kept only long enough to match).
struct Key(String);

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        String::deserialize(d).map(Key)
    }
}

/// `id`: a string (a number is taken as its text).
struct Id;

impl<'de> DeserializeSeed<'de> for Id {
    type Value = String;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        d.deserialize_any(self)
    }
}

impl Visitor<'_> for Id {
    type Value = String;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string `id`")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<String, E> {
        Ok(v.to_string())
    }
}

/// `parameters` of the request, an input or an output: the few keys read
/// here; the rest are skipped.
#[derive(Default)]
struct Params {
    binary_data_output: Option<bool>,
    binary_data: Option<bool>,
    binary_data_size: Option<u64>,
}

struct Parameters;

impl<'de> DeserializeSeed<'de> for Parameters {
    type Value = Params;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Params, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Parameters {
    type Value = Params;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a `parameters` object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Params, A::Error> {
        let mut p = Params::default();
        while let Some(key) = map.next_key::<Key>()? {
            match key.0.as_str() {
                "binary_data_output" => p.binary_data_output = Some(map.next_value()?),
                "binary_data" => p.binary_data = Some(map.next_value()?),
                "binary_data_size" => p.binary_data_size = Some(map.next_value()?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(p)
    }
}

/// `outputs`: the names asked for (the model checks them), and the last
/// `binary_data` said, if any.
struct OutputsSeed;

impl<'de> DeserializeSeed<'de> for OutputsSeed {
    type Value = (Vec<String>, Option<bool>);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for OutputsSeed {
    type Value = (Vec<String>, Option<bool>);
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an `outputs` array")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let (mut binary, mut names) = (None, Vec::new());
        while let Some(output) = seq.next_element_seed(OutputSeed)? {
            if names.len() == MAX_OUTPUTS {
                return Err(A::Error::custom(format!("more than {MAX_OUTPUTS} outputs")));
            }
            if output.0.len() > 256 {
                return Err(A::Error::custom("an output name of more than 256 bytes"));
            }
            names.push(output.0);
            binary = output.1.or(binary);
        }
        Ok((names, binary))
    }
}

struct OutputSeed;

impl<'de> DeserializeSeed<'de> for OutputSeed {
    type Value = (String, Option<bool>);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for OutputSeed {
    type Value = (String, Option<bool>);
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an output object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut name, mut binary) = (String::new(), None);
        while let Some(key) = map.next_key::<Key>()? {
            match key.0.as_str() {
                "name" => name = map.next_value()?,
                "parameters" => binary = map.next_value_seed(Parameters)?.binary_data,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok((name, binary))
    }
}

struct InputsSeed<'c, 's>(&'c Context<'c, 's>);

impl<'de, 's> DeserializeSeed<'de> for InputsSeed<'_, 's> {
    type Value = Vec<Input<'s>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, 's> Visitor<'de> for InputsSeed<'_, 's> {
    type Value = Vec<Input<'s>>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an `inputs` array")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut inputs = Vec::new();
        loop {
            let index = inputs.len();
            if index == self.0.limits.max_inputs {
                if seq.next_element::<IgnoredAny>()?.is_none() {
                    return Ok(inputs);
                }
                return Err(A::Error::custom(format!(
                    "more than {index} inputs, the columns the model has (each is given once)"
                )));
            }
            let seed = InputSeed { index, context: self.0 };
            match seq.next_element_seed(seed)? {
                Some(input) => inputs.push(input),
                None => return Ok(inputs),
            }
        }
    }
}

struct InputSeed<'c, 's> {
    index: usize,
    context: &'c Context<'c, 's>,
}

impl<'de, 's> DeserializeSeed<'de> for InputSeed<'_, 's> {
    type Value = Input<'s>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Input<'s>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, 's> Visitor<'de> for InputSeed<'_, 's> {
    type Value = Input<'s>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an input object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Input<'s>, A::Error> {
        let (mut input, mut seen) = (Input::default(), Vec::new());
        while let Some(key) = map.next_key::<Key>()? {
            match key.0.as_str() {
                "name" => {
                    once(&mut seen, "name")?;
                    input.name = map.next_value()?;
                }
                "datatype" => {
                    once(&mut seen, "datatype")?;
                    input.datatype = map.next_value()?;
                }
                "shape" => {
                    once(&mut seen, "shape")?;
                    input.shape = map.next_value_seed(ShapeSeed)?;
                }
                "data" => {
                    once(&mut seen, "data")?;
                    let label = if input.name.is_empty() { format!("#{}", self.index) } else { input.name.clone() };
                    let seed = DataSeed { input: &label, context: self.context };
                    input.cells = map.next_value_seed(seed)?;
                }
                "parameters" => {
                    once(&mut seen, "parameters")?;
                    input.binary_size = map.next_value_seed(Parameters)?.binary_data_size;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if input.name.is_empty() {
            return Err(A::Error::custom(format!("input #{} has no `name`", self.index)));
        }
        if !seen.contains(&"data") && input.binary_size.is_none() {
            return Err(A::Error::custom(format!("input `{}`: no `data` array", input.name)));
        }
        Ok(input)
    }
}

struct ShapeSeed;

impl<'de> DeserializeSeed<'de> for ShapeSeed {
    type Value = Vec<i64>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<i64>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for ShapeSeed {
    type Value = Vec<i64>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a `shape` array of integers")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<i64>, A::Error> {
        let mut shape = Vec::new();
        while let Some(d) = seq.next_element::<i64>()? {
            if shape.len() == MAX_SHAPE_DIMS {
                return Err(A::Error::custom(format!("a shape of more than {MAX_SHAPE_DIMS} dimensions")));
            }
            shape.push(d);
        }
        Ok(shape)
    }
}

/// `data`: a flat array of numbers, strings and nulls, at most `max_rows`.
struct DataSeed<'c, 's> {
    input: &'c str,
    context: &'c Context<'c, 's>,
}

impl<'de, 's> DeserializeSeed<'de> for DataSeed<'_, 's> {
    type Value = Cells<'s>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Cells<'s>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, 's> Visitor<'de> for DataSeed<'_, 's> {
    type Value = Cells<'s>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "input `{}`: a `data` array", self.input)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Cells<'s>, A::Error> {
        let Context { limits, over, ids, source } = *self.context;
        let mut cells = Cells::new(source);
        let max_rows = limits.max_rows;
        loop {
            if cells.len() == max_rows {
                // One more value is one too many; none at all is the end.
                if seq.next_element::<IgnoredAny>()?.is_none() {
                    return Ok(cells);
                }
                over.set(true);
                return Err(A::Error::custom(too_many_rows(self.input, max_rows)));
            }
            let row = cells.len();
            let seed = CellSeed { cells: &mut cells, ids, max_ids: limits.max_ids };
            match seq.next_element_seed(seed)? {
                Some(Ok(())) => {}
                Some(Err(what)) if ids.get() > limits.max_ids => {
                    over.set(true);
                    return Err(A::Error::custom(format!("input `{}`: data[{row}] {what}", self.input)));
                }
                Some(Err(what)) => {
                    return Err(A::Error::custom(format!("input `{}`: data[{row}] {what}", self.input)));
                }
                None => return Ok(cells),
            }
        }
    }
}

/// One element of `data`, appended to `cells`; `Err`: what it is instead
/// (or that its list passed the request's `max_ids`, counted in `ids`).
struct CellSeed<'c, 's> {
    cells: &'c mut Cells<'s>,
    ids: &'c Flag<usize>,
    max_ids: usize,
}

impl<'de> DeserializeSeed<'de> for CellSeed<'_, '_> {
    type Value = Result<(), String>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CellSeed<'_, '_> {
    type Value = Result<(), String>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a number, a string or null")
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        self.cells.values.push(Cell::Null);
        Ok(Ok(()))
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        self.visit_unit()
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
        self.cells.values.push(Cell::Number(v as f64));
        Ok(Ok(()))
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
        self.cells.values.push(Cell::Number(v as f64));
        Ok(Ok(()))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        self.cells.values.push(Cell::Number(v));
        Ok(Ok(()))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.cells.push_text(v))
    }
    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Err(format!("is {v}, not a number, a string or null")))
    }
    /// A list of strings: a behaviour sequence's IDs, one row's (the model
    /// says whether the input takes lists). Anything else in it is skipped
    /// to the list's end, so the error names the input. An empty list is a
    /// missing value, as `null` is (a bare `NaN` is read as one).
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let cells = self.cells;
        let begin = cells.begin_list();
        let mut wrong = None;
        while let Some(item) = seq.next_element::<ListItem>()? {
            match item {
                _ if wrong.is_some() => {}
                ListItem::Text(_) if cells.items_since(begin) == MAX_LIST_ITEMS => {
                    wrong = Some(format!("is a list of more than {MAX_LIST_ITEMS} IDs"));
                }
                ListItem::Text(_) if self.ids.get() == self.max_ids => {
                    self.ids.set(self.max_ids + 1);
                    wrong = Some(format!(
                        "passes the {} IDs a request's lists may hold, this server's --max-request-ids: send fewer \
                         rows a request",
                        self.max_ids
                    ));
                }
                ListItem::Text(t) => match cells.push_item(&t) {
                    Ok(()) => self.ids.set(self.ids.get() + 1),
                    Err(what) => wrong = Some(format!("holds an ID that {what}")),
                },
                ListItem::Other(what) => wrong = Some(format!("is a list holding {what}: a list's IDs are strings")),
            }
        }
        if let Some(what) = wrong {
            cells.drop_list(begin);
            return Ok(Err(what));
        }
        cells.end_list(begin);
        Ok(Ok(()))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Err("is an object, not a number, a string or null".into()))
    }
}

/// One element of a list cell: a string (the body's own, when it holds
/// it unescaped), or what it is instead.
enum ListItem<'de> {
    Text(std::borrow::Cow<'de, str>),
    Other(&'static str),
}

impl<'de> serde::Deserialize<'de> for ListItem<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ListItem<'de>, D::Error> {
        d.deserialize_any(ListItemVisitor)
    }
}

struct ListItemVisitor;

impl<'de> Visitor<'de> for ListItemVisitor {
    type Value = ListItem<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<ListItem<'de>, E> {
        Ok(ListItem::Text(std::borrow::Cow::Borrowed(v)))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ListItem<'de>, E> {
        Ok(ListItem::Text(std::borrow::Cow::Owned(v.to_string())))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<ListItem<'de>, E> {
        Ok(ListItem::Other("null"))
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<ListItem<'de>, E> {
        Ok(ListItem::Other("a boolean"))
    }
    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<ListItem<'de>, E> {
        Ok(ListItem::Other("a number"))
    }
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<ListItem<'de>, E> {
        Ok(ListItem::Other("a number"))
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<ListItem<'de>, E> {
        Ok(ListItem::Other("a number"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ListItem<'de>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(ListItem::Other("an array"))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ListItem<'de>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(ListItem::Other("an object"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binary_body(header: &serde_json::Value, tail: &[u8]) -> (String, Vec<u8>) {
        let mut body = serde_json::to_vec(header).expect("json");
        let len = body.len().to_string();
        body.extend_from_slice(tail);
        (len, body)
    }

    fn limits(max_rows: usize) -> Limits {
        Limits { max_rows, max_inputs: 8, max_ids: 6 }
    }

    /// Decodes `body`, kept for the test's length (a request borrows it).
    fn decoded(header: Option<&str>, body: &[u8], max_rows: usize) -> Result<Request<'static>, DecodeError> {
        let body = Body::new(header.map(str::as_bytes), Bytes::copy_from_slice(body))?;
        Box::leak(Box::new(body)).decode(&limits(max_rows))
    }

    fn json(body: &str) -> Result<Request<'static>, DecodeError> {
        decoded(None, body.as_bytes(), 4)
    }

    fn binary(len: &str, body: &[u8], max_rows: usize) -> Result<Request<'static>, DecodeError> {
        decoded(Some(len), body, max_rows)
    }

    fn message(e: DecodeError) -> String {
        match e {
            DecodeError::Bad(m) | DecodeError::OverLimit(m) => m,
        }
    }

    #[test]
    fn binary_tensors_become_the_cells_they_stand_for() {
        let mut tail = Vec::new();
        for x in [3.0f32, f32::NAN] {
            tail.extend_from_slice(&x.to_le_bytes());
        }
        for s in ["ab", ""] {
            tail.extend_from_slice(&(s.len() as u32).to_le_bytes());
            tail.extend_from_slice(s.as_bytes());
        }
        let header = serde_json::json!({
            "inputs": [
                {"name": "I1", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
                {"name": "C1", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 10}},
            ],
            "outputs": [{"name": "probability", "parameters": {"binary_data": true}}],
        });
        let (len, body) = binary_body(&header, &tail);
        let request = binary(&len, &body, 4).expect("decoded");
        assert!(request.binary_output);
        assert_eq!(request.inputs[0].cells.values, vec![Cell::Number(3.0), Cell::Null]);
        let c1 = &request.inputs[1].cells;
        assert_eq!(c1.len(), 2);
        let texts: Vec<&str> = c1
            .values
            .iter()
            .map(|c| match *c {
                Cell::Text { start, len } => c1.text(start, len),
                _ => panic!("text"),
            })
            .collect();
        assert_eq!(texts, ["ab", ""]);

        // Sizes past the data, data left over: 400s naming them.
        let (len, body) = binary_body(&header, &tail[..12]);
        assert!(message(binary(&len, &body, 4).expect_err("short")).contains("binary_data_size 10"));
        let (len, body) = binary_body(&header, &[&tail[..], b"xx"].concat());
        let e = message(binary(&len, &body, 4).expect_err("long"));
        assert!(e.contains("2 bytes of binary data belong"), "{e}");
        // More rows than the limit: refused as such.
        let e = binary(&len, &body, 1).expect_err("over");
        assert!(matches!(e, DecodeError::OverLimit(ref m) if m.contains("--max-batch-rows")), "{e:?}");
    }

    /// Binary ±inf is refused as JSON's out-of-range numbers are; NaN is a
    /// missing value in both.
    #[test]
    fn binary_infinities_are_refused_like_json_ones() {
        for x in [f32::INFINITY, f32::NEG_INFINITY] {
            let header = serde_json::json!({"inputs": [
                {"name": "I1", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}]});
            let (len, body) = binary_body(&header, &x.to_le_bytes());
            let e = message(binary(&len, &body, 4).expect_err("inf"));
            assert!(e.contains("input `I1`: row 0") && e.contains("not a finite number"), "{e}");
        }
        let e = message(
            json(r#"{"inputs": [{"name": "I1", "datatype": "FP32", "shape": [1], "data": [1e999]}]}"#)
                .expect_err("1e999"),
        );
        assert!(e.contains("not a JSON request"), "{e}");
    }

    #[test]
    fn nan_outside_strings_reads_as_null() {
        let body = r#"{"inputs": [{"name": "C1", "data": ["NaN", "a\"NaN"]}, {"name": "I1", "data": [NaN, 1.5]}]}"#;
        let request = json(body).expect("decoded");
        let c1 = &request.inputs[0].cells;
        assert_eq!(c1.values.len(), 2);
        assert!(matches!(c1.values[0], Cell::Text { start, len } if c1.text(start, len) == "NaN"));
        assert_eq!(request.inputs[1].cells.values, vec![Cell::Null, Cell::Number(1.5)]);
    }

    /// The row limit is met while reading: the limit itself passes, one
    /// more is refused with the flag's name, whatever the declared shape.
    #[test]
    fn rows_past_the_limit_are_refused_while_reading() {
        let ok = json(r#"{"inputs": [{"name": "I1", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}]}"#);
        assert_eq!(ok.expect("at the limit").inputs[0].cells.len(), 4);
        let over = json(r#"{"inputs": [{"name": "I1", "datatype": "FP32", "shape": [1], "data": [1, 2, 3, 4, 5]}]}"#);
        match over {
            Err(DecodeError::OverLimit(m)) => assert!(m.contains("`I1`") && m.contains("--max-batch-rows"), "{m}"),
            other => panic!("{other:?}"),
        }
        // Past the limit before the name: the input's place names it.
        let over = json(r#"{"inputs": [{"data": ["", "", "", "", ""], "name": "C1"}]}"#);
        assert!(matches!(over, Err(DecodeError::OverLimit(ref m)) if m.contains("input `#0`")), "{over:?}");
    }

    #[test]
    fn malformed_requests_are_refused_naming_what() {
        let cases = [
            ("{not json", "not a JSON request"),
            (r#"{"id": "x"}"#, "no `inputs` array"),
            (r#"{"inputs": [{"datatype": "FP32", "data": []}]}"#, "input #0 has no `name`"),
            (r#"{"inputs": [{"name": "I1", "shape": [1]}]}"#, "input `I1`: no `data` array"),
            (r#"{"inputs": [{"name": "I1", "data": [[1]]}]}"#, "input `I1`: data[0] is a list holding a number"),
            (r#"{"inputs": [{"name": "I1", "data": [1, true]}]}"#, "input `I1`: data[1] is true"),
            (r#"{"inputs": [{"name": "I1", "name": "I2", "data": []}]}"#, "`name` is given twice"),
            (r#"{"inputs": [{"name": "I1", "shape": [1,1,1,1,1,1,1,1,1], "data": []}]}"#, "more than 8 dimensions"),
            (r#"{"inputs": [], "id": [1]}"#, "a string `id`"),
        ];
        for (body, want) in cases {
            let e = message(json(body).expect_err(body));
            assert!(e.contains(want), "{body}: `{e}` lacks `{want}`");
        }
        // Keys the server does not read are skipped, whatever they hold.
        let request = json(r#"{"pad": [[1], {"a": 2}], "id": 7, "inputs": [], "parameters": {"x": [1]}}"#);
        assert_eq!(request.expect("decoded").id.as_deref(), Some("7"));
    }

    /// A request names no more inputs than the model has columns, its
    /// lists hold at most `max_ids` IDs together (413, naming the flag),
    /// and no string is longer than a data file's line.
    #[test]
    fn inputs_ids_and_strings_past_their_limits_are_refused() {
        let input = r#"{"name": "I1", "data": [1]}"#;
        let eight = json(&format!(r#"{{"inputs": [{}]}}"#, [input; 8].join(",")));
        assert_eq!(eight.expect("8 inputs").inputs.len(), 8);
        let nine = message(json(&format!(r#"{{"inputs": [{}]}}"#, [input; 9].join(","))).expect_err("9"));
        assert!(nine.contains("more than 8 inputs"), "{nine}");

        let six = json(r#"{"inputs": [{"name": "h", "data": [["a", "b", "c"], ["d", "e", "f"]]}]}"#);
        assert_eq!(six.expect("6 IDs").list_ids, 6);
        let seven = json(r#"{"inputs": [{"name": "h", "data": [["a", "b", "c"], ["d", "e", "f", "g"]]}]}"#);
        match seven {
            Err(DecodeError::OverLimit(m)) => assert!(m.contains("--max-request-ids") && m.contains("data[1]"), "{m}"),
            other => panic!("{other:?}"),
        }

        let long = "x".repeat(MAX_CELL_BYTES + 1);
        let e = message(json(&format!(r#"{{"inputs": [{{"name": "C1", "data": ["{long}"]}}]}}"#)).expect_err("long"));
        assert!(e.contains("input `C1`: data[0] is a string of 1048577 bytes"), "{}", &e[..200.min(e.len())]);
        let e = message(json(&format!(r#"{{"inputs": [{{"name": "h", "data": [["{long}"]]}}]}}"#)).expect_err("long"));
        assert!(e.contains("holds an ID that is a string of 1048577 bytes"), "{}", &e[..200.min(e.len())]);
    }

    /// `[]` is a missing value as `null` is; a bare `NaN` is rewritten to it
    /// in place (the body is not copied to grow by a byte), never inside a
    /// string; the strings are spans of the body.
    #[test]
    fn empty_lists_and_bare_nans_are_missing_values() {
        let body = r#"{"inputs": [{"name": "I1", "data": [NaN, [], 2, NaN]}, {"name": "C1", "data": ["NaN"]}]}"#;
        let request = json(body).expect("decoded");
        assert_eq!(request.inputs[0].cells.values, vec![Cell::Null, Cell::Null, Cell::Number(2.0), Cell::Null]);
        let c1 = &request.inputs[1].cells;
        assert!(matches!(c1.values[0], Cell::Text { start, len } if c1.text(start, len) == "NaN"));
        let nans = b"[NaN,\"NaN\",NaNaN]";
        let rewritten = nan_as_empty_list(nans.to_vec(), nans.len());
        assert_eq!(rewritten, b"[[] ,\"NaN\",[] aN]", "overlapping matches are left alone");
    }
}
