//! Image file formats of `-o`: PNG (with `tEXt` chunks), JPEG (`jpeg-encoder`, quality 90)
//! and lossless WebP (`image-webp`), chosen by the name's extension. JPEG and WebP carry the
//! `parameters` text as A1111 writes it there: an EXIF UserComment (`UNICODE\0` and the
//! text in UTF-16 big-endian) in an APP1 segment (JPEG) or an `EXIF` chunk (WebP).

use std::path::Path;

use sd_tensor::Image;

/// An output file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// PNG with `tEXt`/`iTXt` chunks.
    Png,
    /// Baseline JPEG, quality 90, 4:2:0 (alpha dropped).
    Jpeg,
    /// Lossless WebP (VP8L).
    WebP,
}

/// JPEG quality (A1111's default for JPEG saves is 80; sd-rs keeps more detail).
const JPEG_QUALITY: u8 = 90;

impl Format {
    /// The format a file name asks for by its extension (case-insensitive); `None` for an
    /// extension sd does not write.
    pub fn from_path(path: &Path) -> Option<Format> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "png" => Some(Format::Png),
            "jpg" | "jpeg" => Some(Format::Jpeg),
            "webp" => Some(Format::WebP),
            _ => None,
        }
    }

    /// The format's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Format::Png => "PNG",
            Format::Jpeg => "JPEG",
            Format::WebP => "WebP",
        }
    }
}

/// Encodes `image` (RGB or RGBA) as `format` with the text chunks `text` (`(key, value)`;
/// JPEG and WebP keep the `parameters` one).
pub fn encode(image: &Image, format: Format, text: &[(String, String)]) -> Result<Vec<u8>, String> {
    let parameters = text
        .iter()
        .find(|(k, _)| k == "parameters")
        .map(|(_, v)| v.as_str());
    match format {
        Format::Png => image.encode_png(text).map_err(|e| e.to_string()),
        Format::Jpeg => {
            let too_big = |n: usize| n > u16::MAX as usize;
            if too_big(image.width()) || too_big(image.height()) {
                return Err(format!(
                    "JPEG holds at most 65535 pixels a side, the image is {}x{}",
                    image.width(),
                    image.height()
                ));
            }
            let rgb = image.to_rgb();
            let mut out = Vec::new();
            let mut enc = jpeg_encoder::Encoder::new(&mut out, JPEG_QUALITY);
            if let Some(p) = parameters {
                // An APP1 segment holds 65533 bytes: a longer text is cut at a character.
                let room = 65533 - 6 - 44 - 8;
                let mut used = 0;
                let keep: String = p
                    .chars()
                    .take_while(|c| {
                        used += 2 * c.len_utf16();
                        used <= room
                    })
                    .collect();
                let mut app1 = b"Exif\0\0".to_vec();
                app1.extend(exif_user_comment(&keep));
                enc.add_app_segment(1, &app1).map_err(|e| e.to_string())?;
            }
            enc.encode(
                rgb.pixels(),
                rgb.width() as u16,
                rgb.height() as u16,
                jpeg_encoder::ColorType::Rgb,
            )
            .map_err(|e| e.to_string())?;
            Ok(out)
        }
        Format::WebP => {
            let (color, w, h) = (
                if image.has_alpha() {
                    image_webp::ColorType::Rgba8
                } else {
                    image_webp::ColorType::Rgb8
                },
                image.width() as u32,
                image.height() as u32,
            );
            let pixels = if image.has_alpha() {
                image.to_rgba()
            } else {
                image.to_rgb()
            };
            let mut out = Vec::new();
            let mut enc = image_webp::WebPEncoder::new(&mut out);
            if let Some(p) = parameters {
                enc.set_exif_metadata(exif_user_comment(p));
            }
            enc.encode(pixels.pixels(), w, h, color)
                .map_err(|e| e.to_string())?;
            Ok(out)
        }
    }
}

/// A big-endian TIFF (EXIF) block holding `text` as the UserComment (tag 0x9286) of an
/// EXIF sub-IFD, encoded as A1111 (piexif's `UserComment.dump(.., "unicode")`) writes it.
pub fn exif_user_comment(text: &str) -> Vec<u8> {
    let mut comment = b"UNICODE\0".to_vec();
    for u in text.encode_utf16() {
        comment.extend(u.to_be_bytes());
    }
    let mut t = Vec::new();
    t.extend(b"MM\0\x2a");
    t.extend(8u32.to_be_bytes());
    // IFD0 at 8: one entry, ExifIFDPointer (0x8769, LONG) -> the EXIF IFD at 26.
    t.extend(1u16.to_be_bytes());
    t.extend(0x8769u16.to_be_bytes());
    t.extend(4u16.to_be_bytes());
    t.extend(1u32.to_be_bytes());
    t.extend(26u32.to_be_bytes());
    t.extend(0u32.to_be_bytes());
    // EXIF IFD at 26: one entry, UserComment (UNDEFINED) -> its data at 44.
    t.extend(1u16.to_be_bytes());
    t.extend(0x9286u16.to_be_bytes());
    t.extend(7u16.to_be_bytes());
    t.extend((comment.len() as u32).to_be_bytes());
    t.extend(44u32.to_be_bytes());
    t.extend(0u32.to_be_bytes());
    debug_assert_eq!(t.len(), 44);
    t.extend(comment);
    t
}

/// The UserComment text of a TIFF block written by [`exif_user_comment`] (tests).
#[cfg(test)]
pub fn read_user_comment(tiff: &[u8]) -> Option<String> {
    let u16at = |o: usize| Some(u16::from_be_bytes(tiff.get(o..o + 2)?.try_into().ok()?));
    let u32at = |o: usize| Some(u32::from_be_bytes(tiff.get(o..o + 4)?.try_into().ok()?));
    if tiff.get(..4)? != b"MM\0\x2a" {
        return None;
    }
    let ifd0 = u32at(4)? as usize;
    let exif = (0..u16at(ifd0)? as usize)
        .map(|i| ifd0 + 2 + 12 * i)
        .find(|&e| u16at(e) == Some(0x8769))
        .and_then(|e| u32at(e + 8))? as usize;
    let entry = (0..u16at(exif)? as usize)
        .map(|i| exif + 2 + 12 * i)
        .find(|&e| u16at(e) == Some(0x9286))?;
    let (n, off) = (u32at(entry + 4)? as usize, u32at(entry + 8)? as usize);
    let data = tiff.get(off..off + n)?.strip_prefix(b"UNICODE\0")?;
    let units: Vec<u16> = data
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    String::from_utf16(&units).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> Image {
        let px: Vec<u8> = (0..16 * 8 * 3).map(|i| (i * 7 % 256) as u8).collect();
        Image::from_rgb(16, 8, px).unwrap()
    }

    #[test]
    fn formats_by_extension() {
        assert_eq!(Format::from_path(Path::new("a.PNG")), Some(Format::Png));
        assert_eq!(Format::from_path(Path::new("a.jpeg")), Some(Format::Jpeg));
        assert_eq!(Format::from_path(Path::new("a.JPG")), Some(Format::Jpeg));
        assert_eq!(Format::from_path(Path::new("a.webp")), Some(Format::WebP));
        assert_eq!(Format::from_path(Path::new("a.gif")), None);
        assert_eq!(Format::from_path(Path::new("a")), None);
    }

    #[test]
    fn user_comment_round_trips() {
        let text = "a red circle, (dé:1.2)\nSteps: 20, Seed: 42";
        assert_eq!(
            read_user_comment(&exif_user_comment(text)).as_deref(),
            Some(text)
        );
    }

    #[test]
    fn jpeg_decodes_with_its_comment() {
        let text = vec![("parameters".to_string(), "hello, Seed: 1".to_string())];
        let bytes = encode(&image(), Format::Jpeg, &text).unwrap();
        assert_eq!(&bytes[..2], &[0xff, 0xd8]);
        let mut dec = zune_jpeg::JpegDecoder::new(std::io::Cursor::new(&bytes));
        let px = dec.decode().unwrap();
        let (w, h) = dec.dimensions().unwrap();
        assert_eq!((w, h), (16, 8));
        // Lossy: close to the original on average.
        let err: f64 = px
            .iter()
            .zip(image().pixels())
            .map(|(a, b)| (*a as f64 - *b as f64).abs())
            .sum::<f64>()
            / px.len() as f64;
        assert!(err < 40.0, "mean abs error {err}");
        let at = bytes.windows(6).position(|w| w == b"Exif\0\0").unwrap();
        assert_eq!(
            read_user_comment(&bytes[at + 6..]).as_deref(),
            Some("hello, Seed: 1")
        );
    }

    #[test]
    fn webp_is_lossless_with_its_comment() {
        let text = vec![("parameters".to_string(), "hello, Seed: 1".to_string())];
        let bytes = encode(&image(), Format::WebP, &text).unwrap();
        let mut dec = image_webp::WebPDecoder::new(std::io::Cursor::new(&bytes)).unwrap();
        assert_eq!(dec.dimensions(), (16, 8));
        let exif = dec.exif_metadata().unwrap().unwrap();
        assert_eq!(read_user_comment(&exif).as_deref(), Some("hello, Seed: 1"));
        let mut px = vec![0u8; dec.output_buffer_size().unwrap()];
        dec.read_image(&mut px).unwrap();
        assert_eq!(px, image().pixels());
    }
}
