//! Tiled VAE decoding and encoding (`--vae-tiling`): latents (or pixels) are cut into
//! overlapping tiles of equal size, each tile is decoded (encoded) on its own (one graph shape for every tile, so the engine reuses one
//! plan and workspace), and the decoded tiles are blended with linear ramps across their
//! overlaps.
//!
//! As in stable-diffusion.cpp the result is not bit-identical to a whole decode (each tile's
//! group norms see only that tile); with tiles at least as large as the latents it is the
//! whole decode.

use sd_tensor::Tensor;

/// Tile geometry in latent pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VaeTiling {
    /// Side of a square tile.
    pub tile: usize,
    /// Overlap between neighbouring tiles (less than `tile`).
    pub overlap: usize,
}

impl Default for VaeTiling {
    /// stable-diffusion.cpp's geometry: 32-latent tiles, half of them overlapping.
    fn default() -> Self {
        VaeTiling {
            tile: 32,
            overlap: 16,
        }
    }
}

impl VaeTiling {
    /// Start offsets of the tiles along an axis of `len` latent pixels: stride
    /// `tile - overlap`, the last tile flush with the end. One tile of the whole axis when
    /// it is no longer than a tile.
    pub fn starts(&self, len: usize) -> Vec<usize> {
        let tile = self.tile.max(1);
        if len <= tile {
            return vec![0];
        }
        let stride = tile.saturating_sub(self.overlap).max(1);
        let mut v = Vec::new();
        let mut s = 0;
        while s + tile < len {
            v.push(s);
            s += stride;
        }
        v.push(len - tile);
        v.dedup();
        v
    }
}

/// Blending weight of output pixel `i` of a tile spanning `[start, start + size)` on an axis
/// of `len` pixels, with ramps of `ramp` pixels on the sides that touch another tile.
fn ramp_weight(i: usize, start: usize, size: usize, len: usize, ramp: usize) -> f32 {
    let mut w = 1f32;
    if ramp == 0 {
        return w;
    }
    if start > 0 && i < ramp {
        w = w.min((i as f32 + 0.5) / ramp as f32);
    }
    if start + size < len && size - i <= ramp {
        w = w.min(((size - i) as f32 - 0.5) / ramp as f32);
    }
    w
}

/// The blended output: weighted sums `[c, oh, ow]` and the weight sums `[oh, ow]`.
struct Canvas {
    acc: Vec<f32>,
    wsum: Vec<f32>,
    c: usize,
    oh: usize,
    ow: usize,
}

/// Decodes latents `[1, C, h, w]` tile by tile with `decode_tile` (latents of one tile to its
/// image `[1, c, th * f, tw * f]`) and blends the tiles into one image `[1, c, h * f, w * f]`.
pub fn decode_tiled<E>(
    latents: &Tensor<f32>,
    tiling: VaeTiling,
    decode_tile: impl FnMut(&Tensor<f32>) -> Result<Tensor<f32>, E>,
) -> Result<Tensor<f32>, E>
where
    E: From<sd_tensor::host::ShapeError>,
{
    run_tiled(latents, tiling, decode_tile)
}

/// Encodes an image `[1, c, H, W]` (sides multiples of `f`) tile by tile with `encode_tile`
/// (pixels of one tile to its moments `[1, C, th / f, tw / f]`) and blends the tiles into
/// `[1, C, H / f, W / f]`; `tiling` is in latent pixels, as for decoding.
pub fn encode_tiled<E>(
    image: &Tensor<f32>,
    tiling: VaeTiling,
    f: usize,
    encode_tile: impl FnMut(&Tensor<f32>) -> Result<Tensor<f32>, E>,
) -> Result<Tensor<f32>, E>
where
    E: From<sd_tensor::host::ShapeError>,
{
    let f = f.max(1);
    let pixels = VaeTiling {
        tile: tiling.tile * f,
        overlap: tiling.overlap * f,
    };
    run_tiled(image, pixels, encode_tile)
}

/// Runs `run` on overlapping square tiles of `input` `[1, C, h, w]` and blends the outputs,
/// which must all scale the tile by one ratio (`out / in` per side, from the first tile).
fn run_tiled<E>(
    input: &Tensor<f32>,
    tiling: VaeTiling,
    mut run: impl FnMut(&Tensor<f32>) -> Result<Tensor<f32>, E>,
) -> Result<Tensor<f32>, E>
where
    E: From<sd_tensor::host::ShapeError>,
{
    let s = input.shape();
    let (h, w) = (s[2], s[3]);
    let ys = tiling.starts(h);
    let xs = tiling.starts(w);
    let (th, tw) = (h.min(tiling.tile.max(1)), w.min(tiling.tile.max(1)));
    // Output pixels per input pixel as num / den (from the first tile's height).
    let scale = |v: usize, num: usize| v * num / th.max(1);
    let mut out: Option<Canvas> = None;
    let mut num = 0;
    for &y0 in &ys {
        for &x0 in &xs {
            let tile = input.slice(2, y0, y0 + th)?.slice(3, x0, x0 + tw)?;
            let img = run(&tile)?;
            let is = img.shape();
            let (c, ih, iw) = (is[1], is[2], is[3]);
            if out.is_none() {
                num = ih;
            }
            let (oh, ow) = (scale(h, num), scale(w, num));
            let Canvas { acc, wsum, .. } = out.get_or_insert_with(|| Canvas {
                acc: vec![0f32; c * oh * ow],
                wsum: vec![0f32; oh * ow],
                c,
                oh,
                ow,
            });
            let ramp = scale(tiling.overlap, num);
            let (py0, px0) = (scale(y0, num), scale(x0, num));
            let data = img.data();
            for y in 0..ih.min(oh - py0) {
                let wy = ramp_weight(y, py0, ih, oh, ramp);
                for x in 0..iw.min(ow - px0) {
                    let wt = wy * ramp_weight(x, px0, iw, ow, ramp);
                    let o = (py0 + y) * ow + px0 + x;
                    wsum[o] += wt;
                    for ch in 0..c {
                        acc[ch * oh * ow + o] += wt * data[(ch * ih + y) * iw + x];
                    }
                }
            }
        }
    }
    let Canvas {
        mut acc,
        wsum,
        c,
        oh,
        ow,
    } = out.expect("`starts` gives at least one tile per axis");
    let plane = oh * ow;
    for ch in 0..c {
        for (v, s) in acc[ch * plane..(ch + 1) * plane].iter_mut().zip(&wsum) {
            *v /= s.max(f32::MIN_POSITIVE);
        }
    }
    Ok(Tensor::new([1, c, oh, ow], acc)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_cover_the_axis_with_the_overlap() {
        let t = VaeTiling {
            tile: 8,
            overlap: 4,
        };
        assert_eq!(t.starts(5), vec![0]);
        assert_eq!(t.starts(8), vec![0]);
        assert_eq!(t.starts(16), vec![0, 4, 8]);
        assert_eq!(t.starts(17), vec![0, 4, 8, 9]);
        let t = VaeTiling {
            tile: 8,
            overlap: 0,
        };
        assert_eq!(t.starts(20), vec![0, 8, 12]);
    }

    /// A "decoder" that upsamples by 2 with nearest neighbour and adds 1: tiled and whole
    /// decodes agree exactly (weights are normalized), and every output pixel is covered.
    #[test]
    fn blending_a_pointwise_decoder_is_exact() {
        let (h, w) = (13, 21);
        let lat = Tensor::from_fn([1, 2, h, w], |i| (i[1] * 100 + i[2] * 7 + i[3]) as f32).unwrap();
        let up = |t: &Tensor<f32>| -> Result<Tensor<f32>, sd_tensor::host::ShapeError> {
            let s = t.shape().to_vec();
            Tensor::from_fn([1, s[1], s[2] * 2, s[3] * 2], |i| {
                t.at(&[0, i[1], i[2] / 2, i[3] / 2]).unwrap() + 1.0
            })
        };
        let whole = up(&lat).unwrap();
        let tiled = decode_tiled(
            &lat,
            VaeTiling {
                tile: 6,
                overlap: 3,
            },
            up,
        )
        .unwrap();
        assert_eq!(tiled.shape(), whole.shape());
        for (a, b) in tiled.data().iter().zip(whole.data()) {
            assert!((a - b).abs() < 1e-3, "{a} vs {b}");
        }
    }

    /// An "encoder" that averages 2x2 blocks: tiled (tiles in latent units) equals whole.
    #[test]
    fn blending_a_pointwise_encoder_is_exact() {
        let (h, w) = (24, 40);
        let img = Tensor::from_fn([1, 3, h, w], |i| (i[1] * 50 + i[2] * 3 + i[3]) as f32).unwrap();
        let down = |t: &Tensor<f32>| -> Result<Tensor<f32>, sd_tensor::host::ShapeError> {
            let s = t.shape().to_vec();
            Tensor::from_fn([1, s[1], s[2] / 2, s[3] / 2], |i| {
                let at = |dy, dx| *t.at(&[0, i[1], 2 * i[2] + dy, 2 * i[3] + dx]).unwrap();
                (at(0, 0) + at(0, 1) + at(1, 0) + at(1, 1)) / 4.0
            })
        };
        let whole = down(&img).unwrap();
        let tiling = VaeTiling {
            tile: 6,
            overlap: 2,
        };
        let tiled = encode_tiled(&img, tiling, 2, down).unwrap();
        assert_eq!(tiled.shape(), whole.shape());
        for (a, b) in tiled.data().iter().zip(whole.data()) {
            assert!((a - b).abs() < 1e-3, "{a} vs {b}");
        }
    }
}
