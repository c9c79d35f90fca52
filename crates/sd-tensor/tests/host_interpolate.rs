//! Interpolation against torch `F.interpolate` outputs
//! (`scripts/fixtures/make_host_fixtures.py` writes `fixtures/host/interpolate.json`).

use sd_tensor::host::Tensor;
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
    assert!(cases.len() >= 30);
    for case in cases {
        let shape = usizes(&case["in_shape"]);
        let out_hw = usizes(&case["out_hw"]);
        let input = Tensor::new(shape.clone(), floats(&case["input"])).unwrap();
        let mode = case["mode"].as_str().unwrap();
        let got = match mode {
            "nearest" => input.interpolate_nearest(out_hw[0], out_hw[1]).unwrap(),
            "bilinear" => {
                let ac = case["align_corners"].as_bool().unwrap();
                input
                    .interpolate_bilinear(out_hw[0], out_hw[1], ac)
                    .unwrap()
            }
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
        assert!(err <= 1e-6, "{label}: max abs diff {err}");
        if mode == "nearest" {
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
