//! Hostile and broken inputs: every one must give an error naming the problem, never a panic,
//! a huge allocation or the execution of anything.

#[path = "common/builders.rs"]
mod builders;

use builders::*;
use sd_formats::files::pickle::{unpickle, GlobalPolicy, PickleOptions};
use sd_formats::files::{FileError, GlobalPolicy as Policy};
use std::path::Path;

const PWNED: &str = "/tmp/sd-rs-pickle-pwned";

fn expect_err(b: &[u8]) -> FileError {
    match parse_bytes(b) {
        Ok(p) => panic!("parsed: {:?}", p.tensors),
        Err(e) => e,
    }
}

fn assert_names(e: &FileError, names: &[&str]) {
    let msg = e.to_string();
    assert!(msg.contains("hostile.bin"), "no path in: {msg}");
    for n in names {
        assert!(msg.contains(&format!("`{n}`")), "`{n}` not named in: {msg}");
    }
}

#[test]
fn every_truncation_is_an_error() {
    let mut total = 0;
    for f in [
        "mixed.safetensors",
        "mixed.gguf",
        "state_dict.pt",
        "legacy.pt",
        "esrgan_like.pth",
        "lightning.ckpt",
        "nested.pt",
    ] {
        let full = fixture(f);
        let parsed = parse_bytes(&full).unwrap();
        // Bytes past the last tensor may be padding (GGUF pads its end).
        let needed = match parsed.format {
            sd_formats::files::FileFormat::Gguf => parsed
                .tensors
                .iter()
                .map(|t| t.offset + t.size)
                .max()
                .unwrap() as usize,
            _ => full.len(),
        };
        for n in 0..full.len() {
            let r = parse_bytes(&full[..n]);
            if n < needed {
                let e = r
                    .err()
                    .unwrap_or_else(|| panic!("{f}: prefix of {n} bytes parsed"));
                assert!(e.to_string().contains("hostile.bin"), "{e}");
            }
            total += 1;
        }
    }
    eprintln!("truncations: {total} prefixes parsed");
}

#[test]
fn safetensors_header_lengths() {
    let ok = safetensors(
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        &f32_ramp(2),
    );
    assert!(parse_bytes(&ok).is_ok());
    // Header length past the end of the file.
    let mut past = ok.clone();
    past[..8].copy_from_slice(&(ok.len() as u64).to_le_bytes());
    assert!(matches!(expect_err(&past), FileError::Truncated { .. }));
    past[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        expect_err(&past),
        FileError::HeaderTooLarge { .. }
    ));
    past[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        expect_err(&past),
        FileError::HeaderTooLarge { .. }
    ));
    // Not JSON, not an object, deeply nested JSON, bad metadata.
    assert!(matches!(
        expect_err(&safetensors("{nope", &[])),
        FileError::Malformed { .. }
    ));
    let deep = format!("{{\"a\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(matches!(
        expect_err(&safetensors(&deep, &[])),
        FileError::Malformed { .. }
    ));
    assert!(matches!(
        expect_err(&safetensors(r#"{"__metadata__": 3}"#, &[])),
        FileError::Malformed { .. }
    ));
    // Duplicate names.
    let dup = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    let e = expect_err(&safetensors(dup, &f32_ramp(2)));
    assert!(matches!(e, FileError::DuplicateTensor { .. }));
    assert_names(&e, &["a"]);
}

#[test]
fn safetensors_bad_entries() {
    let data = f32_ramp(4);
    let cases: &[(&str, &[&str])] = &[
        // Overlap.
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            &["a", "b"],
        ),
        // Out of range.
        (
            r#"{"big":{"dtype":"F32","shape":[250],"data_offsets":[0,1000]}}"#,
            &["big"],
        ),
        (
            r#"{"far":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551610,18446744073709551614]}}"#,
            &["far"],
        ),
        // Size does not match dtype x shape.
        (
            r#"{"short":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            &["short"],
        ),
        // Reversed offsets, wrong arity.
        (
            r#"{"rev":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}}"#,
            &["rev"],
        ),
        (
            r#"{"three":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}"#,
            &["three"],
        ),
        // Unsupported and unknown dtypes.
        (
            r#"{"u8":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
            &["u8"],
        ),
        (
            r#"{"b":{"dtype":"BOOL","shape":[1],"data_offsets":[0,1]}}"#,
            &["b"],
        ),
        (
            r#"{"f8":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}}"#,
            &["f8"],
        ),
        (
            r#"{"f8b":{"dtype":"F8_E5M2","shape":[1],"data_offsets":[0,1]}}"#,
            &["f8b"],
        ),
        (
            r#"{"x":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}"#,
            &["x"],
        ),
        (
            r#"{"x":{"dtype":7,"shape":[1],"data_offsets":[0,1]}}"#,
            &["x"],
        ),
        // Negative, fractional and overflowing shapes; too many dimensions.
        (
            r#"{"neg":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            &["neg"],
        ),
        (
            r#"{"frac":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}"#,
            &["frac"],
        ),
        (
            r#"{"huge":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}}"#,
            &["huge"],
        ),
        (
            r#"{"bytes":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,4]}}"#,
            &["bytes"],
        ),
        (
            r#"{"dims":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}}"#,
            &["dims"],
        ),
        // Missing fields.
        (r#"{"m":{"shape":[1],"data_offsets":[0,4]}}"#, &["m"]),
        (r#"{"m":{"dtype":"F32","data_offsets":[0,4]}}"#, &["m"]),
        (r#"{"m":{"dtype":"F32","shape":[1]}}"#, &["m"]),
        (r#"{"m":[]}"#, &["m"]),
    ];
    for (header, names) in cases {
        let e = expect_err(&safetensors(header, &data));
        assert_names(&e, names);
    }
}

#[test]
fn gguf_bad_headers() {
    let f32_4 = f32_ramp(4);
    let mut g = Gguf::header(3, 1, 0);
    g.tensor("ok", &[4], 0, 0);
    assert!(parse_bytes(&g.data(&f32_4)).is_ok());

    let unsupported = |version: u32| {
        let mut g = Gguf::header(version, 0, 0);
        expect_err(&g.data(&[]))
    };
    assert!(matches!(unsupported(1), FileError::Unsupported { .. }));
    assert!(matches!(
        unsupported(3u32.swap_bytes()),
        FileError::Unsupported { .. }
    ));
    assert!(matches!(unsupported(77), FileError::Unsupported { .. }));

    // Counts that cannot fit the file are refused before allocating.
    for (nt, nkv) in [(u64::MAX, 0), (0, u64::MAX), (1 << 40, 1 << 40)] {
        let mut g = Gguf::header(3, nt, nkv);
        assert!(matches!(
            expect_err(&g.data(&[0; 64])),
            FileError::Malformed { .. }
        ));
    }
    // A string longer than the file.
    let mut g = Gguf::header(3, 0, 1);
    g.u64(u64::MAX);
    assert!(matches!(
        expect_err(&g.data(&[0; 64])),
        FileError::Truncated { .. }
    ));
    // An array longer than the file, an unknown value type, arrays nested too deeply.
    let mut g = Gguf::header(3, 0, 1);
    g.str("arr").u32(9).u32(10).u64(1 << 60);
    assert!(matches!(
        expect_err(&g.data(&[0; 64])),
        FileError::Malformed { .. }
    ));
    let mut g = Gguf::header(3, 0, 1);
    g.str("bad").u32(13);
    assert!(matches!(
        expect_err(&g.data(&[0; 64])),
        FileError::Malformed { .. }
    ));
    let mut g = Gguf::header(3, 0, 1);
    g.str("deep").u32(9);
    for _ in 0..20 {
        g.u32(9).u64(1);
    }
    assert!(matches!(
        expect_err(&g.data(&[0; 64])),
        FileError::Malformed { .. }
    ));
    // Duplicate keys; alignment of the wrong type, zero, not a power of two.
    let mut g = Gguf::header(3, 0, 2);
    g.str("k").u32(4).u32(1).str("k").u32(4).u32(2);
    assert!(matches!(
        expect_err(&g.data(&[])),
        FileError::Malformed { .. }
    ));
    for (ty, val) in [(4u32, 0u64), (4, 3), (10, 32)] {
        let mut g = Gguf::header(3, 0, 1);
        g.str("general.alignment").u32(ty);
        if ty == 10 {
            g.u64(val);
        } else {
            g.u32(val as u32);
        }
        assert!(
            matches!(expect_err(&g.data(&[])), FileError::Malformed { .. }),
            "{ty} {val}"
        );
    }
}

/// Name, `ne`, ggml type, relative offset.
type GgufInfo = (&'static str, Vec<u64>, u32, u64);

#[test]
fn gguf_bad_tensors() {
    let data = f32_ramp(16);
    let cases: Vec<(Vec<GgufInfo>, Vec<&str>)> = vec![
        // Overlapping tensors.
        (
            vec![("a", vec![8], 0, 0), ("b", vec![8], 0, 0)],
            vec!["a", "b"],
        ),
        (
            vec![
                ("a", vec![8], 0, 0),
                ("c", vec![1], 0, 32),
                ("b", vec![8], 0, 0),
            ],
            vec!["a", "b"],
        ),
        // Out of range and misaligned offsets.
        (vec![("far", vec![4], 0, 1 << 20)], vec!["far"]),
        (vec![("wrap", vec![4], 0, u64::MAX - 31)], vec!["wrap"]),
        (vec![("odd", vec![4], 0, 4)], vec!["odd"]),
        // Unknown ggml types (Q8_1, a type id past the end).
        (vec![("q81", vec![32], 9, 0)], vec!["q81"]),
        (vec![("t200", vec![4], 200, 0)], vec!["t200"]),
        // Negative and overflowing dimensions, too many dimensions, partial blocks.
        (vec![("neg", vec![u64::MAX], 0, 0)], vec!["neg"]),
        (vec![("ovf", vec![1 << 32, 1 << 32], 0, 0)], vec!["ovf"]),
        (vec![("ovf2", vec![1 << 40, 1 << 22], 0, 0)], vec!["ovf2"]),
        (vec![("five", vec![1, 1, 1, 1, 1], 0, 0)], vec!["five"]),
        (vec![("q8", vec![16, 2], 8, 0)], vec!["q8"]),
        // Duplicate names.
        (vec![("d", vec![1], 0, 0), ("d", vec![1], 0, 32)], vec!["d"]),
    ];
    for (tensors, names) in cases {
        let mut g = Gguf::header(3, tensors.len() as u64, 0);
        for (n, ne, ty, off) in &tensors {
            g.tensor(n, ne, *ty, *off);
        }
        let e = expect_err(&g.data(&data));
        assert_names(&e, &names);
    }
    // A tensor name that is not UTF-8.
    let mut g = Gguf::header(3, 1, 0);
    g.u64(2);
    g.0.extend_from_slice(&[0xff, 0xfe]);
    g.u32(1).u64(1).u32(0).u64(0);
    assert!(matches!(
        expect_err(&g.data(&data)),
        FileError::Malformed { .. }
    ));
}

fn forbidden(module: &str, name: &str) -> Vec<Vec<u8>> {
    let payload = format!("touch {PWNED}");
    vec![
        Pickle::new()
            .global(module, name)
            .s(&payload)
            .op(b"\x85R")
            .stop(),
        Pickle::new()
            .stack_global(module, name)
            .s(&payload)
            .op(b"\x85R")
            .stop(),
        // Inside a dict, as a state dict value would be.
        Pickle::new()
            .op(b"}")
            .s("w")
            .global(module, name)
            .s(&payload)
            .op(b"\x85Rs")
            .stop(),
        // Through INST and OBJ.
        Pickle::new()
            .op(b"(")
            .s(&payload)
            .op(format!("i{module}\n{name}\n").as_bytes())
            .stop(),
        Pickle::new()
            .op(b"(")
            .global(module, name)
            .s(&payload)
            .op(b"o")
            .stop(),
    ]
}

#[test]
fn pickles_never_run_globals() {
    let globals = [
        ("os", "system"),
        ("posix", "system"),
        ("nt", "system"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("__builtin__", "eval"),
        ("subprocess", "Popen"),
        ("subprocess", "check_output"),
        ("os.path", "join"),
        ("torch", "load"),
        ("torch.hub", "load"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("collections", "namedtuple"),
        ("torch._utils", "_rebuild_device_tensor_from_numpy"),
    ];
    for (module, name) in globals {
        for p in forbidden(module, name) {
            for policy in [GlobalPolicy::Strict, GlobalPolicy::Inert] {
                let r = unpickle(
                    &p,
                    Path::new("evil.pkl"),
                    PickleOptions {
                        globals: policy,
                        persistent: false,
                    },
                );
                let dangerous = !(module.starts_with("numpy")
                    || module == "collections"
                    || module == "torch._utils"
                    || (module == "torch" && policy == GlobalPolicy::Inert));
                if policy == GlobalPolicy::Strict || dangerous {
                    match r {
                        Err(FileError::ForbiddenGlobal {
                            module: m, name: n, ..
                        }) => {
                            assert_eq!((m.as_str(), n.as_str()), (module, name));
                        }
                        other => panic!("{module}.{name} ({policy:?}): {other:?}"),
                    }
                }
            }
            // The same pickle as the object of a legacy PyTorch file.
            let e = expect_err(&legacy(&p, &[], &[]));
            assert!(
                matches!(&e, FileError::ForbiddenGlobal { module: m, .. } if m == module),
                "{e}"
            );
            assert!(e.to_string().contains(&format!("`{module}.{name}`")), "{e}");
        }
    }
    assert!(!Path::new(PWNED).exists(), "a pickle payload ran");
}

#[test]
fn inert_globals_build_nothing() {
    // A Lightning-style checkpoint: a callback object keyed by its class, then the state dict.
    let main = Pickle::new()
        .op(b"}(")
        .s("callbacks")
        .op(b"}")
        .global(
            "pytorch_lightning.callbacks.model_checkpoint",
            "ModelCheckpoint",
        )
        .op(b"}s")
        .s("state_dict")
        .op(b"}")
        .s("w")
        .tensor("FloatStorage", "0", 4, 0, &[2, 2], &[2, 1])
        .op(b"su")
        .stop();
    let file = legacy(&main, &["0"], &[(4, &f32_ramp(4))]);
    assert!(matches!(
        expect_err(&file),
        FileError::ForbiddenGlobal { .. }
    ));
    let b = file.clone();
    let opts = sd_formats::files::ReadOptions {
        pickle_globals: Policy::Inert,
    };
    let p = sd_formats::files::parse(&b, Path::new("x"), sd_formats::FileId(0), opts).unwrap();
    assert_eq!(p.tensors.len(), 1);
    assert_eq!(p.tensors[0].name, "w");
}

fn one_tensor(
    class: &str,
    numel: u64,
    offset: u64,
    shape: &[u64],
    stride: &[u64],
    stored: u64,
) -> Vec<u8> {
    let main = Pickle::new()
        .op(b"}")
        .s("t")
        .tensor(class, "0", numel, offset, shape, stride)
        .op(b"s")
        .stop();
    let elsize = match class {
        "ByteStorage" | "BoolStorage" => 1,
        "ComplexFloatStorage" => 8,
        _ => 4,
    };
    legacy(
        &main,
        &["0"],
        &[(stored, &vec![0u8; (stored * elsize) as usize])],
    )
}

#[test]
fn torch_bad_tensors() {
    assert!(parse_bytes(&one_tensor("FloatStorage", 6, 0, &[2, 3], &[3, 1], 6)).is_ok());
    let e = expect_err(&one_tensor("FloatStorage", 6, 0, &[2, 3], &[1, 2], 6));
    assert!(matches!(e, FileError::NonContiguous { .. }));
    assert_names(&e, &["t"]);
    // Past the end of the storage.
    assert_names(
        &expect_err(&one_tensor("FloatStorage", 6, 1, &[2, 3], &[3, 1], 6)),
        &["t"],
    );
    assert_names(
        &expect_err(&one_tensor("FloatStorage", 60, 0, &[10, 6], &[6, 1], 6)),
        &["t"],
    );
    // Storage count larger than the file.
    let mut f = one_tensor("FloatStorage", 6, 0, &[2, 3], &[3, 1], 6);
    let at = f.len() - 6 * 4 - 8;
    f[at..at + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    assert!(matches!(
        expect_err(&f),
        FileError::Malformed { .. } | FileError::Truncated { .. }
    ));
    // Unsupported storages.
    for class in ["ByteStorage", "BoolStorage", "ComplexFloatStorage"] {
        let e = expect_err(&one_tensor(class, 4, 0, &[4], &[1], 4));
        assert!(matches!(e, FileError::UnsupportedDType { .. }), "{e}");
        assert_names(&e, &["t"]);
    }
    // An unknown storage class is a forbidden global.
    assert!(matches!(
        expect_err(&one_tensor("EvilStorage", 4, 0, &[4], &[1], 4)),
        FileError::ForbiddenGlobal { .. }
    ));
    // Shape and stride of different lengths; negative sizes; a storage key never stored.
    assert_names(
        &expect_err(&one_tensor("FloatStorage", 6, 0, &[2, 3], &[3], 6)),
        &["t"],
    );
    assert!(matches!(
        expect_err(&one_tensor("FloatStorage", 6, 0, &[u64::MAX], &[1], 6)),
        FileError::Pickle { .. }
    ));
    let main = Pickle::new()
        .op(b"}")
        .s("t")
        .tensor("FloatStorage", "9", 4, 0, &[4], &[1])
        .op(b"s")
        .stop();
    assert_names(&expect_err(&legacy(&main, &[], &[])), &["t"]);
    // Two storages overlapping is impossible in the legacy layout; two tensors named alike
    // after `state_dict` is stripped are an error.
    let main = Pickle::new()
        .op(b"}(")
        .s("w")
        .tensor("FloatStorage", "0", 4, 0, &[4], &[1])
        .s("x")
        .op(b"}")
        .s("state_dict")
        .op(b"}")
        .s("w")
        .tensor("FloatStorage", "0", 4, 0, &[4], &[1])
        .op(b"ssu")
        .stop();
    assert!(parse_bytes(&legacy(&main, &["0"], &[(4, &f32_ramp(4))])).is_ok());
    let main = Pickle::new()
        .op(b"}(")
        .s("a")
        .op(b"}")
        .s("state_dict")
        .op(b"}")
        .s("w")
        .tensor("FloatStorage", "0", 4, 0, &[4], &[1])
        .op(b"ss")
        .s("a.w")
        .tensor("FloatStorage", "0", 4, 0, &[4], &[1])
        .op(b"u")
        .stop();
    let e = expect_err(&legacy(&main, &["0"], &[(4, &f32_ramp(4))]));
    assert!(matches!(e, FileError::DuplicateTensor { .. }), "{e}");
}

#[test]
fn pickle_structures_cannot_exhaust_anything() {
    // A million nested lists, a list containing itself, and 2^60 paths through shared dicts.
    let n = 1_000_000;
    let mut deep = vec![0x80, 2, b'}', b'X', 1, 0, 0, 0, b'a'];
    deep.extend(std::iter::repeat_n(b']', n + 1));
    deep.extend(std::iter::repeat_n(b'a', n));
    deep.extend_from_slice(b"s.");
    let e = expect_err(&legacy(&deep, &[], &[]));
    assert!(matches!(e, FileError::Malformed { .. }), "{e}");

    let cyclic = Pickle::new()
        .op(b"}")
        .s("a")
        .op(b"]q\x00h\x00ah\x00as")
        .stop();
    assert!(parse_bytes(&legacy(&cyclic, &[], &[]))
        .unwrap()
        .tensors
        .is_empty());

    let mut laughs = Pickle::new().op(b"}q\x00");
    for i in 1..60u8 {
        // d_i = {'x': d_{i-1}, 'y': d_{i-1}}
        laughs = laughs
            .op(b"}")
            .s("x")
            .op(&[b'h', i - 1])
            .s("y")
            .op(&[b'h', i - 1])
            .op(b"ss")
            .op(&[b'q', i]);
    }
    let laughs = laughs.stop();
    assert!(parse_bytes(&legacy(&laughs, &[], &[])).is_ok());

    // Memo amplification: one list of 100k pairs handed to OrderedDict 50k times.
    let mut amp = Pickle::new()
        .global("collections", "OrderedDict")
        .op(b"q\x000](");
    for _ in 0..100_000 {
        amp = amp.op(b"NN\x86");
    }
    amp = amp.op(b"eq\x010](");
    for _ in 0..50_000 {
        amp = amp.op(b"h\x00h\x01\x85R");
    }
    let amp = amp.op(b"e").stop();
    let e = unpickle(
        &amp,
        Path::new("amp.pkl"),
        PickleOptions {
            globals: GlobalPolicy::Strict,
            persistent: false,
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("too many"), "{e}");

    // A stack of a million values and an unterminated pickle.
    let mut wide = vec![0x80, 2];
    wide.extend(std::iter::repeat_n(b'N', n));
    assert!(matches!(
        expect_err(&legacy(&wide, &[], &[])),
        FileError::Truncated { .. }
    ));
    // Lengths larger than the file.
    for op in [
        &b"X\xff\xff\xff\xff"[..],
        b"\x8d\xff\xff\xff\xff\xff\xff\xff\xff",
        b"\x8e\xff\xff\xff\xff\xff\xff\xff\x7f",
        b"\x8b\xff\xff\xff\x7f",
    ] {
        let p = Pickle::new().op(op).stop();
        assert!(expect_err(&legacy(&p, &[], &[]))
            .to_string()
            .contains("hostile.bin"));
    }
}

#[test]
fn zip_entries_must_be_stored() {
    let e = sd_formats::files::TensorCatalog::new()
        .add_file(fixture_dir().join("deflated.pt"), None)
        .unwrap_err();
    match &e {
        FileError::CompressedEntry { entry, method, .. } => {
            assert!(entry.contains("/data/"), "{entry}");
            assert!(method.contains("compressed"), "{method}");
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("deflated.pt"));
}

#[test]
fn unknown_formats() {
    for b in [
        &b""[..],
        b"x",
        b"\x00\x00\x00\x00\x00\x00\x00\x00[",
        b"GGU",
        b"\x80\x09",
        b"PK\x01\x02",
    ] {
        assert!(
            matches!(expect_err(b), FileError::UnknownFormat { .. }),
            "{b:?}"
        );
    }
    // A zip without data.pkl (a renamed archive).
    let mut z = fixture("evil_global.pt");
    let pos = z.windows(8).position(|w| w == b"data.pkl").unwrap();
    z[pos..pos + 8].copy_from_slice(b"data.txt");
    assert!(expect_err(&z).to_string().contains("hostile.bin"));
}
