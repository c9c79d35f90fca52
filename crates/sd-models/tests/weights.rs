//! `ParamBuilder` and `load_all_to_cpu`: dtypes from the file, shape checks, errors.

use std::collections::HashMap;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use sd_formats::files::TensorCatalog;
use sd_models::{load_all_to_cpu, ModelError, ParamBuilder};
use sd_tensor::DType;

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A safetensors file with an f16 `[4, 2]` linear weight, an f16 bias `[4]` and an f32
/// `[3, 3]` matrix stored as a `[3, 3, 1, 1]` convolution.
fn catalog(dir: &std::path::Path) -> TensorCatalog {
    let w: Vec<f32> = (0..8).map(|i| i as f32 * 0.5).collect();
    let b = [1.0f32, -2.0, 3.0, -4.0];
    let c: Vec<f32> = (0..9).map(|i| i as f32).collect();
    let (wb, bb, cb) = (f16_bytes(&w), f16_bytes(&b), f32_bytes(&c));
    let mut tensors = HashMap::new();
    tensors.insert(
        "m.lin.weight".to_string(),
        TensorView::new(Dtype::F16, vec![4, 2], &wb).unwrap(),
    );
    tensors.insert(
        "m.lin.bias".to_string(),
        TensorView::new(Dtype::F16, vec![4], &bb).unwrap(),
    );
    tensors.insert(
        "m.conv.weight".to_string(),
        TensorView::new(Dtype::F32, vec![3, 3, 1, 1], &cb).unwrap(),
    );
    let path = dir.join("w.safetensors");
    safetensors::serialize_to_file(&tensors, &None, &path).unwrap();
    let mut loader = TensorCatalog::new();
    loader.add_file(&path, None).unwrap();
    loader
}

#[test]
fn dtypes_shapes_and_loading() {
    let dir = std::env::temp_dir().join(format!("sd-models-weights-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cat = catalog(&dir);
    let pb = ParamBuilder::new(Some(&cat), 16).unwrap();
    let m = pb.pp("m");
    let w = m.pp("lin").tensor("weight", &[4, 2]).unwrap();
    let b = m.pp("lin").tensor("bias", &[4]).unwrap();
    // A [3, 3, 1, 1] file tensor declared as a [3, 3] linear weight.
    let c = m.pp("conv").tensor("weight", &[3, 3]).unwrap();
    assert_eq!(w.dtype(), Some(DType::F16));
    assert_eq!(w.ne(), [2, 4, 1, 1]);
    assert_eq!(b.dtype(), Some(DType::F32), "1-D tensors are kept in f32");
    assert_eq!(c.ne(), [3, 3, 1, 1]);
    assert_eq!(w.name(), "m.lin.weight");
    assert!(w.is_param());

    assert!(matches!(
        m.pp("lin").tensor("weight", &[4, 2]),
        Err(ModelError::Duplicate { .. })
    ));
    let err = m.tensor("nope.weight", &[1]).unwrap_err();
    assert!(matches!(&err, ModelError::MissingTensor { name } if name == "m.nope.weight"));
    let err = ParamBuilder::new(Some(&cat), 16)
        .unwrap()
        .tensor("m.lin.weight", &[2, 4])
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("m.lin.weight") && msg.contains("[4, 2]") && msg.contains("[2, 4]"),
        "{msg}"
    );

    let params = pb.finish();
    assert_eq!(params.tensors.len(), 3);
    let _buf = load_all_to_cpu(&params, &cat).unwrap();
    assert_eq!(b.read_f32().unwrap(), vec![1.0, -2.0, 3.0, -4.0]);
    assert_eq!(w.read_f32().unwrap()[3], 1.5);
    assert_eq!(c.read_f32().unwrap()[8], 8.0);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn synthetic_builders_are_f32() {
    let pb = ParamBuilder::new(None, 4).unwrap();
    let t = pb.pp("a").pp("b").tensor("weight", &[5, 3, 3, 3]).unwrap();
    assert_eq!(t.dtype(), Some(DType::F32));
    assert_eq!(t.name(), "a.b.weight");
    assert!(pb.tensor("x", &[]).is_err());
    assert!(pb.tensor("y", &[0, 2]).is_err());
}
