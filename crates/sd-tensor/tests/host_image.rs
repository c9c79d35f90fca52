//! Images: tensor round trips, PNG fixtures, corrupt PNGs.

use proptest::prelude::*;
use sd_tensor::host::{Image, ImageError, PixelRange, Tensor};
use serde_json::Value;

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/host")
        .join(name)
}

fn sample_image(w: usize, h: usize, c: usize) -> Image {
    Image::new(
        w,
        h,
        c,
        (0..w * h * c).map(|i| ((i * 7919) % 256) as u8).collect(),
    )
    .unwrap()
}

proptest! {
    #[test]
    fn host_tensor_image_tensor_within_one_level(
        (c, h, w, values) in (prop_oneof![Just(3usize), Just(4)], 1usize..6, 1usize..6)
            .prop_flat_map(|(c, h, w)| (Just(c), Just(h), Just(w), prop::collection::vec(-1.0f32..=1.0, c * h * w))),
        signed in any::<bool>(),
    ) {
        let range = if signed { PixelRange::MinusOneToOne } else { PixelRange::ZeroToOne };
        let values = if signed { values } else { values.iter().map(|v| (v + 1.0) / 2.0).collect() };
        let t = Tensor::new([1, c, h, w], values).unwrap();
        let img = Image::from_tensor(&t, range).unwrap();
        prop_assert_eq!((img.width(), img.height(), img.channels()), (w, h, c));
        let back = img.to_tensor(range);
        let span = if signed { 2.0 } else { 1.0 };
        // Rounding to the nearest level is off by at most half a level.
        prop_assert!(back.max_abs_diff(&t).unwrap() <= span / 255.0 * 0.5 + 1e-6);
        prop_assert_eq!(Image::from_tensor(&back, range).unwrap(), img);
    }

    #[test]
    fn host_image_png_round_trip(w in 1usize..20, h in 1usize..20, alpha in any::<bool>(), seed in any::<u8>()) {
        let c = if alpha { 4 } else { 3 };
        let img = Image::new(w, h, c, (0..w * h * c).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()).unwrap();
        let bytes = img.encode_png(&[]).unwrap();
        prop_assert_eq!(Image::decode_png(&bytes).unwrap(), img);
    }

    #[test]
    fn host_png_decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = Image::decode_png(&bytes);
    }
}

#[test]
fn host_png_fixtures_decode() {
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("png.json")).unwrap()).unwrap();
    let entries = manifest.as_object().unwrap();
    assert!(entries.contains_key("png_rgb16.png"));
    for (name, want) in entries {
        let (img, text) =
            Image::load_png_with_text(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let dims = (img.width(), img.height(), img.channels());
        let want_dims = (
            want["width"].as_u64().unwrap() as usize,
            want["height"].as_u64().unwrap() as usize,
            want["channels"].as_u64().unwrap() as usize,
        );
        assert_eq!(dims, want_dims, "{name}");
        let pixels: Vec<u8> = want["pixels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(img.pixels(), &pixels[..], "{name}");
        let want_text: Vec<(String, String)> = want["text"]
            .as_array()
            .unwrap()
            .iter()
            .map(|kv| {
                (
                    kv[0].as_str().unwrap().to_string(),
                    kv[1].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(text, want_text, "{name}");
        assert_eq!(Image::load_png(fixture(name)).unwrap(), img, "{name}");
    }
}

#[test]
fn host_png_16bit_rgb_decodes() {
    let img = Image::load_png(fixture("png_rgb16.png")).unwrap();
    assert_eq!((img.width(), img.height(), img.channels()), (3, 2, 3));
}

#[test]
fn host_png_parameters_round_trip_through_file() {
    let dir = std::env::temp_dir().join(format!("sd-tensor-host-image-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("out.png");
    let img = sample_image(7, 5, 3);
    let params = "masterpiece, 1girl\nNegative prompt: blurry\nSteps: 20, Sampler: euler_a, CFG scale: 7.0, Seed: 42, Size: 7x5";
    let text = vec![("parameters".to_string(), params.to_string())];
    img.save_png(&path, &text).unwrap();
    assert!(!dir.join("out.png.tmp").exists());
    let (back, got) = Image::load_png_with_text(&path).unwrap();
    assert_eq!(back, img);
    assert_eq!(got, text);
    let missing = Image::load_png(dir.join("missing.png")).unwrap_err();
    assert!(matches!(missing, ImageError::Io { .. }), "{missing}");
    assert!(missing.to_string().contains("missing.png"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn host_corrupt_png_is_an_error() {
    let good = sample_image(16, 16, 4)
        .encode_png(&[("parameters".into(), "x".into())])
        .unwrap();
    // Not a PNG at all, empty, signature only.
    for bytes in [&b"GIF89a not a png"[..], &[], &good[..8]] {
        assert!(matches!(
            Image::decode_png(bytes),
            Err(ImageError::PngDecode(_))
        ));
    }
    // Truncated anywhere before the end of the image data.
    let idat = good.windows(4).position(|w| w == b"IDAT").unwrap();
    for cut in [9, 20, 33, idat, idat + 10, good.len() - 20] {
        let r = Image::decode_png(&good[..cut]);
        assert!(r.is_err(), "truncated at {cut} of {} decoded", good.len());
    }
    // A flipped bit in the image data fails its CRC.
    let mut bad = good.clone();
    bad[idat + 8] ^= 0x40;
    assert!(Image::decode_png(&bad).is_err());
    // A header claiming an enormous image is refused before allocating.
    let mut huge = good.clone();
    huge[16..20].copy_from_slice(&60000u32.to_be_bytes());
    huge[20..24].copy_from_slice(&60000u32.to_be_bytes());
    let ihdr_crc = crc32(&huge[12..29]);
    huge[29..33].copy_from_slice(&ihdr_crc.to_be_bytes());
    let err = Image::decode_png(&huge).unwrap_err();
    assert!(matches!(err, ImageError::PngTooLarge { .. }), "{err}");
    // Every single-byte corruption is an error or an image, never a panic.
    for i in 8..good.len() {
        let mut b = good.clone();
        b[i] = b[i].wrapping_add(0x55);
        let _ = Image::decode_png(&b);
        let _ = Image::decode_png_with_text(&b);
    }
}

/// CRC-32 (PNG chunk checksums).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                0xedb8_8320 ^ (crc >> 1)
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn host_image_resize_matches_tensor_interpolation() {
    let img = sample_image(9, 6, 3);
    let resized = img.resize_bilinear(4, 11).unwrap();
    let t = img
        .to_tensor(PixelRange::ZeroToOne)
        .interpolate_bilinear(11, 4, false)
        .unwrap();
    let via_tensor = Image::from_tensor(&t, PixelRange::ZeroToOne).unwrap();
    let diff = resized
        .pixels()
        .iter()
        .zip(via_tensor.pixels())
        .map(|(a, b)| a.abs_diff(*b))
        .max()
        .unwrap();
    assert!(diff <= 1, "{diff}");
}

#[test]
fn host_image_alpha_survives_rgb_processing() {
    let img = sample_image(6, 4, 4);
    let (rgb, alpha) = img.split_alpha();
    let alpha = alpha.unwrap();
    let processed = Image::from_tensor(
        &rgb.to_tensor(PixelRange::MinusOneToOne),
        PixelRange::MinusOneToOne,
    )
    .unwrap();
    assert_eq!(processed.with_alpha(&alpha).unwrap(), img);
    let small_alpha = alpha.interpolate_bilinear(2, 3, false).unwrap();
    let small = rgb
        .resize_bilinear(3, 2)
        .unwrap()
        .with_alpha(&small_alpha)
        .unwrap();
    assert_eq!((small.width(), small.height(), small.channels()), (3, 2, 4));
}
