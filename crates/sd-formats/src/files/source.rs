//! Byte sources the readers parse from (a file or bytes in memory), and a bounds-checked,
//! buffered cursor over them.
//!
//! Readers never trust a length read from a file: every read is checked against the source's
//! length first, so no allocation is larger than the file.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};

use super::error::{Ctx, FileError};

/// Random-access bytes: a model file or an in-memory copy of one.
pub trait Source: Sync {
    /// Total length in bytes.
    fn len(&self) -> u64;

    /// Whether the source is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills `buf` with the bytes at `offset`; an error if they are not all there.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;

    /// The whole source as a slice, when it is in memory.
    fn as_slice(&self) -> Option<&[u8]> {
        None
    }
}

fn slice_read_at(s: &[u8], offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let start = usize::try_from(offset).map_err(|_| eof())?;
    let end = start.checked_add(buf.len()).ok_or_else(eof)?;
    let src = s.get(start..end).ok_or_else(eof)?;
    buf.copy_from_slice(src);
    Ok(())
}

impl Source for &[u8] {
    fn len(&self) -> u64 {
        <[u8]>::len(self) as u64
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        slice_read_at(self, offset, buf)
    }

    fn as_slice(&self) -> Option<&[u8]> {
        Some(self)
    }
}

impl Source for Vec<u8> {
    fn len(&self) -> u64 {
        <[u8]>::len(self) as u64
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        slice_read_at(self, offset, buf)
    }

    fn as_slice(&self) -> Option<&[u8]> {
        Some(self)
    }
}

/// A file with its length taken once, when it was opened.
#[derive(Debug)]
pub struct FileSource {
    file: File,
    len: u64,
}

impl FileSource {
    /// Wraps an open file.
    pub fn new(file: File) -> io::Result<Self> {
        let len = file.metadata()?.len();
        Ok(FileSource { file, len })
    }
}

impl Source for FileSource {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        read_exact_at(&self.file, offset, buf)
    }
}

fn eof() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "read past the end of the data",
    )
}

/// Positioned read of exactly `buf.len()` bytes, without moving any shared file cursor.
pub(crate) fn read_exact_at(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
    }
    #[cfg(windows)]
    {
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset.checked_add(done as u64).ok_or_else(eof)?;
            match std::os::windows::fs::FileExt::seek_read(file, &mut buf[done..], at) {
                Ok(0) => return Err(eof()),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

const CHUNK: usize = 1 << 16;

/// A forward cursor over a [`Source`] with bounds checks and a read buffer.
pub(crate) struct Cursor<'a> {
    src: &'a dyn Source,
    ctx: Ctx<'a>,
    pos: u64,
    end: u64,
    buf: Vec<u8>,
    buf_start: u64,
}

impl<'a> Cursor<'a> {
    /// A cursor over `src[start..end]` (`end` clamped to the source length).
    pub fn new(src: &'a dyn Source, ctx: Ctx<'a>, start: u64, end: u64) -> Self {
        let end = end.min(src.len());
        Cursor {
            src,
            ctx,
            pos: start,
            end,
            buf: Vec::new(),
            buf_start: 0,
        }
    }

    /// Current absolute position.
    pub fn pos(&self) -> u64 {
        self.pos
    }

    /// Bytes left before the end.
    pub fn remaining(&self) -> u64 {
        self.end.saturating_sub(self.pos)
    }

    fn check(&self, n: u64) -> Result<u64, FileError> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or_else(|| self.ctx.truncated(self.pos, u64::MAX, self.end))?;
        if end > self.end {
            return Err(self.ctx.truncated(self.pos, end, self.end));
        }
        Ok(end)
    }

    /// Moves forward `n` bytes.
    pub fn skip(&mut self, n: u64) -> Result<(), FileError> {
        self.pos = self.check(n)?;
        Ok(())
    }

    /// Fills `out` from the current position.
    pub fn read_exact(&mut self, out: &mut [u8]) -> Result<(), FileError> {
        let n = out.len() as u64;
        let end = self.check(n)?;
        if let Some(s) = self.src.as_slice() {
            // In bounds: `end <= self.end <= s.len()`.
            let (a, b) = (self.pos as usize, end as usize);
            out.copy_from_slice(&s[a..b]);
        } else if out.len() >= CHUNK {
            self.src
                .read_at(self.pos, out)
                .map_err(|e| self.ctx.io(e))?;
        } else {
            let buf_end = self.buf_start + self.buf.len() as u64;
            if self.pos < self.buf_start || end > buf_end {
                let want = (self.end - self.pos).min(CHUNK as u64) as usize;
                self.buf.resize(want, 0);
                self.src
                    .read_at(self.pos, &mut self.buf)
                    .map_err(|e| self.ctx.io(e))?;
                self.buf_start = self.pos;
            }
            let a = (self.pos - self.buf_start) as usize;
            out.copy_from_slice(&self.buf[a..a + out.len()]);
        }
        self.pos = end;
        Ok(())
    }

    /// Reads `n` bytes into a new vector (checked against the remaining length first).
    pub fn read_vec(&mut self, n: u64) -> Result<Vec<u8>, FileError> {
        self.check(n)?;
        let mut v = vec![0u8; n as usize];
        self.read_exact(&mut v)?;
        Ok(v)
    }

    /// Reads one byte.
    pub fn u8(&mut self) -> Result<u8, FileError> {
        let mut b = [0u8; 1];
        self.read_exact(&mut b)?;
        Ok(b[0])
    }

    /// Reads a little-endian u16.
    pub fn u16(&mut self) -> Result<u16, FileError> {
        let mut b = [0u8; 2];
        self.read_exact(&mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// Reads a little-endian u32.
    pub fn u32(&mut self) -> Result<u32, FileError> {
        let mut b = [0u8; 4];
        self.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Reads a little-endian u64.
    pub fn u64(&mut self) -> Result<u64, FileError> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Reads a fixed array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], FileError> {
        let mut b = [0u8; N];
        self.read_exact(&mut b)?;
        Ok(b)
    }
}

/// `Read + Seek` over a [`Source`], for the zip reader.
pub(crate) struct SourceReader<'a> {
    src: &'a dyn Source,
    pos: u64,
}

impl<'a> SourceReader<'a> {
    pub fn new(src: &'a dyn Source) -> Self {
        SourceReader { src, pos: 0 }
    }
}

impl Read for SourceReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.src.len().saturating_sub(self.pos);
        let n = (buf.len() as u64).min(left) as usize;
        if n == 0 {
            return Ok(0);
        }
        self.src.read_at(self.pos, &mut buf[..n])?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for SourceReader<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let invalid = || io::Error::new(io::ErrorKind::InvalidInput, "seek out of range");
        let new = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.src.len().checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = new.ok_or_else(invalid)?;
        Ok(self.pos)
    }
}
