//! Reads the fixtures written by `scripts/fixtures/make_file_fixtures.py` with the reference
//! libraries and compares names, dtypes, shapes and values with its manifest.

use std::path::{Path, PathBuf};

use sd_formats::files::{
    CatalogOptions, FileError, FileFormat, FileMetadata, GgufValue, GlobalPolicy, ReadOptions,
    TensorCatalog,
};
use sd_formats::TensorStorage;
use sd_tensor::convert::to_f32;
use sd_tensor::DType;
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/files")
}

fn manifest() -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(dir().join("manifest.json")).unwrap();
    serde_json::from_str::<Value>(&text)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
}

fn error_kind(e: &FileError) -> &'static str {
    match e {
        FileError::NonContiguous { .. } => "NonContiguous",
        FileError::UnsupportedDType { .. } => "UnsupportedDType",
        FileError::CompressedEntry { .. } => "CompressedEntry",
        FileError::ForbiddenGlobal { .. } => "ForbiddenGlobal",
        _ => "other",
    }
}

fn check_values(loader: &TensorCatalog, t: &TensorStorage, want: &[Value]) {
    let got = loader.read_converted(&t.name, DType::F32).unwrap();
    let got = to_f32(DType::F32, &got).unwrap();
    assert_eq!(got.len(), want.len(), "{}", t.name);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let w = w.as_f64().unwrap() as f32;
        let tol = if t.dtype.is_quantized() {
            1e-6 * w.abs().max(1.0)
        } else {
            0.0
        };
        assert!((g - w).abs() <= tol, "{} [{i}]: {g} != {w}", t.name);
    }
}

#[test]
fn fixtures_match_the_manifest() {
    let m = manifest();
    let mut checked = 0;
    for (file, spec) in &m {
        let path = dir().join(file);
        let mut loader = TensorCatalog::new();
        if let Some(kind) = spec.get("error").and_then(Value::as_str) {
            let e = loader.add_file(&path, None).expect_err(file);
            assert_eq!(error_kind(&e), kind, "{file}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains(file.as_str()),
                "message must name the file: {msg}"
            );
            if let Some(t) = spec.get("tensor").and_then(Value::as_str) {
                assert!(
                    msg.contains(&format!("`{t}`")),
                    "message must name the tensor: {msg}"
                );
            }
            if let (FileError::ForbiddenGlobal { module, name, .. }, Some(m)) =
                (&e, spec.get("module"))
            {
                assert_eq!(module, m.as_str().unwrap());
                assert_eq!(name, spec["name"].as_str().unwrap());
            }
            continue;
        }
        let id = loader
            .add_file(&path, None)
            .unwrap_or_else(|e| panic!("{e}"));
        let rec = loader.file(id).unwrap();
        assert_eq!(
            rec.format.to_string(),
            spec["format"].as_str().unwrap(),
            "{file}"
        );
        assert_eq!(rec.size, std::fs::metadata(&path).unwrap().len());
        let want = spec["tensors"].as_array().unwrap();
        assert_eq!(
            loader.len(),
            want.len(),
            "{file}: {:?}",
            loader.tensors().map(|t| &t.name).collect::<Vec<_>>()
        );
        for w in want {
            let name = w["name"].as_str().unwrap();
            let t = loader
                .get(name)
                .unwrap_or_else(|| panic!("{file}: missing {name}"));
            assert_eq!(
                t.dtype.name(),
                w["dtype"].as_str().unwrap(),
                "{file}: {name}"
            );
            let shape: Vec<u64> = w["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            assert_eq!(t.shape, shape, "{file}: {name}");
            assert_eq!(
                Some(t.size as usize),
                t.dtype.bytes_for(t.numel() as usize),
                "{file}: {name}"
            );
            check_values(&loader, t, w["values"].as_array().unwrap());
            let raw = loader.read_raw(name).unwrap();
            assert_eq!(raw.len() as u64, t.size);
            let mapped = loader.mapped_bytes(name).unwrap();
            assert_eq!(mapped.bytes(), &raw[..]);
            checked += 1;
        }
        if let Some(meta) = spec.get("metadata") {
            match &rec.metadata {
                FileMetadata::Safetensors(md) => {
                    for (k, v) in meta.as_object().unwrap() {
                        assert_eq!(md.get(k).map(String::as_str), v.as_str(), "{k}");
                    }
                }
                FileMetadata::Gguf(h) => {
                    assert_eq!(h.version, 3);
                    assert_eq!(h.alignment, 32);
                    for (k, v) in meta.as_object().unwrap() {
                        let got = &h.metadata[k];
                        match v {
                            Value::String(s) => assert_eq!(got.as_str(), Some(s.as_str()), "{k}"),
                            n => assert_eq!(got.as_i64(), n.as_i64(), "{k}"),
                        }
                    }
                    assert_eq!(h.metadata["test.bool"], GgufValue::Bool(true));
                    assert_eq!(h.metadata["test.f32"].as_f64(), Some(1.5));
                    assert!(
                        matches!(&h.metadata["test.strings"], GgufValue::Array(a) if a.len() == 2)
                    );
                }
                FileMetadata::None => panic!("{file}: no metadata"),
            }
        }
    }
    assert!(checked >= 40, "only {checked} tensors checked");
    assert!(
        !Path::new("/tmp/sd-rs-pickle-pwned").exists(),
        "a pickle payload ran"
    );
}

#[test]
fn dangerous_globals_are_refused_even_when_inert_globals_are_allowed() {
    let opts = CatalogOptions {
        read: ReadOptions {
            pickle_globals: GlobalPolicy::Inert,
        },
    };
    for f in ["evil_global.pt", "evil_stack_global.pt", "evil_legacy.pt"] {
        let mut loader = TensorCatalog::with_options(opts);
        let e = loader.add_file(dir().join(f), None).unwrap_err();
        assert!(matches!(e, FileError::ForbiddenGlobal { .. }), "{f}: {e}");
    }
    assert!(
        !Path::new("/tmp/sd-rs-pickle-pwned").exists(),
        "a pickle payload ran"
    );
}

#[test]
fn formats_and_shared_storage_offsets() {
    let mut loader = TensorCatalog::new();
    let id = loader.add_file(dir().join("state_dict.pt"), None).unwrap();
    assert_eq!(loader.file(id).unwrap().format, FileFormat::TorchZip);
    let a = loader.get("shared.first").unwrap().clone();
    let b = loader.get("shared.second").unwrap().clone();
    // Two views of one 12-element f32 storage.
    assert_eq!(b.offset, a.offset + 24);
    let legacy = loader
        .add_file(dir().join("legacy.pt"), Some("legacy."))
        .unwrap();
    assert_eq!(loader.file(legacy).unwrap().format, FileFormat::TorchLegacy);
    assert_eq!(
        loader.read_raw("legacy.shared.second").unwrap(),
        loader.read_raw("shared.second").unwrap()
    );
    assert_eq!(loader.names_with_prefix("legacy.").count(), 13);
    assert_eq!(
        loader.names_with_prefix("shared.").collect::<Vec<_>>(),
        ["shared.first", "shared.second"]
    );
}

#[test]
fn prefixes_duplicates_and_renames() {
    let mut loader = TensorCatalog::new();
    let first = loader
        .add_file(dir().join("mixed.safetensors"), Some("model."))
        .unwrap();
    assert!(loader.get("model.conv.weight").is_some());
    // Later files win on duplicate names.
    let second = loader
        .add_file(dir().join("mixed.safetensors"), Some("model."))
        .unwrap();
    assert_eq!(loader.get("model.conv.weight").unwrap().file, second);
    assert_ne!(first, second);
    assert_eq!(loader.files().len(), 2);
    assert_eq!(loader.files()[0].revision, loader.files()[1].revision);

    // Split a [2, 3, 2, 2] tensor into two [1, 3, 2, 2] halves, drop the i8 tensor.
    loader
        .rename(|t| match t.name.as_str() {
            "model.conv.weight" => t.split_outer(2, &["a.w".into(), "b.w".into()]).unwrap(),
            "model.counts.i8" => vec![],
            _ => vec![t.clone()],
        })
        .unwrap();
    assert!(loader.get("model.conv.weight").is_none() && loader.get("model.counts.i8").is_none());
    let whole: Vec<f32> = (0..24).map(|i| i as f32 * 0.25 - 1.0).collect();
    let a = to_f32(
        DType::F32,
        &loader.read_converted("a.w", DType::F32).unwrap(),
    )
    .unwrap();
    let b = to_f32(
        DType::F32,
        &loader.read_converted("b.w", DType::F32).unwrap(),
    )
    .unwrap();
    assert_eq!([a, b].concat(), whole);

    // Collisions leave the catalog unchanged.
    let before = loader.len();
    let e = loader
        .rename(|t| {
            vec![TensorStorage {
                name: "same".into(),
                ..t.clone()
            }]
        })
        .unwrap_err();
    assert!(matches!(e, FileError::RenameCollision { .. }), "{e}");
    assert_eq!(loader.len(), before);
    // Entries that leave their file are refused.
    let e = loader
        .rename(|t| {
            vec![TensorStorage {
                offset: u64::MAX - 1,
                ..t.clone()
            }]
        })
        .unwrap_err();
    assert!(matches!(e, FileError::OutOfBounds { .. }), "{e}");
    let e = loader
        .rename(|t| {
            vec![TensorStorage {
                size: t.size + 1,
                ..t.clone()
            }]
        })
        .unwrap_err();
    assert!(matches!(e, FileError::SizeMismatch { .. }), "{e}");

    loader.strip_prefix("model.").unwrap();
    assert!(loader.get("norm.weight").is_some());
    assert_eq!(loader.remove_with_prefix("counts."), 2);
    assert!(matches!(
        loader.read_raw("nope"),
        Err(FileError::NotFound { .. })
    ));
}

#[test]
fn conversions_and_parallel_loading() {
    let mut loader = TensorCatalog::new();
    loader.add_file(dir().join("mixed.gguf"), None).unwrap();
    loader.add_file(dir().join("state_dict.pt"), None).unwrap();
    // f16 -> q8_0 needs rows of whole blocks: t.f16 has rows of 8.
    let e = loader.read_converted("t.f16", DType::Q8_0).unwrap_err();
    assert!(
        matches!(e, FileError::Convert { .. }) && e.to_string().contains("t.f16"),
        "{e}"
    );
    let q = loader.read_converted("t.q8_0", DType::F16).unwrap();
    assert_eq!(q.len(), 2 * 64 * 2);

    let requests: Vec<(String, DType)> = loader
        .tensors()
        .map(|t| {
            (
                t.name.clone(),
                if t.dtype.is_float() || t.dtype.is_quantized() {
                    DType::F32
                } else {
                    t.dtype
                },
            )
        })
        .collect();
    for threads in [0, 1, 3] {
        let got = std::sync::Mutex::new(std::collections::BTreeMap::new());
        let sink = |name: &str, bytes: &[u8]| -> Result<(), String> {
            got.lock().unwrap().insert(name.to_string(), bytes.to_vec());
            Ok(())
        };
        loader.load_tensors(&requests, threads, &sink).unwrap();
        let got = got.into_inner().unwrap();
        assert_eq!(got.len(), requests.len());
        for (name, dtype) in &requests {
            assert_eq!(
                got[name],
                loader.read_converted(name, *dtype).unwrap(),
                "{name}"
            );
        }
    }
    // The first error is returned: a failing sink, or an unknown name before anything runs.
    let sink = |name: &str, _: &[u8]| {
        if name == "t.f32" {
            Err("full".to_string())
        } else {
            Ok(())
        }
    };
    let e = loader.load_tensors(&requests, 2, &sink).unwrap_err();
    assert!(
        e.to_string().contains("t.f32") && e.to_string().contains("full"),
        "{e}"
    );
    let e = loader
        .load_tensors(&[("missing".into(), DType::F32)], 2, &sink)
        .unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
}

#[test]
fn sharded_safetensors_index() {
    let tmp = std::env::temp_dir().join(format!("sd-rs-shards-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::copy(
        dir().join("mixed.safetensors"),
        tmp.join("part-1.safetensors"),
    )
    .unwrap();
    let index = tmp.join("model.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"metadata": {"total_size": 1}, "weight_map": {"conv.weight": "part-1.safetensors"}}"#,
    )
    .unwrap();
    let mut loader = TensorCatalog::new();
    let ids = loader.add_sharded(&index, None).unwrap();
    assert_eq!(ids.len(), 1);
    assert!(loader.get("conv.weight").is_some());

    std::fs::write(
        &index,
        r#"{"weight_map": {"not.there": "part-1.safetensors"}}"#,
    )
    .unwrap();
    let e = TensorCatalog::new().add_sharded(&index, None).unwrap_err();
    assert!(e.to_string().contains("not.there"), "{e}");
    std::fs::write(&index, r#"{"weight_map": {"x": "../etc/passwd"}}"#).unwrap();
    assert!(TensorCatalog::new().add_sharded(&index, None).is_err());
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[test]
fn shrunk_files_are_errors_not_panics() {
    let tmp = std::env::temp_dir().join(format!("sd-rs-shrink-{}.safetensors", std::process::id()));
    std::fs::copy(dir().join("mixed.safetensors"), &tmp).unwrap();
    let mut loader = TensorCatalog::new();
    loader.add_file(&tmp, None).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&tmp).unwrap();
    f.set_len(100).unwrap();
    let name = loader
        .tensors()
        .max_by_key(|t| t.offset)
        .unwrap()
        .name
        .clone();
    assert!(matches!(loader.read_raw(&name), Err(FileError::Io { .. })));
    assert!(matches!(
        loader.try_mapped_bytes(&name),
        Err(FileError::Changed { .. })
    ));
    assert!(loader.mapped_bytes(&name).is_none());
    std::fs::remove_file(&tmp).unwrap();
}
