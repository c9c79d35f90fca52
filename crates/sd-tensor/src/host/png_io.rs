//! PNG encoding and decoding of [`Image`]s (the `png` crate).
//!
//! Decoding accepts every PNG color type and bit depth and converts to 8-bit RGB or RGBA:
//! gray becomes RGB, gray+alpha becomes RGBA, palettes are expanded (RGBA when they have
//! transparency), and 16-bit samples are rounded to 8 bits. Corrupt or truncated files are an
//! [`ImageError`], never a panic. Encoding writes 8-bit RGB(A) with optional text chunks
//! (`parameters` is the key A1111-style readers look for).

use std::io::Cursor;
use std::path::Path;

use png::{BitDepth, ColorType, Transformations};

use super::image::{Image, ImageError, Result};

/// Largest decoded pixel buffer [`Image::decode_png`] accepts, in bytes (1 GiB).
pub const MAX_PNG_DECODED_BYTES: usize = 1 << 30;

/// Largest decompressed text chunk kept by [`Image::decode_png_with_text`], in bytes.
const MAX_TEXT_BYTES: usize = 16 << 20;

fn decode_err(e: png::DecodingError) -> ImageError {
    ImageError::PngDecode(e.to_string())
}

fn encode_err(e: png::EncodingError) -> ImageError {
    ImageError::PngEncode(e.to_string())
}

/// Checks a text chunk keyword: 1 to 79 printable Latin-1 characters, no leading or trailing
/// space.
fn check_keyword(keyword: &str) -> Result<()> {
    let err = |reason| {
        Err(ImageError::PngText {
            keyword: keyword.to_string(),
            reason,
        })
    };
    let n = keyword.chars().count();
    if n == 0 || n > 79 {
        return err("keywords have 1 to 79 characters");
    }
    if !keyword
        .chars()
        .all(|c| matches!(c as u32, 32..=126 | 161..=255))
    {
        return err("keywords are printable Latin-1");
    }
    if keyword.starts_with(' ') || keyword.ends_with(' ') {
        return err("keywords cannot start or end with a space");
    }
    Ok(())
}

/// 16-bit sample to 8 bits, rounded to nearest.
#[inline]
fn to_8bit(hi: u8, lo: u8) -> u8 {
    let v = u32::from(u16::from_be_bytes([hi, lo]));
    ((v * 255 + 32767) / 65535) as u8
}

impl Image {
    /// Encodes the image as an 8-bit RGB(A) PNG with `text` as `(keyword, text)` chunks, in
    /// order. Latin-1 texts go in `tEXt` chunks and others in `iTXt` (UTF-8), as PIL does.
    pub fn encode_png(&self, text: &[(String, String)]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let color = if self.has_alpha() {
            ColorType::Rgba
        } else {
            ColorType::Rgb
        };
        let mut enc = png::Encoder::new(&mut out, self.width() as u32, self.height() as u32);
        enc.set_color(color);
        enc.set_depth(BitDepth::Eight);
        for (keyword, value) in text {
            check_keyword(keyword)?;
            if value.contains('\0') {
                return Err(ImageError::PngText {
                    keyword: keyword.clone(),
                    reason: "text cannot hold NUL",
                });
            }
            if value.chars().all(|c| (c as u32) < 256) {
                enc.add_text_chunk(keyword.clone(), value.clone())
                    .map_err(encode_err)?;
            } else {
                enc.add_itxt_chunk(keyword.clone(), value.clone())
                    .map_err(encode_err)?;
            }
        }
        let mut writer = enc.write_header().map_err(encode_err)?;
        writer.write_image_data(self.pixels()).map_err(encode_err)?;
        writer.finish().map_err(encode_err)?;
        Ok(out)
    }

    /// Decodes a PNG to 8-bit RGB or RGBA.
    pub fn decode_png(bytes: &[u8]) -> Result<Image> {
        decode(bytes, false).map(|(img, _)| img)
    }

    /// Decodes a PNG to 8-bit RGB or RGBA, with its text chunks (`tEXt`, `zTXt`, `iTXt`, in
    /// file order by kind) as `(keyword, text)` pairs. Text chunks that fail to decompress
    /// are skipped.
    pub fn decode_png_with_text(bytes: &[u8]) -> Result<(Image, Vec<(String, String)>)> {
        decode(bytes, true)
    }

    /// Reads and decodes a PNG file.
    pub fn load_png(path: impl AsRef<Path>) -> Result<Image> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| ImageError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::decode_png(&bytes)
    }

    /// Reads and decodes a PNG file with its text chunks.
    pub fn load_png_with_text(path: impl AsRef<Path>) -> Result<(Image, Vec<(String, String)>)> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| ImageError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::decode_png_with_text(&bytes)
    }

    /// Encodes the image and writes it to `path` (through `<path>.tmp` and a rename, so a
    /// failed write leaves no partial PNG).
    pub fn save_png(&self, path: impl AsRef<Path>, text: &[(String, String)]) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.encode_png(text)?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = std::path::PathBuf::from(tmp);
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| ImageError::Io { path: p, source }
        };
        std::fs::write(&tmp, &bytes).map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(path)(e)
        })
    }
}

fn decode(bytes: &[u8], with_text: bool) -> Result<(Image, Vec<(String, String)>)> {
    let mut decoder = png::Decoder::new(Cursor::new(bytes));
    decoder.set_transformations(Transformations::EXPAND);
    decoder.set_ignore_text_chunk(!with_text);
    let mut reader = decoder.read_info().map_err(decode_err)?;
    let (width, height) = reader.info().size();
    let buf_len = reader.output_buffer_size().ok_or(ImageError::PngTooLarge {
        width,
        height,
        bytes: usize::MAX,
        limit: MAX_PNG_DECODED_BYTES,
    })?;
    if buf_len > MAX_PNG_DECODED_BYTES {
        return Err(ImageError::PngTooLarge {
            width,
            height,
            bytes: buf_len,
            limit: MAX_PNG_DECODED_BYTES,
        });
    }
    let mut buf = vec![0u8; buf_len];
    let frame = reader.next_frame(&mut buf).map_err(decode_err)?;
    let (w, h) = (frame.width as usize, frame.height as usize);
    buf.truncate(frame.line_size * h);

    let samples = match frame.color_type {
        ColorType::Grayscale => 1,
        ColorType::GrayscaleAlpha => 2,
        ColorType::Rgb => 3,
        ColorType::Rgba => 4,
        ColorType::Indexed => return Err(ImageError::PngDecode("palette was not expanded".into())),
    };
    let eight: Vec<u8> = match frame.bit_depth {
        BitDepth::Eight => {
            buf.truncate(w * h * samples);
            buf
        }
        BitDepth::Sixteen => buf
            .chunks_exact(2)
            .take(w * h * samples)
            .map(|s| to_8bit(s[0], s[1]))
            .collect(),
        d => {
            return Err(ImageError::PngDecode(format!(
                "unexpected bit depth {d:?} after expansion"
            )))
        }
    };
    if eight.len() != w * h * samples {
        return Err(ImageError::PngDecode(
            "decoded frame is smaller than its header says".into(),
        ));
    }
    let image = match samples {
        1 => Image::new(w, h, 3, eight.iter().flat_map(|&g| [g, g, g]).collect()),
        2 => Image::new(
            w,
            h,
            4,
            eight
                .chunks_exact(2)
                .flat_map(|p| [p[0], p[0], p[0], p[1]])
                .collect(),
        ),
        c => Image::new(w, h, c, eight),
    }?;

    let mut text = Vec::new();
    if with_text {
        // Text chunks may follow the image data; errors past the image leave it intact.
        if let Err(e) = reader.finish() {
            tracing::debug!("ignoring PNG error after the image data: {e}");
        }
        let info = reader.info();
        for t in &info.uncompressed_latin1_text {
            text.push((t.keyword.clone(), t.text.clone()));
        }
        for t in &info.compressed_latin1_text {
            let mut t = t.clone();
            match t
                .decompress_text_with_limit(MAX_TEXT_BYTES)
                .and_then(|_| t.get_text())
            {
                Ok(s) => text.push((t.keyword.clone(), s)),
                Err(e) => tracing::debug!("skipping zTXt chunk {:?}: {e}", t.keyword),
            }
        }
        for t in &info.utf8_text {
            let mut t = t.clone();
            match t
                .decompress_text_with_limit(MAX_TEXT_BYTES)
                .and_then(|_| t.get_text())
            {
                Ok(s) => text.push((t.keyword.clone(), s)),
                Err(e) => tracing::debug!("skipping iTXt chunk {:?}: {e}", t.keyword),
            }
        }
    }
    Ok((image, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_to_eight_rounds() {
        assert_eq!(to_8bit(0, 0), 0);
        assert_eq!(to_8bit(0xff, 0xff), 255);
        assert_eq!(to_8bit(0x80, 0x00), 128);
        for v in 0..=255u8 {
            // v * 257 is the exact 16-bit equivalent of v.
            let [hi, lo] = (u16::from(v) * 257).to_be_bytes();
            assert_eq!(to_8bit(hi, lo), v);
        }
    }

    #[test]
    fn keywords_are_checked() {
        assert!(check_keyword("parameters").is_ok());
        assert!(check_keyword("").is_err());
        assert!(check_keyword(&"k".repeat(80)).is_err());
        assert!(check_keyword(" lead").is_err());
        assert!(check_keyword("snow\u{2603}").is_err());
        assert!(check_keyword("tab\there").is_err());
    }

    #[test]
    fn round_trip_with_text() {
        let img = Image::new(3, 2, 4, (0..24).map(|i| i as u8 * 10).collect()).unwrap();
        let text = vec![
            (
                "parameters".to_string(),
                "a cat, Steps: 20, Sampler: Euler a".to_string(),
            ),
            (
                "Comment".to_string(),
                "unicode \u{4e2d}\u{6587} prompt".to_string(),
            ),
        ];
        let bytes = img.encode_png(&text).unwrap();
        let (back, got) = Image::decode_png_with_text(&bytes).unwrap();
        assert_eq!(back, img);
        assert_eq!(got, text);
        assert_eq!(Image::decode_png(&bytes).unwrap(), img);
        let bad = [("parameters".to_string(), "nul\0".to_string())];
        assert!(matches!(
            img.encode_png(&bad),
            Err(ImageError::PngText { .. })
        ));
    }
}
