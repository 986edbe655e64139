//! A text input file, read through gzip or zstd when its first bytes say it
//! is compressed (Criteo's and Avazu's public logs ship gzipped): the magic
//! bytes decide, not the name. Offsets are positions in the decompressed
//! text, so a resumed run continues at the same row either way.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::DataError;

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
const BUFFER_BYTES: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    Plain,
    Gzip,
    Zstd,
}

impl Codec {
    /// What the file's first bytes say it is.
    pub fn sniff(path: &Path) -> Result<Codec, DataError> {
        let mut head = Vec::with_capacity(4);
        File::open(path).and_then(|f| f.take(4).read_to_end(&mut head)).map_err(|e| DataError::io(path, e))?;
        Ok(if head.starts_with(&GZIP_MAGIC) {
            Codec::Gzip
        } else if head.starts_with(&ZSTD_MAGIC) {
            Codec::Zstd
        } else {
            Codec::Plain
        })
    }
}

/// A buffered reader over the file's text, plain or decompressed.
pub struct TextInput {
    path: PathBuf,
    codec: Codec,
    reader: BufReader<Box<dyn Read + Send>>,
}

/// The file's text from `offset` on: a plain file seeks; a decoder cannot,
/// so a resumed run decodes the text before its position again.
fn open_text(path: &Path, codec: Codec, offset: u64) -> Result<BufReader<Box<dyn Read + Send>>, DataError> {
    let io = |e| DataError::io(path, e);
    let mut file = File::open(path).map_err(io)?;
    let decoded: Box<dyn Read + Send> = match codec {
        Codec::Plain => {
            file.seek(SeekFrom::Start(offset)).map_err(io)?;
            return Ok(BufReader::with_capacity(BUFFER_BYTES, Box::new(file)));
        }
        // Multi-member: `cat a.gz b.gz` and bgzip files are one stream of text.
        Codec::Gzip => Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(file))),
        Codec::Zstd => Box::new(ruzstd::decoding::StreamingDecoder::new(BufReader::new(file)).map_err(|e| {
            DataError::io(path, std::io::Error::new(std::io::ErrorKind::InvalidData, format!("zstd: {e}")))
        })?),
    };
    let mut reader = BufReader::with_capacity(BUFFER_BYTES, decoded);
    let skipped = std::io::copy(&mut (&mut reader).take(offset), &mut std::io::sink()).map_err(io)?;
    if skipped < offset {
        let e = format!("the text ends at byte {skipped}, before the position {offset} to resume at");
        return Err(io(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, e)));
    }
    Ok(reader)
}

impl TextInput {
    pub fn open(path: &Path) -> Result<TextInput, DataError> {
        let codec = Codec::sniff(path)?;
        Ok(TextInput { path: path.to_path_buf(), codec, reader: open_text(path, codec, 0)? })
    }

    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// Continues at `offset` bytes into the text.
    pub fn seek(&mut self, offset: u64) -> Result<(), DataError> {
        self.reader = open_text(&self.path, self.codec, offset)?;
        Ok(())
    }
}

impl Read for TextInput {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.reader.read(buf)
    }
}

impl BufRead for TextInput {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        self.reader.fill_buf()
    }

    fn consume(&mut self, amt: usize) {
        self.reader.consume(amt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn read_all(input: &mut TextInput) -> String {
        let mut s = String::new();
        input.read_to_string(&mut s).expect("read");
        s
    }

    #[test]
    fn gzip_and_zstd_read_as_their_text_by_magic_and_seek_by_text_offset() {
        let tmp = tempfile::tempdir().expect("tmp");
        let text = "1\ta\tb\n0\tc\td\n1\te\tf\n";
        let plain = tmp.path().join("rows.tsv");
        std::fs::write(&plain, text).expect("write");
        // Named as if plain: the magic bytes decide.
        let gz = tmp.path().join("rows.txt");
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(&text.as_bytes()[..7]).expect("gz");
        let mut two_members = enc.finish().expect("gz");
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(&text.as_bytes()[7..]).expect("gz");
        two_members.extend(enc.finish().expect("gz"));
        std::fs::write(&gz, two_members).expect("write");
        let zst = tmp.path().join("rows.zst");
        let compressed =
            ruzstd::encoding::compress_to_vec(text.as_bytes(), ruzstd::encoding::CompressionLevel::Fastest);
        std::fs::write(&zst, compressed).expect("write");
        for (path, codec) in [(&plain, Codec::Plain), (&gz, Codec::Gzip), (&zst, Codec::Zstd)] {
            let mut input = TextInput::open(path).expect("open");
            assert_eq!(input.codec(), codec);
            assert_eq!(read_all(&mut input), text);
            input.seek(7).expect("seek");
            assert_eq!(read_all(&mut input), &text[7..]);
            assert!(input.seek(1000).is_err() || codec == Codec::Plain);
        }
    }
}
