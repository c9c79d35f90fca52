//! Input images (`-i`): PNG or JPEG, told apart by their first bytes.

use std::path::Path;

use sd_tensor::Image;
use zune_jpeg::zune_core::bytestream::ZCursor;
use zune_jpeg::zune_core::colorspace::ColorSpace;
use zune_jpeg::zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

/// The largest input side (pixels) decoded.
const MAX_SIDE: usize = 32768;

/// An image file with its PNG text chunks (none for JPEG).
pub struct Loaded {
    /// The image (RGB or RGBA).
    pub image: Image,
    /// PNG `(keyword, text)` chunks.
    pub text: Vec<(String, String)>,
}

/// Reads a PNG or JPEG file; the message names the file.
pub fn load(path: &Path) -> Result<Loaded, String> {
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    if bytes.starts_with(b"\x89PNG") {
        let (image, text) =
            Image::decode_png_with_text(&bytes).map_err(|e| format!("{shown}: {e}"))?;
        return Ok(Loaded { image, text });
    }
    if bytes.starts_with(&[0xFF, 0xD8]) {
        let options = DecoderOptions::default()
            .jpeg_set_out_colorspace(ColorSpace::RGB)
            .set_max_width(MAX_SIDE)
            .set_max_height(MAX_SIDE);
        let mut dec = JpegDecoder::new_with_options(ZCursor::new(&bytes), options);
        let pixels = dec
            .decode()
            .map_err(|e| format!("{shown}: not a readable JPEG: {e:?}"))?;
        let info = dec
            .info()
            .ok_or_else(|| format!("{shown}: JPEG without a frame header"))?;
        let image = Image::from_rgb(usize::from(info.width), usize::from(info.height), pixels)
            .map_err(|e| format!("{shown}: {e}"))?;
        return Ok(Loaded {
            image,
            text: Vec::new(),
        });
    }
    Err(format!("{shown}: not a PNG or JPEG file"))
}
