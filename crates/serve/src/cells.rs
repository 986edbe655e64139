//! An input's values as decoded: a tag and a number a value, strings as
//! spans. A string the body holds as it reads (no escape) is a span of the
//! body itself, so a request's strings cost their bytes once; only an
//! escaped one (`\n`, `\u00e9`) is copied, unescaped, into a buffer of the
//! input's own.

/// One value of an input.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Cell {
    /// `null`, NaN or an empty list: a missing value, an empty cell in the
    /// data file.
    Null,
    Number(f64),
    /// A string: read with [`Cells::text`].
    Text {
        start: u32,
        len: u32,
    },
    /// A list of strings (a behaviour sequence's IDs), read with
    /// [`Cells::list`].
    List {
        first: u32,
        count: u32,
    },
}

/// IDs one list cell may hold.
pub const MAX_LIST_ITEMS: usize = 100_000;

/// A string no longer than a data file's line (its reader's limit): a
/// longer one is no value `sparrow predict` could be asked.
pub const MAX_CELL_BYTES: usize = sparrow_data::text::MAX_LINE_BYTES as usize;

/// A span's length with this bit set is a span of [`Cells::owned`], else
/// of [`Cells::source`] (lengths are under [`MAX_CELL_BYTES`]).
const OWNED: u32 = 1 << 31;

/// An input's values.
#[derive(Debug, Default)]
pub struct Cells<'s> {
    pub values: Vec<Cell>,
    /// The request's body: the spans of strings read as they stand.
    source: &'s [u8],
    /// Escaped strings, unescaped.
    owned: String,
    /// The list cells' items: spans.
    items: Vec<(u32, u32)>,
}

impl<'s> Cells<'s> {
    pub fn new(source: &'s [u8]) -> Cells<'s> {
        Cells { values: Vec::new(), source, owned: String::new(), items: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The text of a [`Cell::Text`] (or of one list item).
    pub fn text(&self, start: u32, len: u32) -> &str {
        let (from, n) = (start as usize, (len & !OWNED) as usize);
        if len & OWNED != 0 {
            return self.owned.get(from..from + n).unwrap_or_default();
        }
        // Checked UTF-8 when read in; checking again keeps this safe code.
        self.source.get(from..from + n).and_then(|b| std::str::from_utf8(b).ok()).unwrap_or_default()
    }

    /// The strings of a [`Cell::List`].
    pub fn list(&self, first: u32, count: u32) -> impl DoubleEndedIterator<Item = &str> {
        let (first, count) = (first as usize, count as usize);
        self.items.get(first..first + count).unwrap_or_default().iter().map(|&(start, len)| self.text(start, len))
    }

    pub(crate) fn push_text(&mut self, s: &str) -> Result<(), String> {
        let (start, len) = self.span(s)?;
        self.values.push(Cell::Text { start, len });
        Ok(())
    }

    /// Starts a list cell: what [`end_list`](Self::end_list) and
    /// [`drop_list`](Self::drop_list) take.
    pub(crate) fn begin_list(&self) -> (usize, usize) {
        (self.items.len(), self.owned.len())
    }

    pub(crate) fn push_item(&mut self, s: &str) -> Result<(), String> {
        let span = self.span(s)?;
        self.items.push(span);
        Ok(())
    }

    /// Items pushed since `begin`.
    pub(crate) fn items_since(&self, begin: (usize, usize)) -> usize {
        self.items.len() - begin.0
    }

    /// Ends the list begun at `begin` as one value (an empty one is `Null`).
    pub(crate) fn end_list(&mut self, begin: (usize, usize)) {
        let count = self.items_since(begin) as u32;
        self.values.push(if count == 0 { Cell::Null } else { Cell::List { first: begin.0 as u32, count } });
    }

    /// Forgets the items pushed since `begin` (a list refused).
    pub(crate) fn drop_list(&mut self, begin: (usize, usize)) {
        self.items.truncate(begin.0);
        self.owned.truncate(begin.1);
    }

    /// `s`'s span: in the body when it lies there, else copied.
    fn span(&mut self, s: &str) -> Result<(u32, u32), String> {
        if s.len() > MAX_CELL_BYTES {
            return Err(format!(
                "is a string of {} bytes, more than a data file's line holds ({MAX_CELL_BYTES})",
                s.len()
            ));
        }
        let (base, at) = (self.source.as_ptr() as usize, s.as_ptr() as usize);
        if at >= base && at + s.len() <= base + self.source.len() {
            let start = u32::try_from(at - base).map_err(|_| "lies past 4 GiB of body".to_string())?;
            return Ok((start, s.len() as u32));
        }
        if self.owned.capacity() - self.owned.len() < s.len() {
            // Room for every string of the body at once: the pages are only
            // resident once written, and the buffer is never copied to grow.
            self.owned.reserve(self.source.len().max(s.len()));
        }
        let start = u32::try_from(self.owned.len()).map_err(|_| "more than 4 GiB of text".to_string())?;
        self.owned.push_str(s);
        Ok((start, s.len() as u32 | OWNED))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A string inside the body is a span of it (nothing copied); one from
    /// elsewhere (an unescaped copy) is kept; both read back.
    #[test]
    fn strings_of_the_body_are_spans_others_are_copied() {
        let body = b"xx\"hello\"yy".to_vec();
        let mut cells = Cells::new(&body);
        let inside = std::str::from_utf8(&body[3..8]).expect("utf8");
        cells.push_text(inside).expect("span");
        cells.push_text("a\nb").expect("copy");
        assert_eq!(cells.owned, "a\nb", "only the string from elsewhere is copied");
        let texts: Vec<&str> = cells
            .values
            .iter()
            .map(|c| match *c {
                Cell::Text { start, len } => cells.text(start, len),
                _ => panic!("text"),
            })
            .collect();
        assert_eq!(texts, ["hello", "a\nb"]);
        let long = "x".repeat(MAX_CELL_BYTES + 1);
        assert!(cells.push_text(&long).expect_err("long").contains("more than a data file's line"));
    }

    #[test]
    fn a_refused_list_leaves_nothing_behind() {
        let mut cells = Cells::new(b"");
        let begin = cells.begin_list();
        cells.push_item("a").expect("a");
        cells.push_item("b").expect("b");
        cells.drop_list(begin);
        assert!(cells.items.is_empty() && cells.owned.is_empty());
        let begin = cells.begin_list();
        cells.end_list(begin);
        assert_eq!(cells.values, vec![Cell::Null], "an empty list is a missing value");
    }
}
