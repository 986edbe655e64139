//! A KServe v2 `infer` request body, decoded into typed columns with its
//! memory bounded before any of it is kept: no input may hold more than
//! `max_rows` values (the count is checked while the JSON is read, so a
//! body declaring 10⁷ rows is refused at row `max_rows + 1`), `shape`s and
//! `outputs` are short, and keys the server does not read are skipped
//! without being stored. Cells are kept compactly (a tag and a number, or a
//! span of one text buffer per input), not as `serde_json::Value`s.
//!
//! The body is plain JSON (any content type: Triton's client sends none),
//! or KServe's binary tensor extension: a JSON header of
//! `Inference-Header-Content-Length` bytes, then each input with
//! `parameters.binary_data_size` as raw little-endian values (`BYTES`
//! elements each a 4-byte length and the bytes).

use std::cell::Cell as Flag;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The header of KServe's binary tensor extension: the JSON part's length.
pub const BINARY_HEADER: &str = "inference-header-content-length";

/// Shapes have at most this many dimensions (ours have one, or two for a
/// behaviour sequence given as a flat [N, L] tensor).
const MAX_SHAPE_DIMS: usize = 8;
/// A request names at most this many outputs.
const MAX_OUTPUTS: usize = 64;

/// Why a body was refused: too many rows (413, naming the limit) or
/// malformed (400).
#[derive(Debug, PartialEq)]
pub enum DecodeError {
    TooManyRows(String),
    Bad(String),
}

/// One decoded request.
#[derive(Debug, Default)]
pub struct Request {
    /// The request's `id`, echoed in the reply.
    pub id: Option<String>,
    pub inputs: Vec<Input>,
    /// Whether the reply's output is to be binary data.
    pub binary_output: bool,
    /// The outputs asked for by name (`outputs`); empty: every output.
    pub outputs: Vec<String>,
}

#[derive(Debug, Default)]
pub struct Input {
    pub name: String,
    pub datatype: String,
    /// As given (a `-1` is kept, to be reported as such).
    pub shape: Vec<i64>,
    pub cells: Cells,
    /// `parameters.binary_data_size`: the values follow the JSON header.
    binary_size: Option<u64>,
}

/// One value of an input.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Cell {
    /// `null` (or NaN): a missing value, an empty cell in the data file.
    Null,
    Number(f64),
    /// A span of [`Cells::text`].
    Text {
        start: u32,
        len: u32,
    },
    /// A list of strings (a behaviour sequence's IDs): `count` spans of
    /// [`Cells::text`] from [`Cells::items`]`[first]`.
    List {
        first: u32,
        count: u32,
    },
}

/// IDs one list cell may hold.
pub const MAX_LIST_ITEMS: usize = 100_000;

/// An input's values: tags and numbers, with every string in one buffer.
#[derive(Debug, Default)]
pub struct Cells {
    pub values: Vec<Cell>,
    text: String,
    /// The list cells' items: (start, len) spans of `text`.
    items: Vec<(u32, u32)>,
}

impl Cells {
    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The text of a [`Cell::Text`].
    pub fn text(&self, start: u32, len: u32) -> &str {
        let (start, len) = (start as usize, len as usize);
        self.text.get(start..start + len).unwrap_or_default()
    }

    /// The strings of a [`Cell::List`].
    pub fn list(&self, first: u32, count: u32) -> impl Iterator<Item = &str> {
        let (first, count) = (first as usize, count as usize);
        self.items.get(first..first + count).unwrap_or_default().iter().map(|&(start, len)| self.text(start, len))
    }

    fn push_text(&mut self, s: &str) -> Result<(), String> {
        let start = u32::try_from(self.text.len()).map_err(|_| "more than 4 GiB of text".to_string())?;
        let len = u32::try_from(s.len()).map_err(|_| "a value of more than 4 GiB".to_string())?;
        self.text.push_str(s);
        self.values.push(Cell::Text { start, len });
        Ok(())
    }
}

/// Decodes a body (`binary_header`: the value of [`BINARY_HEADER`], if sent).
pub fn decode(binary_header: Option<&[u8]>, body: &[u8], max_rows: usize) -> Result<Request, DecodeError> {
    let bad = |m: String| DecodeError::Bad(m);
    let json_len = match binary_header {
        None => body.len(),
        Some(v) => std::str::from_utf8(v)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n <= body.len())
            .ok_or_else(|| bad(format!("{BINARY_HEADER}: not a length within the body ({} bytes)", body.len())))?,
    };
    let over = Flag::new(false);
    let json = nan_as_null(&body[..json_len]);
    let mut de = serde_json::Deserializer::from_slice(&json);
    let decoded = RequestSeed { max_rows, over: &over }.deserialize(&mut de).and_then(|r| de.end().map(|()| r));
    let mut request = match decoded {
        Ok(r) => r,
        Err(e) if over.get() => return Err(DecodeError::TooManyRows(e.to_string())),
        Err(e) => return Err(bad(format!("the body is not a JSON request: {e}"))),
    };
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
        input.cells = binary_cells(name, &input.datatype, raw, max_rows)?;
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
fn binary_cells(name: &str, datatype: &str, raw: &[u8], max_rows: usize) -> Result<Cells, DecodeError> {
    let bad = |m: String| DecodeError::Bad(format!("input `{name}`: {m}"));
    let mut cells = Cells::default();
    match datatype {
        "FP32" if raw.len().is_multiple_of(4) => {
            if raw.len() / 4 > max_rows {
                return Err(DecodeError::TooManyRows(too_many_rows(name, max_rows)));
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
                    return Err(DecodeError::TooManyRows(too_many_rows(name, max_rows)));
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

/// `NaN` outside strings read as `null` (a missing value): numpy-based
/// clients (Triton's) write a float column's NaN so, though JSON has no NaN.
fn nan_as_null(json: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if !json.windows(3).any(|w| w == b"NaN") {
        return std::borrow::Cow::Borrowed(json);
    }
    let (mut out, mut in_string, mut escaped, mut i) = (Vec::with_capacity(json.len() + 16), false, false, 0);
    while i < json.len() {
        let b = json[i];
        if in_string {
            (escaped, in_string) = (!escaped && b == b'\\', in_string && (escaped || b != b'"'));
        } else if b == b'"' {
            in_string = true;
        } else if json[i..].starts_with(b"NaN") {
            out.extend_from_slice(b"null");
            i += 3;
            continue;
        }
        out.push(b);
        i += 1;
    }
    std::borrow::Cow::Owned(out)
}

/// The whole request object.
struct RequestSeed<'a> {
    max_rows: usize,
    over: &'a Flag<bool>,
}

impl<'de> DeserializeSeed<'de> for RequestSeed<'_> {
    type Value = Request;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Request, D::Error> {
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

impl<'de> Visitor<'de> for RequestSeed<'_> {
    type Value = Request;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an inference request object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Request, A::Error> {
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
                    request.inputs = map.next_value_seed(InputsSeed { max_rows: self.max_rows, over: self.over })?;
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

struct InputsSeed<'a> {
    max_rows: usize,
    over: &'a Flag<bool>,
}

impl<'de> DeserializeSeed<'de> for InputsSeed<'_> {
    type Value = Vec<Input>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<Input>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for InputsSeed<'_> {
    type Value = Vec<Input>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an `inputs` array")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Input>, A::Error> {
        let mut inputs = Vec::new();
        loop {
            let seed = InputSeed { index: inputs.len(), max_rows: self.max_rows, over: self.over };
            match seq.next_element_seed(seed)? {
                Some(input) => inputs.push(input),
                None => return Ok(inputs),
            }
        }
    }
}

struct InputSeed<'a> {
    index: usize,
    max_rows: usize,
    over: &'a Flag<bool>,
}

impl<'de> DeserializeSeed<'de> for InputSeed<'_> {
    type Value = Input;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Input, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for InputSeed<'_> {
    type Value = Input;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an input object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Input, A::Error> {
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
                    let seed = DataSeed { input: &label, max_rows: self.max_rows, over: self.over };
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
struct DataSeed<'a> {
    input: &'a str,
    max_rows: usize,
    over: &'a Flag<bool>,
}

impl<'de> DeserializeSeed<'de> for DataSeed<'_> {
    type Value = Cells;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Cells, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for DataSeed<'_> {
    type Value = Cells;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "input `{}`: a `data` array", self.input)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Cells, A::Error> {
        let mut cells = Cells::default();
        loop {
            if cells.len() == self.max_rows {
                // One more value is one too many; none at all is the end.
                if seq.next_element::<IgnoredAny>()?.is_none() {
                    return Ok(cells);
                }
                self.over.set(true);
                return Err(A::Error::custom(too_many_rows(self.input, self.max_rows)));
            }
            let row = cells.len();
            match seq.next_element_seed(CellSeed { cells: &mut cells })? {
                Some(Ok(())) => {}
                Some(Err(what)) => {
                    return Err(A::Error::custom(format!("input `{}`: data[{row}] {what}", self.input)));
                }
                None => return Ok(cells),
            }
        }
    }
}

/// One element of `data`, appended to `cells`; `Err`: what it is instead.
struct CellSeed<'a> {
    cells: &'a mut Cells,
}

impl<'de> DeserializeSeed<'de> for CellSeed<'_> {
    type Value = Result<(), String>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CellSeed<'_> {
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
    /// to the list's end, so the error names the input.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let cells = self.cells;
        let first = cells.items.len();
        let mut wrong = None;
        while let Some(item) = seq.next_element::<ListItem>()? {
            match item {
                _ if wrong.is_some() => {}
                ListItem::Text(_) if cells.items.len() - first == MAX_LIST_ITEMS => {
                    wrong = Some(format!("is a list of more than {MAX_LIST_ITEMS} IDs"));
                }
                ListItem::Text(t) => match u32::try_from(cells.text.len()) {
                    Ok(start) if t.len() <= u32::MAX as usize => {
                        cells.text.push_str(&t);
                        cells.items.push((start, t.len() as u32));
                    }
                    _ => wrong = Some("holds more than 4 GiB of text".into()),
                },
                ListItem::Other(what) => wrong = Some(format!("is a list holding {what}: a list's IDs are strings")),
            }
        }
        if let Some(what) = wrong {
            cells.items.truncate(first);
            return Ok(Err(what));
        }
        let count = (cells.items.len() - first) as u32;
        cells.values.push(Cell::List { first: first as u32, count });
        Ok(Ok(()))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Err("is an object, not a number, a string or null".into()))
    }
}

/// One element of a list cell: a string, or what it is instead.
enum ListItem {
    Text(String),
    Other(&'static str),
}

impl<'de> serde::Deserialize<'de> for ListItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ListItem, D::Error> {
        d.deserialize_any(ListItemVisitor)
    }
}

struct ListItemVisitor;

impl<'de> Visitor<'de> for ListItemVisitor {
    type Value = ListItem;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ListItem, E> {
        Ok(ListItem::Text(v.to_string()))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<ListItem, E> {
        Ok(ListItem::Other("null"))
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<ListItem, E> {
        Ok(ListItem::Other("a boolean"))
    }
    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<ListItem, E> {
        Ok(ListItem::Other("a number"))
    }
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<ListItem, E> {
        Ok(ListItem::Other("a number"))
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<ListItem, E> {
        Ok(ListItem::Other("a number"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ListItem, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(ListItem::Other("an array"))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ListItem, A::Error> {
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

    fn json(body: &str) -> Result<Request, DecodeError> {
        decode(None, body.as_bytes(), 4)
    }

    fn message(e: DecodeError) -> String {
        match e {
            DecodeError::Bad(m) | DecodeError::TooManyRows(m) => m,
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
        let request = decode(Some(len.as_bytes()), &body, 4).expect("decoded");
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
        assert!(message(decode(Some(len.as_bytes()), &body, 4).expect_err("short")).contains("binary_data_size 10"));
        let (len, body) = binary_body(&header, &[&tail[..], b"xx"].concat());
        let e = message(decode(Some(len.as_bytes()), &body, 4).expect_err("long"));
        assert!(e.contains("2 bytes of binary data belong"), "{e}");
        // More rows than the limit: refused as such.
        let e = decode(Some(len.as_bytes()), &body, 1).expect_err("over");
        assert!(matches!(e, DecodeError::TooManyRows(ref m) if m.contains("--max-batch-rows")), "{e:?}");
    }

    /// Binary ±inf is refused as JSON's out-of-range numbers are; NaN is a
    /// missing value in both.
    #[test]
    fn binary_infinities_are_refused_like_json_ones() {
        for x in [f32::INFINITY, f32::NEG_INFINITY] {
            let header = serde_json::json!({"inputs": [
                {"name": "I1", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}]});
            let (len, body) = binary_body(&header, &x.to_le_bytes());
            let e = message(decode(Some(len.as_bytes()), &body, 4).expect_err("inf"));
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
            Err(DecodeError::TooManyRows(m)) => assert!(m.contains("`I1`") && m.contains("--max-batch-rows"), "{m}"),
            other => panic!("{other:?}"),
        }
        // Past the limit before the name: the input's place names it.
        let over = json(r#"{"inputs": [{"data": ["", "", "", "", ""], "name": "C1"}]}"#);
        assert!(matches!(over, Err(DecodeError::TooManyRows(ref m)) if m.contains("input `#0`")), "{over:?}");
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
}
