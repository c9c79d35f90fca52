//! Interpolation against torch `F.interpolate` outputs and image resizing against PIL's
//! `Image.resize` (`scripts/fixtures/make_host_fixtures.py` writes
//! `fixtures/host/interpolate.json` and `fixtures/host/resize_pil.json`).

use sd_tensor::host::{Image, ResampleFilter, Tensor};
use serde_json::Value;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect()
}

#[test]
fn host_interpolate_matches_torch() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/host/interpolate.json"
    ))
    .unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 80);
    for case in cases {
        let shape = usizes(&case["in_shape"]);
        let out_hw = usizes(&case["out_hw"]);
        let input = Tensor::new(shape.clone(), floats(&case["input"])).unwrap();
        let mode = case["mode"].as_str().unwrap();
        let got = match mode {
            "nearest" => input.interpolate_nearest(out_hw[0], out_hw[1]).unwrap(),
            "nearest-exact" => input
                .interpolate_nearest_exact(out_hw[0], out_hw[1])
                .unwrap(),
            "bilinear" => {
                let ac = case["align_corners"].as_bool().unwrap();
                input
                    .interpolate_bilinear(out_hw[0], out_hw[1], ac)
                    .unwrap()
            }
            "bicubic" => {
                let ac = case["align_corners"].as_bool().unwrap();
                input.interpolate_bicubic(out_hw[0], out_hw[1], ac).unwrap()
            }
            "bilinear-aa" => input
                .interpolate_filtered(out_hw[0], out_hw[1], ResampleFilter::Triangle)
                .unwrap(),
            "bicubic-aa" => input
                .interpolate_filtered(out_hw[0], out_hw[1], ResampleFilter::Cubic)
                .unwrap(),
            m => panic!("unknown mode {m}"),
        };
        let mut out_shape = shape.clone();
        out_shape[2] = out_hw[0];
        out_shape[3] = out_hw[1];
        let want = Tensor::new(out_shape, floats(&case["output"])).unwrap();
        let err = got.max_abs_diff(&want).unwrap();
        let label = format!(
            "{mode} ac={} {shape:?} -> {out_hw:?}",
            case["align_corners"]
        );
        // torch sums the sixteen bicubic taps in another order.
        let tolerance = if mode.starts_with("bicubic") {
            1e-5
        } else {
            1e-6
        };
        assert!(err <= tolerance, "{label}: max abs diff {err}");
        if mode.starts_with("nearest") {
            assert_eq!(got, want, "{label}");
        }
    }
}

#[test]
fn host_interpolate_works_on_rank_2_and_5() {
    let t = Tensor::from_fn([3, 4], |i| (i[0] * 4 + i[1]) as f32).unwrap();
    let as4 = t.clone().reshape([1, 1, 3, 4]).unwrap();
    let a = t.interpolate_bilinear(5, 7, false).unwrap();
    let b = as4.interpolate_bilinear(5, 7, false).unwrap();
    assert_eq!(a.data(), b.data());
    let t5 = Tensor::from_fn([2, 1, 2, 3, 4], |i| i.iter().sum::<usize>() as f32).unwrap();
    let r = t5.interpolate_nearest(6, 8).unwrap();
    assert_eq!(r.shape(), &[2, 1, 2, 6, 8]);
    let plane = r.slice(2, 1, 2).unwrap().slice(0, 1, 2).unwrap();
    let want = t5
        .slice(2, 1, 2)
        .unwrap()
        .slice(0, 1, 2)
        .unwrap()
        .interpolate_nearest(6, 8)
        .unwrap();
    assert_eq!(plane, want);
}

/// `Image::resize_filtered` and `Image::resize_nearest` give PIL's bytes exactly (8-bit RGB,
/// up and down, with clipped overshoot).
#[test]
fn image_resize_matches_pil() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/host/resize_pil.json"
    ))
    .unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 40);
    for case in cases {
        let bytes = |v: &Value| -> Vec<u8> { usizes(v).into_iter().map(|b| b as u8).collect() };
        let (iw, ow) = (usizes(&case["in_wh"]), usizes(&case["out_wh"]));
        let c = case["channels"].as_u64().unwrap() as usize;
        let image = Image::new(iw[0], iw[1], c, bytes(&case["input"])).unwrap();
        let name = case["filter"].as_str().unwrap();
        let got = match name {
            "lanczos" => image.resize_filtered(ow[0], ow[1], ResampleFilter::Lanczos3),
            "bicubic" => image.resize_filtered(ow[0], ow[1], ResampleFilter::Cubic),
            "bilinear" => image.resize_filtered(ow[0], ow[1], ResampleFilter::Triangle),
            "nearest" => image.resize_nearest(ow[0], ow[1]),
            f => panic!("unknown filter {f}"),
        }
        .unwrap();
        let want = bytes(&case["output"]);
        let diff = got
            .pixels()
            .iter()
            .zip(&want)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(
            diff, 0,
            "{name} {c}ch {iw:?} -> {ow:?}: {diff} bytes differ from PIL"
        );
        assert_eq!(got.pixels().len(), want.len());
    }
}
