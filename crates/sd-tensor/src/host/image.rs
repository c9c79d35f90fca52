//! 8-bit RGB(A) images and their conversion to and from tensors.

use std::path::PathBuf;

use thiserror::Error;

use super::shape::ShapeError;
use super::tensor::Tensor;

/// Why an image operation failed.
#[derive(Debug, Error)]
pub enum ImageError {
    /// A zero or too large width or height.
    #[error("invalid image size {width}x{height}: {reason}")]
    Size {
        /// Width asked for.
        width: usize,
        /// Height asked for.
        height: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A channel count other than 3 (RGB) or 4 (RGBA).
    #[error("{0} channels are not supported (3 for RGB or 4 for RGBA)")]
    Channels(usize),
    /// The pixel buffer does not match the size.
    #[error("a {width}x{height} image with {channels} channels needs {expected} bytes, got {got}")]
    PixelCount {
        /// Width.
        width: usize,
        /// Height.
        height: usize,
        /// Channels.
        channels: usize,
        /// Bytes needed.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// A tensor that is not shaped like an image.
    #[error("tensor of shape {shape:?} is not an image: {reason}")]
    TensorShape {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// What is wrong.
        reason: &'static str,
    },
    /// A crop rectangle outside the image.
    #[error("crop of {w}x{h} at ({x}, {y}) does not fit in the {width}x{height} image")]
    Crop {
        /// Left edge.
        x: usize,
        /// Top edge.
        y: usize,
        /// Crop width.
        w: usize,
        /// Crop height.
        h: usize,
        /// Image width.
        width: usize,
        /// Image height.
        height: usize,
    },
    /// A tensor operation failed.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The bytes are not a PNG this decoder can read (corrupt, truncated or unsupported).
    #[error("cannot decode PNG: {0}")]
    PngDecode(String),
    /// The PNG would decode to more bytes than allowed.
    #[error("PNG of {width}x{height} decodes to {bytes} bytes, over the limit of {limit}")]
    PngTooLarge {
        /// Width from the header.
        width: u32,
        /// Height from the header.
        height: u32,
        /// Decoded size in bytes.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// Encoding failed.
    #[error("cannot encode PNG: {0}")]
    PngEncode(String),
    /// A text chunk that PNG cannot hold.
    #[error("PNG text chunk {keyword:?}: {reason}")]
    PngText {
        /// The keyword.
        keyword: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Result of the image operations.
pub type Result<T, E = ImageError> = std::result::Result<T, E>;

/// How pixel values 0..=255 map to tensor values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PixelRange {
    /// 0 -> 0.0, 255 -> 1.0.
    ZeroToOne,
    /// 0 -> -1.0, 255 -> 1.0 (the VAE's input range).
    MinusOneToOne,
}

impl PixelRange {
    /// The tensor value of a pixel value.
    #[inline]
    pub fn to_value(self, p: u8) -> f32 {
        match self {
            PixelRange::ZeroToOne => p as f32 / 255.0,
            PixelRange::MinusOneToOne => p as f32 / 127.5 - 1.0,
        }
    }

    /// The pixel value of a tensor value, rounded to nearest and clamped (NaN gives 0).
    #[inline]
    pub fn to_pixel(self, v: f32) -> u8 {
        let x = match self {
            PixelRange::ZeroToOne => v * 255.0,
            PixelRange::MinusOneToOne => (v + 1.0) * 127.5,
        };
        // `as u8` saturates and maps NaN to 0.
        x.round() as u8
    }
}

/// An 8-bit RGB or RGBA image: rows top to bottom, channels interleaved.
///
/// Width and height are at least 1, and `pixels.len() == width * height * channels`.
#[derive(Clone, PartialEq, Eq)]
pub struct Image {
    width: usize,
    height: usize,
    channels: usize,
    pixels: Vec<u8>,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("width", &self.width)
            .field("height", &self.height)
            .field("channels", &self.channels)
            .finish_non_exhaustive()
    }
}

/// Fraction bits of PIL's 8-bit resampling weights (`PRECISION_BITS`).
const FIXED_BITS: u32 = 22;

/// Weights as PIL's `normalize_coeffs_8bpc` rounds them (half away from zero).
fn fixed_point(taps: &[super::interpolate::Taps]) -> Vec<(usize, Vec<i64>)> {
    let one = (1i64 << FIXED_BITS) as f64;
    taps.iter()
        .map(|t| {
            let k = t
                .weights
                .iter()
                .map(|&w| {
                    if w < 0.0 {
                        (w * one - 0.5) as i64
                    } else {
                        (w * one + 0.5) as i64
                    }
                })
                .collect();
            (t.first, k)
        })
        .collect()
}

/// Source indices of PIL's nearest-neighbour resize of `in_size` to `out_size`.
fn pil_nearest(in_size: usize, out_size: usize) -> Vec<usize> {
    let step = in_size as f64 / out_size as f64;
    let mut pos = step * 0.5;
    (0..out_size)
        .map(|_| {
            let i = (pos.max(0.0) as usize).min(in_size - 1);
            pos += step;
            i
        })
        .collect()
}

/// PIL's 8-bit tap sum: `src[start + j * step] * k[j]` over the taps, from half a unit,
/// shifted down and clipped to 0..=255.
fn fixed_sum(src: &[u8], k: &[i64], start: usize, step: usize) -> u8 {
    let acc = k
        .iter()
        .enumerate()
        .fold(1i64 << (FIXED_BITS - 1), |a, (j, &k)| {
            a + src[start + j * step] as i64 * k
        });
    (acc >> FIXED_BITS).clamp(0, 255) as u8
}

fn check_size(width: usize, height: usize) -> Result<()> {
    if width == 0 || height == 0 {
        return Err(ImageError::Size {
            width,
            height,
            reason: "width and height must be at least 1",
        });
    }
    if width > u32::MAX as usize || height > u32::MAX as usize {
        return Err(ImageError::Size {
            width,
            height,
            reason: "too large",
        });
    }
    Ok(())
}

/// `(channels, height, width)` of an image-shaped tensor: `[1, C, H, W]` or `[C, H, W]`.
fn image_dims(shape: &[usize]) -> Result<(usize, usize, usize)> {
    let chw = match shape {
        [1, c, h, w] | [c, h, w] => (*c, *h, *w),
        [_, _, _, _] => {
            return Err(ImageError::TensorShape {
                shape: shape.to_vec(),
                reason: "batch size must be 1",
            });
        }
        _ => {
            return Err(ImageError::TensorShape {
                shape: shape.to_vec(),
                reason: "expected [1, C, H, W] or [C, H, W]",
            });
        }
    };
    Ok(chw)
}

impl Image {
    /// An image from interleaved pixels; `channels` is 3 or 4.
    pub fn new(width: usize, height: usize, channels: usize, pixels: Vec<u8>) -> Result<Self> {
        check_size(width, height)?;
        if channels != 3 && channels != 4 {
            return Err(ImageError::Channels(channels));
        }
        let expected = width
            .checked_mul(height)
            .and_then(|n| n.checked_mul(channels))
            .ok_or(ImageError::Size {
                width,
                height,
                reason: "too large",
            })?;
        if pixels.len() != expected {
            return Err(ImageError::PixelCount {
                width,
                height,
                channels,
                expected,
                got: pixels.len(),
            });
        }
        Ok(Image {
            width,
            height,
            channels,
            pixels,
        })
    }

    /// An RGB image from interleaved pixels.
    pub fn from_rgb(width: usize, height: usize, pixels: Vec<u8>) -> Result<Self> {
        Self::new(width, height, 3, pixels)
    }

    /// An RGBA image from interleaved pixels.
    pub fn from_rgba(width: usize, height: usize, pixels: Vec<u8>) -> Result<Self> {
        Self::new(width, height, 4, pixels)
    }

    /// An image with every pixel `color` (3 or 4 values, which sets the channel count).
    pub fn filled(width: usize, height: usize, color: &[u8]) -> Result<Self> {
        check_size(width, height)?;
        let n = width.checked_mul(height).ok_or(ImageError::Size {
            width,
            height,
            reason: "too large",
        })?;
        if color.len() != 3 && color.len() != 4 {
            return Err(ImageError::Channels(color.len()));
        }
        Self::new(width, height, color.len(), color.repeat(n))
    }

    /// Width in pixels.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> usize {
        self.height
    }

    /// Channels: 3 (RGB) or 4 (RGBA).
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Whether the image has an alpha channel.
    pub fn has_alpha(&self) -> bool {
        self.channels == 4
    }

    /// Pixels, row-major, interleaved channels.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// Pixels, mutable (the size stays fixed).
    pub fn pixels_mut(&mut self) -> &mut [u8] {
        &mut self.pixels
    }

    /// The pixel buffer.
    pub fn into_pixels(self) -> Vec<u8> {
        self.pixels
    }

    /// The channels of pixel `(x, y)`, or `None` outside the image.
    pub fn pixel(&self, x: usize, y: usize) -> Option<&[u8]> {
        if x >= self.width || y >= self.height {
            return None;
        }
        let o = (y * self.width + x) * self.channels;
        Some(&self.pixels[o..o + self.channels])
    }

    /// The image as a `[1, C, H, W]` f32 tensor in `range`.
    pub fn to_tensor(&self, range: PixelRange) -> Tensor<f32> {
        self.to_tensor_with(|p| range.to_value(p))
    }

    fn to_tensor_with(&self, value: impl Fn(u8) -> f32) -> Tensor<f32> {
        let (w, h, c) = (self.width, self.height, self.channels);
        let plane = w * h;
        let mut data = vec![0f32; c * plane];
        for (i, px) in self.pixels.chunks_exact(c).enumerate() {
            for (ch, &p) in px.iter().enumerate() {
                data[ch * plane + i] = value(p);
            }
        }
        Tensor::new([1, c, h, w], data).expect("image invariants give a consistent shape")
    }

    /// An image from a `[1, C, H, W]` or `[C, H, W]` tensor in `range` (C = 3 or 4, or 1 for a
    /// gray image, which becomes RGB). Values are rounded to nearest and clamped.
    pub fn from_tensor(t: &Tensor<f32>, range: PixelRange) -> Result<Self> {
        Self::from_tensor_with(t, |v| range.to_pixel(v))
    }

    fn from_tensor_with(t: &Tensor<f32>, pixel: impl Fn(f32) -> u8) -> Result<Self> {
        let (c, h, w) = image_dims(t.shape())?;
        check_size(w, h)?;
        let plane = w * h;
        let src = t.data();
        let out_c = match c {
            1 => 3,
            3 | 4 => c,
            _ => {
                return Err(ImageError::TensorShape {
                    shape: t.shape().to_vec(),
                    reason: "channels must be 1, 3 or 4",
                });
            }
        };
        let mut pixels = Vec::with_capacity(plane * out_c);
        for i in 0..plane {
            if c == 1 {
                let p = pixel(src[i]);
                pixels.extend_from_slice(&[p, p, p]);
            } else {
                pixels.extend((0..c).map(|ch| pixel(src[ch * plane + i])));
            }
        }
        Self::new(w, h, out_c, pixels)
    }

    /// The RGB channels, and the alpha channel as a `[1, 1, H, W]` tensor in [0, 1] when the
    /// image has one.
    pub fn split_alpha(&self) -> (Image, Option<Tensor<f32>>) {
        if self.channels == 3 {
            return (self.clone(), None);
        }
        let plane = self.width * self.height;
        let mut rgb = Vec::with_capacity(plane * 3);
        let mut alpha = Vec::with_capacity(plane);
        for px in self.pixels.chunks_exact(4) {
            rgb.extend_from_slice(&px[..3]);
            alpha.push(px[3] as f32 / 255.0);
        }
        let img = Image {
            width: self.width,
            height: self.height,
            channels: 3,
            pixels: rgb,
        };
        let a =
            Tensor::new([1, 1, self.height, self.width], alpha).expect("consistent alpha shape");
        (img, Some(a))
    }

    /// The RGB channels of this image with `alpha` as the alpha channel. `alpha` is a plane of
    /// the image's size in [0, 1] shaped `[H, W]`, `[1, H, W]` or `[1, 1, H, W]` (rounded and
    /// clamped to 8 bits).
    pub fn with_alpha(&self, alpha: &Tensor<f32>) -> Result<Image> {
        let (h, w) = match alpha.shape() {
            [h, w] | [1, h, w] | [1, 1, h, w] => (*h, *w),
            s => {
                return Err(ImageError::TensorShape {
                    shape: s.to_vec(),
                    reason: "alpha must be [H, W], [1, H, W] or [1, 1, H, W]",
                });
            }
        };
        if (w, h) != (self.width, self.height) {
            return Err(ImageError::Shape(ShapeError::Mismatch {
                op: "with_alpha",
                lhs: vec![self.height, self.width],
                rhs: alpha.shape().to_vec(),
            }));
        }
        let mut pixels = Vec::with_capacity(w * h * 4);
        for (px, &a) in self.pixels.chunks_exact(self.channels).zip(alpha.data()) {
            pixels.extend_from_slice(&px[..3]);
            pixels.push(PixelRange::ZeroToOne.to_pixel(a));
        }
        Self::new(w, h, 4, pixels)
    }

    /// The image without its alpha channel (a copy if it has none).
    pub fn to_rgb(&self) -> Image {
        self.split_alpha().0
    }

    /// The image with an alpha channel (opaque if it had none).
    pub fn to_rgba(&self) -> Image {
        if self.channels == 4 {
            return self.clone();
        }
        let mut pixels = Vec::with_capacity(self.width * self.height * 4);
        for px in self.pixels.chunks_exact(3) {
            pixels.extend_from_slice(px);
            pixels.push(255);
        }
        Image {
            width: self.width,
            height: self.height,
            channels: 4,
            pixels,
        }
    }

    /// Raw pixel values as a `[1, C, H, W]` tensor (0.0..=255.0), for resampling.
    fn raw_tensor(&self) -> Tensor<f32> {
        self.to_tensor_with(|p| p as f32)
    }

    /// An image from raw pixel values (rounded and clamped to 0..=255).
    fn from_raw_tensor(t: &Tensor<f32>) -> Result<Image> {
        Self::from_tensor_with(t, |v| v.round() as u8)
    }

    /// The image resampled to `width` x `height` with bilinear interpolation (torch
    /// `F.interpolate` `bilinear`, `align_corners=False`, no antialiasing; channels, alpha
    /// included, are filtered independently).
    pub fn resize_bilinear(&self, width: usize, height: usize) -> Result<Image> {
        check_size(width, height)?;
        if (width, height) == (self.width, self.height) {
            return Ok(self.clone());
        }
        Self::from_raw_tensor(
            &self
                .raw_tensor()
                .interpolate_bilinear(height, width, false)?,
        )
    }

    /// The image resampled to `width` x `height` taking the pixel under each output pixel's
    /// centre, as PIL's `NEAREST` resize (torch `nearest-exact`).
    /// The source positions are PIL's: `(i + 0.5) * in / out` accumulated in f64 step by step
    /// (`ImagingScaleAffine`), which can land one pixel below the exact product.
    pub fn resize_nearest(&self, width: usize, height: usize) -> Result<Image> {
        check_size(width, height)?;
        if super::checked_numel(&[width, height, self.channels]).is_none() {
            return Err(ImageError::Size {
                width,
                height,
                reason: "too large",
            });
        }
        let cols = pil_nearest(self.width, width);
        let rows = pil_nearest(self.height, height);
        let c = self.channels;
        let mut out = Vec::with_capacity(width * height * c);
        for &y in &rows {
            let row = &self.pixels[y * self.width * c..(y + 1) * self.width * c];
            for &x in &cols {
                out.extend_from_slice(&row[x * c..(x + 1) * c]);
            }
        }
        Image::new(width, height, c, out)
    }

    /// The image resampled to `width` x `height` with an antialiasing `filter`, bit for bit
    /// as PIL's `Image.resize` of an 8-bit RGB or L image (`LANCZOS`, `BICUBIC`,
    /// `BILINEAR`): columns first, then rows, each pass skipped when its size is unchanged;
    /// 22-bit fixed-point weights and a rounded, clipped 8-bit result after each pass.
    /// Channels (alpha included) are filtered independently; PIL premultiplies RGBA.
    pub fn resize_filtered(
        &self,
        width: usize,
        height: usize,
        filter: super::ResampleFilter,
    ) -> Result<Image> {
        check_size(width, height)?;
        if super::checked_numel(&[width, height, self.channels]).is_none() {
            return Err(ImageError::Size {
                width,
                height,
                reason: "too large",
            });
        }
        let c = self.channels;
        let mut cur = self.pixels.clone();
        let mut w = self.width;
        if width != self.width {
            let taps = fixed_point(&super::interpolate::filter_taps(self.width, width, filter));
            let mut out = Vec::with_capacity(width * self.height * c);
            for y in 0..self.height {
                for (first, k) in &taps {
                    for ch in 0..c {
                        out.push(fixed_sum(&cur, k, y * w * c + first * c + ch, c));
                    }
                }
            }
            cur = out;
            w = width;
        }
        if height != self.height {
            let taps = fixed_point(&super::interpolate::filter_taps(
                self.height,
                height,
                filter,
            ));
            let stride = w * c;
            let mut out = Vec::with_capacity(stride * height);
            for (first, k) in &taps {
                for i in 0..stride {
                    out.push(fixed_sum(&cur, k, first * stride + i, stride));
                }
            }
            cur = out;
        }
        Image::new(width, height, c, cur)
    }

    /// The `w` x `h` rectangle whose top-left corner is `(x, y)`.
    pub fn crop(&self, x: usize, y: usize, w: usize, h: usize) -> Result<Image> {
        let fits = w > 0
            && h > 0
            && x.checked_add(w).is_some_and(|r| r <= self.width)
            && y.checked_add(h).is_some_and(|b| b <= self.height);
        if !fits {
            return Err(ImageError::Crop {
                x,
                y,
                w,
                h,
                width: self.width,
                height: self.height,
            });
        }
        let c = self.channels;
        let mut pixels = Vec::with_capacity(w * h * c);
        for row in y..y + h {
            let o = (row * self.width + x) * c;
            pixels.extend_from_slice(&self.pixels[o..o + w * c]);
        }
        Self::new(w, h, c, pixels)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient(w: usize, h: usize, c: usize) -> Image {
        let pixels = (0..w * h * c).map(|i| (i * 37 % 256) as u8).collect();
        Image::new(w, h, c, pixels).unwrap()
    }

    #[test]
    fn constructors_validate() {
        assert!(matches!(
            Image::new(2, 2, 2, vec![0; 8]),
            Err(ImageError::Channels(2))
        ));
        assert!(matches!(
            Image::new(0, 2, 3, vec![]),
            Err(ImageError::Size { .. })
        ));
        assert!(matches!(
            Image::new(2, 2, 3, vec![0; 11]),
            Err(ImageError::PixelCount { expected: 12, .. })
        ));
        assert!(matches!(
            Image::new(usize::MAX / 2, 3, 3, vec![]),
            Err(ImageError::Size { .. })
        ));
        let f = Image::filled(2, 1, &[1, 2, 3, 4]).unwrap();
        assert_eq!(f.pixels(), &[1, 2, 3, 4, 1, 2, 3, 4]);
        assert_eq!(f.pixel(1, 0), Some(&[1u8, 2, 3, 4][..]));
        assert_eq!(f.pixel(2, 0), None);
    }

    #[test]
    fn tensor_layout_and_ranges() {
        let img = Image::from_rgb(2, 1, vec![0, 128, 255, 10, 20, 30]).unwrap();
        let t = img.to_tensor(PixelRange::ZeroToOne);
        assert_eq!(t.shape(), &[1, 3, 1, 2]);
        assert_eq!(t.data()[0], 0.0);
        assert_eq!(t.data()[1], 10.0 / 255.0);
        assert_eq!(t.data()[4], 1.0);
        let s = img.to_tensor(PixelRange::MinusOneToOne);
        assert_eq!((s.data()[0], s.data()[4]), (-1.0, 1.0));
        for range in [PixelRange::ZeroToOne, PixelRange::MinusOneToOne] {
            assert_eq!(
                Image::from_tensor(&img.to_tensor(range), range).unwrap(),
                img
            );
        }
        let chw = t.clone().squeeze(0).unwrap();
        assert_eq!(
            Image::from_tensor(&chw, PixelRange::ZeroToOne).unwrap(),
            img
        );
    }

    #[test]
    fn from_tensor_rounds_clamps_and_rejects() {
        let t = Tensor::new([1, 1, 1, 4], vec![-3.0f32, 0.5 / 255.0, 2.0, f32::NAN]).unwrap();
        let img = Image::from_tensor(&t, PixelRange::ZeroToOne).unwrap();
        assert_eq!(img.channels(), 3);
        assert_eq!(img.pixels(), &[0, 0, 0, 1, 1, 1, 255, 255, 255, 0, 0, 0]);
        for shape in [
            vec![2, 3, 2, 2],
            vec![1, 2, 2, 2],
            vec![3, 4],
            vec![1, 3, 0, 2],
        ] {
            let t = Tensor::<f32>::zeros(shape.clone()).unwrap();
            assert!(
                Image::from_tensor(&t, PixelRange::ZeroToOne).is_err(),
                "{shape:?}"
            );
        }
    }

    #[test]
    fn alpha_split_and_join() {
        let img = gradient(3, 2, 4);
        let (rgb, alpha) = img.split_alpha();
        assert_eq!(rgb.channels(), 3);
        let alpha = alpha.unwrap();
        assert_eq!(alpha.shape(), &[1, 1, 2, 3]);
        assert_eq!(rgb.with_alpha(&alpha).unwrap(), img);
        assert_eq!(img.to_rgb(), rgb);
        assert!(rgb.split_alpha().1.is_none());
        assert!(rgb.with_alpha(&Tensor::zeros([2, 2]).unwrap()).is_err());
        assert!(rgb.with_alpha(&Tensor::zeros([2, 2, 3]).unwrap()).is_err());
        let opaque = rgb.to_rgba();
        assert!(opaque.pixels().chunks(4).all(|p| p[3] == 255));
    }

    #[test]
    fn crop_and_resize() {
        let img = gradient(4, 3, 3);
        let c = img.crop(1, 1, 2, 2).unwrap();
        assert_eq!((c.width(), c.height()), (2, 2));
        assert_eq!(c.pixel(0, 0), img.pixel(1, 1));
        assert_eq!(c.pixel(1, 1), img.pixel(2, 2));
        assert!(img.crop(3, 0, 2, 1).is_err());
        assert!(img.crop(0, 0, 0, 1).is_err());
        assert!(img.crop(usize::MAX, 0, 2, 1).is_err());
        assert_eq!(img.resize_bilinear(4, 3).unwrap(), img);
        let big = img.resize_bilinear(8, 6).unwrap();
        assert_eq!((big.width(), big.height(), big.channels()), (8, 6, 3));
        let flat = Image::filled(5, 5, &[9, 99, 199]).unwrap();
        assert_eq!(
            flat.resize_bilinear(3, 7).unwrap(),
            Image::filled(3, 7, &[9, 99, 199]).unwrap()
        );
        assert_eq!(
            img.resize_nearest(8, 6)
                .unwrap()
                .resize_nearest(4, 3)
                .unwrap(),
            img
        );
        assert!(img.resize_bilinear(0, 3).is_err());
    }
}
