//! Tiled upscaling with the upscaler fixtures of `sd-models` (tiny random weights): tiled
//! equals untiled, no seam at tile edges, alpha, tiny and odd inputs, 16-bit PNG, corrupt
//! files.

use std::path::PathBuf;

use sd_pipeline::upscale::{
    upscale_image, upscale_planes, CpuUpscaler, UpscaleError, UpscaleOptions,
};
use sd_tensor::host::PixelRange;
use sd_tensor::{Image, Tensor};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../sd-models/tests/fixtures/upscalers")
        .join(name)
}

/// A smooth test pattern with some texture, `[3, H, W]` in [0, 1].
fn pattern(w: usize, h: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(3 * w * h);
    for c in 0..3 {
        for y in 0..h {
            for x in 0..w {
                let (fx, fy) = (x as f32, y as f32);
                let t = 0.5
                    + 0.3 * ((fx * 0.11 + c as f32).sin() * (fy * 0.07 - c as f32).cos())
                    + 0.15 * ((fx * 0.9 + fy * 1.3 + c as f32 * 2.0).sin());
                v.push(t.clamp(0.0, 1.0));
            }
        }
    }
    v
}

fn image(w: usize, h: usize, alpha: bool) -> Image {
    let p = pattern(w, h);
    let t = Tensor::new([1, 3, h, w], p).unwrap();
    let img = Image::from_tensor(&t, PixelRange::ZeroToOne).unwrap();
    if !alpha {
        return img;
    }
    let a: Vec<f32> = (0..w * h)
        .map(|i| (i % w) as f32 / w as f32 * 0.8 + (i / w) as f32 / h as f32 * 0.2)
        .collect();
    img.with_alpha(&Tensor::new([h, w], a).unwrap()).unwrap()
}

/// Max |a - b| over the pixels at least `border` from the image edge (`[C, H, W]`).
fn max_diff_inside(a: &[f32], b: &[f32], w: usize, h: usize, border: usize) -> f32 {
    let c = a.len() / (w * h);
    let mut m = 0f32;
    for ch in 0..c {
        for y in border..h - border {
            for x in border..w - border {
                let i = ch * w * h + y * w + x;
                m = m.max((a[i] - b[i]).abs());
            }
        }
    }
    m
}

#[test]
fn tiled_equals_untiled_when_the_receptive_field_fits_the_margin() {
    // Compact x2 with 2 body convolutions: receptive field radius 4 input pixels; tiles of
    // 64 overlap by 16, whose outer quarter (4 pixels) gets weight zero.
    let mut up = CpuUpscaler::open(fixture("compact_x2.safetensors"), 2).unwrap();
    let (w, h) = (150, 100);
    let x = pattern(w, h);
    let whole = upscale_planes(&mut up, &x, w, h, 0).unwrap();
    let tiled = upscale_planes(&mut up, &x, w, h, 64).unwrap();
    assert_eq!(whole.len(), 3 * 300 * 200);
    let d = max_diff_inside(&tiled, &whole, 300, 200, 8);
    println!("compact x2: max |tiled - untiled| = {d:.3e}");
    assert!(d < 1e-3, "tiled differs from untiled by {d}");
}

/// Mean |step| between output columns `x - 1` and `x`, for every `x` (`[C, H, W]`).
fn column_steps(a: &[f32], w: usize, h: usize) -> Vec<f32> {
    let c = a.len() / (w * h);
    (1..w)
        .map(|x| {
            let mut s = 0f32;
            for ch in 0..c {
                for y in 0..h {
                    let i = ch * w * h + y * w + x;
                    s += (a[i] - a[i - 1]).abs();
                }
            }
            s / (c * h) as f32
        })
        .collect()
}

/// The largest excess of a column's mean step over the untiled image's, relative to the
/// untiled image's mean step: a seam is a column whose step stands out.
fn seam_score(img: &[f32], reference: &[f32], w: usize, h: usize) -> f32 {
    let a = column_steps(img, w, h);
    let b = column_steps(reference, w, h);
    let mean = b.iter().sum::<f32>() / b.len() as f32;
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / mean)
        .fold(0f32, f32::max)
}

#[test]
fn no_seam_across_tile_edges_with_a_deep_network() {
    // ESRGAN (one RRDB block: 17 convolutions deep) sees beyond the tile margin, so tiles
    // differ from the whole image near their edges. Tiles of 32 with overlap 8 over a width
    // of 72 start at 0, 24 and 40 (one row of tiles: the height fits in a tile).
    let mut up = CpuUpscaler::open(fixture("esrgan_old.pth"), 2).unwrap();
    let (w, h, s) = (72, 24, 4);
    let x = pattern(w, h);
    let whole = upscale_planes(&mut up, &x, w, h, 0).unwrap();
    let tiled = upscale_planes(&mut up, &x, w, h, 32).unwrap();
    let (ow, oh) = (w * s, h * s);
    let diff = max_diff_inside(&tiled, &whole, ow, oh, 0);
    assert!(
        diff > 1e-3,
        "the network should see past the tile margin here ({diff})"
    );

    // What the same tiles give side by side, each used up to its own edge (no blending).
    let mut tile = |x0: usize| {
        let crop: Vec<f32> = (0..3 * h)
            .flat_map(|r| x[r * w + x0..r * w + x0 + 32].to_vec())
            .collect();
        upscale_planes(&mut up, &crop, 32, h, 0).unwrap()
    };
    let tiles = [(0usize, tile(0)), (24, tile(24)), (40, tile(40))];
    let mut hard = vec![0f32; whole.len()];
    for ch in 0..3 {
        for y in 0..oh {
            for xo in 0..ow {
                let (x0, t) = if xo < 32 * s {
                    &tiles[0]
                } else if xo < 56 * s {
                    &tiles[1]
                } else {
                    &tiles[2]
                };
                hard[ch * ow * oh + y * ow + xo] = t[ch * 32 * s * oh + y * 32 * s + xo - x0 * s];
            }
        }
    }
    let blended = seam_score(&tiled, &whole, ow, oh);
    let switched = seam_score(&hard, &whole, ow, oh);
    println!(
        "esrgan: max |tiled - untiled| {diff:.3e}; seam score blended {blended:.3e}, tiles \
         side by side {switched:.3e}"
    );
    assert!(blended < 0.05, "seam: {blended}");
    assert!(
        blended < 0.05 * switched,
        "blended {blended} vs side by side {switched}"
    );
}

#[test]
fn rgba_keeps_its_alpha() {
    let mut up = CpuUpscaler::open(fixture("compact_x4.pth"), 2).unwrap();
    let img = image(20, 14, true);
    let out = upscale_image(&mut up, &img, &UpscaleOptions::default()).unwrap();
    assert_eq!((out.width(), out.height(), out.channels()), (80, 56, 4));
    // Alpha: the bilinear resize of the input alpha.
    let (rgb_in, alpha) = img.split_alpha();
    let want = alpha.unwrap().interpolate_bilinear(56, 80, false).unwrap();
    let (rgb_out, got) = out.split_alpha();
    let got = got.unwrap();
    for (g, w) in got.data().iter().zip(want.data()) {
        assert!((g - w).abs() <= 0.5 / 255.0 + 1e-6, "alpha {g} vs {w}");
    }
    // RGB: as upscaling the RGB image alone.
    let rgb_only = upscale_image(&mut up, &rgb_in, &UpscaleOptions::default()).unwrap();
    assert_eq!(rgb_only.pixels(), rgb_out.pixels());
}

#[test]
fn one_pixel_and_smaller_than_a_tile() {
    let mut up = CpuUpscaler::open(fixture("esrgan_old.pth"), 2).unwrap();
    let one = Image::from_rgb(1, 1, vec![200, 10, 90]).unwrap();
    let out = upscale_image(&mut up, &one, &UpscaleOptions::default()).unwrap();
    assert_eq!((out.width(), out.height()), (4, 4));
    // Smaller than a tile: one tile, equal to the untiled result.
    let x = pattern(20, 12);
    let a = upscale_planes(&mut up, &x, 20, 12, 128).unwrap();
    let b = upscale_planes(&mut up, &x, 20, 12, 0).unwrap();
    assert_eq!(a, b);
    // Repeats compose.
    let opts = UpscaleOptions {
        tile_size: 16,
        repeats: 2,
    };
    let out = upscale_image(&mut up, &image(5, 3, false), &opts).unwrap();
    assert_eq!((out.width(), out.height()), (80, 48));
}

#[test]
fn sixteen_bit_rgb_png_input() {
    // A 3-channel 16-bit PNG decodes (rounded to 8 bits) and upscales.
    let (w, h) = (9usize, 7usize);
    let mut data = Vec::with_capacity(w * h * 6);
    for i in 0..w * h * 3 {
        data.extend_from_slice(&((i as u16).wrapping_mul(977)).to_be_bytes());
    }
    let mut bytes = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut bytes, w as u32, h as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Sixteen);
        let mut wr = enc.write_header().unwrap();
        wr.write_image_data(&data).unwrap();
    }
    let img = Image::decode_png(&bytes).unwrap();
    assert_eq!((img.width(), img.height(), img.channels()), (w, h, 3));
    // Rounded from the 16-bit value.
    let v0 = u16::from_be_bytes([data[2], data[3]]);
    assert_eq!(img.pixels()[1], ((v0 as f32) / 257.0).round() as u8);
    let mut up = CpuUpscaler::open(fixture("compact_x2.safetensors"), 2).unwrap();
    let out = upscale_image(&mut up, &img, &UpscaleOptions::default()).unwrap();
    assert_eq!((out.width(), out.height(), out.channels()), (18, 14, 3));
}

#[test]
fn corrupt_model_file_is_a_clear_error() {
    let good = std::fs::read(fixture("compact_x4.pth")).unwrap();
    let dir = std::env::temp_dir().join(format!("sd-pipeline-upscale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("broken-upscaler.pth");
    std::fs::write(&p, &good[..good.len() - 300]).unwrap();
    let e = CpuUpscaler::open(&p, 1).unwrap_err();
    assert!(matches!(e, UpscaleError::Model { .. }), "{e}");
    assert!(e.to_string().contains("broken-upscaler.pth"), "{e}");
    let e = CpuUpscaler::open(dir.join("missing.pth"), 1).unwrap_err();
    assert!(e.to_string().contains("missing.pth"), "{e}");
}
