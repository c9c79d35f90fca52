//! `ModelManager` on the CPU: bad input (missing tensors, shape mismatches, LoRAs naming
//! unknown weights) gives clear errors and leaves nothing half-loaded; dtype conversion;
//! LoRA application in kohya and diffusers forms; mmap accounting; model sources.

#[path = "common/manager.rs"]
mod support;

use std::path::PathBuf;
use std::sync::Arc;

use sd_formats::files::TensorCatalog;
use sd_residency::{
    BackendId, Component, DeviceResidencyManager, LoraSpec, ModelManager, OwnerId, ParamSpec,
    ResidencyError, ResidencyMode, SourceId,
};
use sd_tensor::ggml::{Backend, Device};
use sd_tensor::DType;
use support::*;

fn manager(files: &[&PathBuf]) -> (ModelManager, BackendId) {
    let mut loader = TensorCatalog::new();
    for f in files {
        loader.add_file(f, None).unwrap();
    }
    let mut mm = ModelManager::new(loader);
    mm.set_load_threads(1);
    let cpu = mm.add_backend(Arc::new(Backend::cpu(1).unwrap())).unwrap();
    (mm, cpu)
}

fn spec(cpu: BackendId, mode: ResidencyMode) -> ParamSpec {
    ParamSpec {
        component: Component::Diffusion,
        mode,
        params_backend: cpu,
        compute_backend: cpu,
        source: SourceId::MAIN,
    }
}

const W: &str = "model.diffusion_model.out.2.weight";

fn weight_file() -> (PathBuf, Vec<FileTensor>) {
    let t = vec![
        f32_tensor(W, &[4, 16], 1.0),
        f32_tensor("model.diffusion_model.out.0.weight", &[16], -3.0),
    ];
    let p = temp_path("weights");
    write_safetensors(&p, &t);
    (p, t)
}

#[test]
fn a_missing_tensor_is_named_and_nothing_is_registered() {
    let (path, tensors) = weight_file();
    let (mut mm, cpu) = manager(&[&path]);
    let c = ctx(4);
    let mut descs = descs_for(&c, &tensors);
    descs.push((
        "model.diffusion_model.missing.weight".into(),
        desc(&c, DType::F32, &[4]),
    ));
    let err = mm
        .register_params(spec(cpu, ResidencyMode::ParamBackend), &descs)
        .unwrap_err();
    assert!(
        matches!(err, ResidencyError::MissingTensor { .. }),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("model.diffusion_model.missing.weight"),
        "{err}"
    );
    assert_eq!(mm.param_count(), 0);
    assert_eq!(mm.block_counts(), (0, 0));
}

#[test]
fn a_shape_mismatch_names_the_tensor_and_both_shapes() {
    let (path, _) = weight_file();
    let (mut mm, cpu) = manager(&[&path]);
    let c = ctx(2);
    let descs = vec![(W.to_string(), desc(&c, DType::F32, &[16, 4]))];
    let err = mm
        .register_params(spec(cpu, ResidencyMode::ParamBackend), &descs)
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ResidencyError::ShapeMismatch { .. }),
        "{err:?}"
    );
    assert!(
        msg.contains(W) && msg.contains("[16, 4]") && msg.contains("[4, 16]"),
        "{msg}"
    );
    assert_eq!(mm.param_count(), 0);
    // Trailing ones are not a mismatch.
    let ok = vec![(
        "model.diffusion_model.out.0.weight".to_string(),
        desc(&c, DType::F32, &[1, 16]),
    )];
    mm.register_params(spec(cpu, ResidencyMode::ParamBackend), &ok)
        .unwrap();
}

#[test]
fn weights_load_converted_to_the_registered_dtype() {
    let (path, tensors) = weight_file();
    let (mut mm, cpu) = manager(&[&path]);
    let c = ctx(2);
    let descs = vec![(W.to_string(), desc(&c, DType::F16, &[4, 16]))];
    let ids = mm
        .register_params(spec(cpu, ResidencyMode::Disk), &descs)
        .unwrap();
    mm.prepare_params(&ids).unwrap();
    let t = mm.tensor(ids[0]).unwrap().clone();
    assert_eq!(t.nbytes(), 128);
    assert_eq!(t.read_f32().unwrap(), f32s(&tensors[0].bytes));
    mm.unpin_params(&ids).unwrap();
    mm.release_params_backend_params(&ids).unwrap();
    assert!(!t.is_allocated());
    assert_eq!(mm.block_counts(), (0, 0));
}

fn lora_file(tensors: &[FileTensor]) -> PathBuf {
    let p = temp_path("lora");
    write_safetensors(&p, tensors);
    p
}

/// `w + up @ down * scale` for `[4, 16]` / `[4, r]` / `[r, 16]`.
fn patched(w: &[f32], up: &[f32], down: &[f32], r: usize, scale: f32) -> Vec<f32> {
    let mut out = w.to_vec();
    for i in 0..4 {
        for j in 0..16 {
            let d: f32 = (0..r).map(|k| up[i * r + k] * down[k * 16 + j]).sum();
            out[i * 16 + j] += d * scale;
        }
    }
    out
}

#[test]
fn loras_apply_in_kohya_and_diffusers_forms() {
    let (path, tensors) = weight_file();
    let (mut mm, cpu) = manager(&[&path]);
    let c = ctx(2);
    let ids = mm
        .register_params(
            spec(cpu, ResidencyMode::ParamBackend),
            &[(W.to_string(), desc(&c, DType::F32, &[4, 16]))],
        )
        .unwrap();
    let w0 = f32s(&tensors[0].bytes);
    let down: Vec<f32> = (0..32).map(|i| (i % 5) as f32 * 0.5).collect();
    let up: Vec<f32> = (0..8).map(|i| i as f32 - 3.0).collect();

    // kohya with alpha 1, rank 2, multiplier 0.5: scale 0.25.
    let kohya = lora_file(&[
        f32_values("lora_unet_out_2.lora_down.weight", &[2, 16], &down),
        f32_values("lora_unet_out_2.lora_up.weight", &[4, 2], &up),
        f32_values("lora_unet_out_2.alpha", &[], &[1.0]),
    ]);
    mm.set_loras(vec![LoraSpec {
        path: kohya.clone(),
        multiplier: 0.5,
    }])
    .unwrap();
    let epoch = mm.lora_epoch();
    mm.prepare_params(&ids).unwrap();
    let got = mm.tensor(ids[0]).unwrap().read_f32().unwrap();
    assert_eq!(got, patched(&w0, &up, &down, 2, 0.25));
    assert_eq!(mm.param_info(ids[0]).unwrap().lora_epoch, Some(epoch));

    // Refused while running: pinned weights, then a registered owner.
    let diff = lora_file(&[
        f32_values("model.diffusion_model.out.2.lora_A.weight", &[2, 16], &down),
        f32_values("model.diffusion_model.out.2.lora_B.weight", &[4, 2], &up),
    ]);
    let specs = vec![LoraSpec {
        path: diff,
        multiplier: 1.0,
    }];
    assert!(matches!(
        mm.set_loras(specs.clone()),
        Err(ResidencyError::Busy(_))
    ));
    mm.unpin_params(&ids).unwrap();
    mm.register_runtime_owner(OwnerId(3));
    assert!(matches!(
        mm.set_loras(specs.clone()),
        Err(ResidencyError::Busy(_))
    ));
    mm.remove_runtime_owner(OwnerId(3));

    // diffusers form, no alpha: scale = multiplier; the old patch is not kept.
    mm.set_loras(specs).unwrap();
    assert!(mm.lora_epoch() > epoch);
    mm.prepare_params(&ids).unwrap();
    let got = mm.tensor(ids[0]).unwrap().read_f32().unwrap();
    assert_eq!(got, patched(&w0, &up, &down, 2, 1.0));
    mm.unpin_params(&ids).unwrap();

    // No LoRA: the file's values again.
    mm.set_loras(vec![]).unwrap();
    mm.prepare_params(&ids).unwrap();
    assert_eq!(mm.tensor(ids[0]).unwrap().read_f32().unwrap(), w0);
}

#[test]
fn a_lora_naming_unknown_weights_is_refused() {
    let (path, _) = weight_file();
    let (mut mm, cpu) = manager(&[&path]);
    let c = ctx(2);
    mm.register_params(
        spec(cpu, ResidencyMode::ParamBackend),
        &[(W.to_string(), desc(&c, DType::F32, &[4, 16]))],
    )
    .unwrap();
    let bad = lora_file(&[
        f32_values("lora_unet_out_2.lora_down.weight", &[2, 16], &[0.0; 32]),
        f32_values("lora_unet_out_2.lora_up.weight", &[4, 2], &[0.0; 8]),
        f32_values("lora_unet_nowhere.lora_down.weight", &[2, 16], &[0.0; 32]),
        f32_values("lora_unet_nowhere.lora_up.weight", &[4, 2], &[0.0; 8]),
    ]);
    let err = mm
        .set_loras(vec![LoraSpec {
            path: bad,
            multiplier: 1.0,
        }])
        .unwrap_err();
    assert!(
        matches!(err, ResidencyError::LoraUnknownWeights { .. }),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("lora_unet_nowhere.lora_down.weight"),
        "{err}"
    );
    assert_eq!(mm.lora_epoch(), 0, "the previous set stays");

    // A pair whose shapes do not fit the weight.
    let wrong = lora_file(&[
        f32_values("lora_unet_out_2.lora_down.weight", &[2, 8], &[0.0; 16]),
        f32_values("lora_unet_out_2.lora_up.weight", &[4, 2], &[0.0; 8]),
    ]);
    let err = mm
        .set_loras(vec![LoraSpec {
            path: wrong,
            multiplier: 1.0,
        }])
        .unwrap_err();
    assert!(err.to_string().contains(W), "{err}");
}

#[test]
fn mmap_backed_weights_count_once_per_buffer() {
    let a = vec![
        f32_tensor("model.diffusion_model.a.weight", &[4, 16], 0.0),
        f32_tensor("model.diffusion_model.b.weight", &[8, 16], 7.0),
        f32_tensor("model.diffusion_model.c.weight", &[16], 9.0),
    ];
    let b = vec![f32_tensor("first_stage_model.d.weight", &[2, 16], 5.0)];
    let (pa, pb) = (temp_path("mmap-a"), temp_path("mmap-b"));
    let (la, lb) = (write_safetensors(&pa, &a), write_safetensors(&pb, &b));
    let (mut mm, cpu) = manager(&[&pa, &pb]);
    mm.set_mmap(true);
    let c = ctx(8);
    let all: Vec<FileTensor> = a.iter().chain(&b).cloned().collect();
    let ids = mm
        .register_params(spec(cpu, ResidencyMode::ParamBackend), &descs_for(&c, &all))
        .unwrap();
    mm.prepare_params(&ids[..2]).unwrap();
    let cpu_dev = Device::cpu().unwrap();
    assert_eq!(
        mm.resident_bytes(&cpu_dev),
        la,
        "one mapping, counted at full size"
    );
    mm.prepare_params(&ids).unwrap();
    assert_eq!(
        mm.resident_bytes(&cpu_dev),
        la + lb,
        "once per mapped buffer"
    );
    assert_eq!(mm.block_counts(), (2, 0));
    for (p, t) in ids.iter().zip(&all) {
        assert!(mm.param_info(*p).unwrap().mmapped);
        assert_eq!(mm.tensor(*p).unwrap().read_bytes().unwrap(), t.bytes);
    }
    // Never evicted, never released.
    mm.unpin_params(&ids).unwrap();
    mm.unpin_params(&ids[..2]).unwrap();
    assert!(mm.evictable_compute_backend_blocks(cpu, &[]).is_empty());
    mm.release_compute_backend_params(&ids).unwrap();
    mm.release_params_backend_params(&ids).unwrap();
    assert_eq!(mm.resident_bytes(&cpu_dev), la + lb);

    // Disk mode is never mapped.
    let (mut mm, cpu) = manager(&[&pa]);
    mm.set_mmap(true);
    let ids = mm
        .register_params(spec(cpu, ResidencyMode::Disk), &descs_for(&c, &a))
        .unwrap();
    mm.prepare_params(&ids).unwrap();
    assert!(!mm.param_info(ids[0]).unwrap().mmapped);
    assert!(mm.resident_bytes(&cpu_dev) < la);
}

#[test]
fn model_sources_are_separate_catalogs() {
    let (path, _) = weight_file();
    let (mut mm, cpu) = manager(&[&path]);
    let up = vec![f32_tensor("conv_first.weight", &[4, 16], 2.0)];
    let up_path = temp_path("upscaler");
    write_safetensors(&up_path, &up);
    let mut aux = TensorCatalog::new();
    aux.add_file(&up_path, None).unwrap();
    let src = mm.register_model_source(aux).unwrap();
    // The same file again is refused.
    let mut again = TensorCatalog::new();
    again.add_file(&up_path, None).unwrap();
    assert!(mm.register_model_source(again).is_err());
    let c = ctx(2);
    let mut s = spec(cpu, ResidencyMode::Disk);
    // Not in the main catalog.
    assert!(mm.register_params(s, &descs_for(&c, &up)).is_err());
    s.source = src;
    s.component = Component::Upscaler;
    let ids = mm.register_params(s, &descs_for(&c, &up)).unwrap();
    mm.prepare_params(&ids).unwrap();
    assert_eq!(
        mm.tensor(ids[0]).unwrap().read_bytes().unwrap(),
        up[0].bytes
    );
    mm.unpin_params(&ids).unwrap();
    let err = mm.unregister_model_source(src).unwrap_err();
    assert!(err.to_string().contains("still registered"), "{err}");
    mm.unregister_params(&ids).unwrap();
    assert!(mm.tensor(ids[0]).is_none());
    mm.unregister_model_source(src).unwrap();
}
